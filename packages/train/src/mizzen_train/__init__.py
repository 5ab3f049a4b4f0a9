"""mizzen-train: fine-tuning language models on megatron-core.

Supervised and RL fine-tuning for mizzen: a multi-tenant LoRA slot executor (many adapters, each
with its own optimizer, trained in slots of one base model), SFT and policy-gradient losses, and
slot checkpoints.  Rollout samples come from :mod:`mizzen_rollout.samples`, the one sample contract.

Modules (each states its invariants in its docstring):

- :mod:`~mizzen_train.run` -- the run framework SFT and RL share: the configuration machinery
  and shared sections, the public ``Trainer`` base (set-up, steps, checkpoints, resume, eval
  points, the end), the run directory, metrics and curves, the process's device and rank.
- :mod:`~mizzen_train.sft` -- ``mizzen-train sft``: SFT's configuration and trainer (a ``Trainer``
  whose step is one packed batch); :mod:`~mizzen_train.cli` the command line.
- :mod:`~mizzen_train.rl` -- ``mizzen-train rl``: GRPO on K LoRA tenants (rollout through the
  engines with each tenant's published adapter, reward, policy step, adapter sync), its
  configuration, advantages and the toy tasks of the README demo.  ``sft`` and ``rl`` import
  ``run`` and never each other.
- :mod:`~mizzen_train.hf` -- Hugging Face Llama import into megatron-core, merged-snapshot and
  PEFT adapter export (the one megatron <-> HF name table), small Llamas created by code.
- :mod:`~mizzen_train.data` -- SFT records, tokenisation with response-only loss, packing.
- :mod:`~mizzen_train.eval_dispatch` -- the eval dispatcher (snapshots evaluated on the side);
  :mod:`~mizzen_train.evaluators` its built-in generation and held-out loss evaluators.

- :mod:`~mizzen_train.executor` -- ``SlotExecutor``: load_slot / unload_slot / forward_backward /
  optim_step, forward_logprobs, forward_backward_logprobs, save_slot / restore_slot; the failure
  policy.
- :mod:`~mizzen_train.lora` -- slotted LoRA around megatron's column/row-parallel linears.
- :mod:`~mizzen_train.routing` -- per-token slot routing packed for batched GEMMs.
- :mod:`~mizzen_train.slot_optimizer` -- fp32 masters + AdamW per slot, stepped in lockstep.
- :mod:`~mizzen_train.checkpoint` -- sharded slot checkpoints, writer election, export.
- :mod:`~mizzen_train.losses` -- cross-entropy (SFT) and clipped policy-gradient (RL) losses.
- :mod:`~mizzen_train.validation` and :mod:`~mizzen_train.errors` -- registration-time rules.
- :mod:`~mizzen_train.batch`, :mod:`~mizzen_train.specs` -- request records.
- :mod:`~mizzen_train.gpt` -- build a megatron-core GPT (local layer spec; GPT-2 or Llama shape).
- :mod:`~mizzen_train.megatron_on_cpu` -- opt-in ``torch.cuda`` shim to run megatron on a CPU.
- :mod:`~mizzen_train.memory` -- CUDA allocated bytes once asynchronous frees have landed.

Invariant: every module imports on a CPU machine with no GPU-only library installed (megatron-core
and torch are allowed at module scope; transformer_engine, apex, flash_attn, … only inside the
functions that use them).  Importing the package itself imports nothing heavy.
"""

__version__ = "0.1.0"
