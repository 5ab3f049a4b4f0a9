"""``fleet.toml`` of any shape is a fleet or one :class:`FleetError` (issue: hostile fleet shapes):
every table, array of tables and scalar is type-checked where it is read, so an entry that is not
a table, a ``pool`` that is not a list, a count below 1 or an empty ``runs_on`` is one line naming
the file, the entry, the rule and the fix — never a ``TypeError`` or a ``PackingError`` later.
The cases the probe found, the real CLI on one of them (exit 2, one line), and a property: any
TOML value in any field of a good table decodes or raises FleetError, nothing else."""

from __future__ import annotations

import datetime as dt
import json
import math
import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import Fleet, FleetError, parse_fleet

register_cpu_ci(est_time=5, labels=["ci"])

GOOD = """
capabilities = ["rdma"]
labels = ["ci", "lora"]

[[arch]]
name = "hopper"
vendor = "nvidia"
compute_capabilities = ["9.0"]
gpus = ["H100"]

[[arch]]
name = "cdna3"
vendor = "amd"
isa = ["gfx942"]

[cpu_pool]
name = "cpu-hosted"
runs_on = ["ubuntu-24.04"]
runners = 2
job_setup_s = 60

[[pool]]
name = "h200-2gpu"
arch = "hopper"
gpu = "H200"
gpus_per_runner = 2
runners = 1
runs_on = ["self-hosted", "h200"]
runner_group = "mizzen-h200"
job_setup_s = 300
capabilities = ["rdma"]
"""
GOOD_DATA = tomllib.loads(GOOD)


def toml_text(data: dict) -> str:
    """``data`` as TOML: one ``key = value`` line per top-level key, tables inline."""
    return "".join(f"{_key(k)} = {_value(v)}\n" for k, v in data.items())


def _key(key: str) -> str:
    return json.dumps(key)


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return (
            "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
        )
    if isinstance(v, (int, dt.date, dt.time)):
        return v.isoformat() if not isinstance(v, int) else str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + "}"


def test_the_good_table_decodes():
    assert isinstance(parse_fleet(GOOD, "ci/fleet.toml"), Fleet)


def _with(**top) -> str:
    """GOOD with top-level keys replaced (TOML text, the replaced tables written inline)."""
    return toml_text({**GOOD_DATA, **top})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (_with(arch=[1, 2]), "[[arch]] #1 must be a table, got 1. Fix: write each generation as"),
        (_with(pool=5), "pool must be a list of tables, got 5. Fix: write one [[pool]] section"),
        (_with(pool="abc"), "pool must be a list of tables, got 'abc'"),
        (_with(pool=[{**GOOD_DATA["pool"][0]}, "x"]), "[[pool]] #2 must be a table, got 'x'"),
        (_with(cpu_pool=[GOOD_DATA["cpu_pool"]]), "cpu_pool must be a table, got [{"),
        (_with(cpu_pool={**GOOD_DATA["cpu_pool"], "runners": 0}),
         "[cpu_pool].runners must be an integer ≥ 1, got 0. Fix: write `runners = 1`"),
        (_with(cpu_pool={**GOOD_DATA["cpu_pool"], "runs_on": []}),
         "[cpu_pool].runs_on is empty. Fix: list the runner labels"),
        (_with(pool=[{**GOOD_DATA["pool"][0], "runs_on": []}]), "pool h200-2gpu.runs_on is empty"),
        (_with(pool=[{**GOOD_DATA["pool"][0], "runners": -1}]),
         "pool h200-2gpu.runners must be an integer ≥ 1, got -1"),
        (_with(pool=[{**GOOD_DATA["pool"][0], "job_setup_s": math.inf}]),
         "job_setup_s must be seconds from 0 to 3600, got inf"),
        (_with(arch=[{"name": ["hopper"]}]), "[[arch]] #1.name must be a string, got ['hopper']"),
        (_with(labels={"a": 1}), "labels must be a list of non-empty strings, got {'a': 1}"),
        (_with(capabilities=["x"] * 200), "capabilities lists a name twice: ['x', 'x', "),
        ("labels = []\narch = " + "[" * 5000 + "]" * 5000, "nested too deeply"),
    ],
)  # fmt: skip
def test_each_hostile_shape_is_one_fleet_error_naming_entry_and_fix(text: str, message: str):
    with pytest.raises(FleetError) as info:
        parse_fleet(text, "ci/fleet.toml")
    said = str(info.value)
    assert said.startswith("ci/fleet.toml: ") and message in said, said
    assert "\n" not in said and len(said) < 400, said


def test_the_cli_says_it_in_one_line_and_exits_2(tmp_path: Path, mizzen_ci):
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / "fleet.toml").write_text(
        "arch = [1, 2]\n" + GOOD.replace("[[arch]]", "[[x]]")
    )
    done = mizzen_ci("plan", "--root", str(tmp_path), "--event", "push", "--no-cache", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "fleet.toml: [[arch]] #1 must be a table, got 1. Fix:" in done.stderr


# -- the property ----------------------------------------------------------------------------


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)
SCALARS = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    TEXT,
    st.sampled_from(["hopper", "nvidia", "amd", "9.0", "gfx942", "self-hosted", "rdma", ""]),
    st.dates(),
    st.times(),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(["name", "a", "runs_on"]), inner, max_size=3),
    ),
    max_leaves=10,
)


def _fields(data, at=()) -> list[tuple]:
    """Every path to a value in ``data`` (tables, arrays of tables and scalars alike)."""
    paths = [at] if at else []
    if isinstance(data, dict):
        for k, v in data.items():
            paths += _fields(v, (*at, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            paths += _fields(v, (*at, i))
    return paths


FIELDS = _fields(GOOD_DATA)


def _replaced(data, path: tuple, value, delete: bool):
    data = dict(data) if isinstance(data, dict) else list(data)
    head, *rest = path
    if rest:
        data[head] = _replaced(data[head], tuple(rest), value, delete)
    elif delete and isinstance(data, dict):
        del data[head]
    else:
        data[head] = value
    return data


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(FIELDS), VALUES, st.booleans()), min_size=1, max_size=3))
def test_any_value_in_any_field_decodes_or_is_a_fleet_error(edits):
    data = GOOD_DATA
    for path, value, delete in edits:
        try:
            data = _replaced(data, path, value, delete)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed or replaced the way to this field
    text = toml_text(data)
    try:
        parse_fleet(text, "ci/fleet.toml")
    except FleetError as e:
        said = str(e)
        assert said.startswith("ci/fleet.toml: ") and "\n" not in said, said
