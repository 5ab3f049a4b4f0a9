"""Path literals: the repository files a Python source may name with a string literal.

Tests read files without importing them: data (``HERE / "tasks" / "instruction.md"``), helpers
loaded by path (``spec_from_file_location(name, HERE / "fake_engine.py")``), scripts they run
(``Path(__file__).with_name("worker.py")``).  No import names such a file; a string literal does.
This module reads those literals, so that the planner selects whoever names a changed file.

``path_literals(source, tree=None) -> tuple[str, ...] | None``: the path literals of a source, in
order, each once; ``None`` when the source is not :func:`simple` and no ``tree`` is given (the
caller must parse it).  ``names(literal, path, beside)``: whether a literal names a path;
``lookup_keys(path)``: the literals that would name it (for an index lookup).

Definitions.

- *Path characters*: letters and digits (of any script) and ``. _ - + @ ~ /``.
- The *tail* of a string value V: its longest suffix of path characters.  When the character
  before that suffix is not whitespace (and the suffix is not all of V), the suffix continues a
  word that is no path, so its first segment is cut off (``"{root}/data/x.json"`` gives
  ``data/x.json``, ``"{name}.json"`` nothing, ``"python tests/w.py"`` gives ``tests/w.py``).  An
  f-string's value is its text with each replacement field counted as a non-path character.
- The tail is normalised: ``.`` segments dropped, everything up to the last ``..`` or empty
  segment dropped (``../data/x.json`` -> ``data/x.json``, ``/abs/x.json`` -> ``abs/x.json``).  It
  is a *path literal* when it contains ``/`` or its last segment has an extension (a ``.`` after
  its first character and before its last); one longer than :data:`MAX_LENGTH` characters is kept
  as its longest suffix of whole segments within that length.
- *Module literals*: a string whose whole value is a loader spec, a dotted name of two
  identifiers or more and ``:attr`` (``"pkg.mod:func"``: how a run's configuration names a
  reward or a plugin, not by an import), gives ``":pkg.mod"`` (:data:`MODULE_MARK` and the
  module).  It names the Python files of that module: ``:a.b.c`` names ``…/a/b/c.py`` and
  ``…/a/b/c/__init__.py``.  (Simple sources: every quote, spec, quote run of the bytes,
  docstrings included: a superset again.)  A bare dotted string is no module literal (file
  names such as ``"engine.py"`` are spelled so).
- A path literal L *names* a repository path P when ``P == L`` or P ends with ``"/" + L``;
  except that a bare :data:`CONVENTION_NAMES` literal (``"__init__.py"``, ``"__main__.py"``,
  ``"conftest.py"``) names only the file of that name beside the file holding it.  Python and
  pytest give these names to a file of every package and test directory, so alone they identify
  none (code that writes or walks other trees spells them); the planner reaches such files
  through imports and the conftest rule anyway.  ``"pkg/__init__.py"`` names as any literal does.
- A source has at most :data:`MAX_LITERALS` distinct path literals; one with more gives
  ``(OVERFLOW,)``, which names every path (fail open: a bounded record never hides a file).

Two ways to read them, chosen by the bytes alone:

- A *simple* source (:func:`simple`: ASCII, no backslash, no implicitly concatenated string
  tokens) spells every string value verbatim between its quotes, so the tail of each value is the
  run of path characters that ends at a quote character of the source.  Its literals are read from
  the bytes, without parsing: the tails of the runs before *every* quote character (docstrings,
  comments and bytes literals count too, so this is a superset of what the tree holds).
- Any other source is read from its syntax tree: every ``str`` constant that is not a statement
  of its own (docstrings and bare strings name nothing: they are never used) and the tail of every
  f-string (its format specs are not strings of their own).  A source that does not parse names
  nothing.

Invariants:
- A pure function of the bytes: the same source gives the same literals whether or not the
  caller parsed it (so a file left unparsed by the planner's index is answered as a parsed one).
- For a simple source, the literals read from the bytes include every literal the tree would give
  (or are ``(OVERFLOW,)``): tested on generated sources in ``tests/ci/plan/index/test_spelled_names.py``.
- Stdlib only; never raises for bad input.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

MAX_LITERALS = 64
MAX_LENGTH = 200
OVERFLOW = "*"  # not a path character: never a literal itself
CONVENTION_NAMES = frozenset({"__init__.py", "__main__.py", "conftest.py"})

_PATH_PUNCTUATION = frozenset("._-+@~/")
# A whole string that is a loader spec ``"pkg.mod:attr"`` (rewards, entry points): its module,
# marked (``MODULE_MARK`` is no path character).
MODULE_MARK = ":"
_MODULE = re.compile(r"((?:[A-Za-z_][A-Za-z0-9_]*\.)+[A-Za-z_][A-Za-z0-9_]*):[A-Za-z_][\w.]*")
_QUOTED_MODULE = re.compile(
    rb"[\"']((?:[A-Za-z_][A-Za-z0-9_]*\.)+[A-Za-z_][A-Za-z0-9_]*):[A-Za-z_][A-Za-z0-9_.]*[\"']"
)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# In the *reversed* source: a quote, then the run of path characters that ends at it in the
# source (holding a "." or "/": a run without one is no path literal), then the character before
# the run.  Reversed, every match starts with a quote, which the regex engine finds fast.
_QUOTE_THEN_RUN_REVERSED = re.compile(
    rb"[\"']([A-Za-z0-9_\-+@~]*+[./][A-Za-z0-9._\-+@~/]*+)(?=(.?))", re.DOTALL
)
# Implicit concatenation of string tokens, or something that may be one (false alarms only cost a
# parse), after a quote: whitespace or comments (at least one character), an optional prefix and
# a quote; a prefix and a quote; or, the quote starting a run of quote characters, a run that is
# not exactly one triple-quote delimiter (``""`` is also the empty string: parsed, to be safe).
# Every branch starts with a quote (so the engine scans for quotes only).
_GAP = rb"(?:[ \t\f\r\n]++|\#[^\r\n]*+)++[rRbBuUfF]{0,2}[\"']|[rRbBuUfF]{1,2}[\"']"
_MAY_CONCATENATE = re.compile(
    rb"\"(?:" + _GAP + rb"|(?<![\"']\")(?:[\"'](?![\"'])|[\"']{3,}|\"'(?![\"'])|'[\"'](?![\"'])))"
    rb"|'(?:" + _GAP + rb"|(?<![\"']')(?:[\"'](?![\"'])|[\"']{3,}|'\"(?![\"'])|\"[\"'](?![\"'])))"
)


def simple(source: bytes) -> bool:
    """Whether every string value of ``source`` is spelled verbatim between its quotes (ASCII, no
    backslash, no implicit concatenation): then :func:`path_literals` reads the bytes."""
    return source.isascii() and b"\\" not in source and _MAY_CONCATENATE.search(source) is None


def path_literals(source: bytes, tree: ast.Module | None = None) -> tuple[str, ...] | None:
    """The path literals of ``source`` (see the module docstring); None when ``source`` is not
    simple and ``tree`` is None.  ``tree``: the source parsed by the caller (only read when the
    source is not simple); a source that is not simple and does not parse names nothing."""
    if simple(source):
        found = _from_bytes(source)
    elif tree is None:
        return None
    else:
        found = literals_of_tree(tree)
    out: dict[str, None] = {}
    for literal in found:
        if literal not in out:
            if len(out) == MAX_LITERALS:
                return (OVERFLOW,)
            out[literal] = None
    return tuple(out)


def unparsed_literals(source: bytes) -> tuple[str, ...]:
    """The path literals of a source that does not parse (there is no tree to read)."""
    return path_literals(source, None) or ()


def _from_bytes(source: bytes) -> Iterator[str]:
    found = _QUOTE_THEN_RUN_REVERSED.findall(source[::-1])
    for run, before in reversed(found):  # in source order
        if b"/" not in run and b"." not in run[1:-1]:
            continue  # one segment without an extension (most docstrings end so): no literal
        # start of the source, whitespace or a quote (the string's own opening quote): whole run
        cut = before not in (b"", b'"', b"'") and not before.isspace()
        literal = _literal(run[::-1].decode("ascii"), cut)
        if literal is not None:
            yield literal
    for module in _QUOTED_MODULE.findall(source):
        yield MODULE_MARK + module.decode("ascii")


def literals_of_tree(tree: ast.Module) -> Iterator[str]:
    """The path literals of a parsed source, in source order, with repeats (the reference
    reading: :func:`path_literals` reads a non-simple source so)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        t = type(node)
        if t is ast.Constant:
            if type(node.value) is str:
                literal = _tail(node.value)
                if literal is not None:
                    yield literal
                spec = _MODULE.fullmatch(node.value)
                if spec is not None:
                    yield MODULE_MARK + spec.group(1)
            continue
        if t is ast.Expr and type(node.value) in (ast.Constant, ast.JoinedStr):
            continue  # a docstring or a bare string: never used
        if t is ast.JoinedStr:
            text = []
            fields = []
            for part in node.values:
                if type(part) is ast.Constant:
                    text.append(part.value)
                else:  # a replacement field: not a path character
                    text.append("\x00")
                    fields.append(part)
            literal = _tail("".join(text))
            if literal is not None:
                yield literal
            # Strings inside the fields' expressions count; a format spec's own text does not
            # (it is no string of its own), the fields nested in it do.
            while fields:
                part = fields.pop()
                stack.append(part.value)
                if part.format_spec is not None:
                    fields.extend(v for v in part.format_spec.values if type(v) is not ast.Constant)
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _is_path_char(c: str) -> bool:
    return c.isalnum() or c in _PATH_PUNCTUATION


def _tail(value: str) -> str | None:
    i = len(value)
    while i > 0 and _is_path_char(value[i - 1]):
        i -= 1
    if i == len(value):
        return None
    cut = i > 0 and not value[i - 1].isspace()
    return _literal(value[i:], cut)


def _literal(run: str, cut: bool) -> str | None:
    """The path literal of a tail ``run`` (``cut``: its first segment continues another word)."""
    if cut:
        slash = run.find("/")
        if slash == -1:
            return None
        run = run[slash + 1 :]
    segments: list[str] = []
    for s in run.split("/"):
        if s == "" or s == "..":
            segments = []
        elif s != ".":
            segments.append(s)
    if not segments or (len(segments) == 1 and "." not in segments[0][1:-1]):
        return None
    literal = "/".join(segments)
    while len(literal) > MAX_LENGTH and len(segments) > 1:
        segments.pop(0)
        literal = "/".join(segments)
    return literal if len(literal) <= MAX_LENGTH else None


def names(literal: str, path: str, beside: str) -> bool:
    """Whether ``literal`` (a path literal, or :data:`OVERFLOW`), held by a file of directory
    ``beside`` (root-relative, "" at the root), names the repository ``path``."""
    if literal == OVERFLOW:
        return True
    if literal in CONVENTION_NAMES:
        return path == (f"{beside}/{literal}" if beside else literal)
    if literal.startswith(MODULE_MARK):
        return path.endswith(".py") and literal in _module_keys(path)
    return path == literal or path.endswith("/" + literal)


def _module_keys(path: str) -> list[str]:
    """The dotted names that name the Python file ``path`` as a module (``a/b/c.py``: ``a.b.c``,
    ``b.c``; ``a/b/__init__.py``: ``a.b``), of two components or more, identifiers only."""
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts.pop()
    keys = []
    for i in range(len(parts) - 1):
        if not _IDENTIFIER.fullmatch(parts[i]):
            continue
        if all(_IDENTIFIER.fullmatch(p) for p in parts[i:]):
            keys.append(MODULE_MARK + ".".join(parts[i:]))
    return keys


def lookup_keys(path: str, bare: bool = True) -> list[str]:
    """Every string that names ``path`` as a literal (``path`` itself and each of its suffixes of
    whole segments), then :data:`OVERFLOW`: the keys an index of literals is looked up by.
    ``bare=False`` leaves out the file name alone (the literals holding a ``/``)."""
    keys = [path]
    i = path.find("/")
    while i != -1:
        keys.append(path[i + 1 :])
        i = path.find("/", i + 1)
    if not bare and len(keys) > 1:
        keys.pop()
    if path.endswith(".py"):
        keys += _module_keys(path)
    keys.append(OVERFLOW)
    return keys
