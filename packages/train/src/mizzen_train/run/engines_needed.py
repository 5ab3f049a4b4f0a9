"""What a run needs, derived once from its configuration and read everywhere.

:class:`EnginesNeeded` says whether rollout engines start and what for:

- ``none``: nothing generates (SFT with engine-free evaluators, or no evaluation at all);
- ``eval-only``: engines serve evaluation only (SFT with a generating evaluator): they start for
  an eval point, from the eval configuration, and never while training steps run;
- ``train+eval``: engines serve training (RL rollouts) and evaluation.

Invariant: the value is computed by :func:`engines_needed` from the configuration alone; the
trainer, the eval dispatcher and the launcher read the field instead of re-deriving it from
scattered settings.
"""

from __future__ import annotations

import enum


class EnginesNeeded(enum.StrEnum):
    NONE = "none"
    EVAL_ONLY = "eval-only"
    TRAIN_AND_EVAL = "train+eval"

    @property
    def for_training(self) -> bool:
        return self is EnginesNeeded.TRAIN_AND_EVAL

    @property
    def for_eval(self) -> bool:
        return self is not EnginesNeeded.NONE


def engines_needed(*, train_needs_engines: bool, eval_needs_engines: bool) -> EnginesNeeded:
    if train_needs_engines:
        return EnginesNeeded.TRAIN_AND_EVAL
    if eval_needs_engines:
        return EnginesNeeded.EVAL_ONLY
    return EnginesNeeded.NONE
