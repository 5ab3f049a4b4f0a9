"""The selection audit: the planner's selection measured against what tests really execute.

Rooms: :mod:`.contexts` (the pytest plugin: one coverage context per test, subprocesses
included), :mod:`.observe` (run tests under coverage, turn the data into execution rows, stored
by :mod:`mizzen_ci.history_execution`), :mod:`.recall` (the audit: recall, precision, misses),
:mod:`.explain` (why a miss was missed), :mod:`.report` (text and Markdown), :mod:`.mutants`
(seeded AST mutants) and :mod:`.mutation_check` (running them), :mod:`.cli` (``mizzen-ci
audit``).  coverage.py is an optional extra (``mizzen-ci[audit]``), imported inside functions.
"""
