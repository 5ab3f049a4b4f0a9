"""What a run leaves for others to load: a PEFT adapter per tenant (and, on request, the merged
Hugging Face model), under ``<run.dir>/export/step-NNNNNNNN/<tenant>/{adapter,merged}``.

Every run exports its last step when it ends; ``mizzen-train export RUN_DIR [--step N]
[--merged]`` exports any complete checkpoint of an existing run.

Invariants:
- An export is whole or absent: it is written under a temporary sibling and renamed; an export
  that exists is never rewritten.
- An adapter records its base model by absolute path (``base_model_name_or_path``), so
  ``AutoPeftModelForCausalLM.from_pretrained(adapter)`` works from any directory; files are 0644.
- The files are the same whatever the run's layout wrote them (the exporters gather shards).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mizzen_train.run.layout import EXPORT_DIR
from mizzen_train.run.state import checkpoint_name

__all__ = ["export_root", "export_tenants"]


def export_root(run_dir: Path, step: int) -> Path:
    """Where the export of ``step`` lives."""
    return run_dir / EXPORT_DIR / checkpoint_name(step)


def export_tenants(
    target: Path,
    *,
    names: Iterable[str],
    slot_of: Mapping[str, int],
    executor: Any,
    model: Any,
    source: Any,
    base_model_dir: Path,
    tokenizer: Any,
    merged: bool,
    dtype: str,
) -> Path:
    """Each tenant's adapter (and merged model) into ``target``, whole or not at all; an
    existing ``target`` is kept as it is.  Collective under tensor parallelism."""
    from mizzen_train.hf import export_hf_snapshot, export_peft_adapter

    if target.exists():
        return target
    tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
    try:
        for name in names:
            export_peft_adapter(
                tmp / name / "adapter",
                executor=executor,
                slot=slot_of[name],
                source=source,
                base_model_name_or_path=str(base_model_dir.resolve()),
            )
            if merged:
                export_hf_snapshot(
                    tmp / name / "merged", model=model, source=source, executor=executor,
                    slot=slot_of[name], dtype=dtype, tokenizer=tokenizer,
                )  # fmt: skip
        if tmp.exists():  # rank 0 wrote it
            os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
