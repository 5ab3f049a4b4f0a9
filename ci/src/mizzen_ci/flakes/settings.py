"""k, n and m of the flaky loop, per repository: ``[tool.mizzen.flakes]`` of the root
``pyproject.toml``::

    [tool.mizzen.flakes]
    flips = 3        # k: a (test, arch) whose outcome flips k times ...
    window = 20      # n: ... in its last n trusted runs is proposed for quarantine
    clean = 10       # m: a quarantined one is proposed for re-enabling after m clean runs

Defaults (:data:`DEFAULTS`) and why:
- ``window = 20``: the estimator's window (:data:`mizzen_ci.history.RECENT`), about three weeks of
  nightly runs plus the pushes to main; long enough to see a 10 % flake twice, short enough that
  a fixed test leaves it.
- ``flips = 3``: a real regression that is then fixed flips twice (pass -> fail -> pass); a third
  flip means the failure came back without a change that explains it.  A test failing 10 % of
  its runs flips about 3.6 times in 20 (2 x 0.1 x 0.9 x 19), so k = 3 catches it.
- ``clean = 10``: a test that still fails 25 % of its runs passes 10 in a row with probability
  0.75^10 = 5.6 %, one that fails 10 % with 35 %: ten clean runs rarely lift a test that is
  still badly flaky, and it takes about ten nights at most.

Invariants: every value is an integer within :data:`BOUNDS`; ``flips < window``; an unknown key,
a wrong type or a value out of range is a :class:`~mizzen_ci.sources.ConfigError` naming
``pyproject.toml``, the key, the rule and the fix.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..registry.rules import shown
from ..sources import ConfigError, RefusedFile, read_bytes

PYPROJECT_LIMIT = 1024 * 1024
BOUNDS = {"flips": (1, 100), "window": (2, 200), "clean": (1, 200)}


@dataclass(frozen=True)
class FlakeSettings:
    flips: int = 3  # k
    window: int = 20  # n
    clean: int = 10  # m


DEFAULTS = FlakeSettings()


def settings_from(table: object, where: str) -> FlakeSettings:
    """The settings of a ``[tool.mizzen.flakes]`` table (``None``: the defaults)."""
    if table is None:
        return DEFAULTS
    if not isinstance(table, dict):
        raise ConfigError(
            f"{where}: [tool.mizzen.flakes] must be a table; write [tool.mizzen.flakes]"
        )
    unknown = sorted(set(table) - set(BOUNDS))
    if unknown:
        raise ConfigError(
            f"{where}: [tool.mizzen.flakes] has unknown key(s) {', '.join(map(shown, unknown[:5]))}; "
            f"use {', '.join(BOUNDS)}"
        )
    values = {}
    for key, (low, high) in BOUNDS.items():
        value = table.get(key, getattr(DEFAULTS, key))
        if type(value) is not int or not low <= value <= high:
            raise ConfigError(
                f"{where}: [tool.mizzen.flakes] {key} = {shown(value)}: must be an integer from "
                f"{low} to {high}; write e.g. {key} = {getattr(DEFAULTS, key)}"
            )
        values[key] = value
    if values["flips"] >= values["window"]:
        raise ConfigError(
            f"{where}: [tool.mizzen.flakes] flips = {values['flips']} must be below window = "
            f"{values['window']} (n runs hold at most n - 1 flips); lower flips or raise window"
        )
    return FlakeSettings(**values)


def load_settings(root: Path) -> FlakeSettings:
    """The settings of ``root/pyproject.toml`` (no file or no table: the defaults)."""
    path = Path(root) / "pyproject.toml"
    try:
        data, _ = read_bytes(path, PYPROJECT_LIMIT)
    except FileNotFoundError:
        return DEFAULTS
    except (RefusedFile, OSError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    try:
        parsed = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as e:
        raise ConfigError(f"{path}: not valid UTF-8 TOML: {e}; fix the syntax") from None
    table = parsed.get("tool", {}).get("mizzen", {}).get("flakes") if isinstance(
        parsed.get("tool"), dict) and isinstance(parsed["tool"].get("mizzen"), dict) else None  # fmt: skip
    return settings_from(table, str(path))
