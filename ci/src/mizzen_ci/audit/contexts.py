"""The pytest plugin of observed execution: every test runs under its own coverage context.

Loaded by :mod:`.observe` (``-p mizzen_ci.audit.contexts``) into a pytest that runs under
``coverage run`` with ``patch = subprocess``; inert when coverage is not measuring.

Invariants:
- The context of a test is its node id (``tests/x/test_y.py::test_z[p]``); the import and
  collection of a test module run under the module's path (``tests/x/test_y.py``); everything
  else (pytest's own start, conftests of directories) under the empty context, which the
  observer drops.
- Subprocesses a test starts (``python -m …``, servers, workers) record under the same context:
  coverage starts in them from ``COVERAGE_PROCESS_CONFIG``, whose static ``context`` this plugin
  sets to the running test's id before the test and clears after it; they measure with the
  ``sysmon`` core (this process keeps the tracer that dynamic contexts need).
- Files a test opens (kind ``data``) are recorded in this process only, through one audit hook
  (``sys.addaudithook``: ``open`` events of regular paths inside the tree that are not Python
  sources); a file the test only copies (``shutil.copyfile``'s audit event, which copytree and
  copy2 raise per file: a test copying a whole tree depends on no file's content) is left out;
  written at the end of the session to ``$MIZZEN_AUDIT_DIR/opened-<pid>.json``.
- Importing this module needs neither pytest nor coverage (stdlib only); they are imported in
  ``pytest_configure``.
"""

from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path

AUDIT_DIR_ENV = "MIZZEN_AUDIT_DIR"
CONFIG_ENV = "COVERAGE_PROCESS_CONFIG"
SKIPPED_PARTS = frozenset({".git", ".venv", ".nox", "__pycache__", ".ci-artifacts"})
MAX_OPENED = 200_000  # (context, path) pairs kept per process
# audit events: ``open`` records a data file; ``shutil.copyfile`` marks one that was only copied
COUNTED = frozenset({"open", "shutil.copyfile"})


def pytest_configure(config) -> None:
    out = os.environ.get(AUDIT_DIR_ENV)
    try:
        import coverage
    except ImportError:
        return
    cov = coverage.Coverage.current()
    if cov is None or not out:
        return
    plugin = _contexts_class()(cov, Path(str(config.rootpath)).resolve(), Path(out))
    config.pluginmanager.register(plugin, "mizzen-audit-contexts")


def with_context(serialized: str, context: str | None) -> str:
    """A serialized coverage config (``CoverageConfig.serialize``) for the subprocesses of a
    test: ``context`` set, and the ``sysmon`` core (a subprocess records under a static context,
    which sys.monitoring supports, and code it does not measure -- a Ray worker's or server's
    own -- then runs untraced: under the C tracer Ray's processes did not come up)."""
    data = json.loads(base64.b64decode(serialized.encode()).decode())
    data["context"] = context or None
    data["core"] = "sysmon"
    return base64.b64encode(json.dumps(data).encode()).decode()


def _contexts_class():
    import pytest

    class Contexts:
        def __init__(self, cov, root: Path, out: Path):
            self.cov, self.root, self.out = cov, root, out
            self.context = ""
            self.opened: set[tuple[str, str]] = set()
            self.copied: set[tuple[str, str]] = set()
            sys.addaudithook(self._audit)

        def _enter(self, context: str) -> None:
            self.context = context
            self.cov.switch_context(context)
            if CONFIG_ENV in os.environ:
                os.environ[CONFIG_ENV] = with_context(os.environ[CONFIG_ENV], context)

        def _audit(self, event: str, args: tuple) -> None:
            if event not in COUNTED or not self.context or len(self.opened) >= MAX_OPENED:
                return
            path = args[0] if args else None
            if isinstance(path, os.PathLike):  # shutil passes Path objects on
                path = os.fspath(path)
            if isinstance(path, str) and not path.endswith((".py", ".pyc")):
                rel = self._inside(path)
                if rel:
                    seen = self.opened if event == "open" else self.copied
                    seen.add((self.context, rel))

        def _inside(self, path: str) -> str | None:
            try:
                rel = Path(os.path.abspath(path)).relative_to(self.root)
            except ValueError:
                return None
            if SKIPPED_PARTS & set(rel.parts) or not os.path.isfile(path):
                return None
            return rel.as_posix()

        @pytest.hookimpl(hookwrapper=True)
        def pytest_make_collect_report(self, collector):
            module = type(collector).__name__ == "Module"
            if module:
                self._enter(collector.nodeid)
            yield
            if module:
                self._enter("")

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_protocol(self, item, nextitem):
            self._enter(item.nodeid)
            yield
            self._enter("")

        def pytest_unconfigure(self, config) -> None:
            self.context = ""
            self.out.mkdir(parents=True, exist_ok=True)
            path = self.out / f"opened-{os.getpid()}.json"
            path.write_text(json.dumps(sorted(self.opened - self.copied)))

    return Contexts
