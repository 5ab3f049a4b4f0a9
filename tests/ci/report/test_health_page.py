"""`mizzen-ci report --html DIR` renders the CI health page from a seeded history store (pool
records written by `--record-plan` from a real plan, durations, flake records, queue and audit
records, a two-environment metric store) and the page is checked in headless Chromium (Debian's
package): it loads with no console error (no script, no request, no CSP violation), shows every
section with the seeded facts, and its screenshot is not blank.  The console check itself is
shown to catch a page that logs an error; an empty history renders too, saying what is missing
and the record shape the selection audit can write."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.gate.backends import open_store
from mizzen_ci.gate.store import RunInfo
from mizzen_ci.history import FlakeRecord, Record, append, append_flakes
from mizzen_ci.plan import Plan, PoolSummary, SelectionSummary

register_cpu_ci(est_time=20, labels=["ci"])

A, FLAKY = "tests/x/test_a.py", "tests/x/test_flaky.py"
OLD = "python=3.12.3; torch=2.11.0+cu130; runtime=cuda-13.0; driver=580.82.07; gpu=NVIDIA H200; image=sha256:aaaa"
NEW = "python=3.12.3; torch=2.13.0+cu130; runtime=cuda-13.0; driver=580.82.07; gpu=NVIDIA H200; image=sha256:bbbb"
SCREENSHOT = Path(".ci-artifacts") / "health" / "health-page.png"


def night(i: int) -> str:
    return f"2026-11-{i + 1:02d}T02:17:00+00:00"


@pytest.fixture
def tree(tmp_path, repo_root) -> Path:
    """A checkout: fleet and metric names of the repo, two registered test files (one gated),
    k=3 n=10 m=4, and test_flaky quarantined on hopper."""
    root = tmp_path / "tree"
    (root / "ci").mkdir(parents=True)
    for name in ("fleet.toml", "metrics.toml"):
        shutil.copy(repo_root / "ci" / name, root / "ci" / name)
    (root / "pyproject.toml").write_text(
        "[tool.mizzen.flakes]\nflips = 3\nwindow = 10\nclean = 4\n"
    )
    (root / "tests" / "x").mkdir(parents=True)
    (root / A).write_text('from mizzen_ci import register_cpu_ci, register_ci_gate\n\nregister_cpu_ci(est_time=30, labels=["ci"])\n'
                          'register_ci_gate(metric="eval/heldout_loss", direction="lower", tolerance=0.0, floor=0.01)\n')  # fmt: skip
    (root / FLAKY).write_text('from mizzen_ci import register_cuda_ci\n\n'
                              'register_cuda_ci(est_time=120, hardware=["hopper"], num_gpus=1, labels=["ci"])\n')  # fmt: skip
    (root / "ci" / "flaky.toml").write_text(f'[[flaky]]\nfile = "{FLAKY}"\narch = "hopper"\nsince = 2026-11-09\n'
                                            'reason = "flipped 3 times in its last 8 trusted runs (k = 3)"\n')  # fmt: skip
    return root


def seed(root: Path, mizzen_ci) -> Path:
    history = root / ".ci-artifacts" / "history"
    outcomes = "PPFPFPFPPPPP"  # test_flaky on hopper, night by night
    append(history / "durations.jsonl", [
        r for i in range(12) for r in (
            Record(A, None, 40.0 + i % 3, "passed", night(i), "cpu", "cpu-1"),
            Record(FLAKY, "hopper", 100.0, "passed" if outcomes[i] == "P" else "failed", night(i), "gpu-hopper", "hopper-1"),
        )
    ])  # fmt: skip
    append_flakes(
        history / "flakes.jsonl",
        [FlakeRecord(FLAKY, "hopper", "nccl-timeout", "watchdog", "passed", night(3), "hopper-1")],
    )
    for i in range(6):  # a real plan's pools, through the CLI
        pools = [PoolSummary("h200-2gpu", "gpu-hopper", 2, 2, 2, 9, 3000.0 + 100 * i, 1000.0 - 20 * i, 900.0, "lpt", 60.0),
                 PoolSummary("cpu-hosted", "cpu", 1, 1, 1, 40, 600.0, 700.0, 600.0, "lpt", 30.0)]  # fmt: skip
        plan = Plan(event="schedule", cadence="nightly", base=None, head="a" * 40, worktree=False, trusted=True,
                    approval=None, fleet="ci/fleet.toml", budget_seconds=3600.0,
                    selection=SelectionSummary(True, ("schedule",), 0), pools=pools)  # fmt: skip
        plan_path = root / f"plan-{i}.json"
        plan_path.write_text(json.dumps(plan.to_json()))
        r = mizzen_ci("report", "--record-plan", str(plan_path), "--out", str(history / "health.jsonl"),
                      "--when", night(i), "--run", f"gh-{i}-1")  # fmt: skip
        assert r.returncode == 0, r.stderr
    with (history / "health.jsonl").open("a") as f:
        for i, (q, recall) in enumerate([(40.0, 0.94), (95.0, 0.97), (61.0, 0.99)]):
            f.write(
                json.dumps(
                    {
                        "kind": "queue",
                        "v": 1,
                        "when": night(i),
                        "pool": "h200-2gpu",
                        "job": f"hopper-{i}",
                        "queued_seconds": q,
                    }
                )
                + "\n"
            )
            f.write(json.dumps({"kind": "audit", "v": 1, "when": night(i), "recall": recall, "caught": round(recall * 100),
                                "failing": 100, "window": "30 days"}) + "\n")  # fmt: skip
        f.write(
            '{"kind": "queue", "v": 1, "when": "yesterday", "pool": "p", "job": "j", "queued_seconds": 1}\n'
        )
    with open_store(str(history / "metrics.sqlite")) as store:
        for i, loss in enumerate([1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.01, 1.06]):
            store.add_run(RunInfo(A, "cpu", "cpu-hosted", f"{i:040x}", None, "schedule", True, 1, night(i), f"gh-{i}",
                                  OLD if i < 7 else NEW), {("eval/heldout_loss", 60): loss})  # fmt: skip
    return history


def render(mizzen_ci, root: Path, *history: Path) -> tuple[str, Path]:
    out = root / "page"
    args = [a for h in history for a in ("--history", str(h))]
    r = mizzen_ci("report", "--html", str(out), "--root", str(root), *args)
    assert r.returncode == 0, r.stderr
    return r.stderr, out / "index.html"


def non_blank(png: bytes) -> tuple[int, float]:
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert image.width >= 1200 and image.height >= 900  # the page, less a scroll bar
    colours = image.getcolors(maxcolors=1 << 20) or []
    ink = sum(n for n, c in colours if sum(c) < 600)  # not white or near-white
    return len(colours), ink / (image.width * image.height)


def test_the_health_page_renders_from_seeded_history_in_chromium(
    tree, mizzen_ci, browser, repo_root
):
    history = seed(tree, mizzen_ci)
    stderr, page = render(mizzen_ci, tree, history)
    assert "report: dropped" in stderr and "yesterday" in stderr  # the one bad queue line, named
    loaded = browser.load(page)
    assert loaded.errors == []
    text = loaded.text
    for heading in ("Runner pools", "Test file durations against est_time", "Flaky tests", "Metric gate",
                    "Selection audit", "Queue time", "Dropped input (1)"):  # fmt: skip
        assert heading in text
    # the last plan: h200-2gpu 900 s against a bound of 900 s, 3500 GPU-s of 2 x 2 GPUs x 900 s
    assert "h200-2gpu\tgpu-hopper\t6\t2\t15.0\t15.0\t1.00\t\t97 %" in text
    assert "tests/x/test_a.py\tcpu\t30\t12\t41.0\t1.37" in text  # median 41 s against est_time 30
    assert "quarantined since 2026-11-09; proposed: re-enable" in text  # 5 clean runs since, m = 4
    # 1.06 in NEW, judged against OLD's band x2 (1.0 ± 0.089)
    assert "tests/x/test_a.py\tcpu\teval/heldout_loss\t60\t1.06\tpass\t\tnew environment" in text
    assert (
        "test_a.py on cpu: new environment: torch 2.11.0+cu130 -> 2.13.0+cu130, image sha256:aaaa -> sha256:bbbb"
        in text
    )
    assert "99.0 %" in text and "99 of 100" in text  # the newest audit's recall
    assert "95.0" in text  # the p90 queue time
    colours, ink = non_blank(loaded.png)
    assert colours > 20 and ink > 0.01, (colours, ink)
    shot = repo_root / SCREENSHOT
    shot.parent.mkdir(parents=True, exist_ok=True)
    shot.write_bytes(loaded.png)  # kept for people to look at (.ci-artifacts is ignored by git)


def test_an_empty_history_renders_and_names_the_records_it_lacks(tree, mizzen_ci, browser):
    _, page = render(mizzen_ci, tree, tree / ".ci-artifacts" / "history")
    loaded = browser.load(page)
    assert loaded.errors == []
    assert "No audit recorded" in loaded.text and '"kind": "audit"' in loaded.text
    assert "No queue time recorded" in loaded.text and "No pool record yet" in loaded.text


def test_the_console_check_catches_a_page_that_logs_an_error(tmp_path, browser):
    page = tmp_path / "bad.html"
    page.write_text("<!DOCTYPE html><html><body><p>x</p><script>console.error('boom')</script>"
                    '<img src="missing.png"></body></html>')  # fmt: skip
    errors = browser.load(page).errors
    assert any("boom" in e for e in errors) and any(
        "missing.png" in e or "ERR_FILE_NOT_FOUND" in e for e in errors
    ), errors
