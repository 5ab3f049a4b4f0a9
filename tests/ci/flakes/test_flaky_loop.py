"""The flaky loop closed on evidence, from seeded trusted histories through `mizzen-ci flakes
propose`: a (test, arch) is proposed for quarantine after k flips in its last n runs (not
before), or when it passed only on retry; while quarantined it keeps running (its runs feed the
history) and is proposed for re-enabling after m clean runs (not before); each proposal writes
ci/flaky.toml and the pull-request body with the evidence."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.flakes.quarantine import read_tree
from mizzen_ci.flakes.settings import DEFAULTS, settings_from
from mizzen_ci.history import FlakeRecord, Record, append, append_flakes
from mizzen_ci.sources import ConfigError

register_cpu_ci(est_time=6, labels=["ci"])

FLAKY, STEADY, RETRIED = (
    "tests/x/test_flaky.py",
    "tests/x/test_steady.py",
    "tests/x/test_retried.py",
)
PYPROJECT = "[tool.mizzen.flakes]\nflips = 3\nwindow = 10\nclean = 4\n"


class Repo:
    """A checkout with a pyproject, a history cache and nightly runs appended one by one."""

    def __init__(self, root, mizzen_ci):
        self.root, self.cli, self.night = root, mizzen_ci, 0
        (root / "pyproject.toml").write_text(PYPROJECT)
        (root / "ci").mkdir()

    def nightly(self, outcomes: dict[str, str], arch: str = "hopper") -> None:
        self.night += 1
        when = (
            dt.datetime(2026, 11, 1, 2, 17, tzinfo=dt.UTC) + dt.timedelta(days=self.night)
        ).isoformat()
        append(self.root / ".ci-artifacts" / "history" / "gpu-hopper.jsonl",
               [Record(f, arch, 30.0, o, when, f"gpu-{arch}" if arch else "cpu", f"night-{self.night}") for f, o in outcomes.items()])  # fmt: skip

    def propose(self, *extra: str):
        body = self.root / "body.md"
        r = self.cli("flakes", "propose", "--root", str(self.root), "--write", "--body", str(body),
                     "--today", "2026-12-01", "--json", *extra, cwd=self.root)  # fmt: skip
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout), body.read_text()

    def listed(self) -> set[tuple[str, str]]:
        entries, problems = read_tree(self.root)
        assert not problems
        return {e.key for e in entries}


@pytest.fixture
def repo(tmp_path, mizzen_ci) -> Repo:
    return Repo(tmp_path, mizzen_ci)


def test_quarantined_after_k_flips_kept_running_re_enabled_after_m_clean_runs(repo):
    for o in ("passed", "passed", "failed", "passed"):  # two flips: a regression and its fix
        repo.nightly({FLAKY: o, STEADY: "passed"})
    proposal, _ = repo.propose()
    assert not proposal["changed"] and repo.listed() == set()

    repo.nightly({FLAKY: "failed", STEADY: "passed"})  # the third flip: k = 3
    proposal, body = repo.propose()
    assert proposal["quarantine"] == [{"file": FLAKY, "arch": "hopper",
                                       "reason": "flipped 3 times in its last 5 trusted runs (k = 3)"}]  # fmt: skip
    assert repo.listed() == {(FLAKY, "hopper")}
    assert "### Quarantine" in body and "| `PPFPF` | 2\\/5 | 0 | 2026\\-11\\-04 |" in body
    print(body)

    # Quarantined, it keeps running in the nightly lanes: those runs are what lift it.
    for _ in range(3):
        repo.nightly({FLAKY: "passed", STEADY: "passed"})
    proposal, body = repo.propose()
    assert not proposal["changed"] and proposal["still_quarantined"] == [
        {"file": FLAKY, "arch": "hopper"}
    ]
    assert "3 of 4" in body and repo.listed() == {(FLAKY, "hopper")}

    repo.nightly({FLAKY: "passed", STEADY: "passed"})  # the m-th clean run
    proposal, body = repo.propose()
    assert proposal["re_enable"] == [{"file": FLAKY, "arch": "hopper", "clean_streak": 4}]
    assert (
        repo.listed() == set()
        and "### Re-enable" in body
        and "4 clean runs in a row \\(m \\= 4\\)" in body
    )
    print(body)


def test_a_pass_only_on_retry_is_proposed_and_a_retry_is_never_a_clean_run(repo):
    for _ in range(5):
        repo.nightly({RETRIED: "passed"})
    append_flakes(repo.root / ".ci-artifacts" / "flakes.jsonl",
                  [FlakeRecord(RETRIED, "hopper", "nccl-timeout", "NCCL watchdog", "passed",
                               "2026-11-05T02:20:00+00:00", "night-4")])  # fmt: skip
    proposal, _body = repo.propose()
    assert proposal["quarantine"][0]["reason"] == "passed only on retry 1 time(s)"
    repo.nightly({RETRIED: "passed"})
    proposal, _ = repo.propose()
    assert (
        proposal["still_quarantined"] and not proposal["re_enable"]
    )  # 1 clean run since the retry


def test_cpu_records_are_arch_cpu_and_a_broken_list_writes_nothing(repo):
    for o in ("passed", "failed", "passed", "failed"):
        repo.nightly({FLAKY: o}, arch=None)
    _proposal, _ = repo.propose()
    assert repo.listed() == {(FLAKY, "cpu")}
    (repo.root / "ci" / "flaky.toml").write_text('[[flaky]]\nfile = "../etc/passwd"\n')
    r = repo.cli("flakes", "propose", "--root", str(repo.root), "--write", cwd=repo.root)
    assert r.returncode == 2 and "ci/flaky.toml:1:" in r.stderr and "Traceback" not in r.stderr
    assert (repo.root / "ci" / "flaky.toml").read_text() == '[[flaky]]\nfile = "../etc/passwd"\n'


@pytest.mark.parametrize("table, message", [
    ({"flips": 0}, "flips = 0: must be an integer from 1"),
    ({"window": "20"}, "window = '20'"),
    ({"flips": 5, "window": 5}, "must be below window"),
    ({"m": 3}, "unknown key"),
])  # fmt: skip
def test_settings_are_checked(table, message):
    assert settings_from(None, "pyproject.toml") == DEFAULTS
    with pytest.raises(ConfigError, match=message):
        settings_from(table, "pyproject.toml")
