"""The GPU lanes: ``mizzen-ci gpu-lane ARCH`` runs every file a lane owns on this host's GPUs.

Rooms, in the order a run uses them: :mod:`.cli` (options), :mod:`.hardware` (the probe and the
refusal rule), :mod:`.selection` (what runs, checked against the registry), :mod:`mizzen_ci.packing.gpus`
(files onto GPUs, side by side), :mod:`.leases` (one lock per GPU, shared by every lane on the host),
:mod:`.runner` (one pytest process per file), :mod:`.retry` (which failures are infrastructure),
:mod:`.progress`, :mod:`mizzen_ci.junit` (reading and merging reports) and :mod:`.report`
(summary, durations, flakes).  Nothing here is imported until a lane runs; this ``__init__``
exports nothing so that a reader of one module loads only it.
"""
