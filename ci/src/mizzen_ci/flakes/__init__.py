"""The flaky-test loop, closed on evidence: from the trusted history (the runs of main, nightly
and the merge queue that the nightly job merges into the history cache) propose quarantining a
(test file, arch) that flips, and lifting the quarantine once it has run clean.

Rooms: :mod:`.settings` (k, n, m from ``[tool.mizzen.flakes]`` of ``pyproject.toml``),
:mod:`.quarantine` (``ci/flaky.toml``: its entries, its text, the base revision's copy),
:mod:`.evidence` (the outcome series of each pair and what it shows), :mod:`.proposal` (the
quarantine file change and the pull-request body), :mod:`.lane` (what a lane is told: the mode and
its arch's quarantined files), :mod:`.pytest_plugin` (the CPU lane's pytest side of it; the GPU
lane applies it in :mod:`mizzen_ci.lane.cli`) and :mod:`.cli` (``mizzen-ci flakes propose``).

Invariants:
- Stdlib only at import time (``python3 -S``), like every module of :mod:`mizzen_ci`.
- Only the trusted history decides: a pull request's own runs never reach the history cache
  (nightly.yml's history job is its only writer), and a pull request or a merge group reads the
  quarantine list from its **base** revision (:func:`.quarantine.read_revision`).
- A proposal is a pure function of the history, the current list, the settings and the date.
"""
