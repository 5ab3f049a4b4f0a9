"""Instance ids -> task directories: strict names, never outside the tasks root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_rollout.harbor.errors import HarborConfigError
from mizzen_rollout.harbor.task_ids import (
    INSTANCE_ID_PATTERN,
    instance_id_from_metadata,
    resolve_task_dir,
)

register_cpu_ci(est_time=4, labels=["rollout", "harbor"])


@pytest.fixture
def root(tmp_path: Path) -> Path:
    tasks = tmp_path / "tasks"
    for name in ("django__django-11099", "a.b_c-1", "not-a-task"):
        (tasks / name).mkdir(parents=True)
    for name in ("django__django-11099", "a.b_c-1"):
        (tasks / name / "task.toml").write_text('schema_version = "1.4"\n')
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "task.toml").write_text("")
    os.symlink(outside, tasks / "escape")
    (tmp_path / "secret-task").mkdir()
    (tmp_path / "secret-task" / "task.toml").write_text("")
    return tasks


def test_valid_ids_resolve(root: Path) -> None:
    assert resolve_task_dir(root, "django__django-11099") == (root / "django__django-11099")
    assert resolve_task_dir(root, "a.b_c-1").name == "a.b_c-1"


@pytest.mark.parametrize(
    "bad",
    [
        "../x",
        "..",
        ".",
        "../secret-task",
        "/etc",
        "/abs/path",
        "a/b",
        "a\\b",
        "",
        " x",
        "x y",
        "x\n",
        "x\x00y",
        "-rf",
        ".hidden",
        "a..b",
        "~root",
        "$HOME",
        "x;rm",
        "é",
        "a" * 129,
    ],
)
def test_traversal_and_odd_ids_are_rejected(root: Path, bad: str) -> None:
    with pytest.raises(HarborConfigError, match="not a valid task name"):
        resolve_task_dir(root, bad)


def test_symlink_escaping_the_root_is_rejected(root: Path) -> None:
    with pytest.raises(HarborConfigError, match="outside the tasks root"):
        resolve_task_dir(root, "escape")


def test_missing_task_and_non_task_directory(root: Path) -> None:
    with pytest.raises(HarborConfigError, match="no task directory"):
        resolve_task_dir(root, "absent")
    with pytest.raises(HarborConfigError, match=r"no task\.toml"):
        resolve_task_dir(root, "not-a-task")


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_any_accepted_id_stays_inside_the_root(tmp_path_factory, text: str) -> None:
    root = tmp_path_factory.getbasetemp() / "hypothesis-root"
    root.mkdir(exist_ok=True)
    try:
        resolved = resolve_task_dir(root, text)
    except HarborConfigError:
        return
    assert INSTANCE_ID_PATTERN.fullmatch(text)
    assert resolved.parent == root.resolve()


def test_instance_id_from_metadata() -> None:
    assert instance_id_from_metadata({"instance_id": "t1"}) == "t1"
    with pytest.raises(HarborConfigError, match="no 'instance_id'"):
        instance_id_from_metadata({})
    with pytest.raises(HarborConfigError, match="not str"):
        instance_id_from_metadata({"instance_id": 7})
