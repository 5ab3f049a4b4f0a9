"""Hostile text in what mizzen-ci prints: one escaping function per medium (``mizzen_ci.output``)
applied to every path, label, reason, message and warning of the plan report, the registry CLI,
the GPU lane summary and the pytest plugin.  A file name with a newline and ``::error`` never
becomes a workflow command; Markdown (rendered by a real CommonMark parser) never carries HTML,
links or a broken table; look-alike labels show their code points."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from mizzen_ci import junit, register_cpu_ci
from mizzen_ci.fleet import load_fleet
from mizzen_ci.lane.report import SummaryRow, summary_tables
from mizzen_ci.output import Code, markdown, markdown_code, markdown_table, plain, text_table
from mizzen_ci.plan import Plan, report
from mizzen_ci.plan.change import Change
from mizzen_ci.plan.pipeline import PlanOptions, build_plan
from mizzen_ci.plan.request import Inputs

register_cpu_ci(est_time=25, labels=["ci"])

REPO = Path(__file__).resolve().parents[2]
CI_SRC = REPO / "ci" / "src"
FLEET_FILE = Path(__file__).parent / "fixtures" / "registry" / "fleet.toml"
FLEET = load_fleet(FLEET_FILE)
CPU = "from mizzen_ci import register_cpu_ci\nregister_cpu_ci(est_time=30, labels=['ci'])\n"
INJECTION = "x\n::error file=a.py,line=1::pwned"
HOSTILE = [
    INJECTION,
    "::error file=a.py::starts a line",
    "\r::warning::carriage",
    "##[error]legacy command",
    "\x1b[2J\x1b]0;title\x07 terminal escapes",
    "bidi \u202eexe.tset\u202c and zero\u200bwidth",
    "run\u2010ci\u2010lora",
    "run-ci-\uff4c\uff4f\uff52\uff41",
    "l\u043era",
    "<img src=x onerror=alert(1)> <script>x</script> &amp;",
    "[click](https://evil.example) ![i](https://evil.example/i.png) <https://evil.example>",
    "@someone | pipe | `tick` ``two`` **bold** _em_ ~~del~~ # heading",
    "line\u2028separator\x85next\x00nul\x7fdel",
]
MD = MarkdownIt("commonmark", {"html": True}).enable(["table", "strikethrough"])


def no_workflow_command(text: str) -> None:
    for line in text.splitlines():
        assert not line.lstrip().startswith(("::", "##[")), line


def safe_line(text: str) -> None:
    assert "\n" not in text and "\r" not in text and "\x1b" not in text
    assert not text.lstrip().startswith("::") and "##[" not in text
    assert all(c.isprintable() for c in text), ascii(text)


# ----------------------------------------------------------------------------------------------
# The escaping functions


@pytest.mark.parametrize(
    "raw, shown",
    [
        ("tests/test_ok.py", "tests/test_ok.py"),
        ("tests/test_ünïcode.py ≥ 3 … 日本語", "tests/test_ünïcode.py ≥ 3 … 日本語"),
        (INJECTION, "x\\x0a::error file=a.py,line=1::pwned"),
        ("::error::at the start", ":\\x3aerror::at the start"),
        ("  ::warning::after spaces", "  :\\x3awarning::after spaces"),
        ("tests/test_a.py::test_b", "tests/test_a.py::test_b"),
        ("##[error]x", "#\\x23[error]x"),
        ("run\u2010ci\u2010lora", "run\\u2010ci\\u2010lora"),
        ("run-ci-\uff4c\uff4f\uff52\uff41", "run-ci-\\uff4c\\uff4f\\uff52\\uff41"),
        ("l\u043era", "l\\u043era"),
        ("\u202eevil\u200b", "\\u202eevil\\u200b"),
        ("a\tb\u00a0c\u3000d", "a\\x09b\\xa0c\\u3000d"),
        ("\U0001f600 emoji", "\U0001f600 emoji"),
    ],
)
def test_plain_shows_control_format_and_look_alike_characters_as_code_points(raw, shown):
    assert plain(raw) == shown
    safe_line(plain(raw))


@pytest.mark.parametrize("raw", HOSTILE)
def test_every_hostile_string_is_one_safe_line_and_literal_markdown(raw: str):
    safe_line(plain(raw))
    html = MD.render(markdown(raw))
    assert html == f"<p>{_html_text(plain(raw))}</p>\n"  # exactly the text, nothing interpreted
    code = MD.render(markdown_table(("c",), [(Code(raw),)]))
    assert f"<td><code>{_html_text(plain(raw))}</code></td>" in code


def _html_text(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


@pytest.mark.parametrize("raw", ["`", "``a`", "a``b", " `x` ", "|", "", "   "])
def test_markdown_code_spans_survive_backticks_and_pipes(raw: str):
    html = MD.render(markdown_table(("c",), [(Code(raw),)]))
    cells = re.findall(r"<td>(.*?)</td>", html)
    assert len(cells) == 1 and cells[0].startswith("<code>")
    assert markdown_code(raw).count("\n") == 0


def test_tables_keep_their_shape_whatever_the_cells():
    rows = [(h, h, h) for h in HOSTILE]
    html = MD.render(markdown_table(("a", "b", "c"), rows))
    assert html.count("<tr>") == len(rows) + 1
    assert all(len(re.findall(r"<td>", tr)) == 3 for tr in html.split("<tr>")[2:])
    assert "<img" not in html and "<script" not in html and "<a " not in html
    text = text_table(("a", "b", "c"), rows)
    assert len(text.splitlines()) == len(rows) + 2
    no_workflow_command(text)


# ----------------------------------------------------------------------------------------------
# The plan report (terminal and Markdown), from a plan file holding hostile strings


def hostile_plan(tmp_path: Path) -> Plan:
    for rel in ("ci/fleet.toml", "tests/test_ok.py", "tests/test_two.py"):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(FLEET_FILE.read_text() if rel.endswith(".toml") else CPU)
    inputs = Inputs(event="schedule", cadence="nightly")
    plan = build_plan(tmp_path, FLEET, Change.unusable("no git", None, None), inputs, PlanOptions())
    data = json.loads(plan.dumps())
    test = data["jobs"][0]["tests"][0]
    test["file"], test["why"] = "tests/" + HOSTILE[0] + ".py", " / ".join(HOSTILE)
    data["jobs"][0]["id"] = HOSTILE[3]
    data["not_scheduled"] = [
        {"file": h, "arch": HOSTILE[5], "code": h, "reason": h} for h in HOSTILE
    ]
    data["warnings"], data["errors"] = list(HOSTILE), list(HOSTILE)
    data["event"], data["base"] = HOSTILE[0], HOSTILE[1]
    return Plan.from_json(data)


def test_the_terminal_plan_report_prints_no_workflow_command_and_no_escape(tmp_path: Path):
    text = report.terminal(hostile_plan(tmp_path), verbose=True)
    no_workflow_command(text)
    assert "\x1b" not in text and "\r" not in text and "\u202e" not in text
    assert "warning: run\\u2010ci\\u2010lora" in text  # the look-alike label, by code point
    assert "warning: run-ci-\\uff4c\\uff4f\\uff52\\uff41" in text
    assert "tests/x\\x0a::error file=a.py,line=1::pwned.py" in text


def test_the_markdown_plan_report_renders_as_literal_text(tmp_path: Path):
    md = report.markdown(hostile_plan(tmp_path))
    html = MD.render(md)
    assert "<img" not in html and "<script" not in html and "<a " not in html
    assert "<strong>" not in html and "<em>" not in html and "<del>" not in html
    assert html.count("<details>") == 2  # only the report's own HTML
    for table in re.findall(r"<table>.*?</table>", html, re.S):
        widths = {len(re.findall(r"<t[dh]>", tr)) for tr in table.split("<tr>")[1:]}
        assert len(widths) == 1, "a row with more or fewer cells than its header"
    assert "run\\u2010ci\\u2010lora" in html
    no_workflow_command(md)


def test_a_look_alike_label_from_the_event_is_shown_by_code_point(tmp_path: Path):
    for rel in ("ci/fleet.toml", "tests/test_ok.py"):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(FLEET_FILE.read_text() if rel.endswith(".toml") else CPU)
    inputs = Inputs(labels=("run-ci-\uff4c\uff4f\uff52\uff41",))  # fullwidth "lora"
    plan = build_plan(tmp_path, FLEET, Change.unusable("no git", None, None), inputs)
    text = report.terminal(plan)
    (line,) = [ln for ln in text.splitlines() if "unknown test label" in ln]
    assert "\\uff4c\\uff4f\\uff52\\uff41" in line and "\uff4c" not in line


# ----------------------------------------------------------------------------------------------
# The registry CLI, as a subprocess under GitHub Actions


def test_validate_prints_injected_file_names_escaped_and_annotations_escaped(tmp_path: Path):
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / "fleet.toml").write_text(FLEET_FILE.read_text())
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / f"test_{INJECTION}.py").write_text(CPU)  # outside tests/: an error
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / f"test_{INJECTION}.py").write_text(CPU)  # unprintable: an error
    proc = subprocess.run(
        [sys.executable, "-S", "-m", "mizzen_ci", "validate", "--root", str(tmp_path)],
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(CI_SRC), "GITHUB_ACTIONS": "true"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    no_workflow_command(proc.stderr)
    rules = re.findall(r"\[([a-z-]+)\]", proc.stderr)
    assert sorted(rules) == ["outside-tests", "path-unprintable"]
    annotations = proc.stdout.splitlines()
    assert len(annotations) == 2  # one line each: the newline is %0A, the colons %3A
    for line in annotations:
        assert line.startswith("::error file=") and "%0A" in line and line.count("::") == 2


# ----------------------------------------------------------------------------------------------
# The GPU lane's summary and merged junit


def test_the_gpu_lane_summary_escapes_every_cell():
    rows = [SummaryRow(f"tests/{h}.py", "1 (0)", 1.0, f"FAILED [x]: {h}", False) for h in HOSTILE]
    text = summary_tables(rows, [], {})
    no_workflow_command(text)
    assert "\x1b" not in text and len(text.splitlines()) == len(rows) + 2
    html = MD.render(summary_tables(rows, [], {}, markdown=True))
    assert "<img" not in html and "<a " not in html and html.count("<tr>") == len(rows) + 1


def test_the_merged_junit_holds_any_test_output_as_valid_xml(tmp_path: Path):
    tail = "".join(HOSTILE) + "\x00\x01\x08\x0b\x0c\ufffe\ud800"
    tree = junit.merge(
        [
            junit.FileReport(
                f"tests/{INJECTION}.py", None, {"why": tail}, error=tail, output_tail=tail
            )
        ],
        name="lane",
    )
    out = tmp_path / "junit.xml"
    junit.write(tree, out)
    root = ET.parse(out).getroot()  # a reader of the report can parse it
    assert root.find("testsuite/testcase/error").text.startswith("x\n::error")


# ----------------------------------------------------------------------------------------------
# The pytest plugin: a skip reason from a test is printed escaped


def test_the_plugin_prints_a_hostile_skip_reason_escaped(pytester: pytest.Pytester, monkeypatch):
    pytester.makefile(".toml", **{"ci/fleet": FLEET_FILE.read_text()})
    pytester.makepyprojecttoml("[tool.pytest.ini_options]\n")
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("MIZZEN_COMPUTE_CAPABILITY", "9.0")
    for var in ("MIZZEN_LANE", "CI"):
        monkeypatch.delenv(var, raising=False)
    test = pytester.path / "tests" / "test_gpu.py"
    test.parent.mkdir()
    test.write_text(
        "import pytest\nfrom mizzen_ci import register_cuda_ci\n"
        "register_cuda_ci(est_time=1, hardware=['hopper'], labels=['lora'])\n"
        f"def test_skips():\n    pytest.skip({INJECTION!r} + ' \\x1b[2J')\n"
    )
    result = pytester.runpytest_subprocess(
        "-p",
        "mizzen_ci.pytest_plugin",
        "-p",
        "no:cacheprovider",
        "--mizzen-lane",
        "hopper",
        "tests",
    )
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "skipped on hardware it declared" in out and "x\\x0a::error" in out
    assert not [ln for ln in result.outlines if ln.startswith("::")]
    assert "\x1b[2J" not in out


def test_a_symlinked_test_file_is_a_collection_error_not_a_second_copy(
    pytester: pytest.Pytester, monkeypatch
):
    pytester.makefile(".toml", **{"ci/fleet": FLEET_FILE.read_text()})
    pytester.makepyprojecttoml("[tool.pytest.ini_options]\n")
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    for var in ("MIZZEN_LANE", "CI"):
        monkeypatch.delenv(var, raising=False)
    tests = pytester.path / "tests"
    tests.mkdir()
    (tests / "test_real.py").write_text(CPU + "def test_a():\n    pass\n")
    (tests / "test_link.py").symlink_to("test_real.py")
    result = pytester.runpytest_subprocess(
        "-p", "mizzen_ci.pytest_plugin", "-p", "no:cacheprovider",
        "--continue-on-collection-errors", "tests",
    )  # fmt: skip
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        ["*tests/test_link.py:1: [[]symlink[]] symbolic link under tests/*"]
    )
