"""From a sample's instance id to a Harbor task directory, without ever leaving the tasks root.

Invariants:
- An instance id is one path component matching `INSTANCE_ID_PATTERN`: it starts with a letter or
  digit, then letters, digits, `.`, `_`, `-` (at most 128 characters), and is never `..`-like.
  Slashes, absolute paths, whitespace, NUL and other odd characters are refused before any
  filesystem access.
- The resolved directory (symlinks followed) must lie inside the resolved tasks root and hold a
  `task.toml`; anything else is a configuration error naming the id and the root.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mizzen_rollout.harbor.errors import HarborConfigError
from mizzen_rollout.harbor.redaction import shown

INSTANCE_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def instance_id_from_metadata(metadata: Mapping[str, Any] | None) -> str:
    """The sample's instance id (`metadata["instance_id"]`)."""
    value = (metadata or {}).get("instance_id")
    if value is None:
        raise HarborConfigError(
            "sample metadata has no 'instance_id'; fix: give every Harbor sample "
            "metadata={'instance_id': '<task directory name under the tasks root>'}"
        )
    if not isinstance(value, str):
        raise HarborConfigError(
            f"sample metadata 'instance_id' is {type(value).__name__}, not str; fix: use the "
            "task directory name"
        )
    return value


def resolve_task_dir(tasks_root: Path, instance_id: str) -> Path:
    """The task directory for `instance_id` inside `tasks_root` (checked, resolved)."""
    if not INSTANCE_ID_PATTERN.fullmatch(instance_id) or ".." in instance_id:
        raise HarborConfigError(
            f"instance id {shown(instance_id)} is not a valid task name; fix: use one path component "
            "of letters, digits, '.', '_' and '-' (starting with a letter or digit, no '..', at "
            "most 128 characters)"
        )
    root = Path(tasks_root).resolve()
    candidate = (root / instance_id).resolve()
    if not candidate.is_relative_to(root) or candidate == root:
        raise HarborConfigError(
            f"instance id {shown(instance_id)} resolves to {candidate}, outside the tasks root {root} "
            "(a symlink?); fix: keep every task directory inside the tasks root"
        )
    if not candidate.is_dir():
        raise HarborConfigError(
            f"instance id {shown(instance_id)}: no task directory {candidate}; fix: check the id or "
            "MIZZEN_HARBOR_TASKS_DIR"
        )
    if not (candidate / "task.toml").is_file():
        raise HarborConfigError(
            f"instance id {shown(instance_id)}: {candidate} has no task.toml, so it is not a Harbor "
            "task; fix: point MIZZEN_HARBOR_TASKS_DIR at the directory of task directories"
        )
    return candidate
