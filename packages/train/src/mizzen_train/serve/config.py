"""The configuration of ``mizzen-train serve``: one base model, K slots, limits and paths.

Read by the run configuration machinery (:mod:`mizzen_train.run.config`): a TOML file plus
``--set KEY=VALUE`` overrides; every field declared once in :data:`SECTIONS`.  Sections::

    [server]   host, port, state_dir (required), api_keys_file (required), limits
    [model]    path (an HF Llama directory, or "tiny"), name (what clients ask for), device,
               dtype, slots, max_rank, micro_batch_size, seq_bucket, threads
    [model.tiny]  overrides of the packaged tiny Llama's fields (path = "tiny"; the weights'
                  seed is model.seed)
    [sampling] engine ("embedded" | "none"), max_new_tokens

Invariants:
- Everything read is untrusted: an unknown key, a wrong type or a value out of range raises
  :class:`~mizzen_train.run.config.ConfigError` naming the source, the field, the rule and the fix,
  before anything is built.  ``[model.tiny]`` is checked by the rule a training run's is
  (:func:`mizzen_train.run.sections.check_tiny`: its keys, each value's type and range, the
  heads dividing the width), and every path is checked for its use (``state_dir`` a directory or
  creatable, ``port_file`` a writable file name, ...).
- API keys are never part of the configuration (only the path of the file holding them), so a
  configuration can be printed or logged.
- This module imports the standard library and the config machinery only (``check_tiny``'s
  module, which reads the packaged tiny config, when a configuration is parsed).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from mizzen_train.run.config import (
    MAX_BYTES,
    MAX_LORA_RANK,
    MAX_ROWS,
    MAX_SEED,
    MAX_THREADS,
    ConfigError,
    Presence,
    Section,
    build_config,
    config_help,
    opt,
    read_config_source,
)

__all__ = ["SECTIONS", "ServeConfig", "load_serve_config"]


@dataclass(frozen=True)
class ServerSection:
    state_dir: str = opt(kind="str", help="models, checkpoints and published adapters live here")
    api_keys_file: str = opt(
        kind="str", help="a file of 'TENANT KEY' lines (keys start with tml-); never on a CLI"
    )
    host: str = opt("127.0.0.1", kind="str", help="address to listen on")
    port: int = opt(8000, kind="int", low=0, high=65535, help="port (0: any free port)")
    port_file: str = opt("", kind="str", help="write the bound URL here once serving")
    max_queue: int = opt(64, kind="int", low=1, high=100_000, help="pending operations per model")
    max_models_per_key: int = opt(8, kind="int", low=1, help="live models one API key may hold")
    max_sessions_per_key: int = opt(
        64, kind="int", low=1, high=100_000,
        help="live sessions (ServiceClients) one API key may hold; one more is refused (422)",
    )  # fmt: skip
    max_sampling_sessions_per_key: int = opt(
        64, kind="int", low=1, high=100_000,
        help="live sampling sessions of one API key; one more ends the key's least recently used",
    )  # fmt: skip
    max_body_bytes: int = opt(
        16 * 1024 * 1024, kind="int", low=1024, high=MAX_BYTES, help="largest request body accepted"
    )
    max_datums: int = opt(512, kind="int", low=1, help="datums per forward/forward_backward")
    max_batch_rows: int = opt(64, kind="int", low=1, help="rows of one batched executor step")
    long_poll_s: float = opt(
        20.0, kind="float", low=0.0, high=40.0, help="how long retrieve_future waits for a result"
    )
    body_timeout_s: float = opt(
        60.0, kind="float", low=1.0, high=3600.0,
        help="a request body not received whole in this long is refused (408)",
    )  # fmt: skip
    kept_result_bytes: int = opt(
        256 * 1024 * 1024, kind="int", low=1024, high=MAX_BYTES,
        help="finished results kept for retrieve_future, in bytes (oldest forgotten first)",
    )  # fmt: skip
    session_timeout_s: float = opt(
        600.0, kind="float", low=0.0, high=7 * 86400.0,
        help="a session without a heartbeat this long ends, its models unloaded (0: never)",
    )  # fmt: skip
    head_timeout_s: float = opt(
        10.0, kind="float", low=0.1, high=3600.0,
        help="a connection without a whole request head this long after it opened or after its "
        "last response is closed",
    )  # fmt: skip
    max_connections: int = opt(
        1000, kind="int", low=1, high=1_000_000,
        help="open connections at most; one beyond is answered 503 and closed",
    )  # fmt: skip


@dataclass(frozen=True)
class ModelSection:
    path: str = opt(kind="str", help='the base model: an HF Llama directory, or "tiny"')
    name: str = opt("", kind="str", help="the base model name clients ask for (default: path)")
    tiny: Mapping = opt(
        {}, kind="table",
        help='with path = "tiny": fields of the packaged tiny Llama config to override (and '
        "head_dim, rope_theta)",
    )  # fmt: skip
    device: str = opt("auto", kind="str", choices=("auto", "cpu", "cuda"), help="device")
    dtype: str = opt("auto", kind="str", choices=("auto", "fp32", "bf16"), help="dtype")
    slots: int = opt(4, kind="int", low=1, high=1024, help="K: LoRA slots (live models)")
    max_rank: int = opt(
        32, kind="int", low=1, high=MAX_LORA_RANK, help="largest LoRA rank a model may ask"
    )
    micro_batch_size: int = opt(
        1, kind="int", low=1, high=MAX_ROWS, help="rows per executor micro-batch"
    )
    seq_bucket: int = opt(
        32, kind="int", low=1, help="rows are padded to a multiple; equal buckets batch together"
    )
    seed: int = opt(0, kind="int", low=0, high=MAX_SEED, help='seed of the "tiny" model weights')
    threads: int = opt(
        0, kind="int", low=0, high=MAX_THREADS, help="torch CPU threads (0: torch's default)"
    )


@dataclass(frozen=True)
class SamplingSection:
    engine: str = opt(
        "embedded", kind="str", choices=("embedded", "none"), help="what serves asample"
    )
    max_new_tokens: int = opt(512, kind="int", low=1, help="largest max_tokens of a sample")
    max_samples: int = opt(64, kind="int", low=1, help="largest num_samples of one request")


@dataclass(frozen=True)
class ServeConfig:
    server: ServerSection
    model: ModelSection
    sampling: SamplingSection
    source: str = ""

    SECTIONS: ClassVar[dict[str, Section]] = {
        "server": Section(ServerSection, Presence.REQUIRED),
        "model": Section(ModelSection, Presence.REQUIRED),
        "sampling": Section(SamplingSection, Presence.DEFAULTED),
    }

    @property
    def state_dir(self) -> Path:
        return Path(self.server.state_dir)

    @property
    def base_model_name(self) -> str:
        return self.model.name or self.model.path

    def check(self) -> None:
        problem = _state_dir_problem(self.server.state_dir)
        if problem:
            raise ConfigError(
                "server.state_dir", self.server.state_dir, problem,
                "give a writable directory, or a path where one can be created",
                source=self.source,
            )  # fmt: skip
        problem = _port_file_problem(self.server.port_file)
        if problem:
            raise ConfigError(
                "server.port_file", self.server.port_file, problem,
                "give a file name in an existing, writable directory", source=self.source,
            )  # fmt: skip
        if self.model.path != "tiny" and not Path(self.model.path).is_dir():
            raise ConfigError(
                "model.path", self.model.path, "is not a directory",
                'give an HF Llama directory, or "tiny"', source=self.source,
            )  # fmt: skip
        if not os.path.isfile(self.server.api_keys_file):
            raise ConfigError(
                "server.api_keys_file", self.server.api_keys_file, "is not a file",
                "write 'TENANT KEY' lines to a file readable by the server only",
                source=self.source,
            )  # fmt: skip


SECTIONS = ServeConfig.SECTIONS


def _writable_dir_problem(path: Path) -> str:
    if not path.exists():
        return "does not exist"
    if not path.is_dir():
        return "is not a directory"
    return "" if os.access(path, os.W_OK | os.X_OK) else "is not writable"


def _state_dir_problem(value: str) -> str:
    """Why ``value`` cannot be the state directory ('' when it can)."""
    if not value:
        return "is empty"
    path = Path(value).absolute()
    if path.exists():
        return _writable_dir_problem(path)
    existing = next(parent for parent in path.parents if parent.exists())
    problem = _writable_dir_problem(existing)
    return f"cannot be created: {existing} {problem}" if problem else ""


def _port_file_problem(value: str) -> str:
    """Why the URL cannot be written to ``value`` ('' when it can, or when it is unset)."""
    if not value:
        return ""
    path = Path(value).absolute()
    if path.is_dir():
        return "is a directory"
    problem = _writable_dir_problem(path.parent)
    return f"its directory {path.parent} {problem}" if problem else ""


def parse_serve_config(raw: Mapping[str, Any], *, source: str = "<config>") -> ServeConfig:
    """Validate a configuration table: its sections, ``[model.tiny]`` (kept with its floats
    typed: the tiny base model's directory is named by a digest of it), then the paths."""
    from mizzen_train.run.sections import check_tiny

    config = build_config(
        ServeConfig, dict(raw), SECTIONS, source=source, many_fix="(no list sections)"
    )
    tiny = check_tiny(config.model.tiny, source, path=config.model.path, seed=False)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, tiny=tiny))
    config.check()
    return config


def load_serve_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> ServeConfig:
    """Read ``path`` (TOML) with ``--set`` overrides; raises ConfigError naming the field."""
    raw, source = read_config_source(path, overrides)
    return parse_serve_config(raw, source=source)


def serve_config_help() -> str:
    return config_help(SECTIONS)
