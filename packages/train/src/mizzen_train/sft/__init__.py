"""Supervised fine-tuning with checkpoint-snapshot evaluation (``mizzen-train sft``).

- :mod:`.config` -- the configuration table (TOML + ``--set``), validated before step 0.
- :mod:`.trainer` -- :func:`~mizzen_train.sft.trainer.run_sft`, the training loop.
- :mod:`.state` -- the run directory: run id, atomic checkpoints, resume.
- :mod:`.metrics` -- ``metrics.jsonl`` records and the progress line.

Invariant: importing this package imports nothing heavy (the modules import torch at most).
"""
