"""``ci/metrics.toml``: the one table of metric names a test may record and a gate may judge.

Invariants:
- A metric name is 1-64 characters of lower-case letters, digits, ``_ . -``, in ``/``-separated
  parts, each starting with a letter or digit (``eval/score``, ``perf/tokens_per_s``): it prints
  the same in every medium (:data:`NAME`).
- Every entry is a table with a non-empty ``description`` (what is measured, in what unit).
- A malformed table raises :class:`VocabularyError` (a :class:`~mizzen_ci.sources.ConfigError`:
  one line naming the file and the fix; the command line exits 2).  A missing file is an empty
  vocabulary: every gate and every recorded name is then unknown, and says where to declare it.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..sources import ConfigError, read_bytes

VOCABULARY_RELATIVE_PATH = Path("ci") / "metrics.toml"
NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*(?:/[a-z0-9][a-z0-9_.-]*)*")
MAX_NAME_CHARS = 64
MAX_DESCRIPTION_CHARS = 300
MAX_VOCABULARY_BYTES = 1024 * 1024


class VocabularyError(ConfigError):
    """``ci/metrics.toml`` cannot be used; the message names the file, the entry and the fix."""


@dataclass(frozen=True)
class Vocabulary:
    """The declared metric names and their descriptions."""

    path: Path
    metrics: dict[str, str]
    exists: bool = True

    def __contains__(self, name: object) -> bool:
        return name in self.metrics

    def names(self) -> list[str]:
        return sorted(self.metrics)

    def unknown_fix(self) -> str:
        where = VOCABULARY_RELATIVE_PATH.as_posix()
        if not self.metrics:
            return f'declare it in {where}: `[metrics."NAME"]` with a `description`'
        shown = ", ".join(self.names()[:12]) + (" …" if len(self.metrics) > 12 else "")
        return f"use a metric of {where} ({shown}) or declare it there"


def valid_name(name: object) -> bool:
    return isinstance(name, str) and len(name) <= MAX_NAME_CHARS and bool(NAME.fullmatch(name))


def load_vocabulary(root: Path) -> Vocabulary:
    """The vocabulary of the tree at ``root`` (see the module docstring)."""
    path = Path(root) / VOCABULARY_RELATIVE_PATH
    try:
        data, _ = read_bytes(path, MAX_VOCABULARY_BYTES)
    except FileNotFoundError:
        return Vocabulary(path, {}, exists=False)
    except OSError as e:
        raise VocabularyError(f"{path}: cannot read the metric vocabulary: {e}") from None
    return parse_vocabulary(data, path)


def parse_vocabulary(data: bytes | str, path: Path) -> Vocabulary:
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        table = tomllib.loads(text)
    except UnicodeDecodeError:
        raise VocabularyError(f"{path}: not UTF-8; save it as UTF-8") from None
    except (tomllib.TOMLDecodeError, RecursionError) as e:
        raise VocabularyError(f"{path}: not valid TOML: {e}; fix the syntax") from None
    extra = sorted(set(table) - {"metrics"})
    if extra:
        raise VocabularyError(
            f"{path}: unknown top-level key(s) {', '.join(map(repr, extra[:5]))}; the file holds "
            '`[metrics."NAME"]` tables only'
        )
    metrics = table.get("metrics", {})
    if not isinstance(metrics, dict):
        raise VocabularyError(f'{path}: `metrics` must be tables: write `[metrics."eval/score"]`')
    out: dict[str, str] = {}
    for name, entry in metrics.items():
        if not valid_name(name):
            raise VocabularyError(
                f"{path}: metric name {name[:80]!r} is not 1-{MAX_NAME_CHARS} characters of "
                "a-z 0-9 _ . - in /-separated parts; rename it (e.g. `eval/heldout_loss`)"
            )
        description = entry.get("description") if isinstance(entry, dict) else None
        if not (
            isinstance(description, str)
            and description.strip()
            and len(description) <= MAX_DESCRIPTION_CHARS
            and description.isprintable()
        ):
            raise VocabularyError(
                f'{path}: [metrics."{name}"] needs a `description`: one printable line of at most '
                f"{MAX_DESCRIPTION_CHARS} characters saying what is measured and in what unit"
            )
        extra = sorted(set(entry) - {"description"})
        if extra:
            raise VocabularyError(
                f'{path}: [metrics."{name}"] has unknown key(s) {", ".join(map(repr, extra[:5]))}; '
                "an entry has a `description` only (the gate's settings are in the test file)"
            )
        out[name] = description.strip()
    return Vocabulary(path, out)
