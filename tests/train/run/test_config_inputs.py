"""Reading a run configuration is total over its inputs: whatever a file, a ``--set`` override or
a table holds, the result is a configuration or one ConfigError naming the field, the rule and
the fix -- never another exception, never a hang, never a path outside the run directory.

The listed attacks (a FIFO as ``--config``, non-UTF-8 bytes, 5,000-deep nesting, a 5,000-digit
integer, an override through a scalar, ``snapshot_dir`` escaping the run directory) go through
the real command's error boundary (``mizzen_train.cli.main``: exit 2, one line); property tests
throw random tables and random overrides at both commands' readers.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import math
import os
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=30, labels=["train"])

SFT_TOML = """
[run]
dir = "{run_dir}"
steps = 4
checkpoint_interval = 2
[model]
path = "tiny"
[data]
seq_len = 64
[[tenants]]
name = "a"
data = "example:colours_train"
rows = 4
lr = 1e-3
[eval]
interval = 2
snapshot_dir = "{snapshot_dir}"
[[eval.evaluators]]
kind = "loss"
data = "example:colours_eval"
"""


def _cli(capsys, *argv: str) -> tuple[int, str]:
    """``mizzen-train ARGV`` in this process (its one error boundary), with a 20 s deadline."""
    from mizzen_train.cli import main

    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(main(list(argv))), daemon=True)
    worker.start()
    worker.join(20)
    assert result, f"mizzen-train {' '.join(argv)} did not return within 20 s (a hang)"
    return result[0], capsys.readouterr().err


def _assert_one_line_refusal(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "Fix:" in lines[0], err
    for needle in needles:
        assert needle in lines[0], (needle, err)


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("latin1.toml", "[run]\ndir = 'caf\xe9'\n".encode("latin-1"), "is not UTF-8"),
        ("deep.toml", ("a = " + "[" * 5000 + "]" * 5000 + "\n").encode(), "nests too deeply"),
        ("digits.toml", ("[run]\nsteps = " + "9" * 5000 + "\n").encode(), "cannot be read as TOML"),
    ],
)
def test_unreadable_files_are_one_line(tmp_path, capsys, name, content, needle):
    path = tmp_path / name
    path.write_bytes(content)
    _assert_one_line_refusal(*_cli(capsys, "sft", "--config", str(path)), needle, str(path))


def test_a_fifo_or_a_directory_as_config_is_refused_without_opening_it(tmp_path, capsys):
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)  # opening it for reading would block until a writer comes
    _assert_one_line_refusal(*_cli(capsys, "rl", "--config", str(fifo)), "not a regular file")
    _assert_one_line_refusal(*_cli(capsys, "sft", "--config", str(tmp_path)), "not a regular file")


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("run.steps.x=1", "run.steps is a value"),
        ("run.dir.0=1", "run.dir is a value"),
        ("run.steps=" + "9" * 5000, "run.steps="),  # read as a string: not an integer
        ("run.seed=99999999999999999999", "64-bit"),
        ('run.dir="a\\u0000b"', "control character"),
        ("model.tiny={d = 1979-05-27}", "TOML date or time"),
        # a number past what its consumer takes: every field has a ceiling, declared or not
        ("tenants.\u00b2.lr=1", "list index '\u00b2' does not exist"),
        ("run.threads=9223372036854775807", "run.threads=9223372036854775807: must be <= 1024"),
        ("parallel.timeout_s=1e300", "must be <= 1e+12"),
        ("tenants.0.lora_seed=9223372036854775807", "must be <= 4294967295"),
        ("tenants.0.lora_rank=4611686018427387904", "must be <= 1024"),
        ("tenants.0.rows=2147483647", "must be <= 65536"),
        ("run.steps=2147483648", "must be <= 2147483647"),  # no high of its own: the default
        # the tiny model's values, not only its keys
        ('model.tiny.seed="x"', "model.tiny.seed='x': must be an integer"),
        ("model.tiny.hidden_size=0", "must be in [1, 65536]"),
        ("model.tiny.vocab_size=10", "the byte tokenizer uses 259 token ids"),
        ('model.tiny.model_type="gpt2"', "must be one of ['llama']"),
        ("model.tiny.hidden_size=66", "must divide hidden_size=66"),
        ("model.tiny.tie_word_embeddings=1", "must be true or false"),
    ],
)
def test_overrides_that_cannot_apply_are_one_line(tmp_path, capsys, override, needle):
    path = tmp_path / "run.toml"
    path.write_text(SFT_TOML.format(run_dir=tmp_path / "run", snapshot_dir="snapshots"))
    _assert_one_line_refusal(*_cli(capsys, "sft", "--config", str(path), "--set", override), needle)


@pytest.mark.parametrize("snapshot_dir", ["../../outside", "/tmp/elsewhere", "a/../../b"])
def test_snapshot_dir_stays_inside_the_run_dir(tmp_path, capsys, snapshot_dir):
    path = tmp_path / "run.toml"
    path.write_text(SFT_TOML.format(run_dir=tmp_path / "run", snapshot_dir=snapshot_dir))
    code, err = _cli(capsys, "sft", "--config", str(path))
    _assert_one_line_refusal(code, err, "eval.snapshot_dir", "inside run.dir")
    assert not (tmp_path / "run").exists(), "the refused run wrote its directory"


def _inside_each_run_entry() -> list[str]:
    """A snapshot_dir inside every entry of the run directory's table (derived from it: a new
    entry is covered without editing this test), in several spellings."""
    from mizzen_train.run.layout import RUN_DIR_ENTRIES

    names = [name + "x" if name.endswith("-") else name for name in RUN_DIR_ENTRIES]
    return [*names, *(f"./{n.upper()}/evals" for n in names), "."]


@pytest.mark.parametrize("snapshot_dir", _inside_each_run_entry())
def test_snapshot_dir_is_a_directory_of_its_own(tmp_path, capsys, snapshot_dir):
    # snapshots under "checkpoints" deleted every checkpoint of the run (a point's directory is
    # named by step like a checkpoint, and is deleted once evaluated)
    path = tmp_path / "run.toml"
    path.write_text(SFT_TOML.format(run_dir=tmp_path / "run", snapshot_dir=snapshot_dir))
    code, err = _cli(capsys, "sft", "--config", str(path))
    needle = "is run.dir itself" if snapshot_dir == "." else "where the run keeps"
    _assert_one_line_refusal(code, err, "eval.snapshot_dir", needle, "directory of its own")
    assert not (tmp_path / "run").exists(), "the refused run wrote its directory"


# -- properties ---------------------------------------------------------------------------------

#: Valid configurations the properties start from: each command, and SFT with a python evaluator
#: (the one with a free-form table, ``options``).
BASES = {
    "sft": {
        "run": {"dir": "RUN", "steps": 4, "checkpoint_interval": 2, "seed": 0},
        "model": {"path": "tiny", "tiny": {"seed": 1}},
        "data": {"seq_len": 64},
        "tenants": [{"name": "a", "data": "example:colours_train", "rows": 4, "lr": 1e-3}],
        "eval": {"interval": 2, "snapshot_dir": "snapshots", "evaluators": [
            {"kind": "loss", "data": "example:colours_eval"},
            {"kind": "python", "factory": "m:f", "options": {"k": 1}},
        ]},
    },
    "rl": {
        "run": {"dir": "RUN", "steps": 4, "checkpoint_interval": 2},
        "model": {"path": "tiny"},
        "rollout": {"temperature": 1.0, "batch_size": 4},
        "algo": {"advantage": "grpo"},
        "tenants": [{"name": "a", "data": "example:rl_fixed", "reward": "math", "lr": 1e-3,
                     "prompts_per_step": 2, "n_samples": 2}],
        "eval": {"interval": 2, "snapshot_dir": "snapshots", "evaluators": [
            {"kind": "generate", "data": "example:rl_fixed", "reward": "math"},
        ]},
    },
}  # fmt: skip


def _leaf_paths(node, prefix=()) -> list[tuple]:
    if isinstance(node, dict):
        return [prefix] + [p for k, v in node.items() for p in _leaf_paths(v, (*prefix, k))]
    if isinstance(node, list):
        return [prefix] + [p for i, v in enumerate(node) for p in _leaf_paths(v, (*prefix, i))]
    return [prefix]


def _at(node, path):
    for part in path:
        node = node[part]
    return node


#: Every place of a base a value can go: each field, table and list item.
PATHS = [(cmd, path) for cmd, base in BASES.items() for path in _leaf_paths(base) if path]
_scalars = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.booleans(),
    st.dates(),
    st.just(datetime.time(1, 2)),
)
#: Values that pass some field's own type rule and break a later one (or a first use).
_ATTACKS = st.sampled_from(
    ["../x", "/abs", "a/../../b", "a\x00b", "python", "m:f", "tiny", 2**64, -(2**63) - 1, 10**30,
     float("nan"), float("inf"), datetime.date(2020, 1, 1), ["../x"], {"d": datetime.time(1)}]
)  # fmt: skip
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)


def _reads_or_refuses(cls, raw) -> None:
    from mizzen_train.run.config import ConfigError

    try:
        config = cls.parse(raw, source="t.toml")
    except ConfigError as exc:
        assert "Fix:" in str(exc)
        return
    _first_uses(config)


def _first_uses(config) -> None:
    """What a run does first with an accepted configuration: run.json (plain JSON), the run and
    snapshot directories (inside the run directory), every path looked up, every seed set."""
    import torch

    config.to_dict()
    assert config.snapshot_root is None or config.run_dir in config.snapshot_root.parents
    paths = [config.run.dir, config.model.path, *(t.data for t in config.tenants)]
    for path in paths + [e.data for e in config.evaluators]:
        with contextlib.suppress(OSError):
            os.stat(path)
    seeds = [config.run.seed] + [s for t in config.tenants for s in (t.lora_seed, t.data_seed)]
    for seed in seeds:
        torch.Generator().manual_seed(seed)


@settings(
    max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(where=st.sampled_from(PATHS), value=st.one_of(_values, _ATTACKS), data=st.data())
def test_any_value_anywhere_is_a_config_or_a_config_error(tmp_path, where, value, data):
    from mizzen_train.rl.config import RlConfig
    from mizzen_train.sft.config import SftConfig

    cmd, path = where
    raw = _with_run_dir(BASES[cmd], tmp_path)
    parent = _at(raw, path[:-1])
    if data.draw(st.booleans(), label="beside") and isinstance(parent, dict):
        parent["x_" + str(path[-1])] = value  # an unknown key next to a known one
    else:
        parent[path[-1]] = value
    _reads_or_refuses(SftConfig if cmd == "sft" else RlConfig, raw)


def _with_run_dir(base: dict, tmp_path) -> dict:
    raw = copy.deepcopy(base)
    raw["run"]["dir"] = str(tmp_path / "run")
    return raw


_NAMES = sorted({str(p) for _, path in PATHS for p in path} | {"x"})
_override_keys = st.lists(
    st.one_of(st.sampled_from(_NAMES), st.integers(0, 3).map(str)),
    min_size=1,
    max_size=4,
).map(".".join)
_override_values = st.one_of(
    st.text(max_size=20),
    st.sampled_from(
        [
            "1",
            "-1",
            "1e400",
            "nan",
            "inf",
            "[1, [2]]",
            "{a = 1}",
            "true",
            '"x"',
            "1979-05-27",
            "[[[]]]",
            "9" * 30,
        ]
    ),
)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(overrides=st.lists(st.tuples(_override_keys, _override_values), max_size=3))
def test_any_override_is_a_config_or_a_config_error(tmp_path, overrides):
    from mizzen_train.run.config import ConfigError, apply_overrides
    from mizzen_train.sft.config import SftConfig

    items = [f"{key}={value}" for key, value in overrides]
    try:
        raw = apply_overrides(_with_run_dir(BASES["sft"], tmp_path), items)
    except ConfigError as exc:
        assert "Fix:" in str(exc)
        return
    _reads_or_refuses(SftConfig, raw)


def test_the_property_tests_reach_both_outcomes(tmp_path):
    """The generators are not vacuous: the valid base parses, and one bad value is refused."""
    from mizzen_train.rl.config import RlConfig
    from mizzen_train.run.config import ConfigError
    from mizzen_train.sft.config import SftConfig

    assert SftConfig.parse(_with_run_dir(BASES["sft"], tmp_path)).run.steps == 4
    assert RlConfig.parse(_with_run_dir(BASES["rl"], tmp_path)).run.steps == 4
    with pytest.raises(ConfigError):
        SftConfig.parse({**_with_run_dir(BASES["sft"], tmp_path), "run": {"steps": math.nan}})


def test_a_bad_config_is_refused_before_torch_loads(tmp_path):
    """The configuration is checked before any heavy import (a typo costs a second, not torch)."""
    import subprocess
    import sys

    path = tmp_path / "bad.toml"
    path.write_text(
        SFT_TOML.format(run_dir=tmp_path / "run", snapshot_dir="snapshots") + "typo = 1\n"
    )
    probe = (
        "import sys\nfrom mizzen_train.cli import main\n"
        f"code = main(['sft', '--config', {str(path)!r}])\n"
        "heavy = sorted(m for m in ('torch', 'megatron', 'transformers') if m in sys.modules)\n"
        "print(code, heavy)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip() == "2 []", (done.stdout, done.stderr[-2000:])
    assert "typo" in done.stderr and "Fix:" in done.stderr, done.stderr


def test_an_engine_url_credential_reaches_no_output(tmp_path, capsys):
    """The password of an evaluator's engine URL is masked in the CLI's error and in run.json."""
    from mizzen_rollout.masking import isolated_masks
    from mizzen_train.run.state import open_run
    from mizzen_train.sft.config import SftConfig

    secret = "Secr3tPass99"
    toml = SFT_TOML.format(run_dir=tmp_path / "run", snapshot_dir="snapshots").replace(
        'kind = "loss"', 'kind = "generate"\nreward = "f1"\nengine_urls = ["URL"]'
    )
    with isolated_masks():
        bad = tmp_path / "bad.toml"
        bad.write_text(toml.replace("URL", f"ftp://trainer:{secret}@127.0.0.1:1"))
        code, err = _cli(capsys, "sft", "--config", str(bad))
        assert code == 2 and "is not an http(s) URL" in err and secret not in err, err
        good = tmp_path / "good.toml"
        good.write_text(toml.replace("URL", f"http://trainer:{secret}@127.0.0.1:1"))
        config = SftConfig.load(good)
        open_run(config.run_dir, config.to_dict(), resume=False)
        stored = (config.run_dir / "run.json").read_text()
        assert secret not in stored and "trainer:***@127.0.0.1" in stored, stored
