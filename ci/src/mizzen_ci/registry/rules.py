"""The registration rules that need the fleet: field validators over what the syntax tree said.

Invariants:
- One validator per field (:data:`VALIDATORS`); each returns the normalised value or raises
  :class:`~mizzen_ci.registry.model.RuleBroken` with the rule, what is wrong and the fix.
- :func:`validate` never raises for bad input: every problem becomes a
  :class:`~mizzen_ci.registry.model.Violation` naming ``file:line``; all of a file's violations
  are reported, and a file with any violation has no registration.
- :func:`validate_row` is the same with the registration as plain data (its fields in order),
  for a content-hash cache; ``Registration(*row)`` is the registration.
- Numbers are bounded before anything computes with them, so no value a file can spell
  overflows downstream (planner timeouts, GPU-lane timeouts, packing): ``est_time`` is finite,
  positive and at most :data:`MAX_EST_TIME_SECONDS` (an integer or float literal of any size
  beyond it is an error, never an ``OverflowError``); ``num_gpus`` is at most
  :data:`MAX_NUM_GPUS`.  A ``disabled`` reason is printable text of at most
  :data:`MAX_REASON_CHARS` characters with something visible in it.  A value quoted in a message
  is cut to :data:`SHOWN_CHARS` characters (:func:`shown`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping

from ..fleet import VENDORS, Fleet
from .model import Registration, RuleBroken, Violation
from .syntax import BACKEND_OF, REQUIRED, SIGNATURES, VENDORS_OF

# The one ceiling of a test file's time, and the job timeout it keeps every workflow under:
# 3 hours of est_time (recorded durations are bounded by it too, :mod:`mizzen_ci.history`) gives
# a job of that one file at most MAX_JOB_SETUP_S (1 h) + 3 h × 1.25 + 5 min = 290 minutes
# (:mod:`mizzen_ci.plan.jobs`), under the 360-minute limit GitHub puts on a hosted runner's job,
# which every job the plan emits keeps (``timeout_minutes`` ≤ MAX_JOB_TIMEOUT_MINUTES, the
# ``timeout-minutes`` of the lane jobs of pr.yml and gpu.yml).  A GPU lane's per-file timeout
# (estimate × factor) is bounded by the same job limit: the job would end first.
MAX_EST_TIME_SECONDS = 3 * 3600  # a test file that needs more must be split
MAX_JOB_TIMEOUT_MINUTES = 360
MAX_NUM_GPUS = 1024
MAX_REASON_CHARS = 300
SHOWN_CHARS = 80


def shown(value: object) -> str:
    """``repr(value)`` for a message, cut to :data:`SHOWN_CHARS` characters; an integer too long
    for ``repr`` (over 4300 digits) is described by its size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        return f"a {type(value).__name__} too large to show"
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"


def _names(names: list[str], most: int = 10) -> str:
    """Names for a message: each cut to :data:`SHOWN_CHARS`, at most ``most`` of them."""
    cut = [n if len(n) <= SHOWN_CHARS else n[: SHOWN_CHARS - 1] + "…" for n in names[:most]]
    return ", ".join(cut) + (f" and {len(names) - most} more" if len(names) > most else "")


def _strings(value, field_name: str) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise RuleBroken(
            f"{field_name}-type",
            f"`{field_name}` must be a list of strings, got {shown(value)}",
            f'write `{field_name}=["..."]`',
        )
    dup = sorted(v for v, n in Counter(value).items() if n > 1)  # linear: lists may be huge
    if dup:
        raise RuleBroken(
            f"{field_name}-duplicate",
            f"`{field_name}` lists {_names(dup)} more than once",
            "list each name once",
        )
    return tuple(value)


def _check_est_time(value, fleet: Fleet):
    fix = (
        "write the expected wall time in seconds, e.g. `est_time=30` (at most "
        f"{MAX_EST_TIME_SECONDS} s, {MAX_EST_TIME_SECONDS // 3600} hours)"
    )
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RuleBroken(
            "est-time", f"`est_time` must be a number of seconds, got {shown(value)}", fix
        )
    # Compared before any conversion: a huge int never becomes a float, inf and nan never pass.
    if isinstance(value, float) and not math.isfinite(value):
        raise RuleBroken(
            "est-time", f"`est_time` must be a finite number of seconds, got {shown(value)}", fix
        )
    if value <= 0:
        raise RuleBroken(
            "est-time",
            f"`est_time` must be positive, got {shown(value)}",
            "give the seconds the file takes",
        )
    if value > MAX_EST_TIME_SECONDS:
        raise RuleBroken(
            "est-time",
            f"`est_time` must be at most {MAX_EST_TIME_SECONDS} s "
            f"({MAX_EST_TIME_SECONDS // 3600} hours, the CI's ceiling), got {shown(value)}",
            "give the real wall time in seconds; a file that needs longer must be split into "
            "files that each fit (a job of it must end within the workflow's job timeout)",
        )
    return float(value)


def _known(value, field_name: str, known: frozenset[str], rule: str, what: str, fix: str):
    """A list of names from one of the fleet's vocabularies (``known``)."""
    names = _strings(value, field_name)
    unknown = sorted(set(names) - known)
    if unknown:
        raise RuleBroken(rule, f"unknown {what} {_names(unknown)}", fix)
    return names


def _check_labels(value, fleet: Fleet):
    fix = (
        f"use labels from `labels` in {fleet.path.name} ({', '.join(sorted(fleet.labels))}) "
        "or add the new label there"
    )
    return _known(value, "labels", fleet.labels, "label-unknown", "label(s)", fix)


def _check_nightly(value, fleet: Fleet):
    if not isinstance(value, bool):
        raise RuleBroken(
            "nightly-type",
            f"`nightly` must be True or False, got {value!r}",
            "write `nightly=True`",
        )
    return value


def _check_disabled(value, fleet: Fleet):
    if value is None:
        return None
    fix = 'say why, e.g. `disabled="flaky on NCCL 2.27, issue #123"`, or remove it'
    if not isinstance(value, str):
        raise RuleBroken(
            "disabled-reason",
            f"`disabled` must be a reason string or None, got {shown(value)}",
            fix,
        )
    reason = value.strip()
    if not reason or not any(_visible(c) for c in reason):
        raise RuleBroken(
            "disabled-reason",
            f"`disabled` must give a visible reason, got {shown(value)}"
            + (" (only invisible characters)" if reason else ""),
            fix,
        )
    if len(reason) > MAX_REASON_CHARS:
        raise RuleBroken(
            "disabled-reason",
            f"`disabled` is {len(reason)} characters long, over {MAX_REASON_CHARS}",
            "keep the reason short and link an issue for the details",
        )
    hidden = sorted({c for c in reason if not c.isprintable()})
    if hidden:
        raise RuleBroken(
            "disabled-reason",
            "`disabled` holds characters that do not print: "
            + ", ".join(f"U+{ord(c):04X}" for c in hidden[:5]),
            "write the reason on one line in printable characters (no control, zero-width or "
            "direction characters)",
        )
    return reason


def _visible(c: str) -> bool:
    """Whether ``c`` leaves a mark: printable and not a space."""
    return c.isprintable() and not c.isspace()


def _check_hardware(value, fleet: Fleet):
    if isinstance(value, list | tuple) and not value:
        raise RuleBroken(
            "hardware-empty",
            "`hardware` is empty",
            f"list the GPU generations the test supports, from {', '.join(fleet.generation_names)}",
        )
    arches = _strings(value, "hardware")
    unknown = [a for a in arches if a not in fleet.generation_names]
    if unknown:
        raise RuleBroken(
            "hardware-unknown",
            f"unknown GPU generation(s) {_names(unknown)}",
            f"use generations from {fleet.path.name}: {', '.join(fleet.generation_names)} "
            "(a generation, not a SKU: hopper, not h100)",
        )
    return arches


def _check_num_gpus(value, fleet: Fleet):
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_NUM_GPUS:
        raise RuleBroken(
            "num-gpus",
            f"`num_gpus` must be an integer from 1 to {MAX_NUM_GPUS}, got {shown(value)}",
            "write e.g. `num_gpus=2`",
        )
    return value


def _check_needs(value, fleet: Fleet):
    fix = f"use capabilities from {fleet.path.name}: {', '.join(sorted(fleet.capabilities))}"
    return _known(value, "needs", fleet.capabilities, "needs-unknown", "capability(ies)", fix)


MAX_WATCHES = 32
MAX_WATCH_LENGTH = 200


def _check_watches(value, fleet: Fleet):
    """Globs of repository paths (the planner's glob dialect: ``*``, ``?``, ``**``)."""
    globs = _strings(value, "watches")
    if len(globs) > MAX_WATCHES:
        raise RuleBroken(
            "watches-count",
            f"`watches` lists {len(globs)} globs (at most {MAX_WATCHES})",
            "watch whole trees with `**` (e.g. `packages/*/src/**/*.py`) instead of files",
        )
    for glob in globs:
        shown = glob if len(glob) <= 60 else glob[:57] + "..."
        problem = None
        if not glob.strip():
            problem = "an empty glob"
        elif len(glob) > MAX_WATCH_LENGTH:
            problem = f"longer than {MAX_WATCH_LENGTH} characters"
        elif glob != glob.strip() or any(c < " " or c == "\x7f" for c in glob):
            problem = "spaces at its ends or control characters"
        elif "\\" in glob:
            problem = "a backslash (paths are POSIX: `/`)"
        elif glob.startswith("/") or (len(glob) > 1 and glob[1] == ":"):
            problem = "an absolute path"
        elif any(part in ("", ".", "..") for part in glob.split("/")):
            problem = "an empty, `.` or `..` segment"
        elif any(c in glob for c in "[]{}"):
            problem = "`[`, `]`, `{` or `}` (the glob dialect has `*`, `?` and `**` only)"
        if problem is not None:
            raise RuleBroken(
                "watches-glob",
                f"`watches` glob {shown!r} has {problem}",
                "write a repository-relative POSIX glob such as `packages/*/src/**/*.py`",
            )
    return globs


def _check_shares_gpu(value, fleet: Fleet):
    if not isinstance(value, bool):
        raise RuleBroken(
            "shares-gpu-type",
            f"`shares_gpu` must be True or False, got {shown(value)}",
            "write `shares_gpu=True` (or leave it out)",
        )
    return value


VALIDATORS: dict[str, Callable] = {
    "est_time": _check_est_time,
    "labels": _check_labels,
    "nightly": _check_nightly,
    "disabled": _check_disabled,
    "hardware": _check_hardware,
    "num_gpus": _check_num_gpus,
    "needs": _check_needs,
    "watches": _check_watches,
    "shares_gpu": _check_shares_gpu,
}


def bound_arguments(
    params: Mapping[str, object],
    given: Mapping[str, tuple[object, int] | None],
    check: Callable[[str, object], object],
    bad: Callable[[str, str, str, int], None],
    missing: Callable[[str], None],
) -> dict[str, object]:
    """The argument values of a statically read call, in the order of ``params`` (``{name:
    default or REQUIRED}``): one given as ``(value, line)`` is what ``check(name, value)``
    returns (a :class:`RuleBroken` it raises goes to ``bad`` at that line), one given as None
    (unreadable, already reported) is left out, one not given is its default (a list as a tuple),
    or, where it is required, left to ``missing(name)``."""
    values: dict[str, object] = {}
    for name, default in params.items():
        if name not in given:
            if default is REQUIRED:
                missing(name)
            else:
                values[name] = default if not isinstance(default, list) else tuple(default)
            continue
        if given[name] is None:  # already reported
            continue
        value, line = given[name]
        try:
            values[name] = check(name, value)
        except RuleBroken as b:
            bad(b.rule, b.message, b.fix, line)
    return values


def _validate_call(call, rel: str, fleet: Fleet) -> tuple[tuple | None, list[Violation]]:
    """The rules that need the fleet (and the path) over a :class:`CallSyntax`: the
    registration's field values in order (None on error) and the errors."""
    fname, call_line, given_items, unpacked, call_problems = call
    errors = [Violation(rel, *p) for p in call_problems]

    def bad(rule: str, message: str, fix: str, line: int | None = None):
        errors.append(Violation(rel, line or call_line, rule, message, fix))

    params = SIGNATURES[fname][1]
    given = {name: ((value, line) if ok else None) for name, value, line, ok in given_items}

    def missing(name: str) -> None:
        if unpacked:  # after * or ** the reader cannot know
            return
        rule = "hardware-required" if name == "hardware" else "missing-argument"
        fix = (
            f"add `hardware=[...]` with the GPU generations it supports ({', '.join(fleet.generation_names)})"
            if name == "hardware"
            else f"add `{name}=...`"
        )
        bad(rule, f"{fname} needs `{name}`", fix)

    values = bound_arguments(
        params, given, lambda name, value: VALIDATORS[name](value, fleet), bad, missing
    )

    backend = BACKEND_OF[fname]
    if "hardware" in values:
        _check_vendors(fname, values["hardware"], given["hardware"][1], fleet, bad)
    if backend.is_gpu and "labels" in values and not values["labels"]:
        bad(
            "labels-empty",
            "a GPU test needs at least one domain label",
            f"add a label from {fleet.path.name} so a PR can ask for it with run-ci-<label>",
        )
    if errors:
        return None, errors

    if backend.is_gpu:
        arches, n, needs = values["hardware"], values["num_gpus"], set(values["needs"])
        if values.get("shares_gpu") and n != 1:
            bad(
                "shares-gpu",
                f"`shares_gpu=True` with `num_gpus={n}`: only a one-GPU file can share its GPU",
                "drop `shares_gpu`, or use `num_gpus=1`",
                given["shares_gpu"][1],
            )
        largest = max(fleet.max_gpus(a) for a in arches)
        if largest == 0:
            bad(
                "no-pool",
                f"the fleet has no pool of {', '.join(arches)}",
                f"declare a generation the fleet has ({', '.join(fleet.generations_in_fleet())}) "
                f"or add a pool to {fleet.path.name}",
            )
        elif n > largest:
            bad(
                "num-gpus",
                f"`num_gpus={n}` but the largest runner of {', '.join(arches)} has {largest} GPU(s)",
                f"use at most {largest} GPUs, or add a larger pool to {fleet.path.name}",
            )
        elif not any(fleet.pool_for(a, n, needs) for a in arches):
            bad(
                "no-pool",
                f"no pool of {', '.join(arches)} has {n} GPU(s) with {', '.join(sorted(needs))}",
                f"drop a `needs` entry or add such a pool to {fleet.path.name}",
            )
        if errors:
            return None, errors
    return (  # Registration's fields, in order
        (
            rel,
            call_line,
            backend.value,  # a plain string: the row is cached with marshal
            values["est_time"],
            tuple(values["labels"]),
            values["nightly"],
            values["disabled"],
            tuple(values.get("hardware", ())),
            values.get("num_gpus", 0),
            tuple(values.get("needs", ())),
            tuple(values["watches"]),
            values.get("shares_gpu", False),
        ),
        [],
    )


def _check_vendors(fname: str, arches: tuple[str, ...], line: int, fleet: Fleet, bad) -> None:
    """A GPU register function declares only generations of the vendors it is for
    (:data:`~.syntax.VENDORS_OF`): ``register_cuda_ci`` NVIDIA ones."""
    allowed = VENDORS_OF.get(fname)
    if allowed is None:
        return
    others = [a for a in arches if fleet.generation(a).vendor not in allowed]
    if others:
        vendors = sorted({VENDORS[fleet.generation(a).vendor].title for a in others})
        bad(
            "hardware-vendor",
            f"{fname} declares {' and '.join(VENDORS[v].title for v in allowed)} generations only, "
            f"but {_names(others)} {'is' if len(others) == 1 else 'are'} {' and '.join(vendors)}",
            f"declare every generation in one call: `register_gpu_ci(hardware={list(arches)!r}, "
            "...)` (same arguments, any vendor)",
            line,
        )


def validate(syntax, rel: str, fleet: Fleet) -> tuple[Registration | None, list[Violation]]:
    """The registration of the file at ``rel`` from its :class:`RegistrationSyntax` (or its
    :meth:`~RegistrationSyntax.plain` form): the rules that need the fleet, then every error
    with ``rel`` attached.  A file with any error has no registration."""
    row, errors = validate_row(syntax, rel, fleet)
    return (Registration(*row) if row is not None else None), errors


def validate_row(syntax, rel: str, fleet: Fleet) -> tuple[tuple | None, list[Violation]]:
    """:func:`validate` with the registration as its field values in order (plain data, for a
    cache: ``Registration(*row)`` is the registration)."""
    problems, call = syntax
    errors = [Violation(rel, *p) for p in problems]
    row = None
    if call is not None:
        row, call_errors = _validate_call(call, rel, fleet)
        errors.extend(call_errors)
    return (row if not errors else None), errors
