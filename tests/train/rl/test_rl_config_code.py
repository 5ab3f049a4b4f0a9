"""Reading an RL configuration imports no code it names; the training command's loader does.

``algo.advantage`` is checked for its form when a configuration is parsed (a stored ``run.json``
is data); :func:`~mizzen_train.rl.config.load_advantage`, which the trainer calls when it trains,
imports it and names the field when it does not load.
"""

from __future__ import annotations

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_train.rl.config import RlConfig, load_advantage
from mizzen_train.run.config import ConfigError

register_cpu_ci(est_time=5, labels=["train"])


def _with_advantage(spec: str) -> dict:
    raw = RlConfig.load("example:rl_tiny").to_dict()
    raw["algo"]["advantage"] = spec
    return raw


def test_parsing_imports_no_estimator_and_training_loads_it(tmp_path):
    marker = tmp_path / "ran"
    hook = tmp_path / "hook.py"
    hook.write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "def f(values):\n    return values\n"
    )
    config = RlConfig.parse(_with_advantage(f"{hook}:f"), source="run.json")
    assert not marker.exists(), "parsing the configuration imported its estimator"
    assert load_advantage(config)([1.0, 2.0]) == [1.0, 2.0] and marker.exists()


def test_an_estimator_that_does_not_load_is_a_config_error_when_training(tmp_path):
    config = RlConfig.parse(_with_advantage(f"{tmp_path / 'missing.py'}:f"), source="c.toml")
    with pytest.raises(ConfigError, match=r"algo\.advantage=.*does not exist") as caught:
        load_advantage(config)
    assert "c.toml" in str(caught.value) and "Fix:" in str(caught.value)
    with pytest.raises(ConfigError, match="neither built in"):
        RlConfig.parse(_with_advantage("ppo"), source="c.toml")
