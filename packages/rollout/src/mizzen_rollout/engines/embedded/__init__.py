"""The embedded engine: a small HTTP server of mizzen's own speaking SGLang's protocol subset.

Modules: :mod:`.server` (HTTP), :mod:`.backend` (transformers generation / instant echo),
:mod:`.tokenizer` (byte-level tokenizer for the tiny model, HF adapter).  Start it with
``mizzen-rollout serve`` or :func:`mizzen_rollout.engines.launcher.launch_embedded`.

Invariant: importing this package imports no torch or transformers (the backend loads them).
"""
