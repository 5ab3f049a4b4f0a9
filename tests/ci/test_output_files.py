"""``mizzen_ci.output_files``: the one check of output paths and the all-or-nothing writer every
command's outputs go through (plan, comment, fastfail; gpu-lane's checks).  A commit that fails
part-way leaves every target as it was, no temporary file and no folder it created; appending
keeps the old bytes; a replaced file keeps its mode; a link is followed, not replaced."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.output_files import OutputPathError, Outputs, check_dir, check_file

register_cpu_ci(est_time=5, labels=["ci"])


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("adir", "--x {t}/adir: is a folder. Fix: give the path of a file"),
        ("afile/y.txt", "--x {t}/afile/y.txt: {t}/afile is a regular file, not a folder. Fix:"),
        ("fifo", "--x {t}/fifo: is a FIFO (named pipe), not a regular file. Fix:"),
    ],
)
def test_a_file_path_that_cannot_be_written_is_named_with_the_fix(tmp_path, path, problem):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OutputPathError) as info:
        check_file("--x", tmp_path / path)
    assert str(info.value).startswith(problem.format(t=tmp_path)), str(info.value)


def test_a_folder_path_must_be_a_folder_or_creatable(tmp_path):
    (tmp_path / "afile").write_text("x")
    assert check_dir("--d", tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists()  # a check never creates
    for bad in ("afile", "afile/sub"):
        with pytest.raises(OutputPathError, match=r"^--d .*not a folder\. Fix: "):
            check_dir("--d", tmp_path / bad)


def test_a_failed_commit_writes_nothing_and_removes_what_it_created(tmp_path):
    (tmp_path / "gh.txt").write_text("before=1\n")
    outputs = Outputs()
    outputs.add("--github-output", tmp_path / "gh.txt", "run=true\n", append=True)
    outputs.add("--output", tmp_path / "new" / "plan.json", "{}")
    outputs.add("--reply", tmp_path / "later" / "r.md", "hi")
    (tmp_path / "later").write_text("became a file after the check")  # a race
    before = files(tmp_path)
    with pytest.raises(OutputPathError, match=r"^--reply .*: cannot be written \(.*nothing was"):
        outputs.commit()
    assert files(tmp_path) == before and not (tmp_path / "new").exists()


def test_append_keeps_the_old_bytes_and_mode_and_a_link_is_followed(tmp_path):
    real = tmp_path / "real.txt"
    real.write_bytes(b"old\xff\n")
    real.chmod(0o640)
    (tmp_path / "link.txt").symlink_to(real)
    outputs = Outputs()
    outputs.add("--summary", tmp_path / "link.txt", "new\n", append=True)
    outputs.commit()
    assert real.read_bytes() == b"old\xff\nnew\n" and (real.stat().st_mode & 0o777) == 0o640
    assert (tmp_path / "link.txt").is_symlink() and sorted(files(tmp_path)) == [
        "link.txt",
        "real.txt",
    ]


def test_two_options_may_not_name_one_file(tmp_path):
    outputs = Outputs()
    outputs.check("--output", tmp_path / "x")
    with pytest.raises(OutputPathError, match=r"^--summary .*: is also the file of --output"):
        outputs.check("--summary", tmp_path / "." / "x")
