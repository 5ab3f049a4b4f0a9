"""mizzen-rollout: turning prompts into scored samples for RL.

Generate with an inference engine (SGLang servers over HTTP, or the embedded engine for laptops
and CPU runners), score with reward functions, group samples for RL, run Harbor agent trials, and
scale out with a Ray rollout manager.

The public API is one module, :mod:`mizzen_rollout.api`: other packages (``mizzen_train``) import
only from it (a test holds them to it); this root exports only ``__version__`` so that
``import mizzen_rollout`` stays cheap.

Modules (one concern each):
- :mod:`.samples`: the sample contract (plain dataclasses, JSON lines).
- :mod:`.adapters`: LoRA adapters as the unit of weight sync (the PEFT directory format, the
  versioned engine-side name).
- :mod:`.engines`: one async engine interface; the SGLang HTTP client, the launcher, the embedded
  server (``mizzen-rollout serve``) and the protocol shapes (:mod:`.engines.protocol`).
- :mod:`.api`: the public API (every name another package may import).
- :mod:`.rewards`: math exact match, token F1, custom rewards by import path.
- :mod:`.loading`: the one ``module:function`` loader (rewards, evaluators, estimators).
- :mod:`.prompts`: prompt rendering (what an engine generates from), one rule for every caller.
- :mod:`.data`: JSON-lines prompt datasets with a seeded, resumable cursor.
- :mod:`.router`, :mod:`.rollout`, :mod:`.metrics`: routing, the rollout pipeline, its metrics.
- :mod:`.manager`: the Ray rollout manager (engine workers as actors, fault handling).
- :mod:`.harbor`: Harbor agent trials.
- :mod:`.cli`: the ``mizzen-rollout`` command.

Invariant: importing any module of this package loads none of torch, ray, harbor or transformers
(the lazy-import policy in the root ``pyproject.toml``); they are imported inside the functions that
use them, so the base install (httpx only) imports everything.
"""

__version__ = "0.1.0"
