"""Packing test files onto GPUs: the one packer the GPU lane runs and the planner simulates.

Rooms: :mod:`.gpus` (files onto one host's GPUs, side by side: :class:`~.gpus.GpuPacker`, which
the lane drives with process exits and :func:`~.gpus.simulate` with estimated end times) and
:mod:`.pool` (tests into runner-jobs of one pool, each job scored by simulating it with
:mod:`.gpus`).  Both :mod:`mizzen_ci.lane` and :mod:`mizzen_ci.plan` import this folder; it
imports neither, so what a plan promises is what a lane runs.  Stdlib only; this ``__init__``
exports nothing so that a reader of one module loads only it.
"""
