"""A metric store's password never leaves `mizzen-ci gate` (issue 31, mechanism 4), whatever
shape carries it: a libpq key/value string (`host=… password=…`, quoted values too) is a
PostgreSQL store, never a SQLite file named after its password; a driver's error text that quotes a
piece of the password is masked; every line, file and repr the gate writes is masked.  Against
the real PostgreSQL server of the contract tests, with a wrong password, user or database."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=30, labels=["ci"])

SECRET = "S3CRETpw"
TEST = "tests/x/test_a.py"


@pytest.fixture
def tree(tmp_path, repo_root):
    root = tmp_path / "tree"
    (root / "ci").mkdir(parents=True)
    for name in ("fleet.toml", "metrics.toml"):
        shutil.copy(repo_root / "ci" / name, root / "ci" / name)
    (root / "tests" / "x").mkdir(parents=True)
    (root / TEST).write_text(
        "from mizzen_ci import register_ci_gate, register_cpu_ci\n\n"
        "register_cpu_ci(est_time=1)\n"
        'register_ci_gate(metric="eval/heldout_loss", direction="lower", tolerance=0.1)\n'
    )
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


@pytest.fixture
def server(postgres_url) -> tuple[str, str]:
    """``(host, port)`` of the real server."""
    host, port = re.search(r"@([^:/]+):(\d+)/", postgres_url).groups()
    return host, port


def stores(host: str, port: str) -> list[str]:
    """The probe's shapes: key/value (wrong user, wrong database, quoted with a space, a
    quote and a backslash, malformed), and URLs whose secret libpq quotes back."""
    return [
        f"host={host} port={port} dbname=x user=u password={SECRET}",
        f"host={host} port={port} dbname=nodb user=mizzen password={SECRET}",
        f"host={host} port={port} dbname=x user=mizzen password='{SECRET} \\' \\\\x'",
        f"host={host} port={port} password={SECRET} sslmode=require extra",
        f"host = {host}  port = {port}  password = {SECRET}  sslmode={SECRET}zz",
        f"postgresql://u@{host}:{port}/x?password={SECRET}%zz",
        f"postgresql://u:{SECRET}@{host}:{port},{host}:{SECRET}/x",
        f"postgresql://u:{SECRET}@{host}:{port}/nodb?sslpassword={SECRET}2&sslmode=bogus",
    ]


def gate_runs(mizzen_ci, tree, store: str, env: dict | None = None):
    artefact = tree / "m" / "cpu.jsonl"
    artefact.parent.mkdir(exist_ok=True)
    artefact.write_text("")
    given = ["--store", store] if env is None else []
    common = {"cwd": tree, "site": True, "env": env}
    return [
        mizzen_ci("gate", "show", "--root", str(tree), *given, "--test", TEST,
                  "--metric", "eval/heldout_loss", **common),
        mizzen_ci("gate", "check", "--root", str(tree), *given, "--summary",
                  str(tree / "summary.md"), "--metrics", str(artefact), **common),
        mizzen_ci("gate", "ingest", "--root", str(tree), *given, "--trusted", "--event", "push",
                  "--commit", "a" * 40, str(artefact), **common),
        mizzen_ci("gate", "untrust", "--root", str(tree), *given, "--commit", "a" * 40,
                  **common),
    ]  # fmt: skip


def assert_never_shown(tree, runs):
    for out in runs:
        assert out.returncode == 2, (out.args, out.stdout, out.stderr)
        assert SECRET not in out.stdout + out.stderr, (out.args, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert not [p for p in tree.rglob("*") if SECRET in str(p)]  # no SQLite file named after it
    for path in tree.rglob("*.md"):
        assert SECRET not in path.read_text()


@pytest.mark.parametrize("shape", range(8))
def test_a_store_secret_never_leaves_the_gate(tree, mizzen_ci, server, shape):
    store = stores(*server)[shape]
    assert_never_shown(tree, gate_runs(mizzen_ci, tree, store))


def test_a_store_secret_from_the_environment_is_masked_too(tree, mizzen_ci, server):
    store = stores(*server)[0]
    runs = gate_runs(mizzen_ci, tree, store, env={"MIZZEN_METRICS_STORE": store})
    assert_never_shown(tree, runs)


def test_a_key_value_string_is_a_postgres_store_shown_redacted(tree, mizzen_ci, server):
    host, port = server
    out = gate_runs(mizzen_ci, tree, stores(host, port)[1])[0]
    shown = f"host={host} port={port} dbname=nodb user=*** password=***"
    assert shown in out.stderr and "password authentication failed" in out.stderr


def test_the_store_objects_and_errors_are_masked(postgres_schema, tmp_path):
    from mizzen_ci import masking
    from mizzen_ci.gate.backends import open_store
    from mizzen_ci.gate.sqlite import SqliteStore
    from mizzen_ci.gate.store import StoreError

    with masking.scope():
        store = open_store(postgres_schema)
        password = postgres_schema.split("@")[0].rsplit(":", 1)[1]
        try:
            assert password not in repr(store) and password not in str(vars(store))
        finally:
            store.close()
        masking.register(SECRET)
        assert SECRET not in str(StoreError(f"failed at {SECRET}"))
        local = SqliteStore(tmp_path / f"{SECRET}.sqlite")
        assert SECRET not in repr(local) and "***" in repr(local)
        local.close()
