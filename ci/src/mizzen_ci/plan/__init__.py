"""The planner: a pull request (or a push, a schedule) → jobs on runners whose hardware matches.

Rooms, in pipeline order: :mod:`.request` (what the event asks for), :mod:`.change` (the diff,
from git), :mod:`.path_rules` (what a changed path means), :mod:`.impact` (which tests a change
reaches), :mod:`.dispatch` (on which arches and pools a test runs), :mod:`.selection` (what runs
and why everything else does not), :mod:`.jobs` (the job records, packed by
:mod:`mizzen_ci.packing.pool`), :mod:`.pipeline` (all of it: :func:`~.pipeline.build_plan`), :mod:`.report`
(terminal and Markdown), :mod:`.cli` (``mizzen-ci plan``), :mod:`.fastfail` (``mizzen-ci
fastfail``: may a pull request's GPU jobs start, judged from its CPU run).  :mod:`.model` holds the plan's records,
which the lanes and ``noxfile.py`` read.  ``index/`` holds the speed-only caches (skippable on a
first read: the plan is the same without them).

This ``__init__`` exports the records only, so a lane reading a plan loads nothing else.
"""

from .model import (
    ArchSummary,
    Job,
    NotScheduled,
    Plan,
    PlanError,
    PlannedTest,
    PoolSummary,
    SelectionSummary,
)

__all__ = [
    "ArchSummary",
    "Job",
    "NotScheduled",
    "Plan",
    "PlanError",
    "PlannedTest",
    "PoolSummary",
    "SelectionSummary",
]
