"""Fixtures for every test: the one launcher of multi-rank (``torch.distributed``) scenarios.

``run_ranks(fn, world_size=N, args=(...), setup=None, backend="gloo", start=None, timeout=150)``
runs ``fn(*args)`` once in each of N rank processes joined by one default process group and
returns what each rank returned, in rank order.  Each rank, in this order:

1. calls ``torch.set_num_threads(1)`` before any other torch work (a forked child that enters an
   OpenMP parallel region of a pool its parent had started hangs; one intra-op thread never
   enters one);
2. with ``backend="nccl"``: takes GPU ``rank`` (``torch.cuda.set_device``); NVLink SHARP is off
   (``NCCL_NVLS_ENABLE=0``: multicast objects are not available on every host a lane runs on);
3. joins the process group over a ``file://`` rendezvous in a fresh temporary directory (no
   ports, so concurrent runs never collide);
4. calls ``setup()`` when given (e.g. megatron's ``parallel_state``), then ``fn(*args)``.

Two ways to start ranks, one protocol (each rank writes ``(status, payload)`` pickled *by value*
to its own result file, then exits):

- ``start="fork"`` (the default for gloo): ranks are forked from the test process, so ``fn``,
  ``setup`` and ``args`` may be anything, closures included, and start in well under a second
  with whatever the test process had imported.  A forked rank leaves through ``os._exit`` (the
  test process's exit handlers are not its own).  A rank inherits every lock the test process's
  other threads held at the fork, without the threads: a rank that hangs is reported with the
  names of those threads, and a live process group in the test process is refused at once.
  Tests whose body starts long-lived threads (an SDK's event loop, an embedded engine) or joins a
  group carry ``pytest.mark.in_child`` (below): their body runs in a forked child, so the threads
  and the group end with it; a fixture may set ``request.node.in_child_setup`` to a factory of
  the context the child enters around the body (tests/train/plugins: a one-rank world).
- ``start="spawn"`` (the only way for nccl: CUDA cannot be used after fork): ranks are fresh
  ``python`` processes, with the test process's ``sys.path`` and environment.  They load this
  file by path, then the file defining ``fn`` (and ``setup``) by path, under a private module
  name; so ``fn`` and ``setup`` must be module-level functions and ``args`` picklable.  A test
  file never loads anything by path itself.  A spawned rank ends with a barrier and
  ``destroy_process_group`` after writing its result, so no rank tears down its communicator
  while a peer's last collective still runs.

Failure: a rank that raises, dies or exits without a result fails the call with an
AssertionError carrying every rank's traceback (spawned ranks: the tail of their output too).
Ten seconds after the first failure the remaining ranks (maybe blocked in a collective) are
killed; at ``timeout`` every rank still running is killed and reported.  Results must be plain
data the test process can unpickle (builtins, tensors, classes it can import).

Invariants: the test process never initialises CUDA and never runs a torch kernel here; this
module imports only the standard library and pytest at module scope (it is loaded for every test,
those of packages that must not need torch included); torch is imported when ranks start.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import multiprocessing
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

BACKENDS = ("gloo", "nccl")
STARTS = ("fork", "spawn")
FAILURE_GRACE_S = 10.0  # how long the other ranks may still finish after one failed
OUTPUT_TAIL = 3000  # characters of a spawned rank's output shown when it fails

# A spawned rank: load this file by path (it is no importable module), then run the job.
_SPAWN_BOOT = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('mizzen_tests_rank_launcher', sys.argv[1])\n"
    "launcher = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(launcher)\n"
    "launcher._spawned_rank(sys.argv[2])\n"
)


def _write_result(path: str, status: str, payload: Any) -> None:
    """Pickle ``(status, payload)`` by value to ``path`` atomically (plain pickle: torch's
    multiprocessing reducers would share file descriptors with a process that is exiting)."""
    try:
        data = pickle.dumps((status, payload))
    except Exception:
        data = pickle.dumps(("error", "unpicklable result:\n" + traceback.format_exc()))
    partial = path + ".partial"
    with open(partial, "wb") as f:
        f.write(data)
    os.replace(partial, path)


def _join_group(rank: int, world_size: int, backend: str, init_file: str) -> None:
    """Steps 1-3 of the module docstring, in a rank process."""
    import torch

    torch.set_num_threads(1)  # first: see the module docstring
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )


def _forked_rank(rank, world_size, backend, init_file, setup, fn, args, result_file) -> None:
    status, payload = "error", "rank did not start"
    try:
        _join_group(rank, world_size, backend, init_file)
        if setup is not None:
            setup()
        status, payload = "ok", fn(*args)
    except BaseException:
        status, payload = "error", traceback.format_exc()
    try:
        _write_result(result_file, status, payload)
    finally:
        os._exit(0)  # skip the test process's exit handlers, inherited through fork


def _load_by_path(path: str, qualname: str) -> Callable[..., Any]:
    """The module-level function ``qualname`` of the file ``path``, loaded under a private name
    (test modules are not importable by name: pytest imports them by path)."""
    name = "mizzen_rank_target_" + re.sub(r"\W", "_", path)
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return getattr(module, qualname)


def _spawned_rank(job_file: str) -> None:
    """Entry point of a spawned rank (see ``_SPAWN_BOOT``)."""
    with open(job_file, "rb") as f:
        job = pickle.load(f)  # builtins only; the arguments are unpickled on the test's path
    sys.path[:] = job["sys_path"]
    status, payload = "error", "rank did not start"
    try:
        fn = _load_by_path(*job["fn"])
        setup = _load_by_path(*job["setup"]) if job["setup"] else None
        args = pickle.loads(job["args"])
        _join_group(job["rank"], job["world_size"], job["backend"], job["init_file"])
        if setup is not None:
            setup()
        status, payload = "ok", fn(*args)
    except BaseException:
        status, payload = "error", traceback.format_exc()
    _write_result(job["result_file"], status, payload)
    if status != "ok":
        sys.exit(1)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def _where(fn: Callable[..., Any], role: str) -> tuple[str, str]:
    """(file, name) of a module-level function, for a spawned rank to load; TypeError else."""
    qualname = getattr(fn, "__qualname__", "")
    if not inspect.isfunction(fn) or "." in qualname:
        raise TypeError(
            f"run_ranks(start='spawn'): {role} {fn!r} is not a module-level function; a spawned "
            f"rank loads it by file and name. Fix: define it at module scope of a file."
        )
    return inspect.getfile(fn), qualname


class _Rank:
    """One started rank: its process, result file and (spawned ranks) output log."""

    def __init__(self, rank: int, result_file: str, process, log: Path | None = None):
        self.rank, self.result_file, self.process, self.log = rank, result_file, process, log

    def exit_code(self) -> int | None:
        if isinstance(self.process, subprocess.Popen):
            return self.process.poll()
        return None if self.process.is_alive() else self.process.exitcode

    def stop(self, grace: float) -> None:
        """Let the rank exit by itself for up to ``grace`` seconds, then kill it; reap it."""
        deadline = time.monotonic() + grace
        while self.exit_code() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.exit_code() is None:
            self.process.kill()
        if isinstance(self.process, subprocess.Popen):
            self.process.wait(timeout=10)
        else:
            self.process.join(timeout=10)

    def result(self) -> tuple[str, Any] | None:
        """(status, payload) once the rank wrote its result or exited without one, else None."""
        code = self.exit_code()  # before looking for the file: a rank writes it, then exits
        if os.path.exists(self.result_file):
            try:
                with open(self.result_file, "rb") as f:
                    return pickle.load(f)
            except Exception:
                return "error", "its result cannot be unpickled here:\n" + traceback.format_exc()
        if code is None:
            return None
        return "error", f"rank exited with code {code} without a result"

    def output_tail(self) -> str:
        if self.log is None or not self.log.exists():
            return ""
        text = self.log.read_text(errors="replace")[-OUTPUT_TAIL:]
        return f"\n[output of rank {self.rank}, last {OUTPUT_TAIL} characters]\n{text}"


def launch_ranks(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: Sequence[Any] = (),
    setup: Callable[[], Any] | None = None,
    backend: str = "gloo",
    start: str | None = None,
    timeout: float = 150.0,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks of one process group (see the module docstring).

    Returns each rank's result in rank order; raises AssertionError naming every failed rank
    with its traceback (or the timeout) otherwise."""
    start = start or ("spawn" if backend == "nccl" else "fork")
    if backend not in BACKENDS or start not in STARTS or world_size < 1:
        raise ValueError(
            f"run_ranks: backend={backend!r}, start={start!r}, world_size={world_size!r}; "
            f"expected a backend of {BACKENDS}, a start of {STARTS} and world_size >= 1"
        )
    if backend == "nccl" and start == "fork":
        raise ValueError("run_ranks: nccl needs start='spawn' (CUDA cannot be used after fork)")
    threads = _threads_beside_a_fork() if start == "fork" else []
    starter = _fork_rank if start == "fork" else _spawn_rank
    job = {
        "world_size": world_size,
        "backend": backend,
        "fn": fn if start == "fork" else _where(fn, "fn"),
        "setup": setup if start == "fork" or setup is None else _where(setup, "setup"),
        "args": tuple(args),
    }
    if start == "spawn":
        job["args"] = pickle.dumps(job["args"])  # fails here, in the test, if one cannot travel
    ranks: list[_Rank] = []
    problems: list[str] | None = None
    with tempfile.TemporaryDirectory(prefix="mizzen-ranks-") as tmp:
        job["init_file"] = os.path.join(tmp, "rendezvous")
        try:
            for rank in range(world_size):
                ranks.append(starter(rank, job, Path(tmp)))
            results, problems = _collect(ranks, timeout)
            if threads and any("no result within" in p for p in problems):
                problems.append(
                    f"this pytest process had threads {threads} when it forked the ranks: a "
                    "rank that hangs may wait for a lock one of them held. Fix: run the test "
                    "that started them with `pytest.mark.in_child`, or pass start='spawn'"
                )
            if start == "fork" and any("exited with code -" in p for p in problems):
                problems.append(
                    "a forked rank died by a signal: an earlier test in this pytest process may "
                    "have left state a fork cannot carry (a whole mizzen-train command run "
                    f"in-process, threads {threads or 'none now'}). Fix: run such a command as a "
                    "subprocess, or its test with `pytest.mark.in_child`"
                )
        finally:
            # A spawned rank ends with a barrier and destroy_process_group after writing its
            # result: when every rank succeeded it may finish them; otherwise it is killed now.
            grace = FAILURE_GRACE_S if problems == [] else 0.0
            for r in ranks:
                r.stop(grace)
    if problems:
        raise AssertionError("distributed scenario failed:\n" + "\n".join(problems))
    return [results[r.rank][1] for r in ranks]


def _threads_beside_a_fork() -> list[str]:
    """The other threads of this process as ranks fork (named when a rank hangs: a forked rank
    inherits every lock they held, without them); RuntimeError for a live process group (the
    ranks would inherit it and fail to join their own)."""
    import threading

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "run_ranks(start='fork'): this pytest process holds a default process group; its "
            "forked ranks cannot join their own. Fix: run the test that joined it with "
            "`pytest.mark.in_child` (its body then runs in a child process), or destroy the group"
        )
    return [t.name for t in threading.enumerate() if t is not threading.main_thread()]


def _fork_rank(rank: int, job: dict[str, Any], tmp: Path) -> _Rank:
    import torch  # noqa: F401  (before forking: the ranks inherit it instead of importing it)

    result_file = str(tmp / f"rank{rank}.result")
    process = multiprocessing.get_context("fork").Process(
        target=_forked_rank,
        args=(rank, job["world_size"], job["backend"], job["init_file"], job["setup"], job["fn"],
              job["args"], result_file),
        daemon=True,
    )  # fmt: skip
    process.start()
    return _Rank(rank, result_file, process)


def _spawn_rank(rank: int, job: dict[str, Any], tmp: Path) -> _Rank:
    result_file = str(tmp / f"rank{rank}.result")
    job_file = tmp / f"rank{rank}.job"
    job_file.write_bytes(
        pickle.dumps({**job, "rank": rank, "result_file": result_file, "sys_path": list(sys.path)})
    )
    env = dict(os.environ)
    if job["backend"] == "nccl":
        env["NCCL_NVLS_ENABLE"] = "0"
    log = tmp / f"rank{rank}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", _SPAWN_BOOT, __file__, str(job_file)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return _Rank(rank, result_file, process, log)


def _collect(ranks: list[_Rank], timeout: float) -> tuple[dict[int, tuple[str, Any]], list[str]]:
    """Wait for every rank's result (see the module docstring for when the others are killed);
    the results by rank and one message per rank that did not succeed."""
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    first_failure: float | None = None
    while len(results) < len(ranks):
        now = time.monotonic()
        if now > deadline or (first_failure is not None and now > first_failure + FAILURE_GRACE_S):
            break
        for r in ranks:
            if r.rank not in results and (outcome := r.result()) is not None:
                results[r.rank] = outcome
                if outcome[0] != "ok" and first_failure is None:
                    first_failure = time.monotonic()
        time.sleep(0.02)
    problems = []
    for r in ranks:
        if r.rank not in results:
            why = (
                f"still running {FAILURE_GRACE_S:.0f} s after another rank failed; killed"
                if first_failure is not None
                else f"no result within {timeout:.0f} s; killed"
            )
            problems.append(f"--- rank {r.rank} ---\n{why}{r.output_tail()}")
        elif results[r.rank][0] != "ok":
            problems.append(f"--- rank {r.rank} ---\n{results[r.rank][1]}{r.output_tail()}")
    return results, problems


@pytest.fixture(scope="session")
def run_ranks() -> Callable[..., list[Any]]:
    """The multi-rank launcher: ``run_ranks(fn, world_size=N, args=(), setup=None,
    backend="gloo", start=None, timeout=150.0) -> [result of rank 0, ...]``."""
    return launch_ranks


def pytest_configure(config) -> None:
    # A suite started in the background by a non-interactive shell (``./.ci/run &``) inherits
    # SIGINT ignored, and so would every process a test starts: the tests that interrupt a
    # ``mizzen-ci bisect`` or a training run then wait out their timeout.  The suite's processes
    # take SIGINT at its default (a child's exec resets a handler, never an ignore).
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line(
        "markers",
        "in_child: run the test body in a forked child of the pytest process (inside the "
        "context an ``in_child_setup`` attribute of the item makes, when a fixture set one); "
        "for tests whose body starts threads or joins a process group (see tests/conftest.py)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem) -> bool | None:
    """The body of an ``in_child`` test runs in a forked child (fixtures stay in this process).

    Why: a process that has had threads (an SDK's event loop, an embedded engine's server) or a
    process group cannot fork ranks safely afterwards (a forked rank inherits locks held by
    threads that do not exist in it and hangs), and a library's thread may live as long as its
    process.  So such bodies run where they cannot outlive themselves: the child's threads and
    group end with it, and this pytest process stays fit to fork ``run_ranks`` ranks.  The
    child's exception comes back as text (its traceback); output goes to the captured streams."""
    marker = pyfuncitem.get_closest_marker("in_child")
    if marker is None:
        return None
    setup = getattr(pyfuncitem, "in_child_setup", None)  # a fixture's context for the body
    funcargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    with tempfile.TemporaryDirectory(prefix="mizzen-in-child-") as tmp:
        result_file = os.path.join(tmp, "result")
        pid = os.fork()
        if pid == 0:  # the child: run the body, write the outcome, leave without exit handlers
            status, payload = "error", "the test body did not start"
            try:
                if "torch" in sys.modules:  # an OpenMP pool of this process hangs in a fork
                    sys.modules["torch"].set_num_threads(1)
                with setup() if setup is not None else contextlib.nullcontext():
                    pyfuncitem.obj(**funcargs)
                status, payload = "ok", None
            except BaseException:
                status, payload = "error", traceback.format_exc()
            try:
                sys.stdout.flush()
                sys.stderr.flush()
                _write_result(result_file, status, payload)
            finally:
                os._exit(0)
        try:
            _, code = os.waitpid(pid, 0)
        finally:  # the timeout (or Ctrl-C) interrupted the wait: the child goes too
            try:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        if not os.path.exists(result_file):
            pytest.fail(f"the test's child process ended without a result (wait status {code})")
        with open(result_file, "rb") as f:
            status, payload = pickle.load(f)
    if status != "ok":
        pytest.fail(f"in the test's child process:\n{payload}", pytrace=False)
    return True
