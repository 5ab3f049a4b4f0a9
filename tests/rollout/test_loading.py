"""The one ``module:function`` loader (:func:`mizzen_rollout.api.load_object`): built-ins, import
paths, file paths, and a refusal naming the rule and the fix for every other spec."""

from __future__ import annotations

import sys

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.api import (
    ObjectSpecError,
    RewardSpecError,
    check_spec_form,
    load_object,
    load_reward,
)

register_cpu_ci(est_time=2, labels=["rollout"])


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    (tmp_path / "my_scorers.py").write_text(
        "def score(x):\n    return 1.0\nclass Factory:\n    pass\nCONSTANT = 3\n"
    )
    (tmp_path / "broken.py").write_text("raise RuntimeError('no')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_scorers", None)


def test_builtins_import_paths_and_files_resolve(module_dir):
    assert load_object("b", what="thing", builtins={"b": len}) is len
    assert load_object("my_scorers:score", what="thing").__name__ == "score"
    loaded = load_object(f"{module_dir / 'my_scorers.py'}:Factory", what="thing", kind="factory")
    assert loaded.__name__ == "Factory"
    assert not any(name.startswith("_mizzen_loaded_") for name in sys.modules)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nonsense", r"thing 'nonsense' is neither built in \(\['b'\]\) nor 'module:function'"),
        ("my_scorers:missing", "module 'my_scorers' has no attribute 'missing'. Fix:"),
        ("my_scorers:CONSTANT", "'CONSTANT' is int, not callable. Fix:"),
        ("no_such_module_xyz:f", "importing 'no_such_module_xyz' failed .* Fix: make the module"),
        ("/nowhere/r.py:f", "file /nowhere/r.py does not exist. Fix:"),
        ("BROKEN:f", r"importing '.*broken.py' failed \(RuntimeError: no\). Fix:"),
    ],
)
def test_every_other_spec_is_refused_with_the_rule_and_the_fix(module_dir, spec, message):
    spec = spec.replace("BROKEN", str(module_dir / "broken.py"))
    with pytest.raises(ObjectSpecError, match=message):
        load_object(spec, what="thing", builtins={"b": len})


def test_without_builtins_the_rule_names_the_kind_and_callers_keep_their_error_type():
    with pytest.raises(ObjectSpecError, match="evaluator 'x' is not 'module:factory'"):
        load_object("x", what="evaluator", kind="factory")
    with pytest.raises(RewardSpecError, match="reward 'x' is neither built in") as caught:
        load_reward("x")
    assert isinstance(caught.value, ObjectSpecError)


@pytest.mark.parametrize("spec", ["nonsense", ":f", "pkg.mod:", "b:"])
def test_the_form_alone_is_checked_by_the_loaders_rule_without_importing(spec):
    """``check_spec_form`` (a stored run's configuration, read without running its code) refuses
    what ``load_object`` refuses for its form, with the same message, and imports nothing."""
    with pytest.raises(ObjectSpecError) as loaded:
        load_object(spec, what="thing", builtins={"b": len})
    with pytest.raises(ObjectSpecError) as checked:
        check_spec_form(spec, what="thing", builtins={"b": len})
    assert str(checked.value) == str(loaded.value)
    before = set(sys.modules)
    check_spec_form("b", what="thing", builtins={"b": len})
    check_spec_form("no_such_module_xyz:f", what="thing")
    check_spec_form("/nowhere/r.py:f", what="thing")
    assert set(sys.modules) == before
