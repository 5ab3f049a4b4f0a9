"""The lazy-import policy: which modules each package may load at import time.

The one table is ``[tool.mizzen.lazy-imports]`` in the root ``pyproject.toml``::

    [tool.mizzen.lazy-imports]
    gpu-only = ["sglang", "flash_attn", "megatron.bridge", ...]   # forbidden in every package

    [tool.mizzen.lazy-imports.packages.mizzen_ci]
    stdlib-only = true                    # only sys.stdlib_module_names and the package itself
    [tool.mizzen.lazy-imports.packages.mizzen_rollout]
    forbid = ["torch", "ray", "harbor", "transformers"]

    [tool.mizzen.lazy-imports.tolerated]  # runtime only: a forbidden module that an allowed
    triton = ["megatron.core"]            # third-party library itself loads at import time

Invariants:
- Names match by dotted components: ``megatron.bridge`` forbids ``megatron.bridge`` and
  ``megatron.bridge.models.x``, never ``megatron.core`` nor ``megatron_bridge``.
- A package's budget is ``gpu-only`` plus its own ``forbid`` (plus everything outside the stdlib
  when ``stdlib-only``); a package without a table gets ``gpu-only`` alone.
- ``tolerated`` never excuses our own code: it only lets the named third-party package (and the
  tolerated module's own internals) load the module, so the runtime check can import a library
  that the CPU image needs.  The static check does not read third-party code, so it ignores it.
- Every problem in the table is a :class:`PolicyError` naming the key, what is wrong and the fix.
"""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

SECTION = "tool.mizzen.lazy-imports"
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
STDLIB = frozenset(sys.stdlib_module_names)


class PolicyError(Exception):
    """A broken ``[tool.mizzen.lazy-imports]`` table (the message says where and how to fix)."""


@dataclass(frozen=True)
class Rule:
    """Why a module is forbidden: ``origin`` is "gpu-only", "forbid", "stdlib-only" or "cli"."""

    module: str  # the forbidden prefix ("" for stdlib-only: everything outside the stdlib)
    origin: str

    def explain(self, package: str) -> str:
        if self.origin == "gpu-only":
            return f"{self.module} is GPU-only, forbidden at import time in every package"
        if self.origin == "cli":
            return f"{self.module} is forbidden by --forbid"
        if self.origin == "stdlib-only":
            return f"{package} may import only the standard library at import time"
        return f"{self.module} is outside {package}'s import budget"


@dataclass(frozen=True)
class Budget:
    """What one package may not load at import time."""

    package: str
    forbidden: dict[str, Rule]  # prefix -> rule
    stdlib_only: bool = False
    allowed_tops: frozenset[str] = frozenset()  # with stdlib_only: the package itself

    def violated_by(self, name: str) -> Rule | None:
        """The rule ``name`` breaks, or None (dotted-component prefix match)."""
        forbidden = self.forbidden
        if forbidden:
            start = 0
            while True:
                dot = name.find(".", start)
                prefix = name if dot < 0 else name[:dot]
                rule = forbidden.get(prefix)
                if rule is not None:
                    return rule
                if dot < 0:
                    break
                start = dot + 1
        if self.stdlib_only:
            top = name.partition(".")[0]
            if top not in STDLIB and top not in self.allowed_tops:
                return Rule(top, "stdlib-only")
        return None


@dataclass(frozen=True)
class Policy:
    gpu_only: tuple[str, ...]
    packages: dict[str, dict] = field(default_factory=dict)  # name -> {"forbid": (...), ...}
    tolerated: dict[str, tuple[str, ...]] = field(default_factory=dict)
    extra_forbid: tuple[str, ...] = ()  # --forbid
    source: str = "<none>"

    def with_forbid(self, modules: tuple[str, ...]) -> Policy:
        for m in modules:
            _check_name(m, "--forbid")
        return Policy(
            self.gpu_only, self.packages, self.tolerated, self.extra_forbid + modules, self.source
        )

    @property
    def empty(self) -> bool:
        return not (self.gpu_only or self.extra_forbid or self.packages)

    def budget(self, package: str) -> Budget:
        table = self.packages.get(package, {})
        forbidden: dict[str, Rule] = {}
        for m in table.get("forbid", ()):
            forbidden[m] = Rule(m, "forbid")
        for m in self.extra_forbid:
            forbidden[m] = Rule(m, "cli")
        for m in self.gpu_only:
            forbidden[m] = Rule(m, "gpu-only")
        return Budget(
            package,
            forbidden,
            bool(table.get("stdlib-only", False)),
            frozenset({package.partition(".")[0]}),
        )


def _check_name(name: object, where: str) -> str:
    if not isinstance(name, str) or not _DOTTED.match(name):
        raise PolicyError(
            f"{where}: {name!r} is not a dotted module name. Fix: write it as it is imported, "
            "e.g. 'megatron.bridge'"
        )
    return name


def _names(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise PolicyError(f"{where} must be a list of module names. Fix: e.g. {where} = ['sglang']")
    names = tuple(_check_name(v, where) for v in value)
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise PolicyError(f"{where} lists {dupes} twice. Fix: keep one entry each")
    return names


def parse_policy(table: dict, source: str) -> Policy:
    """Check a ``[tool.mizzen.lazy-imports]`` table and build the policy."""
    where = f"{source} [{SECTION}]"
    unknown = sorted(set(table) - {"gpu-only", "packages", "tolerated"})
    if unknown:
        raise PolicyError(
            f"{where}: unknown key(s) {unknown}. Fix: use gpu-only, packages and tolerated"
        )
    gpu_only = _names(table.get("gpu-only", []), f"{where} gpu-only")
    packages: dict[str, dict] = {}
    for pkg, spec in table.get("packages", {}).items():
        pwhere = f"{source} [{SECTION}.packages.{pkg}]"
        _check_name(pkg, pwhere)
        if not isinstance(spec, dict):
            raise PolicyError(
                f"{pwhere} must be a table. Fix: forbid = [...] or stdlib-only = true"
            )
        bad = sorted(set(spec) - {"forbid", "stdlib-only"})
        if bad:
            raise PolicyError(f"{pwhere}: unknown key(s) {bad}. Fix: use forbid and stdlib-only")
        stdlib_only = spec.get("stdlib-only", False)
        if not isinstance(stdlib_only, bool):
            raise PolicyError(f"{pwhere} stdlib-only must be true or false")
        forbid = _names(spec.get("forbid", []), f"{pwhere} forbid")
        overlap = sorted(set(forbid) & set(gpu_only))
        if overlap:
            raise PolicyError(
                f"{pwhere} forbid repeats {overlap} from gpu-only. Fix: list them once, in gpu-only"
            )
        packages[pkg] = {"forbid": forbid, "stdlib-only": stdlib_only}
    tolerated: dict[str, tuple[str, ...]] = {}
    for mod, loaders in table.get("tolerated", {}).items():
        twhere = f"{source} [{SECTION}.tolerated] {mod}"
        _check_name(mod, twhere)
        if not any(mod == g or mod.startswith(g + ".") for g in gpu_only) and not any(
            mod == f or mod.startswith(f + ".") for p in packages.values() for f in p["forbid"]
        ):
            raise PolicyError(
                f"{twhere}: {mod} is not forbidden anywhere, so tolerating it means nothing. "
                "Fix: remove the entry"
            )
        tolerated[mod] = _names(loaders, twhere)
    return Policy(gpu_only, packages, tolerated, (), source)


def load_policy(pyproject: Path) -> Policy:
    """The policy of ``pyproject`` (an empty policy when the file or the section is absent)."""
    if not pyproject.is_file():
        return Policy((), source=str(pyproject))
    try:
        with pyproject.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise PolicyError(f"{pyproject}: not valid TOML ({e}). Fix the file") from None
    table = data.get("tool", {}).get("mizzen", {}).get("lazy-imports")
    if table is None:
        return Policy((), source=str(pyproject))
    return parse_policy(table, str(pyproject))
