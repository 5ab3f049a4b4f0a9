"""Supervised fine-tuning with checkpoint-snapshot evaluation (``mizzen-train sft``).

- :mod:`.config` -- SFT's sections (``[data]``, ``[[tenants]]``) composed with the shared ones of
  :mod:`mizzen_train.run.sections`, validated before step 0.
- :mod:`.trainer` -- :class:`~mizzen_train.sft.trainer.SftTrainer` (a
  :class:`~mizzen_train.run.trainer.Trainer` whose step is one packed batch) and
  :func:`~mizzen_train.sft.trainer.run_sft`.

Invariant: importing this package imports nothing heavy (the modules import torch at most); it
imports :mod:`mizzen_train.run`, never :mod:`mizzen_train.rl`.
"""
