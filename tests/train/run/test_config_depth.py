"""Deeply nested configuration tables end in one bounded ConfigError, never a RecursionError.

A ``--set`` key of thousands of dotted parts, or a TOML header ``[model.tiny.a.a...]`` as deep,
is refused by the one depth rule (:data:`~mizzen_train.run.config.MAX_TABLE_DEPTH`) where the
overrides and sections are built, and the message shows the value depth- and length-bounded.
"""

from __future__ import annotations

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_train.run.config import ConfigError
from mizzen_train.sft.config import SftConfig

register_cpu_ci(est_time=5, labels=["train"])

DEEP = 3000


def _refused(path, overrides) -> str:
    with pytest.raises(ConfigError) as caught:
        SftConfig.load(path, overrides)
    message = str(caught.value)
    assert "Fix:" in message and len(message) < 2000, message[:3000]
    return message


@pytest.mark.parametrize("head", ["x", "model.tiny", "tenants.0.a"])
def test_a_deep_set_key_is_one_bounded_error(head):
    message = _refused("example:sft_tiny", [f"{head}{'.a' * DEEP}=1"])
    assert "deeper than" in message, message


@pytest.mark.parametrize("overrides", [[], ["run.steps=2"]])
def test_a_deep_toml_table_is_one_bounded_error(sft, tmp_path, overrides):
    path = sft.write_config(
        tmp_path / "deep.toml", sft.small_sections("r", steps=1, checkpoint_interval=1)
    )
    path.write_text(path.read_text() + f"\n[model.tiny{'.a' * DEEP}]\nb = 1\n")
    message = _refused(path, overrides)
    assert "deeper than" in message, message
    # the file's depth is the file's error, with or without overrides (before: "--set" named)
    assert message.startswith(f"{path}: model.tiny.a."), message[:200]


def test_a_deep_value_is_shown_bounded():
    # within the depth rule, but wide: the message shows a bounded part of it
    wide = "{" + ", ".join(f"k{i} = {i}" for i in range(5000)) + "}"
    message = _refused("example:sft_tiny", [f"model.tiny={wide}", "model.path=x"])
    assert "model.tiny=" in message and "..." in message, message
