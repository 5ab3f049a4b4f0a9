"""`mizzen-ci gate` end to end, as CI runs it (python -S, a real git repository, real stores):
a seeded noisy trusted history, a 30 % worse loss fails with a readable verdict table (text and
Markdown), a quarantine entry on the base revision turns it into a warning (one the change adds
itself does not), the jobs of a plan are judged, and bad input is one line with exit 2."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.output import markdown
from mizzen_ci.plan import Job, Plan, PlannedTest, SelectionSummary

register_cpu_ci(est_time=20, labels=["ci"])

TEST = "tests/x/test_a.py"
DECLARED = """from mizzen_ci import register_ci_gate, register_cpu_ci

register_cpu_ci(est_time=1)
register_ci_gate(metric="eval/heldout_loss", direction="lower", tolerance=0.1, floor=0.02)
register_ci_gate(metric="eval/score", direction="higher", tolerance=0.1, steps=[20, 60])
"""
QUARANTINE = (
    '[[quarantine]]\nfile = "tests/x/test_a.py"\narch = "cpu"\n'
    'reason = "loss up 30 % since #123 | fix in #130 <b>"\nexpires = 2026-12-31\n'
)


def git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"})  # fmt: skip


@pytest.fixture
def tree(tmp_path, repo_root):
    root = tmp_path / "tree"
    (root / "ci").mkdir(parents=True)
    shutil.copy(repo_root / "ci" / "fleet.toml", root / "ci" / "fleet.toml")
    shutil.copy(repo_root / "ci" / "metrics.toml", root / "ci" / "metrics.toml")
    (root / "tests" / "x").mkdir(parents=True)
    (root / TEST).write_text(DECLARED)
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "base")
    return root


@pytest.fixture
def history(tree, mizzen_ci, points, write_points):
    """20 trusted runs: held-out loss 0.325 with seeded noise (σ 0.004) and one broken run at
    0.9; the score at 20 and 60 around 0.6 and 0.95."""
    rng = random.Random(0)
    pts = []
    for i in range(20):
        loss = 0.9 if i == 7 else rng.gauss(0.325, 0.004)
        pts += points(test=TEST, run=f"gh-{i}-1-cpu-1", when=f"2026-11-{i + 1:02d}T02:17:00+00:00",
                      eval__heldout_loss_at_60=loss, eval__score_at_20=rng.gauss(0.6, 0.01),
                      eval__score_at_60=rng.gauss(0.95, 0.01))  # fmt: skip
    artefact = write_points(tree / "history-artefacts" / "cpu.jsonl", pts)
    store = tree / ".ci-artifacts" / "history" / "metrics.sqlite"
    out = mizzen_ci("gate", "ingest", "--root", str(tree), "--store", str(store), "--trusted",
                    "--event", "schedule", "--commit", "a" * 40, str(artefact))  # fmt: skip
    assert out.returncode == 0 and "20 run(s) stored" in out.stdout, out.stderr
    return store


def this_run(tree, points, write_points, loss: float, score60: float = 0.95):
    return write_points(
        tree / ".ci-artifacts" / "metrics" / "cpu.jsonl",
        points(test=TEST, run="gh-99-1-cpu-1", when="2026-12-01T12:00:00+00:00",
               eval__heldout_loss_at_60=loss, eval__score_at_20=0.6, eval__score_at_60=score60),
    )  # fmt: skip


def check(mizzen_ci, tree, *extra, **options):
    return mizzen_ci(
        "gate", "check", "--root", str(tree), "--today", "2026-12-01", *extra, **options
    )


def test_a_30_percent_worse_loss_fails_with_a_readable_table(
    tree, history, mizzen_ci, points, write_points
):
    this_run(tree, points, write_points, loss=0.325 * 1.3)
    summary = tree / "summary.md"
    out = check(mizzen_ci, tree, "--summary", str(summary), github=True)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "metric gate FAILED: 1 FAIL, 2 pass"
    header = next(line for line in lines if line.startswith("test "))
    for column in ("metric", "step", "reference", "band", "value", "history → value", "verdict"):
        assert column in header
    row = next(line for line in lines if "eval/heldout_loss" in line and TEST in line)
    assert "FAIL" in row and "regressed" in row and re.search(r"\(\+(29|30)\.\d%\)", row)
    assert "█" in row  # the sparkline: the broken run tops the history's scale
    assert (
        "::error file=tests/x/test_a.py,title=mizzen metric gate::eval/heldout_loss@60 on cpu"
        in out.stdout
    )
    md = summary.read_text()
    assert (
        md.startswith("### Metric gate\n")
        and f"| `{TEST}` | cpu | {markdown('eval/heldout_loss')} | 60 |" in md
    )
    assert "| FAIL |" in md


def test_the_median_is_not_dragged_by_the_broken_run(
    tree, history, mizzen_ci, points, write_points
):
    this_run(tree, points, write_points, loss=0.33)
    out = check(mizzen_ci, tree)
    assert out.returncode == 0, out.stdout
    row = next(line for line in out.stdout.splitlines() if "eval/heldout_loss" in line)
    assert " 0.32" in row and "pass" in row  # the reference stays at the median, not the mean 0.35


def test_a_quarantine_from_the_base_turns_the_failure_into_a_warning(
    tree, history, mizzen_ci, points, write_points
):
    this_run(tree, points, write_points, loss=0.325 * 1.3)
    (tree / "ci" / "quarantine.toml").write_text(QUARANTINE)  # the change adds it: not trusted
    out = check(mizzen_ci, tree, "--base-rev", "HEAD")
    assert out.returncode == 1, out.stdout
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "quarantine on the base")
    summary = tree / "summary.md"
    out = check(mizzen_ci, tree, "--base-rev", "HEAD", "--summary", str(summary))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "metric gate passed: 1 warning, 2 pass" in out.stdout
    assert (
        "quarantined until 2026-12-31: tests/x/test_a.py on cpu: loss up 30 % since #123"
        in out.stdout
    )
    md = summary.read_text()
    assert "| WARNING |" in md and "fix in \\#130 \\<b\\>" in md and "<b>" not in md
    # expired: a failure again, and every summary says to remove the entry
    out = check(mizzen_ci, tree, "--base-rev", "HEAD", "--today", "2027-01-01")
    assert out.returncode == 1 and "expired quarantine (since 2026-12-31" in out.stdout


def test_a_cold_start_says_so_and_does_not_fail(tree, mizzen_ci, points, write_points):
    this_run(tree, points, write_points, loss=5.0)
    out = check(mizzen_ci, tree)
    assert out.returncode == 0
    assert "metric gate passed: 3 inactive" in out.stdout
    assert "no metric store at" in out.stdout and "every gate is inactive" in out.stdout


def test_a_planned_test_that_recorded_nothing_fails(tree, history, mizzen_ci):
    planned = PlannedTest(TEST, 0, 1.0, "est_time", 0.0, "changed")
    job = Job(id="cpu-1", lane="cpu", arch=None, pool="cpu-hosted", runs_on=("ubuntu-24.04",),
              runner_group=None, gpus=1, timeout_minutes=20, over_budget=False, est_seconds=1.0,
              tests=(planned,))  # fmt: skip
    plan = Plan(event="pull_request", cadence=None, base=None, head="a" * 40, worktree=False,
                trusted=True, approval=None, fleet="ci/fleet.toml", budget_seconds=3600.0,
                selection=SelectionSummary(False, (), 1), jobs=[job])  # fmt: skip
    (tree / "plan.json").write_text(plan.dumps())
    out = check(mizzen_ci, tree, "--plan", str(tree / "plan.json"), "--lanes", "cpu")
    assert out.returncode == 1 and "did it run?" in out.stdout
    out = check(mizzen_ci, tree, "--plan", str(tree / "plan.json"), "--lanes", "gpu")
    assert out.returncode == 0 and "no gated test ran" in out.stdout


def test_the_postgres_store_behind_the_same_commands(
    tree, mizzen_ci, points, write_points, postgres_schema
):
    store_url = postgres_schema
    env = {"MIZZEN_METRICS_STORE": store_url}
    pts = []
    for i in range(6):
        pts += points(test=TEST, run=f"r{i}", when=f"2026-11-0{i + 1}T00:00:00+00:00",
                      eval__heldout_loss_at_60=0.3, eval__score_at_20=0.6, eval__score_at_60=0.9)  # fmt: skip
    artefact = write_points(tree / "h" / "cpu.jsonl", pts)
    out = mizzen_ci("gate", "ingest", "--root", str(tree), "--trusted", "--event", "push",
                    "--commit", "b" * 40, str(artefact), env=env, site=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    password = store_url.split("@")[0].rsplit(":", 1)[1]
    assert password not in out.stdout + out.stderr and "***@127.0.0.1" in out.stdout
    this_run(tree, points, write_points, loss=0.39, score60=0.9)
    out = check(mizzen_ci, tree, env=env, site=True)
    assert out.returncode == 1 and "metric gate FAILED: 1 FAIL, 2 pass" in out.stdout, out.stderr
    assert password not in out.stdout + out.stderr


def test_bad_input_is_one_line_and_exit_2(tree, mizzen_ci, points, write_points):
    this_run(tree, points, write_points, loss=1.0)
    junk = tree / "junk.sqlite"
    junk.write_bytes(b"garbage" * 1000)
    out = check(mizzen_ci, tree, "--store", str(junk))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and "metric store cannot be used" in out.stderr
    (tree / "ci" / "quarantine.toml").write_text("[[quarantine]]\nfile = 3\n")
    out = check(mizzen_ci, tree)
    assert out.returncode == 2 and "quarantine list cannot be used" in out.stderr
    out = check(mizzen_ci, tree, "--base-rev=--output=/tmp/x")
    assert out.returncode == 2 and "not a revision" in out.stderr
    out = mizzen_ci("gate", "ingest", "--root", str(tree), "--store", str(tree / "s.sqlite"),
                    "--trusted", "--event", "push", "--commit", "; rm -rf /", str(tree))  # fmt: skip
    assert out.returncode == 2 and "is not a commit sha" in out.stderr


def test_show_lists_a_series_with_its_median(tree, history, mizzen_ci):
    out = mizzen_ci("gate", "show", "--root", str(tree), "--store", str(history),
                    "--test", TEST, "--metric", "eval/heldout_loss", "--window", "5")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("gh-") == 5 and "eval/heldout_loss@60 on cpu: 5 trusted" in out.stdout
    assert json.loads('"ok"') == "ok"


def test_untrust_takes_a_commits_runs_out_of_the_reference(tree, mizzen_ci, points, write_points):
    store = tree / "s.sqlite"
    for i, (commit, loss) in enumerate([("a" * 40, 0.3)] * 5 + [("b" * 40, 0.6)] * 5):
        artefact = write_points(tree / f"h{i}" / "cpu.jsonl", points(
            test=TEST, run=f"r{i}", when=f"2026-11-{i + 1:02d}T00:00:00+00:00",
            eval__heldout_loss_at_60=loss, eval__score_at_20=0.6, eval__score_at_60=0.9))  # fmt: skip
        mizzen_ci("gate", "ingest", "--root", str(tree), "--store", str(store), "--trusted",
                  "--event", "push", "--commit", commit, str(artefact))  # fmt: skip
    this_run(tree, points, write_points, loss=0.3, score60=0.9)

    def loss_row() -> str:
        out = check(mizzen_ci, tree, "--store", str(store))
        return next(line for line in out.stdout.splitlines() if "heldout" in line)

    # two commits' runs: median 0.45, MAD 0.15: the noise makes the band wide (±0.6672)
    assert " pass " in loss_row() and "±0.6672" in loss_row()
    untrust = ("gate", "untrust", "--root", str(tree), "--store", str(store), "--commit")
    out = mizzen_ci(*untrust, "a" * 40)
    assert out.returncode == 0 and "5 run(s) marked untrusted" in out.stdout
    assert "improved" in loss_row() and "0.3 vs 0.6 ±" in loss_row()  # commit b's runs only
    assert "5 run(s) marked untrusted" in mizzen_ci(*untrust, "b" * 40).stdout
    assert "cold start: 0 of 5" in loss_row()  # no trusted history left


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://mizzen:s3cretpw@127.0.0.1:1/db",  # SQLAlchemy's spelling
        "POSTGRESQL://mizzen:s3cretpw@127.0.0.1:1/db",  # libpq reads the scheme in any case
        "mysql://mizzen:s3cretpw@127.0.0.1:1/db",
    ],
)
def test_a_store_url_never_shows_its_password_whatever_its_scheme(
    tree, mizzen_ci, points, write_points, url
):
    artefact = this_run(tree, points, write_points, loss=0.3)
    runs = [
        check(mizzen_ci, tree, "--store", url, "--summary", str(tree / "summary.md"), cwd=tree),
        mizzen_ci("gate", "show", "--root", str(tree), "--store", url, "--test", TEST,
                  "--metric", "eval/heldout_loss", cwd=tree),
        mizzen_ci("gate", "ingest", "--root", str(tree), "--store", url, "--trusted",
                  "--event", "push", "--commit", "a" * 40, str(artefact), cwd=tree),
    ]  # fmt: skip
    for out in runs:
        assert out.returncode == 2, (out.stdout, out.stderr)
        assert "Traceback" not in out.stderr
        assert "s3cretpw" not in out.stdout + out.stderr
    summary = tree / "summary.md"
    assert not summary.exists() or "s3cretpw" not in summary.read_text()
    assert not [p for p in tree.rglob("*") if "s3cretpw" in str(p)]  # no folder named after it


LOOSENED = DECLARED.replace(
    'register_ci_gate(metric="eval/heldout_loss", direction="lower", tolerance=0.1, floor=0.02)',
    'register_ci_gate(metric="eval/heldout_loss", direction="lower", tolerance=10, enforce=False,'
    ' reason="noisy")',
)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(LOOSENED, id="loosened-and-unenforced"),
        pytest.param(
            DECLARED.splitlines(True)[0] + DECLARED.splitlines(True)[2], id="gates-deleted"
        ),
    ],
)
def test_a_change_cannot_loosen_or_drop_its_own_gate(
    tree, history, mizzen_ci, points, write_points, change
):
    this_run(tree, points, write_points, loss=0.325 * 1.3)
    (tree / TEST).write_text(change)  # the pull request's version of the test file
    alone = check(mizzen_ci, tree, "--test", TEST)
    assert alone.returncode == 0, alone.stdout + alone.stderr  # its own gates would let it pass
    out = check(mizzen_ci, tree, "--test", TEST, "--base-rev", "HEAD")
    assert out.returncode == 1, out.stdout + out.stderr
    row = next(line for line in out.stdout.splitlines() if "eval/heldout_loss" in line)
    assert "FAIL" in row
    assert "the base's applies" in out.stdout


def test_a_gate_the_change_adds_applies_at_once(tree, history, mizzen_ci, points, write_points):
    this_run(tree, points, write_points, loss=0.325)
    added = DECLARED + (
        'register_ci_gate(metric="perf/tokens_per_s", direction="higher", tolerance=0.5,'
        ' enforce=False, reason="shared hosts")\n'
    )
    (tree / TEST).write_text(added)
    out = check(mizzen_ci, tree, "--test", TEST, "--base-rev", "HEAD")
    assert "perf/tokens_per_s" in out.stdout, out.stdout + out.stderr
    assert "the base's applies" not in out.stdout
    assert out.returncode == 0, out.stdout + out.stderr  # not enforced: a warning, not a failure


def craft_newest_rows(store, created: str, n: int = 20, kind: str = "nan") -> None:
    """``n`` trusted runs of the held-out loss that sort newest, each row bad: ``created`` not a
    time in the store's format, and (``kind`` nan) a nan with a number beside it (what the probe
    crafted)."""
    import sqlite3

    conn = sqlite3.connect(store)
    try:
        for i in range(n):
            rid = conn.execute(
                "INSERT INTO runs (test, arch, pool, commit_sha, pr, event, trusted, attempt,"
                " created, source) VALUES (?, 'cpu', 'p', ?, NULL, 'push', 1, 1, ?, ?)",
                (TEST, "e" * 40, created, f"crafted-{i}"),
            ).lastrowid
            conn.execute(
                "INSERT INTO metric_values (run, metric, step, value, kind)"
                " VALUES (?, 'eval/heldout_loss', 60, 0.325, ?)",
                (rid, kind),
            )
        conn.commit()
    finally:
        conn.close()


@pytest.mark.parametrize("created", ["9999", "2026-11-30T23:00:00.000000+00:00<b>"])
def test_crafted_rows_that_sort_newest_never_turn_a_failure_into_a_pass(
    tree, history, mizzen_ci, points, write_points, created
):
    # they filled the window and were dropped: "metric gate passed: 1 inactive", rc 0
    craft_newest_rows(history, created)
    this_run(tree, points, write_points, loss=0.325 * 1.3)
    out = check(mizzen_ci, tree)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.splitlines()[0] == "metric gate FAILED: 1 FAIL, 2 pass"
    assert "inactive" not in out.stdout.splitlines()[0]
    said = out.stdout + out.stderr
    assert "run(s) 21, 22, 23" in said or "run 40: a nan value with a number beside it" in said


def test_show_never_shows_a_crafted_created_and_names_its_row(tree, history, mizzen_ci):
    craft_newest_rows(history, "2026-11-30T23:00:00<script>alert(1)</script>", n=1, kind="finite")
    out = mizzen_ci("gate", "show", "--root", str(tree), "--store", str(history),
                    "--test", TEST, "--metric", "eval/heldout_loss", "--window", "5")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "<script>" not in out.stdout and out.stdout.count("gh-") == 5
    assert (
        "run 21: `created`" in out.stderr and "eval/heldout_loss@60 on cpu: 5 trusted" in out.stdout
    )
