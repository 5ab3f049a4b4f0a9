"""``mizzen-train serve`` at startup: every path, file and field it is given is checked before
anything slow, and a bad one is exit 2 with one line naming the field or file (never a
traceback); the key file is read bounded; the tiny base model is the one its config describes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_train.run.config import ConfigError
from mizzen_train.serve.auth import KeyFileError, read_key_file
from mizzen_train.serve.config import parse_serve_config

register_cpu_ci(est_time=60, labels=["train"])

KEY_LINE = "alice tml-alice-000000000000000000000001\n"
RECORD = {"model_id": "m1", "tenant": "alice", "base_model": "tiny", "rank": 2, "seed": 0,
          "created": 1.5}  # fmt: skip


def serve(tmp_path, *overrides: str, descriptors=None) -> subprocess.CompletedProcess:
    """``mizzen-train serve`` with a valid key file and the tiny model, plus ``overrides``
    (``descriptors``: the process's hard and soft descriptor limit)."""
    keys = tmp_path / "keys"
    keys.write_text(KEY_LINE)
    os.chmod(keys, 0o600)
    args = [sys.executable, "-m", "mizzen_train", "serve", "--set",
            f'server.api_keys_file="{keys}"', "--set", "server.port=0",
            "--set", 'model.path="tiny"']  # fmt: skip
    for item in overrides:
        args += ["--set", item]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")
    limit = None
    if descriptors is not None:
        import resource

        def limit():
            resource.setrlimit(resource.RLIMIT_NOFILE, (descriptors, descriptors))

    return subprocess.run(
        args, capture_output=True, text=True, env=env, timeout=300, preexec_fn=limit
    )


def models_json(tmp_path, payload) -> str:
    state = tmp_path / "state"
    state.mkdir()
    (state / "models.json").write_text(json.dumps(payload))
    return str(state)


def a_file(tmp_path) -> str:
    (tmp_path / "a_file").write_text("x")
    return str(tmp_path / "a_file")


def a_dir(tmp_path) -> str:
    (tmp_path / "a_dir").mkdir()
    return str(tmp_path / "a_dir")


def checkpoints_a_file(tmp_path) -> str:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "checkpoints").write_text("x")
    return str(tmp_path / "state")


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("server.state_dir", a_file, ["server.state_dir"]),
        ("server.state_dir", lambda t: f"{a_file(t)}/sub", ["server.state_dir"]),
        ("server.state_dir", checkpoints_a_file, ["server.state_dir", "checkpoints"]),
        ("server.state_dir", lambda t: models_json(t, {"m1": {**RECORD, "x": 1}}),
         ["models.json", "'m1'"]),
        ("server.state_dir", lambda t: models_json(t, {"m1": {**RECORD, "rank": "2"}}),
         ["models.json", "'m1'", "rank"]),
        ("server.port_file", a_dir, ["server.port_file"]),
        ("server.port_file", lambda t: f"{t}/missing/url", ["server.port_file"]),
        ("server.max_connections", lambda t: 2000, ["server.max_connections"]),
        ("model.tiny", lambda t: {"hidden_size": "big"}, ["model.tiny.hidden_size"]),
    ],
)  # fmt: skip
def test_a_bad_path_file_or_field_exits_2_with_one_line_before_the_model(
    tmp_path, field, value, named
):
    value = value(tmp_path)
    if field == "model.tiny":
        override = "model.tiny={" + ", ".join(f"{k}={json.dumps(v)}" for k, v in value.items())
        override += "}"
    else:
        override = f"{field}={json.dumps(value)}"
    state = [] if field == "server.state_dir" else [f'server.state_dir="{tmp_path}/state"']
    descriptors = 1024 if field == "server.max_connections" else None
    done = serve(tmp_path, override, *state, descriptors=descriptors)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in done.stderr + done.stdout, done.stderr[-3000:]
    assert all(word in lines[0] for word in named) and "Fix:" in lines[0], lines[0]
    assert "listening on" not in done.stdout  # refused before the model was built


def test_the_key_file_is_read_bounded(tmp_path):
    """A sparse 400 MiB key file is refused without reading it (a fresh process's peak memory
    stays far below its size)."""
    path = tmp_path / "keys"
    with open(path, "wb") as handle:
        handle.write(KEY_LINE.encode())
        handle.truncate(400 * 1024 * 1024)
    code = (
        "import resource, sys\n"
        "from mizzen_train.serve.auth import KeyFileError, read_key_file\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        "    read_key_file(sys.argv[1])\n"
        "except KeyFileError as exc:\n"
        "    print(exc)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True, timeout=120, check=True)  # fmt: skip
    message, grown_kib = done.stdout.splitlines()
    assert message.startswith(str(path)) and "Fix:" in message and "1048576" in message
    assert int(grown_kib) < 64 * 1024, f"reading it grew the process by {grown_kib} KiB"


def test_a_fifo_as_key_file_is_refused_not_waited_on(tmp_path):
    path = tmp_path / "keys"
    os.mkfifo(path)
    outcome = []

    def read() -> None:
        try:
            read_key_file(path)
        except KeyFileError as exc:
            outcome.append(str(exc))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(30)
    if reader.is_alive():  # it waits for a writer: give it one (an empty one), then fail
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(30)
        pytest.fail("read_key_file waited on a FIFO")
    assert outcome and "not a regular file" in outcome[0] and "Fix:" in outcome[0]


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        ({"m1": {**RECORD, "extra": 1}}, "'m1'"),
        ({"m1": {k: v for k, v in RECORD.items() if k != "tenant"}}, "'m1'"),
        ({"m1": {**RECORD, "rank": "2"}}, "rank"),
        ({"m1": {**RECORD, "seed": True}}, "seed"),
        ({"m1": {**RECORD, "model_id": "m2"}}, "model_id"),
        ({"../x": {**RECORD, "model_id": "../x"}}, "model_id"),
        ({"m1": [1]}, "'m1'"),
        ([RECORD], "JSON object"),
    ],
)
def test_models_json_is_checked_against_its_record_schema(tmp_path, payload, says):
    from mizzen_train.serve.state import ServerState, StateError

    (tmp_path / "models.json").write_text(json.dumps(payload))
    with pytest.raises(StateError) as caught:
        ServerState(tmp_path)
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'models.json'}: ") and says in message
    assert "Fix:" in message


def test_models_json_round_trips_and_an_int_created_is_a_float(tmp_path):
    from mizzen_train.serve.state import ModelRecord, ServerState

    (tmp_path / "models.json").write_text(json.dumps({"m1": {**RECORD, "created": 2}}))
    assert ServerState(tmp_path).models == {"m1": ModelRecord(**{**RECORD, "created": 2.0})}


def test_a_checkpoint_discarded_while_listed_is_left_out_not_a_500(tmp_path, monkeypatch):
    """Unnamed sampler weights are discarded from another thread when their last sampling
    session ends; a listing that meets one half-gone lists the rest (it raised
    FileNotFoundError: a 500 with a traceback, found by a hostile review)."""
    from pathlib import Path

    from mizzen_train.serve.sampling import _discard
    from mizzen_train.serve.state import ServerState

    state = ServerState(tmp_path)
    for name in ("kept", "sampler-going"):
        directory = state.checkpoint_dir("m1", "sampler_weights", name)
        directory.mkdir(parents=True)
        (directory / "adapter_model.safetensors").write_bytes(b"x" * 10)
    rglob = Path.rglob

    def discarded_meanwhile(self, pattern, **kwargs):  # the discard lands after is_dir()
        if self.name == "sampler-going":
            _discard([self])
        return rglob(self, pattern, **kwargs)

    monkeypatch.setattr(Path, "rglob", discarded_meanwhile)
    listed = state.list_checkpoints("m1")
    assert [c["checkpoint_id"] for c in listed] == ["sampler_weights/kept"]
    assert listed[0]["size_bytes"] == 10


def test_a_restart_deletes_unnamed_sampler_weights_and_half_written_checkpoints(tmp_path):
    """Unnamed sampler weights live only while a sampling session samples them, and sessions end
    with the server however it ended (a SIGKILL included): the next start deletes them, with any
    half-written or half-deleted directory; named checkpoints stay.  No client can take the
    ``unnamed-`` names."""
    from mizzen_train.serve.state import ServerState, check_name
    from mizzen_train.serve.wire import WireError

    first = ServerState(tmp_path)
    kept = [first.checkpoint_dir("m1", "sampler_weights", "keep"),
            first.checkpoint_dir("m1", "weights", "unnamed-is-a-weights-name-here")]  # fmt: skip
    gone = [first.checkpoint_dir("m1", "sampler_weights", "unnamed-0123456789ab"),
            first.checkpoint_dir("m1", "weights", ".tmp-step-1a2b3c4d"),
            first.checkpoint_dir("m2", "sampler_weights", ".discarded-unnamed-x-5e6f")]  # fmt: skip
    for directory in kept + gone:
        directory.mkdir(parents=True)
        (directory / "adapter_model.safetensors").write_bytes(b"x")
    assert ServerState(tmp_path).swept == 3
    assert [d.exists() for d in kept + gone] == [True, True, False, False, False]
    assert check_name("keep", "path") == "keep"
    with pytest.raises(WireError, match="the server's names of unnamed sampler weights"):
        check_name("unnamed-mine", "path")


def config_with(tmp_path, server=None, tiny=None):
    keys = tmp_path / "keys"
    keys.write_text(KEY_LINE)
    server = {"state_dir": str(tmp_path / "s"), "api_keys_file": str(keys), **(server or {})}
    return parse_serve_config({"server": server, "model": {"path": "tiny", "tiny": tiny or {}}})


@pytest.mark.parametrize(
    ("tiny", "field"),
    [
        ({"hidden_size": "big"}, "model.tiny.hidden_size"),
        ({"hidden_size": 0}, "model.tiny.hidden_size"),
        ({"num_hidden_layers": 1.5}, "model.tiny.num_hidden_layers"),
        ({"vocab_size": 10}, "model.tiny.vocab_size"),
        ({"rms_norm_eps": "x"}, "model.tiny.rms_norm_eps"),
        ({"tie_word_embeddings": 1}, "model.tiny.tie_word_embeddings"),
        ({"model_type": "gpt2"}, "model.tiny.model_type"),
        ({"initializer_range": 0}, "model.tiny.initializer_range"),
        ({"hidden_size": 66}, "model.tiny.num_attention_heads"),
        ({"no_such_field": 1}, "model.tiny.no_such_field"),
    ],
)
def test_tiny_fields_are_checked_like_every_field(tmp_path, tiny, field):
    with pytest.raises(ConfigError) as caught:
        config_with(tmp_path, tiny=tiny)
    assert caught.value.field == field and "Fix:" in str(caught.value)


def test_tiny_fields_are_the_tiny_configs_and_their_values_typed(tmp_path):
    """The fields of ``[model.tiny]`` are the packaged tiny config's (and head_dim, rope_theta):
    each is accepted at its packaged value, a value of another type is refused naming it, any
    other key is refused listing exactly these, and a float field's integer is kept a float."""
    from mizzen_rollout.api import load_tiny_config

    packaged = {**load_tiny_config(), "head_dim": 16, "rope_theta": 10000.0}
    assert config_with(tmp_path, tiny=packaged).model.tiny == packaged
    for name, value in packaged.items():
        with pytest.raises(ConfigError) as caught:
            config_with(tmp_path, tiny={name: 1 if isinstance(value, str) else "x"})
        assert caught.value.field == f"model.tiny.{name}", str(caught.value)
        assert caught.value.rule.startswith("must be "), str(caught.value)
    with pytest.raises(ConfigError) as caught:
        config_with(tmp_path, tiny={"no_such_field": 1})
    assert caught.value.fix == f"use some of {sorted(packaged)}"
    config = config_with(tmp_path, tiny={"initializer_range": 1, "num_hidden_layers": 1})
    assert config.model.tiny == {"initializer_range": 1.0, "num_hidden_layers": 1}
    assert isinstance(config.model.tiny["initializer_range"], float)


def test_tiny_is_checked_by_the_rule_a_training_run_uses(tmp_path):
    """``[model.tiny]`` has one rule (``check_tiny``) for the server and a training run: what a
    run refused, the server refuses too -- heads that do not divide the width, a table beside a
    real model's path, a seed (the server's is model.seed)."""
    with pytest.raises(ConfigError) as caught:
        config_with(tmp_path, tiny={"num_attention_heads": 3})
    assert caught.value.field == "model.tiny.num_attention_heads"
    assert "must divide hidden_size=64" in str(caught.value)
    config_with(tmp_path, tiny={"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 8})
    with pytest.raises(ConfigError) as caught:
        config_with(tmp_path, tiny={"seed": 1})
    assert caught.value.field == "model.tiny.seed" and "model.seed" in caught.value.fix
    (tmp_path / "llama").mkdir()
    raw = {"server": {"state_dir": str(tmp_path / "s"), "api_keys_file": str(tmp_path / "keys")},
           "model": {"path": str(tmp_path / "llama"), "tiny": {"num_hidden_layers": 1}}}  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        parse_serve_config(raw, source="serve.toml")
    assert caught.value.field == "model.tiny" and "serve.toml: " in str(caught.value)
    assert caught.value.rule == 'applies to model.path = "tiny" only'


def test_path_fields_are_checked_for_their_use(tmp_path):
    (tmp_path / "file").write_text("x")
    for server, field in [
        ({"state_dir": str(tmp_path / "file")}, "server.state_dir"),
        ({"state_dir": str(tmp_path / "file" / "sub")}, "server.state_dir"),
        ({"state_dir": ""}, "server.state_dir"),
        ({"port_file": str(tmp_path)}, "server.port_file"),
        ({"port_file": str(tmp_path / "no" / "url")}, "server.port_file"),
    ]:
        with pytest.raises(ConfigError) as caught:
            config_with(tmp_path, server=server)
        assert caught.value.field == field, (server, str(caught.value))
    config = config_with(tmp_path, server={"state_dir": str(tmp_path / "new" / "state"),
                                           "port_file": str(tmp_path / "url")})  # fmt: skip
    assert config.server.port_file.endswith("url")


def test_another_tiny_config_is_another_base_model(tmp_path):
    """The tiny model's directory follows its whole config (seed and overrides): a server
    restarted with other overrides builds and loads the model they describe."""
    from mizzen_train.serve.scheduler import Scheduler
    from mizzen_train.serve.state import ServerState

    def model_dir(tiny, seed=0):
        config = config_with(tmp_path, tiny=tiny)
        (tmp_path / "s").mkdir(exist_ok=True)
        if seed:
            import dataclasses

            model = dataclasses.replace(config.model, seed=seed)
            config = dataclasses.replace(config, model=model)
        return Scheduler(config, ServerState(tmp_path / "s"), None, None, None).model_dir

    def layers(directory) -> int:
        return json.loads((directory / "config.json").read_text())["num_hidden_layers"]

    one, three = model_dir({"num_hidden_layers": 1}), model_dir({"num_hidden_layers": 3})
    assert (layers(one), layers(three)) == (1, 3) and one != three
    assert model_dir({"num_hidden_layers": 1}) == one
    assert model_dir({"num_hidden_layers": 1}, seed=7) != one
    assert not [p for p in (tmp_path / "s").iterdir() if re.match(r"\.tmp-", p.name)]
