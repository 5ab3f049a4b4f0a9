"""The workspace's files on disk: source modules below ``sys.path`` entries, the members of a uv
workspace, packages located by name, and root-relative paths.

- ``source_files(dir)`` / ``source_modules(root, dirs)``: the module walk (every package — a
  directory with ``__init__.py``; namespace packages are not walked, as ``pkgutil`` does not walk
  them — and module below each ``sys.path`` entry, by dotted name).
- ``workspace_members(root)`` / ``workspace_source_dirs(root)``: a uv workspace's members and
  their ``sys.path`` entries.
- ``entry_point_table(root)`` / ``entry_point_modules(root)``: the entry points the members'
  ``pyproject.toml`` declare (``[project.scripts]``, ``[project.gui-scripts]``,
  ``[project.entry-points.*]``), by group, and the plugins pytest's ``addopts`` load.
- ``locate_packages(root, names)``: where top-level packages live in a tree.
- ``root_relative(path, root)`` / ``relative_dirs(dirs, root)``: paths as the CI names them.

Invariants: stdlib only; walks are sorted (deterministic); a module name defined twice keeps the
first and records a :class:`GraphProblem`; nothing here parses a file.  The workspace's members
are read from the checkout's ``pyproject.toml``, so they are checked: relative, inside the
repository, or a :class:`~mizzen_ci.sources.ConfigError` naming the file and the fix.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ..sources import ConfigError, folder_entries, read_bytes

# Folders no import can name (not identifiers) are passed over by the walk's identifier test; a
# folder that *is* a package (an identifier holding ``__init__.py``) is walked whatever its name,
# as Python imports it (``pkg/node_modules/__init__.py`` is ``pkg.node_modules``): a module left
# out of the graph would drop its edges.
_SKIP_DIRS: frozenset[str] = frozenset()


@dataclass(frozen=True)
class GraphProblem:
    """Something the graph could not read as asked: where, and what."""

    file: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


def iter_source_modules(source_dir: Path | str) -> Iterator[tuple[str, Path]]:
    """(module name, file) of every package and module below one ``sys.path`` entry, sorted.
    (:func:`source_files` is the same walk with string paths.)"""
    for name, path in source_files(source_dir):
        yield name, Path(path)


def source_files(source_dir: Path | str) -> Iterator[tuple[str, str]]:
    """(module name, file path as a string) of every package and module below one ``sys.path``
    entry, sorted by name at each level; no ``Path`` objects (cheap on thousands of files)."""
    for e in folder_entries(source_dir):
        if e.name.startswith(".") or e.name in _SKIP_DIRS:
            continue
        if e.is_dir():
            init = os.path.join(e.path, "__init__.py")
            if e.name.isidentifier() and os.path.isfile(init):
                yield from _package_files(e.name, e.path)
        elif e.name.endswith(".py") and e.name[:-3].isidentifier():
            yield e.name[:-3], e.path


def _package_files(name: str, path: str) -> Iterator[tuple[str, str]]:
    yield name, os.path.join(path, "__init__.py")
    for e in folder_entries(path):
        n = e.name
        if n.startswith(".") or n in _SKIP_DIRS:
            continue
        if n.endswith(".py"):
            stem = n[:-3]
            if stem != "__init__" and stem.isidentifier() and e.is_file():
                yield f"{name}.{stem}", e.path
        elif (
            n.isidentifier() and e.is_dir() and os.path.isfile(os.path.join(e.path, "__init__.py"))
        ):
            yield from _package_files(f"{name}.{n}", e.path)


def source_modules(
    root: Path, source_dirs: Iterable[Path | str]
) -> tuple[list[tuple[str, str, str]], list[GraphProblem]]:
    """``([(module name, path, root-relative path)], problems)`` of every module below
    ``source_dirs`` (relative ones are taken from ``root``, which must be resolved), in source-dir
    order; a module name defined twice keeps the first and records a problem."""
    prefix = str(root) + os.sep
    seen: dict[str, str] = {}
    out: list[tuple[str, str, str]] = []
    problems: list[GraphProblem] = []
    for sd in source_dirs:
        sd = Path(sd)
        sd = (sd if sd.is_absolute() else root / sd).resolve()
        for name, path in source_files(sd):
            rel = path[len(prefix) :] if path.startswith(prefix) else path
            if os.sep != "/":
                rel = rel.replace(os.sep, "/")
            if name in seen:
                problems.append(
                    GraphProblem(
                        rel, 1, f"module {name} is also defined by {seen[name]}; kept that one"
                    )
                )
                continue
            seen[name] = rel
            out.append((name, path, rel))
    return out, problems


def root_relative(path: Path | str, root: Path) -> tuple[str, str]:
    """``(path to open, root-relative POSIX path)`` of a file given relative to the resolved
    ``root`` or absolute; lexical (``os.path.normpath``, no ``resolve()`` per file, which costs
    seconds on 10,000 files); absolute when outside ``root``."""
    p = os.fspath(path)
    if not os.path.isabs(p):
        p = os.path.join(root, p)
    p = os.path.normpath(p)
    prefix = str(root) + os.sep
    rel = p[len(prefix) :] if p.startswith(prefix) else p
    return p, rel.replace(os.sep, "/") if os.sep != "/" else rel


_TREE_SKIP = frozenset({"node_modules", "__pycache__", "build", "dist", "site-packages", "tests"})


def locate_packages(root: Path, names: Iterable[str], max_depth: int = 4) -> dict[str, list[Path]]:
    """For each top-level package name, the directories ``<name>/`` (with ``__init__.py``) found at
    ``root/<name>``, ``root/src/<name>`` or ``<dir>/src/<name>`` up to ``max_depth`` below ``root``
    (hidden, virtualenv, build and ``tests`` directories skipped).  Empty list: not found."""
    wanted = list(dict.fromkeys(names))
    found: dict[str, list[Path]] = {n: [] for n in wanted}
    for n in wanted:
        if (root / n / "__init__.py").is_file():
            found[n].append(root / n)
    stack = [(root, 0)]
    while stack:
        d, depth = stack.pop()
        for e in folder_entries(d):
            if not e.is_dir() or e.name.startswith(".") or e.name in _TREE_SKIP:
                continue
            if os.path.exists(os.path.join(e.path, "pyvenv.cfg")):
                continue
            if e.name == "src":
                for n in wanted:
                    if os.path.isfile(os.path.join(e.path, n, "__init__.py")):
                        found[n].append(Path(e.path, n))
            elif depth + 1 < max_depth:
                stack.append((Path(e.path), depth + 1))
    return {n: sorted(set(v)) for n, v in found.items()}


def workspace_members(root: Path) -> list[Path]:
    """The member directories of a uv workspace (those holding a ``pyproject.toml``), from
    ``[tool.uv.workspace] members`` of ``root/pyproject.toml``; empty when ``root`` is none.  The
    members come from the checkout: each must be a relative glob without ``..`` whose matches lie
    inside ``root`` (a member reached through a link out of it is not read); otherwise
    :class:`ConfigError`."""
    pyproject = root / "pyproject.toml"
    out: list[Path] = []
    for pattern in _members(pyproject):
        for member in sorted(root.glob(pattern)):
            if not _inside(member, root):
                raise ConfigError(
                    f"{pyproject}: [tool.uv.workspace] member {member} ({pattern!r}) lies outside "
                    "the repository (a link?); list members inside it"
                )
            if (member / "pyproject.toml").is_file():
                out.append(member)
    return out


def workspace_source_dirs(root: Path) -> list[Path]:
    """The ``sys.path`` entries of a uv workspace's members (``<member>/src`` when it exists, else
    the member directory); plus ``root/src`` when present.  Empty when ``root`` is no uv
    workspace."""
    out = [m / "src" if (m / "src").is_dir() else m for m in workspace_members(root)]
    if (root / "src").is_dir() and root / "src" not in out:
        out.append(root / "src")
    return out


def _members(pyproject: Path) -> list[str]:
    """``[tool.uv.workspace] members`` of ``pyproject`` (none when it does not exist), checked."""
    try:
        source, _ = read_bytes(pyproject, 1024 * 1024)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise ConfigError(f"{pyproject}: cannot read: {e}") from None
    try:
        data = tomllib.loads(source.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as e:
        raise ConfigError(f"{pyproject}: not valid TOML (UTF-8): {e}; fix the file") from None
    table: object = data
    for key in ("tool", "uv", "workspace"):
        table = table.get(key, {}) if isinstance(table, dict) else None
    members = table.get("members", []) if isinstance(table, dict) else None
    fix = 'list relative globs inside the repository, e.g. `members = ["packages/*"]`'
    if not isinstance(members, list) or not all(isinstance(m, str) and m for m in members):
        raise ConfigError(
            f"{pyproject}: [tool.uv.workspace] members must be a list of globs; {fix}"
        )
    for m in members:
        if os.path.isabs(m) or ".." in Path(m).parts or not m.isprintable():
            raise ConfigError(
                f"{pyproject}: [tool.uv.workspace] member {m!r} is absolute or climbs out with "
                f"`..`; {fix}"
            )
    return members


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


# [project.<table>] -> the entry-point group an installer writes it under
_SCRIPT_GROUPS = {"scripts": "console_scripts", "gui-scripts": "gui_scripts"}
UNKNOWN_GROUP = "*"  # the entry points of a member whose pyproject.toml cannot be read


class EntryPointDecl(NamedTuple):
    """One entry point a workspace declares: ``group`` (``console_scripts`` for
    ``[project.scripts]``, ``gui_scripts``, or the ``[project.entry-points.<group>]`` name),
    its ``name``, the ``module`` it loads and ``how`` (where it is declared, in words).  A member
    whose ``pyproject.toml`` cannot be read gives one row of group :data:`UNKNOWN_GROUP` whose
    ``module`` is the member's folder with a trailing ``/`` (every module of it)."""

    group: str
    name: str
    module: str
    how: str


def entry_point_table(root: Path) -> list[EntryPointDecl]:
    """Every entry point the workspace members' ``pyproject.toml`` declare
    (``[project.scripts]``, ``[project.gui-scripts]``, ``[project.entry-points.<group>]``), and the
    plugins the root's pytest configuration loads in every session (``-p NAME`` in
    ``[tool.pytest.ini_options] addopts``: group ``pytest11``), in a fixed order.  A value whose
    module part is not a dotted name is no entry point any installer accepts, and is left out."""
    out: list[EntryPointDecl] = []
    for member in workspace_members(root):
        path = member / "pyproject.toml"
        rel = root_relative(path, root)[1]
        try:
            project = _toml(path).get("project", {})
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as e:
            directory = root_relative(member, root)[1] + "/"
            how = f"{rel} cannot be read ({e}): its entry points are unknown"
            out.append(EntryPointDecl(UNKNOWN_GROUP, "", directory, how))
            continue
        if not isinstance(project, dict):
            continue
        tables: list[tuple[str, str, object]] = [
            (f"[project.{t}]", g, project.get(t)) for t, g in _SCRIPT_GROUPS.items()
        ]
        groups = project.get("entry-points")
        if isinstance(groups, dict):
            tables += [(f"[project.entry-points.{g}]", g, v) for g, v in sorted(groups.items())]
        for table, group, entries in tables:
            if not isinstance(entries, dict):
                continue
            for name, value in entries.items():
                if not isinstance(value, str):
                    continue
                module = value.partition(":")[0].partition("[")[0].strip()
                if module and all(p.isidentifier() for p in module.split(".")):
                    how = f"entry point {name} of {table} in {rel}"
                    out.append(EntryPointDecl(group, name, module, how))
    out += _pytest_addopts_plugins(root)
    return out


def _toml(path: Path) -> dict:
    source, _ = read_bytes(path, 1024 * 1024)
    return tomllib.loads(source.decode("utf-8"))


def _pytest_addopts_plugins(root: Path) -> list[EntryPointDecl]:
    """``-p NAME`` / ``-pNAME`` in the root ``pyproject.toml``'s pytest ``addopts``: loaded in
    every pytest session, as a ``pytest11`` entry point is (``-p no:NAME`` disables one)."""
    try:
        data = _toml(root / "pyproject.toml")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
        return []  # (the workspace members were read from it: a broken file is reported there)
    table: object = data
    for key in ("tool", "pytest", "ini_options"):
        table = table.get(key, {}) if isinstance(table, dict) else {}
    addopts = table.get("addopts", []) if isinstance(table, dict) else []
    if isinstance(addopts, str):
        addopts = addopts.split()
    if not isinstance(addopts, list):
        return []
    opts = [a for a in addopts if isinstance(a, str)]
    out = []
    for i, a in enumerate(opts):
        name = opts[i + 1] if a == "-p" and i + 1 < len(opts) else a[2:] if a[:2] == "-p" else ""
        if name and not name.startswith("no:") and all(p.isidentifier() for p in name.split(".")):
            how = f"-p {name} in [tool.pytest.ini_options] addopts of pyproject.toml"
            out.append(EntryPointDecl("pytest11", name, name, how))
    return out


def entry_point_modules(root: Path) -> dict[str, list[str]]:
    """``{module: [how it is an entry point]}`` for every module a workspace member declares
    (:func:`entry_point_table`, without the pytest ``addopts`` plugins): each description names
    the table, the entry and the member's ``pyproject.toml`` (e.g. ``entry point mizzen-rollout
    of [project.scripts] in packages/rollout/pyproject.toml``).  A member whose
    ``pyproject.toml`` cannot be read (not valid TOML) has unknown entry points: its directory
    (with a trailing ``/``) is a key, meaning every module of it (fail open; the description says
    why)."""
    out: dict[str, list[str]] = {}
    for decl in entry_point_table(root):
        if " addopts " not in decl.how:
            out.setdefault(decl.module, []).append(decl.how)
    return out


def relative_dirs(dirs: Iterable[Path], root: Path) -> list[str]:
    """Source dirs as the planner names them: root-relative POSIX paths (as given when outside
    ``root``)."""
    out = []
    for d in dirs:
        try:
            out.append(d.resolve().relative_to(root.resolve()).as_posix())
        except ValueError:
            out.append(d.as_posix())
    return out
