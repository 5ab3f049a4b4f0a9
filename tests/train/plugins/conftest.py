"""Fixtures of the plugin-model tests: tiny plugin bases.

The test files that drive the slot executor, ``run_sft`` or ``run_rl`` in-process carry
``pytest.mark.in_child`` (tests/conftest.py): each body runs in a forked child of the pytest
process, inside the one-rank gloo world with megatron's parallel state that ``one_rank_in_child``
sets up for it (the run framework's own :func:`mizzen_train.run.parallel.single_rank`), so
neither the world nor an embedded engine's threads outlive the test in the pytest process.
- ``tiny_base(plugin)`` (session scope): the directory of plugin ``plugin``'s tiny base model
  (:func:`mizzen_train.plugin_models.base.write_tiny_base`, seed 0), written once per session.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

PLUGINS = ("nemotron_h", "deepseek_v4")


@pytest.fixture(autouse=True)
def one_rank_in_child(request) -> None:
    """The body of an ``in_child`` test here runs inside a one-rank world (entered in the child)."""

    def one_rank():
        from mizzen_train.run.parallel import single_rank

        return single_rank("cpu")

    request.node.in_child_setup = one_rank


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Callable[[str], Path]:
    from mizzen_train.plugin_models.base import write_tiny_base

    root = tmp_path_factory.mktemp("plugin-bases")

    def base(plugin: str) -> Path:
        # Memoised on disk, not in memory: the first caller may be an ``in_child`` body, whose
        # memory dies with it.  Written beside, then renamed: a base is there whole or not at all.
        target = root / plugin
        if not target.exists():
            scratch = Path(tempfile.mkdtemp(dir=root, prefix=f".{plugin}-"))
            written = write_tiny_base(scratch / plugin, plugin, seed=0)
            written.rename(target)
        return target

    return base
