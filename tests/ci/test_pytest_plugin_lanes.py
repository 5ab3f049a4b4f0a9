"""The pytest plugin decides collection from the registry, driven through pytester on a small repo."""

from __future__ import annotations

from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=20, labels=["ci"])

FLEET = (Path(__file__).parent / "fixtures" / "registry" / "fleet.toml").read_text()
HEAD = "from mizzen_ci import register_cpu_ci, register_cuda_ci\n"


@pytest.fixture
def repo(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makefile(".toml", **{"ci/fleet": FLEET})
    pytester.makepyprojecttoml(
        '[tool.mizzen.registry]\nexclude = ["tests/data"]\n[tool.pytest.ini_options]\n'
    )
    files = {
        "tests/test_cpu_ok.py": HEAD + "register_cpu_ci(est_time=1)\ndef test_a():\n    pass\n",
        "tests/sub/test_cpu_nested.py": HEAD
        + "register_cpu_ci(est_time=1)\ndef test_b():\n    pass\n",
        "tests/test_gpu.py": HEAD
        + "register_cuda_ci(est_time=1, hardware=['hopper'], labels=['lora'])\n"
        + "import not_installed_gpu_lib\ndef test_g():\n    pass\n",
        "tests/test_disabled.py": HEAD
        + "register_cpu_ci(est_time=1, disabled='flaky upstream, issue 7')\n"
        + "raise RuntimeError('a disabled module must never be imported')\n",
        "tests/test_broken_registration.py": HEAD
        + "register_cpu_ci(est_time=-1)\ndef test_c():\n    pass\n",
        "tests/data/test_fixture_data.py": "this is not python at all (\n",
    }
    for rel, src in files.items():
        p = pytester.path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(src)
    return pytester


def test_cpu_lane_collects_cpu_files_skips_disabled_and_fails_broken(repo: pytest.Pytester):
    result = repo.runpytest("tests")
    assert result.ret == pytest.ExitCode.INTERRUPTED  # a broken registration stops the lane
    result = repo.runpytest("-rs", "--continue-on-collection-errors", "tests")
    result.assert_outcomes(passed=2, skipped=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*mizzen lane: cpu*",
            "*tests/test_broken_registration.py:2: ?est-time? `est_time` must be positive*",
            "*disabled in registry: flaky upstream, issue 7*",
        ]
    )
    assert "test_gpu" not in result.stdout.str()
    assert "test_fixture_data" not in result.stdout.str()


def test_gpu_lane_collects_only_files_declaring_the_arch(repo: pytest.Pytester):
    (repo.path / "tests" / "test_broken_registration.py").unlink()
    result = repo.runpytest("--mizzen-lane", "hopper", "tests")
    # the only hopper file is collected (its import fails here: proof it was collected)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*tests/test_gpu.py*", "*not_installed_gpu_lib*"])
    result = repo.runpytest("--mizzen-lane", "blackwell", "tests")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED


def test_a_file_named_explicitly_for_the_wrong_lane_is_an_error(repo: pytest.Pytester):
    result = repo.runpytest("tests/test_gpu.py")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*tests/test_gpu.py:2: registered for cuda (hopper), not for lane 'cpu'*nox -s gpu-hopper*"
        ]
    )


def test_lane_from_environment_and_unknown_lane(repo: pytest.Pytester, monkeypatch):
    monkeypatch.setenv("MIZZEN_LANE", "volta")
    result = repo.runpytest("tests")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown lane 'volta'*hopper*"])


def test_plugin_is_inert_outside_a_mizzen_checkout(pytester: pytest.Pytester):
    pytester.makepyfile(test_plain="def test_x():\n    pass\n")
    result = pytester.runpytest()
    result.assert_outcomes(passed=1)


def test_a_file_the_plan_runs_as_the_base_declares_it_runs_though_disabled(repo: pytest.Pytester):
    """The base decides what must run (issue 31): a head that adds ``disabled=`` to a test the
    base runs for this change does not stop it: the lane runs the plan's overrides."""
    (repo.path / "tests" / "test_disabled.py").write_text(
        HEAD + "register_cpu_ci(est_time=1, disabled='the head says so')\n"
        "def test_d():\n    assert False, 'the head broke it'\n"
    )
    skipped = repo.runpytest("-rs", "tests/test_disabled.py")
    skipped.assert_outcomes(skipped=1)
    ran = repo.runpytest("tests/test_disabled.py", "--mizzen-as-planned", "tests/test_disabled.py")
    ran.assert_outcomes(failed=1)
    ran.stdout.fnmatch_lines(["*the head broke it*"])


def test_files_run_heaviest_first_and_xdist_hands_them_out_in_that_order(pytester: pytest.Pytester):
    """Items are ordered by their file's est_time, descending, a file's tests in their own order;
    with ``--dist loadfile --no-loadscope-reorder`` (the CPU lane) a single xdist worker runs the
    files in that order too, not by how many tests each has."""
    pytester.makefile(".toml", **{"ci/fleet": FLEET})
    pytester.makepyprojecttoml("[tool.pytest.ini_options]\n")
    files = {"a_light": (1, 5), "b_heavy": (300, 1), "c_middle": (40, 3), "d_tie": (40, 2)}
    for name, (est, tests) in files.items():
        body = "".join(f"def test_{i}():\n    pass\n" for i in range(tests))
        (pytester.path / "tests").mkdir(exist_ok=True)
        (pytester.path / "tests" / f"test_{name}.py").write_text(
            HEAD + f"register_cpu_ci(est_time={est})\n{body}"
        )
    expected = [
        "test_b_heavy.py::test_0",
        *[f"test_c_middle.py::test_{i}" for i in range(3)],
        *[f"test_d_tie.py::test_{i}" for i in range(2)],
        *[f"test_a_light.py::test_{i}" for i in range(5)],
    ]
    collected = pytester.runpytest("--collect-only", "-q", "tests")
    assert [line.removeprefix("tests/") for line in collected.outlines[: len(expected)]] == expected
    ran = pytester.runpytest(
        "-n", "1", "--dist", "loadfile", "--no-loadscope-reorder", "-v", "tests"
    )
    order = [line.split(" PASSED ")[-1].strip() for line in ran.outlines if " PASSED " in line]
    assert [o.removeprefix("tests/") for o in order] == expected
