"""Fixtures of the Harbor tests: the shipped tasks, a scripted engine, settings for a local run,
and `leaked`, the one check of where a secret shows up."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
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
def provider_specs() -> dict[str, Any]:
    """The real `PROVIDER_SPECS` with an SDK that is installed here (httpx), so that checks
    before the SDK check (key files, addresses) reach their success paths on the CPU image."""
    from mizzen_rollout.harbor.credentials import PROVIDER_SPECS

    version = importlib.metadata.version("httpx")
    return {
        name: dataclasses.replace(
            spec, sdk_module="httpx", sdk_distribution="httpx", sdk_min_version=version
        )
        for name, spec in PROVIDER_SPECS.items()
    }


@pytest.fixture(scope="session")
def terminus_reply() -> Callable[..., str]:
    return _load_fake_engine().terminus_reply


@pytest.fixture(autouse=True)
def _no_litellm_network(monkeypatch: pytest.MonkeyPatch) -> None:
    # LiteLLM fetches a model-cost map over the network at import unless told not to; the agent
    # function sets this too, tests set it first so no code path reaches for the network.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def _texts_of(thing: Any) -> Iterator[tuple[str, str]]:
    """(where, text) for everything a person or a log could see of `thing`. For an exception:
    its text, repr, args and attributes (a decode error's `object`, a JSON error's `doc`), the
    same for every exception of its chain (`__cause__` and `__context__`, even when suppressed),
    and the formatted traceback. For anything else: its str and repr."""
    if isinstance(thing, BaseException):
        seen: set[int] = set()
        todo: list[BaseException | None] = [thing]
        while todo:
            current = todo.pop()
            if current is None or id(current) in seen:
                continue
            seen.add(id(current))
            name = type(current).__name__
            yield f"{name} text", str(current)
            yield f"{name} repr", repr(current)
            yield f"{name} args", repr(current.args)
            yield f"{name} attributes", repr(getattr(current, "__dict__", {}))
            for attribute in ("doc", "object", "msg", "strerror", "filename"):
                if hasattr(current, attribute):
                    yield f"{name}.{attribute}", repr(getattr(current, attribute))
            todo += [current.__cause__, current.__context__]
        yield "traceback", "".join(traceback.format_exception(thing))
    else:
        yield "str", str(thing)
        yield "repr", repr(thing)


@pytest.fixture(scope="session")
def leaked() -> Callable[..., list[str]]:
    """`leaked(secrets, *things)` -> one line per place where a secret (a string, or several)
    shows up in `things` (exceptions with their whole chain, strings, mappings, objects); tests
    assert it is `[]`, so a failure names the place."""

    def find(secrets: str | Iterable[str], *things: Any) -> list[str]:
        wanted = [secrets] if isinstance(secrets, str) else list(secrets)
        found = []
        for index, thing in enumerate(things):
            for where, text in _texts_of(thing):
                found += [f"thing {index} {where}: {s!r}" for s in wanted if s and s in text]
        return found

    return find
