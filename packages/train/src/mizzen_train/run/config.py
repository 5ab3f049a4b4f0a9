"""The configuration machinery every run command shares: fields declared once, read from TOML
and ``--set`` overrides, checked before anything is built.

A command describes its configuration by one table, :data:`Sections` (``{name: Section}``): each
section's dataclass (its fields declared with :func:`opt`: type, default or required, allowed
values, bounds, help) and its :class:`Presence` in a file.  Everything else is derived from that
table: the reader (:func:`build_sections`), the ``--set`` parser (:func:`apply_overrides`), the
field list of ``--help-config`` (:func:`config_help`) and the command line's ``--section.field``
flags (:func:`flag_sections`).

Invariants:
- Everything read is untrusted: an unknown section or key, a wrong type, a value out of range or
  a missing required field raises :class:`ConfigError` naming the source, the field, the rule and
  the fix -- before anything is built.  Nothing meaningful is defaulted silently: fields without
  a safe default are required.
- A configuration is immutable: lists are stored as tuples, tables as fresh dicts.
- Reading is total over its inputs: a file that is not a regular UTF-8 TOML file of bounded size
  (a FIFO, a directory, other bytes, nesting the parser cannot follow, a 5,000-digit integer), an
  override through a value, an integer beyond 64 bits, a control character in a string, a date or
  a non-finite number in a free-form table: each is a ConfigError, never another exception and
  never a hang.
- One depth rule: a configuration table (a file's, run.json's, with its overrides) nests at most
  :data:`MAX_CONFIG_DEPTH` levels (the path to a free-form table, then its own
  :data:`MAX_TABLE_DEPTH`), checked where overrides and sections are built, before any value is
  shown; a message shows a value through :func:`shown_value` (depth- and length-bounded).
- A ``--set`` value is read as TOML, and text that is no TOML value is taken as a string -- unless
  it is quoted: a quoted value that is no valid TOML string is a ConfigError.  The command line's
  ``--section.field`` flags are typed values (:func:`flag_value`: a ``str`` field's text as
  given), never re-serialised into ``--set`` text.
- Every number has a ceiling, whether or not its field declares one: an ``int`` field takes at
  most :data:`DEFAULT_INT_HIGH` and a ``float`` at most :data:`DEFAULT_FLOAT_HIGH` in magnitude
  unless it declares its own ``high`` (a count, a seed or a timeout beyond those reaches torch or
  the standard library as an overflow, not as a rule).
- This module imports the standard library only.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import os
import tomllib
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field
from typing import Any

from mizzen_train.input_files import read_regular_file

#: A configuration file's size limit; ints beyond 64 bits; how deep a free-form table nests.
MAX_CONFIG_BYTES = 4 * 1024 * 1024
INT_CEILING = 2**63 - 1
#: The ceilings of a field that declares no ``high`` of its own (32-bit counts; 1e12 seconds or
#: any other float quantity: far beyond every real setting, within every consumer's range).
DEFAULT_INT_HIGH = 2**31 - 1
DEFAULT_FLOAT_HIGH = 1e12
#: torch threads a field may ask for (torch takes any int and spawns them); the largest LoRA
#: rank, and rows of one step or micro-batch, any configuration may ask for (beyond them a run
#: fails allocating, after it has started, instead of at the door)
MAX_THREADS = 1024
#: a byte-size field's ceiling (1 TiB)
MAX_BYTES = 2**40
#: a seed field's ceiling (random.seed and torch.manual_seed take 64-bit seeds)
MAX_SEED = INT_CEILING
MAX_LORA_RANK = 1024
MAX_ROWS = 65536
MAX_TABLE_DEPTH = 16
#: How deep a whole configuration table nests: [section] > [[list]] > its table > a table field
#: (``eval.evaluators.0.options``), then that free-form table's own levels.
MAX_CONFIG_DEPTH = MAX_TABLE_DEPTH + 4
#: What a message shows of a value: nesting levels, items of a table or list, characters.
SHOWN_DEPTH, SHOWN_ITEMS, SHOWN_CHARS = 3, 8, 200

__all__ = [
    "ConfigError",
    "Presence",
    "Section",
    "Sections",
    "apply_overrides",
    "build_config",
    "build_section",
    "build_sections",
    "check_depth",
    "check_input_files",
    "config_help",
    "flag_sections",
    "flag_value",
    "opt",
    "read_config_source",
    "shown_value",
]


class ConfigError(ValueError):
    """A configuration value breaks a rule; names the source, the field, the rule and the fix.

    The one error of every configuration table of mizzen-train (``sft`` and ``rl``)."""

    def __init__(self, field: str, value: Any, rule: str, fix: str, *, source: str = "") -> None:
        self.field, self.value, self.rule, self.fix, self.source = field, value, rule, fix, source
        where = f"{source}: " if source else ""
        shown = "<missing>" if value is MISSING else shown_value(value)
        super().__init__(f"{where}{field}={shown}: {rule}. Fix: {fix}")


def shown_value(value: Any) -> str:
    """``value`` as a message shows it: its repr, tables and lists cut after
    :data:`SHOWN_DEPTH` levels and :data:`SHOWN_ITEMS` items, the whole after
    :data:`SHOWN_CHARS` characters (never a RecursionError, whatever the value's depth)."""
    return _cut(_shown(value, SHOWN_DEPTH))


def _cut(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def _shown(value: Any, depth: int) -> str:
    if isinstance(value, dict | list | tuple):
        return _shown_items(value, depth)
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<an integer of {value.bit_length()} bits>"
    if isinstance(value, str) and len(value) > SHOWN_CHARS:
        value = value[:SHOWN_CHARS]
    return _cut(repr(value))


def _shown_items(value: dict | list | tuple, depth: int) -> str:
    """A table or list: its first items shown one level less deep (``...`` below the bound)."""
    opening, closing = (
        "{}" if isinstance(value, dict) else "[]" if isinstance(value, list) else "()"
    )
    if value and depth <= 0:
        return f"{opening}...{closing}"
    items = list(itertools.islice(value.items() if isinstance(value, dict) else value,
                                  SHOWN_ITEMS))  # fmt: skip
    parts = [
        f"{_shown(item[0], 0)}: {_shown(item[1], depth - 1)}" if isinstance(value, dict)
        else _shown(item, depth - 1)
        for item in items
    ]  # fmt: skip
    if len(value) > SHOWN_ITEMS:
        parts.append(f"... ({len(value) - SHOWN_ITEMS} more)")
    comma = "," if isinstance(value, tuple) and len(value) == 1 else ""
    return _cut(opening + ", ".join(parts) + comma + closing)


def opt(
    default: Any = MISSING,
    *,
    kind: str,
    help: str,
    choices=None,
    low=None,
    high=None,
    item=None,
    input_file: bool = False,
):
    """Declare a config field: ``kind`` in int|float|str|bool|list[str]|list[float]|table, or
    ``tables`` (a list of ``item`` dataclass tables, e.g. ``[[eval.evaluators]]``).
    ``input_file``: a ``str`` field naming a file the run reads (or ``example:NAME``), checked by
    :func:`check_input_files` before anything is built."""
    meta = {"kind": kind, "help": help, "choices": choices, "low": low, "high": high, "item": item}
    meta["input_file"] = input_file
    if isinstance(default, dict):  # lists are stored as tuples: a config is immutable
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


class Presence(enum.Enum):
    """How a section appears in a configuration file."""

    REQUIRED = "required"  # [name], must be there
    OPTIONAL = "optional"  # [name], None when absent
    DEFAULTED = "defaulted"  # [name], built from {} (every field's default) when absent
    MANY = "many"  # [[name]], a non-empty list of tables


@dataclass(frozen=True)
class Section:
    cls: type
    presence: Presence

    def header(self, name: str) -> str:
        return f"[[{name}]]" if self.presence is Presence.MANY else f"[{name}]"


#: A command's one table of sections, in file order; a dotted name (``eval.evaluators``) is a
#: table nested in its parent's ``tables`` field, listed for the help only.
Sections = Mapping[str, Section]


# -- reading ------------------------------------------------------------------------------------


def _is_index(part: str) -> bool:
    """A ``--set`` path part that is a list index: ASCII digits only (``str.isdigit`` also
    takes "²", which ``int`` refuses)."""
    return part.isascii() and part.isdecimal()


def check_value(path: str, value: Any, meta: Mapping[str, Any], source: str) -> Any:
    kind = meta["kind"]

    def fail(rule: str, fix: str) -> ConfigError:
        return ConfigError(path, value, rule, fix, source=source)

    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail("must be an integer", f"write e.g. {path.rsplit('.', 1)[-1]} = 1")
        if abs(value) > INT_CEILING:
            raise fail(f"is beyond {INT_CEILING} (a 64-bit integer)", "use a smaller number")
    elif kind == "float":
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise fail("must be a finite number", "write a number")
        value = float(value)
    elif kind == "str":
        if not isinstance(value, str):
            raise fail("must be a string", 'quote it: "..."')
        if any(unicodedata.category(c) == "Cc" for c in value):
            raise fail("holds a control character", "remove it")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise fail("must be true or false", "write true or false")
    elif kind == "list[str]":
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise fail("must be a list of non-empty strings", 'write e.g. ["a", "b"]')
        value = tuple(value)
    elif kind == "list[float]":
        if not isinstance(value, list) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in value
        ):
            raise fail("must be a list of numbers", "write e.g. [0.9, 0.999]")
        value = tuple(float(v) for v in value)
    elif kind == "table":
        if not isinstance(value, dict):
            raise fail("must be a table", "write it as [section.name] or {key = value}")
        problem = _plain_problem(value, depth=0)
        if problem:
            raise fail(problem, "use strings, numbers, booleans, lists and tables only")
        value = dict(value)
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise fail(f"must be one of {list(choices)}", f"use one of {list(choices)}")
    low, high = meta.get("low"), meta.get("high")
    if high is None:
        high = {"int": DEFAULT_INT_HIGH, "float": DEFAULT_FLOAT_HIGH}.get(kind)
        if kind == "float" and isinstance(value, float) and value < -DEFAULT_FLOAT_HIGH:
            raise fail(f"must be >= {-DEFAULT_FLOAT_HIGH:g}", "use a smaller magnitude")
        if kind == "int" and isinstance(value, int) and value < -DEFAULT_INT_HIGH:
            raise fail(f"must be >= {-DEFAULT_INT_HIGH}", "use a smaller magnitude")
    if low is not None and isinstance(value, int | float) and value < low:
        raise fail(f"must be >= {low}", f"use a value >= {low}")
    if high is not None and isinstance(value, int | float) and value > high:
        raise fail(f"must be <= {high:g}" if kind == "float" else f"must be <= {high}",
                   f"use a value <= {high:g}" if kind == "float" else f"use a value <= {high}")  # fmt: skip
    return value


def _plain_problem(value: Any, *, depth: int) -> str:
    """Why ``value`` is not a plain JSON-like value of bounded depth ('' when it is one)."""
    if depth > MAX_TABLE_DEPTH:
        return f"nests deeper than {MAX_TABLE_DEPTH} levels"
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, list):
        items = value
    elif isinstance(value, float):
        return "" if math.isfinite(value) else "holds a number that is not finite"
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_CEILING:
        return f"holds an integer beyond {INT_CEILING}"
    elif isinstance(value, str | int | bool):
        return ""
    else:
        return f"holds a {type(value).__name__} (a TOML date or time)"
    return next((p for p in (_plain_problem(v, depth=depth + 1) for v in items) if p), "")


def build_section(cls: type, table: Any, path: str, source: str) -> Any:
    """The dataclass ``cls`` from the TOML table at ``path``, every field checked."""
    if not isinstance(table, dict):
        raise ConfigError(path, table, "must be a table", f"write it as [{path}]", source=source)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(
            f"{path}.{unknown[0]}",
            table[unknown[0]],
            f"unknown key in [{path}]",
            f"use one of {sorted(known)} (mizzen-train sft --help-config lists them)",
            source=source,
        )
    values = {}
    for name, spec in known.items():
        where = f"{path}.{name}"
        if name not in table:
            if spec.default is MISSING and spec.default_factory is MISSING:
                raise ConfigError(
                    where,
                    MISSING,
                    "is required",
                    f"set it in [{path}] ({spec.metadata['help']}) or with --set "
                    f"{where.replace('[', '.').replace(']', '')}=...",  # --set's form: tenants.0.x
                    source=source,
                )
            continue
        value = table[name]
        if spec.metadata["kind"] == "tables":
            if not isinstance(value, list):
                raise ConfigError(
                    where,
                    value,
                    "must be a list of tables",
                    f"write [[{path}.{name}]]",
                    source=source,
                )
            values[name] = tuple(
                build_section(spec.metadata["item"], item, f"{where}[{i}]", source)
                for i, item in enumerate(value)
            )
            continue
        values[name] = check_value(where, value, spec.metadata, source)
    return cls(**values)


def build_sections(
    raw: Mapping[str, Any], sections: Sections, *, source: str, many_fix: str
) -> dict[str, Any]:
    """Every top-level section of ``sections`` built from ``raw`` by its presence rule;
    ``many_fix`` says what a missing ``[[...]]`` list needs."""
    check_depth(raw, source=source)
    top = {name: section for name, section in sections.items() if "." not in name}
    unknown = sorted(set(raw) - set(top))
    if unknown:
        listed = [section.header(name) for name, section in top.items()]
        raise ConfigError(
            unknown[0], raw[unknown[0]], "unknown section",
            f"use {', '.join(listed[:-1])} and {listed[-1]}", source=source,
        )  # fmt: skip
    for name, section in top.items():
        if section.presence is Presence.REQUIRED and name not in raw:
            raise ConfigError(name, MISSING, "the section is required", f"add [{name}]",
                              source=source)  # fmt: skip
    return {
        name: _build_present(raw, name, section, source, many_fix) for name, section in top.items()
    }


def build_config(
    config_cls: type, raw: Mapping[str, Any], sections: Sections, *, source: str, many_fix: str
):
    """``config_cls`` (a dataclass with one field per top-level section, and ``source``) built
    from ``raw`` by :func:`build_sections`."""
    return config_cls(**build_sections(raw, sections, source=source, many_fix=many_fix),
                      source=source)  # fmt: skip


def _build_present(raw: Mapping[str, Any], name: str, section: Section, source: str, many_fix: str):
    if section.presence is Presence.MANY:
        tables = raw.get(name)
        if not isinstance(tables, list) or not tables:
            raise ConfigError(
                name, tables if tables is not None else MISSING,
                f"at least one [[{name}]] table is required", many_fix, source=source,
            )  # fmt: skip
        return tuple(
            build_section(section.cls, t, f"{name}[{i}]", source) for i, t in enumerate(tables)
        )
    if name not in raw:
        return (
            build_section(section.cls, {}, name, source)
            if (section.presence is Presence.DEFAULTED)
            else None
        )
    return build_section(section.cls, raw[name], name, source)


# -- overrides ----------------------------------------------------------------------------------


def _parse_value(key: str, text: str, source: str = "--set") -> Any:
    """``text`` read as one TOML value, else the string itself (then the field's type rules);
    a quoted ``text`` that is no TOML value is a ConfigError, never a string of its quotes."""
    try:
        table = tomllib.loads(f"v = {text}")
    except (tomllib.TOMLDecodeError, RecursionError, ValueError) as exc:
        if text.startswith(('"', "'")):
            reason = str(exc).split(" (at ", 1)[0] or type(exc).__name__
            raise ConfigError(
                key, text, f"is quoted but not a valid TOML string ({reason})",
                'write a TOML string ("..." with \\uXXXX or \\UXXXXXXXX escapes of Unicode '
                "characters, never of surrogates), or the text unquoted", source=source,
            ) from None  # fmt: skip
        return text
    return table["v"] if len(table) == 1 else text  # "1\nx = 2" is no one value


def flag_value(key: str, kind: str, text: str) -> Any:
    """The value of the command line's ``--KEY TEXT`` for a field of ``kind``: a ``str``
    field's text as given (whatever its characters); any other read as a ``--set`` value."""
    return text if kind == "str" else _parse_value(key, text.strip(), source=f"--{key}")


def apply_overrides(
    raw: dict[str, Any],
    overrides: Sequence[str],
    values: Sequence[tuple[str, Any]] = (),
    *,
    source: str = "<config>",
) -> dict[str, Any]:
    """``raw`` (read from ``source``) with every ``(KEY, value)`` of ``values`` (typed: the
    ``--section.field`` flags) and then every ``KEY=VALUE`` of ``overrides`` applied (dotted
    keys; list items by index).  Too deep a ``raw`` is ``source``'s error, too deep a result
    the overrides'."""
    check_depth(raw, source=source)
    raw = _deep_copy(raw)
    for key, value in values:
        _set(raw, key, value)
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                item, MISSING, "an override is KEY=VALUE", 'write e.g. --set run.steps=60',
                source="--set",
            )  # fmt: skip
        _set(raw, key, _parse_value(key, text.strip()))
    check_depth(raw, source="--set")
    return raw


def _set(raw: dict[str, Any], key: str, value: Any) -> None:
    """``raw``'s dotted ``key`` set to ``value`` (tables and list items made on the way)."""
    parts = key.split(".")
    if len(parts) > MAX_CONFIG_DEPTH:
        raise ConfigError(
            ".".join(parts[:MAX_CONFIG_DEPTH]) + "...", value,
            f"nests deeper than {MAX_CONFIG_DEPTH} levels ({len(parts)} dotted parts)",
            "use a key of a field (mizzen-train sft --help-config lists them)", source="--set",
        )  # fmt: skip
    node: Any = raw
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = node[_index(part, node, key)]
            continue
        if not isinstance(node, dict):
            raise _through_scalar(key, parts[:depth])
        if part not in node:
            node[part] = [] if _is_index(parts[depth + 1]) else {}
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        if _is_index(last) and int(last) == len(node):
            node.append(value)
        else:
            node[_index(last, node, key)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise _through_scalar(key, parts[:-1])


def check_depth(raw: Any, *, source: str) -> None:
    """ConfigError naming the first path of ``raw`` that nests deeper than
    :data:`MAX_CONFIG_DEPTH` levels (walked without recursion: any depth is refused)."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(raw, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            children = [(str(k), v) for k, v in node.items()]
        elif isinstance(node, list):
            children = [(str(i), v) for i, v in enumerate(node)]
        else:
            continue
        if len(path) > MAX_CONFIG_DEPTH:
            raise ConfigError(
                ".".join(path[:MAX_CONFIG_DEPTH]) + "...", node,
                f"nests deeper than {MAX_CONFIG_DEPTH} levels", "flatten it (a free-form table "
                f"such as [model.tiny] nests at most {MAX_TABLE_DEPTH} levels)", source=source,
            )  # fmt: skip
        stack.extend((child, (*path, name)) for name, child in children)


def _through_scalar(key: str, parent: Sequence[str]) -> ConfigError:
    return ConfigError(
        key, MISSING, f"{'.'.join(parent)} is a value, not a table or list",
        f"set {'.'.join(parent)} itself, or a key of a table", source="--set",
    )  # fmt: skip


def _index(part: str, node: list, key: str) -> int:
    if not _is_index(part) or int(part) > len(node):
        raise ConfigError(
            key, MISSING, f"list index {part!r} does not exist (the list has {len(node)})",
            f"use an index below {len(node) + 1} (== {len(node)} appends)", source="--set",
        )  # fmt: skip
    if int(part) == len(node):
        node.append({})
    return int(part)


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def read_config_source(
    path: str | os.PathLike | None,
    overrides: Sequence[str] = (),
    values: Sequence[tuple[str, Any]] = (),
) -> tuple[dict[str, Any], str]:
    """The raw table of ``path`` (TOML, or ``example:NAME`` for a shipped one; None: overrides
    only) with the typed ``values`` and then the overrides applied (:func:`apply_overrides`),
    and its source name for messages."""
    raw: dict[str, Any] = {}
    source = "--set"
    if path is not None:
        source = os.fspath(path)
        if source.startswith("example:"):
            from mizzen_train.data import example_paths

            name = source[len("example:") :]
            shipped = example_paths(".toml")
            if name not in shipped:
                raise ConfigError(
                    "--config", source, "is no shipped configuration",
                    f"use one of {sorted('example:' + n for n in shipped)} or a file",
                )  # fmt: skip
            path = shipped[name]
        raw = _read_toml(path, source)
    if overrides or values:
        raw = apply_overrides(raw, overrides, values, source=source)
        source = f"{source} + --set"
    return raw, source


def _read_toml(path: str | os.PathLike, source: str) -> dict[str, Any]:
    """The table of the TOML file ``path``: a regular file of at most :data:`MAX_CONFIG_BYTES`,
    UTF-8, nested at most as deep as the parser can go; anything else is a ConfigError."""

    def refuse(rule: str, fix: str) -> ConfigError:
        return ConfigError("--config", source, rule, fix)

    try:
        text = read_regular_file(path, MAX_CONFIG_BYTES).decode("utf-8")
    except FileNotFoundError:
        raise refuse("no such file", "give a TOML file") from None
    except OSError as exc:
        raise refuse(f"cannot be read ({exc.strerror})", "check it") from None
    except UnicodeDecodeError as exc:
        raise refuse(f"is not UTF-8 (byte {exc.start})", "save it as UTF-8") from None
    except ValueError as exc:  # not a regular file, or too large
        raise refuse(str(exc), f"give a TOML file of at most {MAX_CONFIG_BYTES} bytes") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise refuse(f"is not valid TOML ({exc})", "fix the syntax") from None
    except (RecursionError, ValueError) as exc:  # nesting too deep; an integer too long
        reason = "nests too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise refuse(f"cannot be read as TOML ({reason})", "simplify the file") from None


# -- derived views of the table -----------------------------------------------------------------


def flag_sections(sections: Sections) -> list[str]:
    """The sections whose fields get ``--section.field`` flags: the single top-level tables."""
    return [n for n, s in sections.items() if "." not in n and s.presence is not Presence.MANY]


def config_help(sections: Sections) -> str:
    """Every field of ``sections``: section, name, type, default or required, what it is for."""
    lines = []
    for name, section in sections.items():
        lines.append(section.header(name))
        for spec in dataclasses.fields(section.cls):
            meta = spec.metadata
            if meta["kind"] == "tables":
                continue
            if spec.default is not MISSING:
                default = f"default {spec.default!r}"
            elif spec.default_factory is not MISSING:
                default = f"default {spec.default_factory()!r}"
            else:
                default = "required"
            choices = f" {list(meta['choices'])}" if meta["choices"] else ""
            lines.append(
                f"  {spec.name:<20} {meta['kind']:<11} {default:<26} {meta['help']}{choices}"
            )
    return "\n".join(lines)


# -- input files --------------------------------------------------------------------------------

EXAMPLE_PREFIX = "example:"  # a data set shipped with the package, resolved by its reader


def check_input_files(config: Any, source: str) -> None:
    """Every ``input_file`` field of ``config`` (sections, tables and lists of tables, derived
    from the declarations) names a regular file, or ``example:NAME`` (its reader checks the
    name): a ConfigError naming the source and field otherwise.  A run calls it before it
    imports torch or writes anything, so a typo'd path costs no model build."""
    for path, value in _input_files(config, ""):
        if not value or value.startswith(EXAMPLE_PREFIX):
            continue
        if not os.path.isfile(value):
            what = "is not a regular file" if os.path.exists(value) else "no such file"
            raise ConfigError(
                path, value, f"{what} (a relative path is read from {os.getcwd()})",
                "give a JSON-lines file's path, or example:NAME for a shipped data set",
                source=source,
            )  # fmt: skip


def _input_files(node: Any, prefix: str):
    """(field path, value) of every ``input_file`` field below the dataclass ``node``."""
    for spec in dataclasses.fields(node):
        value = getattr(node, spec.name)
        path = f"{prefix}{spec.name}"
        if spec.metadata.get("input_file") and isinstance(value, str):
            yield path, value
        elif dataclasses.is_dataclass(value):
            yield from _input_files(value, f"{path}.")
        elif isinstance(value, tuple):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    yield from _input_files(item, f"{path}[{i}].")
