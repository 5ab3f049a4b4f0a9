"""One parse per file: everything the CI reads from a Python file's syntax tree.

``extract(source, filename) -> FileFacts`` parses the source once and reads from that one tree

- its imports (:func:`mizzen_ci.imports.facts.imports_of_tree`, what the import graph, the
  lazy-import check and the planner's impact analysis build on), with the line of its first
  computed dynamic import, and its path literals (:mod:`mizzen_ci.imports.path_literals`: the
  files it may name), and
- its registration as written (:func:`mizzen_ci.registry.syntax.registration_syntax`, which
  the registry then validates against the fleet),

so no file is parsed twice however many readers it has.  :class:`FileFacts` is plain data (tuples,
strings, numbers), a pure function of the file's bytes.

Invariants:
- FileFacts depend only on the bytes (and the code of the modules that read them): a cache may
  keep them by content hash (this module has no cache; that is :mod:`.facts_cache`).
- Extraction never raises for bad source: a parse error is a fact (both the import facts' error
  and the registry's "syntax" problem come from the one exception).
"""

from __future__ import annotations

import ast
from typing import NamedTuple

from ...imports.facts import (
    ModuleFacts,
    RawImport,
    facts_of_parse_error,
    imports_of_tree,
    unreadable_why,
)
from ...imports.path_literals import path_literals
from ...registry import syntax as registry_syntax
from ...sources import PARSE_ERRORS


class FileFacts(NamedTuple):
    """What one file's syntax tree says, as plain data (see the module docstring)."""

    imports: tuple[tuple, ...]  # RawImport fields as plain tuples, in source order
    error: str | None  # "line N: message" when the file does not parse (or cannot be read)
    error_line: int
    bound: frozenset[str] | None  # see ModuleFacts.bound
    registration: tuple  # registry_syntax.RegistrationSyntax.plain()
    dynamic: int  # see ModuleFacts.dynamic
    paths: tuple[str, ...]  # see ModuleFacts.paths
    syspath: tuple[str, ...] = ()  # see ModuleFacts.syspath
    opaque: str = ""  # see ModuleFacts.opaque

    def module_facts(self) -> ModuleFacts:
        """The import facts as :class:`~mizzen_ci.imports.facts.ModuleFacts`."""
        return ModuleFacts(
            tuple(RawImport._make(i) for i in self.imports),
            self.error,
            self.error_line,
            self.bound,
            self.dynamic,
            self.paths,
            self.syspath,
            self.opaque,
        )


def extract(source: bytes, filename: str = "<unknown>") -> FileFacts:
    """The facts of one file's source, from one parse; never raises for bad input."""
    try:
        tree = ast.parse(source, filename)
    except PARSE_ERRORS as e:
        m = facts_of_parse_error(e, source)
        reg = registry_syntax.registration_syntax(source, parse_error=e)
        return FileFacts((), m.error, m.error_line, None, reg.plain(), 0, m.paths, (), m.opaque)
    imports, bound, dynamic, syspath, opaque = imports_of_tree(tree, source)
    return FileFacts(
        imports,
        None,
        0,
        bound,
        registry_syntax.registration_syntax(source, tree).plain(),
        dynamic,
        path_literals(source, tree) or (),
        syspath,
        opaque,
    )


def unreadable(e: OSError) -> FileFacts:
    """The facts of a file that cannot be read (never cached: there are no bytes to key them)."""
    return FileFacts(
        (),
        f"line 1: cannot read: {e.strerror}",
        1,
        None,
        registry_syntax.unreadable(e).plain(),
        0,
        (),
        (),
        unreadable_why(e),  # what it imports is unknown: its dependents fail open
    )
