"""``mizzen-train serve``: a multi-tenant LoRA training service that the official Tinker SDK drives.

One base model per server, K LoRA slots of one :class:`~mizzen_train.executor.SlotExecutor`;
clients own the loop (``forward_backward``, ``optim_step``, save/load, publish weights, sample)
over the Tinker wire protocol of the pinned SDK (``tinker``, the ``serve`` extra).

One concern per module:

- :mod:`.config` -- the ``--config`` file (the run/config machinery): model, slots, limits, paths;
- :mod:`.auth` -- API keys from a file; which tenant a key is; nothing secret in a message;
- :mod:`.wire` -- the SDK's request/response types and protobuf schema in, HTTP bodies out;
- :mod:`.operations` -- one model's operation queue: order, idempotent retries, admission (429);
- :mod:`.batching` -- Tinker data and losses as executor batches (one tenant per row);
- :mod:`.scheduler` -- the executor thread: batches several tenants' operations into one step;
- :mod:`.state` -- models and checkpoints on disk, written atomically (survives a restart);
- :mod:`.sampling` -- published adapters and sampling through the embedded engine;
- :mod:`.metrics` -- Prometheus text for ``/metrics``;
- :mod:`.app` -- the HTTP routes; :mod:`.command` -- the CLI subcommand.

Invariant: importing this package imports no torch, megatron or tinker (they load when the
server starts), like the rest of :mod:`mizzen_train`.
"""
