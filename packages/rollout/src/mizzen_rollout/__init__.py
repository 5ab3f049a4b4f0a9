"""mizzen-rollout: turning prompts into scored samples for RL.

Generate with an inference engine (SGLang servers over HTTP, or the embedded engine for laptops
and CPU runners), score with reward functions, group samples for RL, run Harbor agent trials, and
scale out with a Ray rollout manager.  :mod:`mizzen_rollout.samples` is the sample contract that
training reads.

Invariant: importing any module of this package loads none of torch, ray, harbor or transformers
(the lazy-import policy in the root ``pyproject.toml``); they are imported inside the functions that
use them, so the base install (httpx only) imports everything.
"""

__version__ = "0.1.0"
