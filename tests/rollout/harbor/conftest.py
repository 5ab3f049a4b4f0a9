"""Fixtures of the Harbor tests: the shipped tasks, a scripted engine, settings for a local run."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
TASKS_DIR = HERE / "tasks"


def _load_fake_engine() -> Any:
    name = "mizzen_tests_harbor_fake_engine"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "fake_engine.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def tasks_dir() -> Path:
    return TASKS_DIR


@pytest.fixture
def fake_engine() -> Iterator[Callable[..., Any]]:
    """`fake_engine(replies=[...], stall_s=...)` -> a started FakeEngine, stopped after the test."""
    module = _load_fake_engine()
    started: list[Any] = []

    def make(**kwargs: Any) -> Any:
        engine = module.FakeEngine(**kwargs).__enter__()
        started.append(engine)
        return engine

    yield make
    for engine in started:
        engine.__exit__(None, None, None)


@pytest.fixture(scope="session")
def terminus_reply() -> Callable[..., str]:
    return _load_fake_engine().terminus_reply


@pytest.fixture(autouse=True)
def _no_litellm_network(monkeypatch: pytest.MonkeyPatch) -> None:
    # LiteLLM fetches a model-cost map over the network at import unless told not to; the agent
    # function sets this too, tests set it first so no code path reaches for the network.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
