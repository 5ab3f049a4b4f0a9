"""The metric gate: tests record metric values, trusted runs keep their history, and a change is
judged against it.

Rooms: :mod:`.vocabulary` (``ci/metrics.toml``, the metric names there are), :mod:`.declarations`
(what ``register_ci_gate(...)`` calls a test file's syntax tree holds), :mod:`.artefacts` (the
JSON lines :func:`mizzen_ci.metrics.record` writes and every reader of them), :mod:`.store` (the
history store's interface and its schema; :mod:`.sql`, what both backends run; backends
:mod:`.sqlite` and :mod:`.postgres`, chosen by URL in :func:`.backends.open_store`), :mod:`.redact` (the shown form of a store URL), :mod:`.judge`
(the robust statistics and the verdicts), :mod:`.environment` (the environment a value was
produced in: torch, CUDA/ROCm, driver, GPU SKU, image or lock, Python), :mod:`.quarantine` (``ci/quarantine.toml``),
:mod:`.check` (one gate run: targets, coordinates, verdict rows), :mod:`.report` (verdict tables
with a sparkline of the history), :mod:`.validation` (what ``mizzen-ci validate`` checks) and
:mod:`.cli` (``mizzen-ci
gate check|ingest|untrust|show``).

Invariants:
- Stdlib only at import time (``python3 -S``); the PostgreSQL driver is imported inside
  :mod:`.postgres`'s functions only.
- Everything read from an artefact, a store, a quarantine file or a syntax tree is validated and
  bounded before use; what is printed goes through :mod:`mizzen_ci.output`.
- Nothing here imports a test file.
"""
