"""`mizzen-ci report --html` over hostile history stores: a record whose text is a JSON-escaped
lone surrogate is dropped (named on stderr and on the page) and the page is still written, as is
one whose store path cannot be decoded; an unreadable store is one dropped input, not one per
reader; and a registered secret in a record is masked on the page *before* it is escaped (a
secret holding `&` and `<` leaves neither its raw nor its escaped form, in the file or on stdout).
"""

from __future__ import annotations

import datetime as dt
import html
import json
import os
import shutil
from pathlib import Path

import pytest

from mizzen_ci import masking, register_cpu_ci
from mizzen_ci.report.collect import collect
from mizzen_ci.report.page import render

register_cpu_ci(est_time=10, labels=["ci"])

WHEN = "2026-11-10T06:12:00+00:00"
NOW = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
GOOD = {"file": "tests/a/test_ok.py", "arch": None, "seconds": 1.0, "outcome": "passed",
        "when": WHEN, "lane": "cpu", "job": "j"}  # fmt: skip
SECRET = "ghs_T0k&n<b>S3cr'et"


@pytest.fixture
def tree(tmp_path: Path, repo_root: Path) -> Path:
    """A checkout with the repo's fleet and no registered test, and an empty history folder."""
    (tmp_path / "ci").mkdir()
    shutil.copy(repo_root / "ci" / "fleet.toml", tmp_path / "ci" / "fleet.toml")
    (tmp_path / "h").mkdir()
    return tmp_path


def report(mizzen_ci, tree: Path, **env: str):
    r = mizzen_ci("report", "--html", str(tree / "page"), "--history", str(tree / "h"),
                  "--root", str(tree), env=env)  # fmt: skip
    page = tree / "page" / "index.html"
    return r, page.read_text(encoding="utf-8") if page.exists() else None


def test_a_lone_surrogate_in_a_record_is_dropped_and_the_page_is_written(tree, mizzen_ci):
    bad = json.dumps(GOOD | {"file": "tests/a/test_b\ud800.py"})  # the escape \ud800, as a
    assert "\\ud800" in bad  # downloaded artifact would carry it
    (tree / "h" / "x.jsonl").write_text(json.dumps(GOOD) + "\n" + bad + "\n")
    r, page = report(mizzen_ci, tree)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert page is not None and "tests/a/test_ok.py" in page
    rule = f"{tree / 'h' / 'x.jsonl'}:2: `file` holds U+D800, a lone surrogate"
    assert r.stderr.count("report: dropped") == 1 and rule in r.stderr, r.stderr
    assert "Dropped input (1)" in page and rule in page


def test_a_store_whose_path_cannot_be_decoded_is_named_on_the_page(tree, mizzen_ci):
    path = os.path.join(os.fsencode(tree / "h"), b"bad\xff.jsonl")
    with open(path, "wb") as f:
        f.write(b"not json\n")
    r, page = report(mizzen_ci, tree)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert page is not None and "bad\\udcff.jsonl:1: not JSON" in page
    assert "bad\\udcff.jsonl:1: not JSON" in r.stderr


def test_an_unreadable_store_is_one_dropped_input(tree, mizzen_ci):
    (tree / "h" / "latin1.jsonl").write_bytes(b'{"file": "tests/caf\xe9.py"}\n')
    (tree / "h" / "d.jsonl").write_text(json.dumps(GOOD) + "\n")
    r, page = report(mizzen_ci, tree)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("latin1.jsonl: not UTF-8") == 1, r.stderr
    assert "1 dropped input(s)" in r.stdout, r.stdout
    assert page.count("latin1.jsonl: not UTF-8") == 1 and "Dropped input (1)" in page
    assert len(collect(tree, [tree / "h"], None, now=NOW).problems) == 1


def masked(page: str) -> None:
    forms = (SECRET, html.escape(SECRET), html.escape(SECRET, quote=False), "T0k&amp;n", "S3cr")
    for form in forms:
        assert form not in page, form
    assert "tests/a/test_***.py" in page


def test_a_secret_in_the_history_is_masked_before_the_page_escapes_it(tree, mizzen_ci):
    record = json.dumps(GOOD | {"file": f"tests/a/test_{SECRET}.py"}, ensure_ascii=False)
    assert SECRET in record
    (tree / "h" / "d.jsonl").write_text(record + "\n")
    r, page = report(mizzen_ci, tree, GITHUB_TOKEN=SECRET)
    assert r.returncode == 0, r.stderr
    masked(page)
    assert "S3cr" not in r.stdout + r.stderr


def test_the_rendered_page_masks_a_registered_secret_in_every_section(tree):
    (tree / "h" / "d.jsonl").write_text(
        json.dumps(GOOD | {"file": f"tests/a/test_{SECRET}.py"}) + "\n"
        + json.dumps(GOOD | {"file": f"tests/a/test_{SECRET}.py", "outcome": "failed"}) + "\n"
        + json.dumps({"kind": "queue", "v": 1, "when": WHEN, "pool": "p", "job": "j",
                      "queued_seconds": f"{SECRET}"}) + "\n"
    )  # fmt: skip
    with masking.scope():
        masking.register(SECRET)
        page = render(collect(tree, [tree / "h"], None, now=NOW))
    masked(page)  # the duration table and its sparkline title, the flake table, the dropped line
    assert page.count("test_***.py") == 3 and "Dropped input (1)" in page
