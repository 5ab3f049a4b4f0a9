"""The run directory's layout: every entry a run writes directly under ``run.dir``, one table.

Invariants:
- Each writer takes its entry's name from here (:data:`RUN_DIR_ENTRIES` lists them all, with
  what they hold), so the table cannot fall behind the files.
- A configured path inside the run directory (``eval.snapshot_dir``) is checked against the
  table (:func:`owned_entry`): it never is, or lies inside, an entry the run writes itself.  An
  eval point deletes its snapshot directory once evaluated, and a point's name is a checkpoint's
  (``step-NNNNNNNN``): snapshots under ``checkpoints`` deleted every checkpoint of the run.
  The same holds on disk: no component of that path below ``run.dir`` may be a symbolic link
  (:func:`linked_component`), which would put the deletions wherever the link points.
- Names compare case-insensitively (a case-insensitive file system makes ``Export`` the export).
- Standard library only; importing it imports nothing else.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "ADAPTERS_DIR",
    "CHECKPOINTS_DIR",
    "CURVES_FILE",
    "EXPORT_DIR",
    "LOCK_FILE",
    "METRICS_FILE",
    "RUN_DIR_ENTRIES",
    "RUN_FILE",
    "TENSORBOARD_DIR",
    "TINY_MODEL_PREFIX",
    "WANDB_DIR",
    "linked_component",
    "owned_entry",
]

RUN_FILE = "run.json"
LOCK_FILE = ".lock"
METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
CHECKPOINTS_DIR = "checkpoints"
EXPORT_DIR = "export"
ADAPTERS_DIR = "adapters"
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"  # wandb.init(dir=run.dir) writes its files here
TINY_MODEL_PREFIX = "base-model-tiny-"

#: name (or, ending in "-", name prefix) -> what the run keeps there
RUN_DIR_ENTRIES: dict[str, str] = {
    RUN_FILE: "the run's identity and configuration",
    LOCK_FILE: "the lock of the command using the directory",
    METRICS_FILE: "the metrics log",
    CURVES_FILE: "the plotted curves",
    CHECKPOINTS_DIR: "the checkpoints",
    EXPORT_DIR: "the exported adapters and models",
    ADAPTERS_DIR: "the adapters an RL run publishes to its engines",
    TENSORBOARD_DIR: "the TensorBoard event files",
    WANDB_DIR: "the Weights & Biases run files",
    TINY_MODEL_PREFIX: "the tiny base model a run writes for itself",
}


def owned_entry(name: str) -> str | None:
    """What the run keeps under the top-level entry ``name`` of its directory, or ``None`` when
    the run writes nothing by that name."""
    folded = name.casefold()
    for entry, what in RUN_DIR_ENTRIES.items():
        entry = entry.casefold()
        if folded == entry or (entry.endswith("-") and folded.startswith(entry)):
            return what
    return None


def linked_component(run_dir: Path, relative: str) -> Path | None:
    """The first existing path of ``run_dir / relative``'s components below ``run_dir`` that is
    a symbolic link, or ``None`` (``run_dir`` itself may be one: the run lives where it points)."""
    path = Path(run_dir)
    for part in Path(relative).parts:
        path = path / part
        if path.is_symlink():
            return path
    return None
