"""RL on K LoRA tenants of one base model (``mizzen-train rl``).

- :mod:`.config` -- RL's sections composed with the shared ones of :mod:`mizzen_train.run`.
- :mod:`.advantages` -- group-normalised advantages (GRPO) and the other estimators, by name.
- :mod:`.rows` -- a step's samples as training rows: a row and a segment per sample.
- :mod:`.trainer` -- :class:`~mizzen_train.rl.trainer.RlTrainer` and
  :func:`~mizzen_train.rl.trainer.run_rl`: rollout -> reward -> policy step ->
  adapter sync, per tenant, with checkpoints, resume and snapshot evaluation.

Invariant: importing this package imports nothing heavy (the trainer loads torch when it runs);
it imports :mod:`mizzen_train.run`, never :mod:`mizzen_train.sft`.
"""
