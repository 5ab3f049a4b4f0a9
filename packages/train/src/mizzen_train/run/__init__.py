"""The run framework that ``mizzen-train sft`` and ``mizzen-train rl`` share.

- :mod:`.config` -- the configuration machinery: fields declared once (``opt``), one table of
  sections per command, TOML + ``--set`` reading, ``--help-config``; the one ``ConfigError``.
- :mod:`.sections` -- the shared sections (``[run]``, ``[model]``, ``[eval]``, the tenants'
  LoRA / AdamW / schedule fields), their rules, and ``RunLayout`` (run dir, snapshots, the eval
  points).
- :mod:`.engines_needed` -- whether a run starts rollout engines, derived once.
- :mod:`.process` -- the device and dtype, and the rank the process trains as.
- :mod:`.schedule` -- the learning-rate schedule and a step's optimizer request.
- :mod:`.state` -- the run directory: run id, atomic checkpoints, resume.
- :mod:`.metrics` -- ``metrics.jsonl`` records and the progress line; :mod:`.plot` the curves.
- :mod:`.trainer` -- ``Trainer``: a run's life cycle (validate, set up, step, checkpoint,
  evaluate, finish) with the hooks a command specialises.

Invariant: importing this package imports nothing heavy; :mod:`.config`, :mod:`.sections` and
:mod:`.engines_needed` import the standard library only, the others torch at most.
"""
