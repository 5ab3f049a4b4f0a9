"""Which files may name a module, read from their bytes without parsing them.

The planner's reverse search asks, for a dotted name X, which nodes reach X in one step: those
whose direct names (:func:`mizzen_ci.imports.resolve.direct_names`) hold X or a name below it
(``X.…``; see :mod:`mizzen_ci.imports.reach`).  Parsing every file to know its names is most of a
cold plan; this module tells from a file's bytes that it *cannot* name X, so that only the files
that may are parsed (exact in that direction; the parse then gives the answer).

``spelled_words(source) -> tuple[str, ...] | None``: the distinct identifier words of a source
(keywords left out), or None when the rule below does not apply (the file must be parsed).

The rule.  Let the source be ASCII, declare no encoding (no ``coding`` in its first two lines, as
cut at ``\\n``, which covers the first two lines however they end) and spell none of
:data:`mizzen_ci.imports.facts.DYNAMIC_SPELLINGS` (``import_module``, ``__import__``,
``importorskip``, ``run_module``, a ``"-m"`` literal): then the import facts read no expression
of it, so it has no dynamic import (literal or computed, through any alias), no ``python -m``
run and no fail-open mark (``ModuleFacts.dynamic`` is 0).  If it does not parse it names
nothing.  If it parses, each of its names comes from an ``import`` or ``from … import``
statement: an absolute target is a dotted name written as NAME tokens; a relative target is a
*relative base* (the file's package or one of its ancestors; a file outside any package has none,
its relative imports are skipped) followed by NAME tokens; a ``from`` name adds one NAME token
(``*`` adds none).  So if it names X or a name below X, then either

1. X's last component is one of its NAME tokens, or
2. X is its relative base or an ancestor of it, hence the file's package or an ancestor of it:
   the file is a module M with M == X or M below X.

In an ASCII source a NAME token is a maximal run of ``[A-Za-z0-9_]`` that does not start with a
digit, so it is one of the words found here; a keyword is never a NAME token.
:class:`PendingNodes` keeps unparsed nodes by these words and answers ``candidates(X)``: every
pending node for which 1 or 2 may hold, a superset of those that name X or below.  (A file's
*sibling* imports, :func:`mizzen_ci.imports.resolve.sibling_names`, are looked up by the dotted
name they spell, so the same rule finds them.)

A pending node also keeps its path literals (:mod:`mizzen_ci.imports.path_literals`, read from the
bytes without parsing when the source is *simple*; the planner parses a file that is not):
they are the parsed file's own, so ``namers(P)`` is answered exactly without parsing.

Invariants:
- ``spelled_words`` is a pure function of the bytes; None for any source the rule does not cover.
- ``candidates(X)`` holds every pending node that may name X or a name below X (it may hold more).
- ``namers(P)`` is every pending node whose literals name P.
- ``PendingNodes`` is plain data (``to_data`` / ``from_data``) so that a cache can keep it.
"""

from __future__ import annotations

import bisect
import keyword
import re
import sys

from ...imports.facts import spells_dynamic
from ...imports.path_literals import lookup_keys
from ...imports.reach import list_under

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KEYWORDS = frozenset(keyword.kwlist)


def spelled_words(source: bytes) -> tuple[str, ...] | None:
    """The distinct identifier words of ``source`` without keywords, sorted; None when the rule
    of the module docstring does not apply (the file must be parsed)."""
    if not source.isascii() or spells_dynamic(source):
        return None
    first = source.find(b"\n")
    second = source.find(b"\n", first + 1) if first != -1 else -1
    if b"coding" in (source if second == -1 else source[:second]):
        return None
    words = set(_WORD.findall(source.decode("ascii")))
    words -= _KEYWORDS
    intern = sys.intern  # the same word in many files: one string in the cache
    return tuple(sorted([intern(w) for w in words]))


class PendingNodes:
    """Nodes not parsed yet, by the words they spell and with their path literals; see the module
    docstring.

    ``nodes``: ``{node: its words}`` (a module node is named by its dotted name, a file under
    ``tests/`` by its path).  ``words``: ``{word: nodes}``, which may also list nodes no longer
    pending or no longer spelling the word (filtered on use, compacted by :meth:`to_data`).
    ``literals``: ``{node: its path literals}`` (nodes with none left out) and ``by_literal``:
    ``{literal: nodes}``, kept the same way."""

    __slots__ = ("_sorted", "_stale", "by_literal", "literals", "nodes", "words")

    def __init__(
        self,
        words: dict[str, list[str]] | None = None,
        nodes: dict[str, tuple[str, ...]] | None = None,
        by_literal: dict[str, list[str]] | None = None,
        literals: dict[str, tuple[str, ...]] | None = None,
    ):
        self.words: dict[str, list[str]] = words if words is not None else {}
        self.nodes: dict[str, tuple[str, ...]] = nodes if nodes is not None else {}
        self.by_literal: dict[str, list[str]] = by_literal if by_literal is not None else {}
        self.literals: dict[str, tuple[str, ...]] = literals if literals is not None else {}
        self._sorted: list[str] | None = None
        self._stale = False

    def __len__(self) -> int:
        return len(self.nodes)

    def add(self, node: str, words: tuple[str, ...], literals: tuple[str, ...] = ()) -> None:
        if node in self.nodes:
            self.remove(node)
        self.nodes[node] = words
        list_under(self.words, node, words)
        if literals:
            self.literals[node] = literals
            list_under(self.by_literal, node, literals)
        self._sorted = None

    def remove(self, node: str) -> None:
        if self.nodes.pop(node, None) is not None:
            self.literals.pop(node, None)
            self._stale = True
            self._sorted = None

    def candidates(self, name: str) -> list[str]:
        """Every pending node that may name ``name`` or a name below it (rule 1 or 2), once, in
        a deterministic order."""
        nodes = self.nodes
        if not nodes:
            return []
        out: dict[str, None] = {}
        last = name.rpartition(".")[2]
        for n in self.words.get(last, ()):
            if last in nodes.get(n, ()):
                out[n] = None
        if self._sorted is None:
            self._sorted = sorted(nodes)
        keys = self._sorted
        i = bisect.bisect_left(keys, name)
        if i < len(keys) and keys[i] == name:
            out[name] = None
        prefix = name + "."
        i = bisect.bisect_left(keys, prefix)
        while i < len(keys) and keys[i].startswith(prefix):
            out[keys[i]] = None
            i += 1
        return list(out)

    def namers(self, path: str, bare: bool = True) -> list[str]:
        """Every pending node whose path literals name ``path``, once, in a deterministic order
        (``bare``: as :meth:`~mizzen_ci.imports.reach.ReachIndex.namers`)."""
        if not self.literals:
            return []
        out: dict[str, None] = {}
        literals = self.literals
        for key in lookup_keys(path, bare):
            for n in self.by_literal.get(key, ()):
                if key in literals.get(n, ()):
                    out[n] = None
        return list(out)

    def to_data(self) -> tuple:
        if self._stale:
            words: dict[str, list[str]] = {}
            for node, spelled in self.nodes.items():
                list_under(words, node, spelled)
            by_literal: dict[str, list[str]] = {}
            for node, literals in self.literals.items():
                list_under(by_literal, node, literals)
            self.words, self.by_literal, self._stale = words, by_literal, False
        return self.words, self.nodes, self.by_literal, self.literals

    @classmethod
    def from_data(cls, data: object) -> PendingNodes | None:
        if isinstance(data, tuple) and len(data) == 4 and all(isinstance(t, dict) for t in data):
            return cls(*data)
        return None
