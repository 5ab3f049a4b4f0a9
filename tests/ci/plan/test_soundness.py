"""The planner never under-plans: for random single-file changes, every test whose run can observe
the change is selected.

The check is ``benchmarks/check_plan_soundness.py`` (its module docstring defines the observer
set, computed by brute force from the import graph's forward closure, the syntax trees' string
literals, the ``pyproject.toml`` entry points and the registrations, without the planner's
index); this runs a smaller sample of it, in the CPU lane: a synthetic monorepo with every kind
of dependency no plain import shows (``synthetic_monorepo.generate(..., hidden=True)``) and a
copy of this repository.  The script itself runs the full count (and compares with an older
planner).  The check is shown to be able to fail: a planner that ignores path literals, or one
that forgets ``watches``, misses observers on the same tree.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.imports import ReachIndex
from mizzen_ci.plan.index.lazy_reach import LazyReach

register_cpu_ci(est_time=60, labels=["ci"])


@pytest.fixture(scope="module")
def synthetic(soundness, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("soundness") / "synthetic"
    soundness.synthetic_monorepo.generate(root, modules=300, tests=500, seed=3, hidden=True)
    return root


def test_no_change_of_the_synthetic_monorepo_misses_an_observer(soundness, synthetic):
    result = soundness.check("synthetic monorepo", synthetic, 250, random.Random(3))
    print(result.report())
    assert result.changes == 250 and result.selected  # (most changes select some tests)
    assert result.missed == []


def test_no_change_of_this_repository_misses_an_observer(soundness, tmp_path):
    repo = soundness.copy_of_repository(tmp_path / "repo")
    result = soundness.check("this repository", repo, 150, random.Random(4))
    print(result.report())
    assert result.changes == 150 and result.selected
    assert result.missed == []


def test_the_check_catches_a_planner_that_ignores_path_literals(soundness, synthetic, monkeypatch):
    monkeypatch.setattr(ReachIndex, "namers", lambda self, path, bare=True: [])
    monkeypatch.setattr(LazyReach, "namers", lambda self, path, bare=True: [])
    changes = [
        p
        for p in soundness.tree_files(synthetic)
        if p.endswith(("engine_syn0.py", "worker_syn1.py", ".json"))
    ]
    oracle = soundness.Oracle.of(synthetic)
    selections = soundness.plan_selections(synthetic, changes)
    missed = {
        p
        for p in changes
        if oracle.observers(p) - set(oracle.tests if selections[p] is None else selections[p])
    }
    assert "tests/syn0/shared/engine_syn0.py" in missed  # loaded by path by the conftests
    assert any(p.startswith("packages/") for p in missed)  # a module names its data file


def test_the_check_catches_a_planner_that_forgets_watches(soundness, synthetic, monkeypatch):
    real = soundness.Analyser.of_index.__func__

    def without_watches(cls, index):
        analyser = real(cls, index)
        analyser.watches = {}
        return analyser

    monkeypatch.setattr(soundness.Analyser, "of_index", classmethod(without_watches))
    path = next(p for p in soundness.tree_files(synthetic) if p.endswith("/layer5/__init__.py"))
    oracle = soundness.Oracle.of(synthetic)
    got = set(soundness.plan_selections(synthetic, [path])[path])
    assert "tests/policy/test_every_module_imports.py" in oracle.observers(path) - got
