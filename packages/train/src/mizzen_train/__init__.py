"""mizzen-train: megatron-core training for mizzen -- multi-tenant LoRA slots.

One frozen base GPT on the GPUs, K LoRA *slots* on it; each tenant trains its own adapter in a
slot with its own optimizer and hyperparameters per request, and cannot affect another slot.

Modules (each states its invariants in its docstring):

- :mod:`~mizzen_train.executor` -- :class:`SlotExecutor`: load_slot / unload_slot /
  forward_backward / optim_step, forward_logprobs, save_slot / restore_slot; failure policy.
- :mod:`~mizzen_train.lora` -- slotted LoRA around megatron's column/row-parallel linears.
- :mod:`~mizzen_train.routing` -- per-token slot routing packed for batched GEMMs.
- :mod:`~mizzen_train.slot_optimizer` -- fp32 masters + AdamW per slot, lockstep stepping.
- :mod:`~mizzen_train.checkpoint` -- sharded slot checkpoints, writer election, export.
- :mod:`~mizzen_train.losses` -- cross-entropy (SFT) and clipped policy-gradient (RL) losses.
- :mod:`~mizzen_train.validation` -- registration-time rules; :mod:`~mizzen_train.errors`.
- :mod:`~mizzen_train.batch`, :mod:`~mizzen_train.specs` -- request records.
- :mod:`~mizzen_train.gpt` -- build a megatron-core GPT (local layer spec) for the executor.
- :mod:`~mizzen_train.megatron_on_cpu` -- opt-in ``torch.cuda`` shim to run megatron on a CPU.
- :mod:`~mizzen_train.memory` -- CUDA allocated bytes once asynchronous frees have landed.

Importing the package imports nothing heavy; its modules import torch and megatron.core (never a
GPU-only library).
"""

__version__ = "0.1.0"
