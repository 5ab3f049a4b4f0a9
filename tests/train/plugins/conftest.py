"""Fixtures of the plugin-model tests: a one-rank world in this process and tiny plugin bases.

- ``one_rank`` (module scope): a gloo world of one rank with megatron's parallel state (the run
  framework's own :func:`mizzen_train.run.parallel.single_rank`, CPU shim included), so the slot
  executor, ``run_sft`` and ``run_rl`` run in the test process (megatron is imported once per
  module, not once per subprocess).
- ``tiny_base(plugin)`` (session scope): the directory of plugin ``plugin``'s tiny base model
  (:func:`mizzen_train.plugin_models.base.write_tiny_base`, seed 0), written once per session.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

PLUGINS = ("nemotron_h", "deepseek_v4")


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    from mizzen_train.run.parallel import single_rank

    with single_rank("cpu"):
        yield


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Callable[[str], Path]:
    from mizzen_train.plugin_models.base import write_tiny_base

    root = tmp_path_factory.mktemp("plugin-bases")
    made: dict[str, Path] = {}

    def base(plugin: str) -> Path:
        if plugin not in made:
            made[plugin] = write_tiny_base(root / plugin, plugin, seed=0)
        return made[plugin]

    return base
