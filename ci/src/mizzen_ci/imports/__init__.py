"""Imports read from syntax trees, never executed: one file's facts (:mod:`.facts`) and the
files it names by string literals (:mod:`.path_literals`), their resolution to absolute names and
sibling files (:mod:`.resolve`), the workspace's files and entry points (:mod:`.workspace`), the
graph with its chains (:mod:`.graph`), the inverted one-step relations for reverse searches
(:mod:`.reach`), what a file loads without an import statement (:mod:`.loaders`: programs it
runs, ``sys.path`` edits, entry-point groups) and the folder-level rules of a package (:mod:`.folders`: no folder cycle, no
private name across a folder).  The lazy-import check and the planner's impact analysis both build on them.
"""

from .facts import ModuleFacts, RawImport, facts_of_parse_error, facts_of_tree, parse_facts
from .graph import GETATTR_SUFFIX, Hop, ImportEdge, ImportGraph
from .reach import ReachIndex, node_entry, parents_of, reach_of_graph
from .resolve import direct_names, package_of, relative_base
from .workspace import (
    UNKNOWN_GROUP,
    EntryPointDecl,
    GraphProblem,
    entry_point_modules,
    entry_point_table,
    iter_source_modules,
    locate_packages,
    relative_dirs,
    root_relative,
    source_files,
    source_modules,
    workspace_members,
    workspace_source_dirs,
)

__all__ = [
    "GETATTR_SUFFIX",
    "UNKNOWN_GROUP",
    "EntryPointDecl",
    "GraphProblem",
    "Hop",
    "ImportEdge",
    "ImportGraph",
    "ModuleFacts",
    "RawImport",
    "ReachIndex",
    "direct_names",
    "entry_point_modules",
    "entry_point_table",
    "facts_of_parse_error",
    "facts_of_tree",
    "iter_source_modules",
    "locate_packages",
    "node_entry",
    "package_of",
    "parents_of",
    "parse_facts",
    "reach_of_graph",
    "relative_base",
    "relative_dirs",
    "root_relative",
    "source_files",
    "source_modules",
    "workspace_members",
    "workspace_source_dirs",
]
