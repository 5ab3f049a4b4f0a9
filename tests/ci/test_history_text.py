"""History text is UTF-8, and a store is read once: a JSON escape that decodes to a lone surrogate
(`"tests/a/test_b\\ud800.py"`) in any text field of a duration or a flake record drops the line
naming `path:line` and the rule, like any bad value (no reader's caller ever holds text it cannot
write); and an unreadable store or a bad line is one problem when the duration, flake and kinded
records are read together (`read_history`, `history merge`, `history flakes`), not one per reader."""

from __future__ import annotations

import json

import pytest

from mizzen_ci import history, register_cpu_ci

register_cpu_ci(est_time=8, labels=["ci"])

WHEN = "2026-11-10T06:12:00+00:00"
DURATION = {"file": "tests/a/test_b.py", "arch": None, "seconds": 1.0, "outcome": "passed",
            "when": WHEN, "lane": "cpu", "job": "j"}  # fmt: skip
FLAKE = {"file": "tests/a/test_b.py", "arch": "hopper", "class": "nccl-timeout",
         "evidence": "watchdog", "final": "passed", "when": WHEN, "job": "j"}  # fmt: skip
LONE = "\ud800"


def line(record: dict) -> str:
    return json.dumps(record)  # ensure_ascii: a lone surrogate is written as the escape \ud800


@pytest.mark.parametrize("field", ["file", "arch", "outcome", "when", "lane", "job"])
def test_a_lone_surrogate_in_a_duration_text_field_drops_the_line(tmp_path, field):
    store = tmp_path / "d.jsonl"
    store.write_text(line(DURATION) + "\n" + line(DURATION | {field: f"x{LONE}"}) + "\n")
    assert "x\\ud800" in store.read_text()  # the JSON escape, as an artifact would carry it
    records, problems = history.read_stores(store)
    assert records == [history.Record(**DURATION)]
    assert len(problems) == 1 and problems[0].startswith(f"{store}:2: `{field}` holds U+D800")
    assert "lone surrogate that UTF-8 cannot encode" in problems[0]
    problems[0].encode("utf-8")  # the message itself can be written anywhere


@pytest.mark.parametrize("field", ["file", "arch", "class", "evidence", "final", "job"])
def test_a_lone_surrogate_in_a_flake_text_field_drops_the_line(tmp_path, field):
    store = tmp_path / "flakes.jsonl"
    store.write_text(line(FLAKE) + "\n" + line(FLAKE | {field: f"x{LONE}"}) + "\n")
    kept, problems = history.read_flake_records(store)
    assert [f.evidence for f in kept] == ["watchdog"]
    assert len(problems) == 1 and problems[0].startswith(f"{store}:2: flake record `{field}` holds")
    counts, problems = history.read_flakes(store)
    if field in ("file", "arch"):
        assert counts == {("tests/a/test_b.py", "hopper"): 1} and len(problems) == 1


def test_a_paired_surrogate_escape_is_an_ordinary_character(tmp_path):
    store = tmp_path / "d.jsonl"
    store.write_text(line(DURATION | {"file": "tests/a/test_\U0001f600.py"}) + "\n")
    assert "\\ud83d\\ude00" in store.read_text()
    assert history.load(store)[0].file == "tests/a/test_\U0001f600.py"


def test_one_pass_reads_each_kind_and_names_each_problem_once(tmp_path):
    stores = tmp_path / "h"
    stores.mkdir()
    (stores / "latin1.jsonl").write_bytes(b'{"file": "tests/caf\xe9.py"}\n')
    (stores / "d.jsonl").write_text(
        "\n".join([line(DURATION), "not json", line(FLAKE), '{"kind": "other", "x": 1}']) + "\n"
    )
    read = history.read_history(stores)
    assert read.records == [history.Record(**DURATION)] and len(read.flakes) == 1
    assert read.kinded == {}
    assert read.problems == [
        f"{stores / 'd.jsonl'}:2: not JSON: Expecting value",
        f"{stores / 'latin1.jsonl'}: not UTF-8 (invalid continuation byte at byte 19); "
        "a store is UTF-8 JSON lines",
    ]


def test_the_history_cli_names_an_unreadable_store_once(tmp_path, mizzen_ci):
    stores = tmp_path / "h"
    stores.mkdir()
    (stores / "latin1.jsonl").write_bytes(b"\xff\xfe\n")
    (stores / "d.jsonl").write_text(line(DURATION) + "\n" + line(FLAKE) + "\n")
    merged = mizzen_ci("history", "merge", "--out", str(tmp_path / "m.jsonl"), str(stores))
    listed = mizzen_ci("history", "flakes", str(stores))
    for out in (merged, listed):
        assert out.returncode == 0, out.stderr
        assert out.stderr.count("latin1.jsonl") == 1, out.stderr
        assert out.stderr.count("history: dropped") == 1, out.stderr
    assert "1 record(s)" in merged.stdout and "1 flake record(s)" in merged.stdout
