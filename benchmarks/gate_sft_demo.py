"""The metric gate's done-when demonstration (issue 18), reproducible: a pull request that makes the
SFT CPU e2e's final held-out loss 30 % worse fails the gate with a readable verdict table against
a history of trusted runs of the e2e, and passes with the warning shown once main quarantines it.

    .venv/bin/python benchmarks/gate_sft_demo.py [--runs 5] [--keep] [--workdir DIR]

(or ``uv run python benchmarks/gate_sft_demo.py``).  Runs from a fresh checkout: everything it runs
is the checkout's committed ``HEAD`` (``git archive``), with each copy's ``*/src`` folders first on
``PYTHONPATH``, so the copy's code runs, not whatever the venv's editable installs point at.  About
``(runs + 1) × 60 s`` on a 2-core CPU box.

1. *Trusted history*: ``HEAD`` is unpacked into a throwaway git repository (its ``main``); the real
   e2e ``tests/train/sft/test_sft_e2e.py`` runs there ``--runs`` times (pytest ``--mizzen-lane cpu``,
   ``$MIZZEN_METRICS_DIR`` a fresh folder and ``$MIZZEN_RUN_KEY`` a distinct key per run), each
   run ingested into a temporary SQLite store as a trusted push to main (``mizzen-ci gate ingest
   --trusted --event push --commit <HEAD sha>``).
2. *The pull request*: a branch of that repository with one source line of the training stack
   changed (:data:`REGRESSION`: LoRA adapts the attention projections only by default, as peft
   does for Llama, instead of every linear layer).  The e2e runs there once (its own assertions
   are reported: they may pass, which is the point of the gate), and ``mizzen-ci gate check
   --base-rev <base>`` judges it against the store: it must exit 1 with the held-out loss
   row ``FAIL``.
3. *Quarantine*: main lands a ``ci/quarantine.toml`` entry for (the e2e, cpu); the check with
   ``--base-rev main`` must exit 0 with the row a ``warning`` and the entry listed.  The
   same entry written by the pull request itself (``--base-rev <base>``) must still fail.
4. *Statistics*: a seeded noisy synthetic history (``random.Random(0)``, 12 trusted runs around
   the measured per-step medians, 5 % relative noise, one outlier run) in a second store; the
   PR's values must fail against it and a trusted run's values pass, with the reference and band
   the table prints equal to median/MAD computed here independently.

Every expectation is checked on what the commands printed and returned; the summary lists each
with the figures, and the exit status is 0 only if all held.  Nothing is written outside the
work folder (a temporary one, removed at the end unless ``--keep``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mizzen_ci.gate.artefacts import Point  # stdlib-only
from mizzen_ci.gate.judge import DEFAULT_K, MAD_SCALE

REPO = Path(__file__).resolve().parents[1]
SRC_DIRS = ("ci/src", "packages/train/src", "packages/rollout/src", "packages/plugins/src")

TEST = "tests/train/sft/test_sft_e2e.py"
ARCH = "cpu"
LOSS, SCORE = "eval/heldout_loss", "eval/score"
STEPS = (20, 40, 60)
#: The gate the e2e declares on the held-out loss (checked against the file below).
LOSS_TOLERANCE, LOSS_FLOOR = 0.1, 0.02
#: The pull request's one-line change: (file, the line as main has it, the line as the PR has it).
REGRESSION = (
    "packages/train/src/mizzen_train/specs.py",
    'DEFAULT_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")',
    'DEFAULT_TARGET_MODULES = ("linear_qkv", "linear_proj")',
)
GIT_ID = ("-c", "user.name=gate demo", "-c", "user.email=gate-demo@localhost")
SYNTHETIC_RUNS, SYNTHETIC_NOISE, OUTLIER_RUN, OUTLIER_FACTOR = 12, 0.05, 7, 1.8


class DemoError(RuntimeError):
    """A step of the demo could not run; the message says which and why."""


def sh(argv, *, cwd: Path, env=None, check=True) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise DemoError(
            f"`{' '.join(map(str, argv))}` in {cwd} exited {p.returncode}:\n{p.stdout}{p.stderr}"
        )
    return p


def tree_env(tree: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(tree / d) for d in SRC_DIRS)
    for name in ("MIZZEN_METRICS_STORE", "MIZZEN_METRICS_DIR", "MIZZEN_RUN_KEY", "MIZZEN_JOB"):
        env.pop(name, None)
    env.update(extra)
    return env


def mizzen_ci(tree: Path, *args: str, check=True) -> subprocess.CompletedProcess:
    return sh([sys.executable, "-m", "mizzen_ci", *args], cwd=tree, env=tree_env(tree), check=check)


def run_e2e(tree: Path, metrics: Path, key: str, work: Path) -> dict:
    """One run of the e2e in ``tree``: pytest's exit code, wall time, output tail and the
    values it recorded ``{(metric, step): value}``."""
    basetemp = work / "pytest" / key
    basetemp.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable, "-m", "pytest", TEST, "--mizzen-lane", "cpu", "-q", "-s",
        "-p", "no:cacheprovider", "-W", "ignore", f"--basetemp={basetemp}",
    ]  # fmt: skip
    env = tree_env(tree, MIZZEN_METRICS_DIR=str(metrics), MIZZEN_RUN_KEY=key)
    started = time.monotonic()
    p = sh(argv, cwd=tree, env=env, check=False)
    wall = time.monotonic() - started
    shutil.rmtree(basetemp, ignore_errors=True)  # snapshots and checkpoints: not needed
    values = {}
    for path in sorted(metrics.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            obj = json.loads(line)
            if obj["run"] == key and obj["test"] == TEST:
                values[(obj["metric"], obj["step"])] = float(obj["value"])
    out = p.stdout + p.stderr
    summary = [ln for ln in out.splitlines() if ln.startswith("final eval") or " in " in ln]
    return {"rc": p.returncode, "wall": wall, "values": values, "tail": out[-3000:],
            "said": "; ".join(s.strip() for s in summary[-2:])}  # fmt: skip


def row_of(table: str, metric: str) -> str | None:
    """The verdict table's line of ``metric`` (at the last step), or None."""
    rows = [ln for ln in table.splitlines() if ln.startswith(TEST) and f"  {metric}  " in ln]
    return rows[-1] if rows else None


def robust(values: list[float], tolerance: float, floor: float) -> tuple[float, float, float]:
    """Median, MAD and band computed here, independently of the gate's code."""
    ref = statistics.median(values)
    mad = statistics.median([abs(v - ref) for v in values])
    return ref, mad, max(tolerance * abs(ref), DEFAULT_K * MAD_SCALE * mad, floor)


def g4(x: float) -> str:
    return f"{x:.4g}"


class Expectations:
    def __init__(self) -> None:
        self.items: list[tuple[bool, str]] = []

    def check(self, ok: bool, what: str) -> bool:
        self.items.append((bool(ok), what))
        print(f"[{'ok' if ok else 'FAILED'}] {what}", flush=True)
        return bool(ok)


def banner(text: str) -> None:
    print(f"\n{'=' * 100}\n{text}\n{'=' * 100}", flush=True)


def make_repo(work: Path) -> tuple[Path, str, str]:
    """HEAD unpacked into a throwaway repository; ``(repo, real HEAD sha, base sha there)``."""
    head = sh(["git", "rev-parse", "HEAD"], cwd=REPO).stdout.strip()
    dirty = sh(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO).stdout
    if dirty.strip():
        print(f"note: the checkout has uncommitted changes; the demo runs HEAD {head[:12]} only")
    repo = work / "main"
    repo.mkdir()
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(repo)], input=archive.stdout, check=True)
    sh(["git", "init", "-q", "-b", "main"], cwd=repo)
    sh(["git", "add", "-A"], cwd=repo)
    sh(["git", *GIT_ID, "commit", "-q", "-m", f"base: {head[:12]}"], cwd=repo)
    base = sh(["git", "rev-parse", "HEAD"], cwd=repo).stdout.strip()
    return repo, head, base


def check_declaration(repo: Path) -> None:
    text = (repo / TEST).read_text(encoding="utf-8")
    want = f'metric="{LOSS}", direction="lower", tolerance={LOSS_TOLERANCE}, floor={LOSS_FLOOR}'
    if want not in text:
        raise DemoError(f"{TEST} no longer declares `{want}`: update this demo's constants")


def make_pr(repo: Path, work: Path, base: str) -> Path:
    path, old, new = REGRESSION
    pr = work / "pr"
    sh(["git", "worktree", "add", "-q", "-b", "pr", str(pr), base], cwd=repo)
    source = (pr / path).read_text(encoding="utf-8")
    if source.count(old) != 1:
        raise DemoError(f"{path} no longer has the line `{old}` once: pick another regression")
    (pr / path).write_text(source.replace(old, new), encoding="utf-8")
    sh(["git", *GIT_ID, "commit", "-q", "-am", "LoRA: adapt attention only by default"], cwd=pr)
    diff = sh(["git", "diff", "-U0", f"{base}..pr"], cwd=pr).stdout
    changed = [ln for ln in diff.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    if len(changed) != 2:
        raise DemoError(f"the PR should change one line, the diff is:\n{diff}")
    print(f"the PR ({path}):\n  - {old}\n  + {new}")
    return pr


def quarantine_entry(reason: str, today: dt.date) -> str:
    expires = today + dt.timedelta(days=30)
    return (
        f'\n[[quarantine]]\nfile = "{TEST}"\narch = "{ARCH}"\nreason = "{reason}"\n'
        f"expires = {expires.isoformat()}\n"
    )


def gate_check(tree: Path, store: Path, metrics: Path, rev: str, summary: Path):
    p = mizzen_ci(
        tree, "gate", "check", "--root", str(tree), "--store", str(store), "--test", TEST,
        "--arch", ARCH, "--metrics", str(metrics), "--base-rev", rev,
        "--summary", str(summary), check=False,
    )  # fmt: skip
    print(f"$ mizzen-ci gate check --test {TEST} --base-rev {rev[:12]}  → exit {p.returncode}")
    print(p.stdout.rstrip())
    errors = [ln for ln in p.stderr.splitlines() if ln.strip()]
    if errors:
        print("stderr (workflow annotations):\n  " + "\n  ".join(errors[:8]))
    return p.returncode, p.stdout


def synthetic_history(repo: Path, store: Path, work: Path, centers: dict) -> dict:
    """Seeded noisy trusted runs around ``centers`` ``{(metric, step): value}`` ingested into
    ``store``; returns the final-step loss values (oldest first)."""
    rng = random.Random(0)
    start = dt.datetime.now(dt.UTC) - dt.timedelta(days=SYNTHETIC_RUNS + 1)
    finals = []
    for i in range(SYNTHETIC_RUNS):
        folder = work / "synthetic" / f"run-{i:02d}"
        folder.mkdir(parents=True)
        when = (start + dt.timedelta(days=i)).isoformat(timespec="microseconds")
        key = f"synthetic-nightly-{i:02d}"
        lines = []
        for (metric, step), center in sorted(centers.items()):
            value = center * (1 + rng.gauss(0.0, SYNTHETIC_NOISE))
            if metric == LOSS and i == OUTLIER_RUN:
                value = center * OUTLIER_FACTOR  # one bad night: the median does not move
            if metric == SCORE:
                value = min(1.0, value)
            if metric == LOSS and step == STEPS[-1]:
                finals.append(value)
            point = Point(TEST, ARCH, metric, step, value, key, None, when)
            lines.append(json.dumps(point.to_json_object()))
        (folder / "cpu.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        commit = f"{rng.getrandbits(160):040x}"
        mizzen_ci(
            repo, "gate", "ingest", "--root", str(repo), "--store", str(store), "--trusted",
            "--event", "schedule", "--commit", commit, str(folder),
        )  # fmt: skip
    return {"finals": finals}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="trusted e2e runs (default 5, ≥ 5)")
    parser.add_argument("--workdir", type=Path, help="work folder (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args(argv)
    if args.runs < 5:
        parser.error("--runs must be at least 5 (the gate is inactive below 5 trusted values)")
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="gate-sft-demo-", dir=args.workdir))
    expect = Expectations()
    print(f"work folder: {work}\nmachine: {platform.platform()}, {os.cpu_count()} CPUs")
    try:
        figures = demo(work, args.runs, expect)
    except DemoError as e:
        expect.check(False, f"the demo ran to its end: {e}")
        figures = {}
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    wall = time.monotonic() - started
    banner("summary")
    for key, value in figures.items():
        print(f"{key}: {value}")
    print(f"wall time: {wall:.0f} s ({'kept' if args.keep else 'removed'}: {work})")
    failed = [what for ok, what in expect.items if not ok]
    print(f"{len(expect.items) - len(failed)} of {len(expect.items)} expectations held")
    for what in failed:
        print(f"FAILED: {what}")
    return 1 if failed or not expect.items else 0


def demo(work: Path, runs: int, expect: Expectations) -> dict:
    today = dt.datetime.now(dt.UTC).date()
    repo, head, base = make_repo(work)
    check_declaration(repo)
    store = work / "history.sqlite"
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")

    banner(f"1. trusted history: {runs} runs of {TEST} at HEAD {head[:12]}")
    trusted = []
    for i in range(runs):
        key = f"gate-demo-{stamp}-main-{i}"
        metrics = work / "metrics" / f"main-{i}"
        run = run_e2e(repo, metrics, key, work)
        trusted.append(run)
        got = sorted(run["values"])
        print(f"run {i + 1}/{runs}: pytest exit {run['rc']}, {run['wall']:.0f} s, {run['said']}")
        if not expect.check(
            run["rc"] == 0 and got == sorted((m, s) for m in (SCORE, LOSS) for s in STEPS),
            f"trusted run {i + 1} passed and recorded {SCORE} and {LOSS} at {STEPS}",
        ):
            print(run["tail"])
            raise DemoError("a trusted run of the e2e failed on HEAD: no history to judge against")
        p = mizzen_ci(
            repo, "gate", "ingest", "--root", str(repo), "--store", str(store), "--trusted",
            "--event", "push", "--commit", head, str(metrics),
        )  # fmt: skip
        print("  " + p.stdout.strip())
        expect.check("1 run(s) stored (trusted)" in p.stdout, f"trusted run {i + 1} ingested once")
    final = [r["values"][(LOSS, STEPS[-1])] for r in trusted]
    ref, mad, band = robust(final, LOSS_TOLERANCE, LOSS_FLOOR)
    spread = max(final) - min(final)
    print(f"\nthe {runs} trusted final held-out losses: {', '.join(f'{v:.6f}' for v in final)}")
    print(f"median {ref:.6f}, MAD {mad:.3g}, spread (max - min) {spread:.3g}, band ±{band:.4g}")
    show = mizzen_ci(
        repo, "gate", "show", "--root", str(repo), "--store", str(store), "--test", TEST,
        "--metric", LOSS,
    )  # fmt: skip
    print("$ mizzen-ci gate show --metric eval/heldout_loss\n" + show.stdout.rstrip())

    banner("2. the pull request: one line of the training stack")
    pr = make_pr(repo, work, base)
    pr_metrics = work / "metrics" / "pr"
    pr_run = run_e2e(pr, pr_metrics, f"gate-demo-{stamp}-pr", work)
    pr_loss = pr_run["values"].get((LOSS, STEPS[-1]))
    pr_score = pr_run["values"].get((SCORE, STEPS[-1]))
    own = "passed" if pr_run["rc"] == 0 else f"FAILED (pytest exit {pr_run['rc']})"
    print(f"the PR's e2e: its own assertions {own}, {pr_run['wall']:.0f} s, {pr_run['said']}")
    if pr_run["rc"] != 0:
        print(pr_run["tail"])
    if not expect.check(pr_loss is not None, f"the PR's e2e recorded {LOSS}@{STEPS[-1]}"):
        raise DemoError("the PR's run recorded no final held-out loss: nothing for the gate")
    worse = pr_loss / ref - 1
    expect.check(
        worse >= 0.30,
        f"the PR's final held-out loss {pr_loss:.4f} is ≥ 30 % worse than the reference "
        f"{ref:.4f} ({worse:+.1%})",
    )
    rc, table = gate_check(pr, store, pr_metrics, base, work / "summary-fail.md")
    row = row_of(table, LOSS) or ""
    expect.check(rc == 1, f"gate check of the PR against the base's quarantine list exits 1 ({rc})")
    expect.check(
        " FAIL " in row and g4(ref) in row and f"±{g4(band)}" in row and g4(pr_loss) in row,
        f"its {LOSS} row is FAIL with reference {g4(ref)}, band ±{g4(band)}, value {g4(pr_loss)}",
    )
    expect.check("metric gate FAILED" in table, "the table's headline says the gate FAILED")

    banner("3. main quarantines the regression; the same PR is checked again")
    reason = f"held-out loss up {worse:.0%} by the attention-only LoRA default; fix in a follow-up"
    entry = quarantine_entry(reason, today)
    # The PR quarantining itself: its own tree has the entry, the base's list is read: no effect.
    qfile = Path("ci") / "quarantine.toml"
    original = (pr / qfile).read_text(encoding="utf-8")
    (pr / qfile).write_text(original + entry, encoding="utf-8")
    rc_self, table_self = gate_check(pr, store, pr_metrics, base, work / "summary-self.md")
    expect.check(
        rc_self == 1 and " FAIL " in (row_of(table_self, LOSS) or ""),
        f"an entry the PR adds itself does not quarantine it (exit {rc_self}, FAIL)",
    )
    (pr / qfile).write_text(original, encoding="utf-8")  # back to the PR's commit
    with (repo / qfile).open("a", encoding="utf-8") as f:
        f.write(entry)
    sh(["git", *GIT_ID, "commit", "-q", "-am", "quarantine the SFT e2e's held-out loss"], cwd=repo)
    main_tip = sh(["git", "rev-parse", "main"], cwd=repo).stdout.strip()
    print(f"main {main_tip[:12]} adds to ci/quarantine.toml:{entry.rstrip()}")
    rc_q, table_q = gate_check(pr, store, pr_metrics, main_tip, work / "summary-quarantine.md")
    row_q = row_of(table_q, LOSS) or ""
    expect.check(rc_q == 0, f"with main's quarantine entry the check exits 0 ({rc_q})")
    expect.check(
        " warning " in row_q and "quarantined" in row_q,
        f"its {LOSS} row is a warning naming the quarantine",
    )
    expect.check(
        f"quarantined until {today + dt.timedelta(days=30)}: {TEST} on {ARCH}: {reason}" in table_q,
        "the summary lists the entry with its reason and expiry",
    )

    banner(f"4. statistics: a seeded noisy history ({SYNTHETIC_RUNS} runs, random.Random(0))")
    centers = {
        (m, s): statistics.median(r["values"][(m, s)] for r in trusted)
        for m in (SCORE, LOSS)
        for s in STEPS
    }
    synthetic_store = work / "synthetic.sqlite"
    synthetic = synthetic_history(repo, synthetic_store, work, centers)
    s_ref, s_mad, s_band = robust(synthetic["finals"], LOSS_TOLERANCE, LOSS_FLOOR)
    mad_band = DEFAULT_K * MAD_SCALE * s_mad
    print(
        f"synthetic final losses: {', '.join(f'{v:.4f}' for v in synthetic['finals'])}\n"
        f"median {s_ref:.4f}, MAD {s_mad:.4f}: band max({LOSS_TOLERANCE} × {s_ref:.4f}, "
        f"{DEFAULT_K:g} × {MAD_SCALE} × {s_mad:.4f} = {mad_band:.4f}, {LOSS_FLOOR}) = ±{s_band:.4f}"
        f" (mean {statistics.fmean(synthetic['finals']):.4f}, dragged by the outlier)"
    )
    rc_s, table_s = gate_check(pr, synthetic_store, pr_metrics, base, work / "summary-syn.md")
    row_s = row_of(table_s, LOSS) or ""
    expect.check(
        rc_s == 1 and " FAIL " in row_s and g4(s_ref) in row_s and f"±{g4(s_band)}" in row_s,
        f"the PR fails against the noisy history: reference {g4(s_ref)} (median), band "
        f"±{g4(s_band)} (exit {rc_s})",
    )
    good_metrics = work / "metrics" / "main-0"
    rc_g, table_g = gate_check(repo, synthetic_store, good_metrics, main_tip, work / "summary-g.md")
    expect.check(
        rc_g == 0 and " pass " in (row_of(table_g, LOSS) or ""),
        f"a trusted run of main ({final[0]:.4f}) passes against the noisy history (exit {rc_g})",
    )

    return {
        "trusted final held-out losses": ", ".join(f"{v:.6f}" for v in final),
        "trusted reference (median) / MAD / spread / band": (
            f"{ref:.6f} / {mad:.3g} / {spread:.3g} / ±{band:.4g}"
        ),
        "trusted e2e wall (s)": ", ".join(f"{r['wall']:.0f}" for r in trusted),
        "PR final held-out loss": f"{pr_loss:.6f} ({worse:+.1%}); score {pr_score}",
        "PR e2e's own assertions": own,
        "verdicts (no quarantine / own entry / main's entry)": f"exit {rc} / {rc_self} / {rc_q}",
        "synthetic reference / MAD / band": f"{s_ref:.4f} / {s_mad:.4f} / ±{s_band:.4f}",
        "synthetic verdicts (PR / main run)": f"exit {rc_s} / {rc_g}",
        "git": f"HEAD {head}",
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs",
    }


if __name__ == "__main__":
    sys.exit(main())
