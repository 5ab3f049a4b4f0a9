"""RL on K LoRA tenants of one base model (``mizzen-train rl``).

- :mod:`.config` -- the configuration table (the SFT table's machinery and shared sections).
- :mod:`.advantages` -- group-normalised advantages (GRPO) and the other estimators, by name.
- :mod:`.trainer` -- :func:`~mizzen_train.rl.trainer.run_rl`: rollout -> reward -> policy step ->
  adapter sync, per tenant, with checkpoints, resume and snapshot evaluation.

Invariant: importing this package imports nothing heavy (the trainer loads torch when it runs).
"""
