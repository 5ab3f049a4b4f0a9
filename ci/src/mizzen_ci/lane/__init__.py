"""The GPU lanes: ``mizzen-ci gpu-lane ARCH`` runs every file a lane owns on this host's GPUs.

Rooms, in the order a run uses them: :mod:`.cli` (options), :mod:`.hardware` (the probe and the
refusal rule), :mod:`.selection` (what runs, checked against the registry), :mod:`.packing` (files
onto GPUs, side by side), :mod:`.leases` (one lock per GPU, shared by every lane on the host),
:mod:`.runner` (one pytest process per file), :mod:`.retry` (which failures are infrastructure),
:mod:`.progress`, :mod:`.junit` (reading and merging reports) and :mod:`.report` (summary,
durations, flakes).  Nothing here is imported until a lane runs; this ``__init__`` exports
nothing so that readers of one module (the history store reads :mod:`.junit`) load only it.
"""
