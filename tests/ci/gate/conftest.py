"""Fixtures of the metric-gate tests: a real PostgreSQL server, both stores behind one fixture,
and writers of metric artefacts.

- ``postgres_url`` (session): the URL of a real PostgreSQL server.  ``$MIZZEN_TEST_POSTGRES``
  names a file holding it (``.ci/run`` starts a throwaway server with ``.ci/postgres`` and
  exports that file); without it this fixture starts its own throwaway server the same way and
  stops it at the end.  If no server can be had the test FAILS with the reason: the contract is
  never skipped.
- ``store_url``: parametrized over ``sqlite`` (a file under ``tmp_path``) and ``postgres``
  (``postgres_schema``: a fresh schema of the server, dropped afterwards): the one contract
  suite runs against both.
- ``points``: ``points(test=..., run=..., when=..., **{"metric@step": value})`` → a list of
  :class:`~mizzen_ci.gate.artefacts.Point`; ``write_points(path, points)`` writes them as an
  artefact (JSON lines, as :func:`mizzen_ci.metrics.record` does).
- ``gate_fixtures``: ``tests/ci/fixtures/gate`` (a tree with good and bad declarations, its own
  ``ci/metrics.toml``, fleet and quarantine list).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest

from mizzen_ci.gate.artefacts import Point

REPO = Path(__file__).resolve().parents[3]
POSTGRES_ENV = "MIZZEN_TEST_POSTGRES"


@pytest.fixture(scope="session")
def gate_fixtures() -> Path:
    return REPO / "tests" / "ci" / "fixtures" / "gate"


@pytest.fixture(scope="session")
def postgres_url():
    given = os.environ.get(POSTGRES_ENV)
    if given:
        try:
            yield Path(given).read_text().strip()
        except OSError as e:
            pytest.fail(f"${POSTGRES_ENV}={given} cannot be read ({e}); .ci/run writes it")
        return
    parent = tempfile.mkdtemp(prefix="mizzen-pg-")
    os.chmod(parent, 0o711)  # the server runs as `postgres` when the tests run as root
    cluster = Path(parent) / "cluster"
    script = REPO / ".ci" / "postgres"
    started = subprocess.run(
        ["bash", str(script), "start", str(cluster)], capture_output=True, text=True, timeout=300
    )
    try:
        if started.returncode != 0:
            pytest.fail(
                "no PostgreSQL server for the store contract tests (never skipped): "
                + started.stderr.strip()[-2000:]
            )
        yield (cluster / "url").read_text().strip()
    finally:
        subprocess.run(
            ["bash", str(script), "stop", str(cluster)], capture_output=True, timeout=120
        )
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "store" / "metrics.sqlite")
    return request.getfixturevalue("postgres_schema")


@pytest.fixture
def postgres_schema(postgres_url):
    """The URL of a fresh schema of the server (dropped afterwards)."""
    try:
        import psycopg
    except ImportError:
        pytest.fail(
            "psycopg is not installed in this environment (never skipped): `uv sync --frozen` "
            "installs it (the lock has mizzen-ci[postgres])"
        )

    url = postgres_url
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield f"{url}?options={quote(f'-csearch_path={schema}')}"
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


def _points(
    *,
    test="tests/x/test_a.py",
    arch="cpu",
    run="r1",
    when="2026-12-01T10:00:00+00:00",
    job=None,
    **values,
) -> list[Point]:
    out = []
    for coordinate, value in values.items():
        metric, step = coordinate.replace("__", "/").rsplit("_at_", 1)
        out.append(Point(test, arch, metric, int(step), float(value), run, job, when))
    return out


def _write_points(path: Path, points) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for p in points:
            f.write(json.dumps(p.to_json_object()) + "\n")
    return path


@pytest.fixture(scope="session")
def points():
    """``points(test=, arch=, run=, when=, eval__score_at_60=0.8, ...)``: metric ``eval/score`` at
    step 60 (``__`` spells ``/``, ``_at_`` the step)."""
    return _points


@pytest.fixture(scope="session")
def write_points():
    return _write_points
