"""A lane with the flaky quarantine (the `mizzen_ci_flakes` pytest plugin), through pytester:
in `record` mode (nightly) a quarantined file runs, its failure is in the junit report (the
history records it) and does not fail the session, while any other failure still does; in
`skip` mode (pull requests, merge queue) it is not run, and the list comes from the base
revision when one is given, whatever the change did to it."""

from __future__ import annotations

import subprocess

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=6, labels=["ci"])

FLAKY_LIST = """
[[flaky]]
file = "tests/test_flaky.py"
arch = "cpu"
since = 2026-12-01
reason = "flipped 3 times in its last 5 trusted runs (k = 3)"
"""


REGISTERED = (
    'from mizzen_ci import register_cpu_ci\n\nregister_cpu_ci(est_time=1, labels=["ci"])\n\n'
)


@pytest.fixture
def lane(pytester: pytest.Pytester, repo_root) -> pytest.Pytester:
    """A mizzen checkout (its fleet table: both plugins are active) with a quarantined file."""
    pytester.makefile(
        ".toml",
        **{"ci/flaky": FLAKY_LIST, "ci/fleet": (repo_root / "ci" / "fleet.toml").read_text()},
    )
    pytester.makepyfile(**{"tests/test_flaky": REGISTERED + "def test_it():\n    assert False, 'flaked'\n",
                           "tests/test_fine": REGISTERED + "def test_it():\n    pass\n"})  # fmt: skip
    return pytester


def test_record_mode_runs_the_quarantined_file_records_its_failure_and_does_not_gate(lane):
    result = lane.runpytest("--mizzen-flaky=record", "--junitxml=junit.xml", "tests")
    result.assert_outcomes(passed=1, failed=1)
    assert result.ret == 0
    assert 'message="AssertionError: flaked' in (lane.path / "junit.xml").read_text()
    result.stdout.fnmatch_lines(
        ["*failed, recorded, not gating (quarantined on cpu): tests/test_flaky.py*"]
    )

    lane.makepyfile(**{"tests/test_fine": REGISTERED + "def test_it():\n    assert False\n"})
    assert lane.runpytest("--mizzen-flaky=record", "tests").ret == 1  # not quarantined: gates


def test_off_by_default_and_skip_mode_deselects(lane, monkeypatch):
    assert lane.runpytest("tests").ret == 1
    monkeypatch.setenv("MIZZEN_FLAKY", "skip")
    result = lane.runpytest("tests")
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.fnmatch_lines(
        ["*not run, quarantined on cpu (ci/flaky.toml): tests/test_flaky.py: flipped 3 times*"]
    )
    assert result.ret == 0


def test_skip_mode_reads_the_list_from_the_base_revision(lane):
    git = lambda *a: subprocess.run(["git", *a], cwd=lane.path, check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "base")
    result = lane.runpytest("--mizzen-flaky=skip", "--mizzen-flaky-rev=HEAD", "tests")
    assert result.ret == 1  # the base has no list: the change's own list quarantines nothing
    git("add", "ci/flaky.toml")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "quarantine")
    (lane.path / "ci" / "flaky.toml").write_text("")  # the change lifts it: ignored
    result = lane.runpytest("--mizzen-flaky=skip", "--mizzen-flaky-rev=HEAD", "tests")
    result.assert_outcomes(passed=1, deselected=1)


def test_a_broken_list_quarantines_nothing_and_says_so(lane):
    (lane.path / "ci" / "flaky.toml").write_text("[[flaky]]\nfile = 3\n")
    result = lane.runpytest("--mizzen-flaky=record", "tests")
    assert result.ret == 1
    result.stdout.fnmatch_lines(
        ["*mizzen flaky: ci/flaky.toml:1: `file` 3 is not a test file path*(nothing quarantined)*"]
    )


def test_outside_a_mizzen_checkout_the_plugin_reads_nothing(lane):
    (lane.path / "ci" / "fleet.toml").unlink()  # another test's pytester tree, in a lane job
    result = lane.runpytest("--mizzen-flaky=record", "tests")
    assert result.ret == 1 and "mizzen flaky" not in result.stdout.str()
