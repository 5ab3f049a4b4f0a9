"""Fixtures of the flaky-loop tests.

- ``no_lane_quarantine`` (autouse): the variables a CI lane job sets for the flaky quarantine
  (``MIZZEN_FLAKY``, ``MIZZEN_FLAKY_REV``), ``GITHUB_ACTIONS`` and ``MIZZEN_LANE`` are removed, so
  each test sets exactly the mode it means, in CI as locally.
"""

from __future__ import annotations

import pytest

LANE_VARIABLES = ("MIZZEN_FLAKY", "MIZZEN_FLAKY_REV", "GITHUB_ACTIONS", "MIZZEN_LANE")


@pytest.fixture(autouse=True)
def no_lane_quarantine(monkeypatch):
    for name in LANE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
