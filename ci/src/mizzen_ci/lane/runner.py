"""Running a GPU lane's test files: one pytest process per file, side by side, each on its own
leased GPUs.

Invariants:
- Each file runs as ``python -m pytest FILE --mizzen-lane ARCH`` in its own session (process
  group), with its vendor's visible-devices variable naming exactly its GPUs set in the
  environment it starts with (``CUDA_VISIBLE_DEVICES``; ``HIP_VISIBLE_DEVICES`` on AMD, every other
  variable that would pick or renumber AMD devices removed: :class:`mizzen_ci.fleet.Vendor`), so
  nothing in it can see another GPU, whatever it imports first.
- A file starts only when the packer (:mod:`mizzen_ci.packing.gpus`) gives it GPUs *and* their
  leases (:mod:`.leases`) are taken; the lease descriptors go to the process, and the
  runner drops its copies only after the whole process group is gone.  Files sharing a GPU
  (``gpu_seats`` > 1) share one lease of it: taken when the first starts, held by the runner
  and by each of them, and freed when the last one's group is gone.
- A file's timeout is ``max(min_timeout, estimate × factor)``, at most the job timeout every
  workflow job keeps (:data:`MAX_FILE_TIMEOUT_S`, from
  :data:`mizzen_ci.registry.rules.MAX_JOB_TIMEOUT_MINUTES`: whatever the estimate, the factor or
  the plan file say); on expiry the whole group gets
  SIGTERM, then SIGKILL after a grace period.  When a file's main process exits, whatever it left
  in its group is killed before its GPUs are released.
- A failed attempt is retried (same file, new process, new timeout, possibly other GPUs) only
  when :mod:`.retry` calls it infrastructure, at most ``retries`` times.
- The pytest plugin is loaded explicitly (``-p mizzen_ci.pytest_plugin``) when it is not
  installed as an entry point, so a lane works with the workspace only on ``PYTHONPATH``.
- If the runner is interrupted, every running group is killed before it returns.  A file whose
  process cannot be spawned (or fails right after, before it is tracked: its group is killed)
  holds no lease: its GPUs, and those acquired for the rest of its start batch, are freed before
  the error propagates.
- A file's log is written by the code under test: the retry classifier reads only its last
  :data:`CLASSIFY_BYTES` (never through a link: :func:`mizzen_ci.sources.read_tail`), and the
  lease directory is checked before anything runs (:meth:`.leases.LeaseDir.check`).
- Each attempt gets the compile-cache variables of :mod:`.compile_cache` (the lane's checked cache,
  never overriding one its environment sets) and its own ``$MIZZEN_COMPILE_STATS`` path, removed
  before it starts; what the child leaves there is read back as hostile
  (:func:`.compile_cache.read_stats`): a bad file is the attempt's warning, never a crash.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .. import __file__ as _package_init
from ..fleet import NVIDIA, VENDORS, Vendor, nox_session_name
from ..junit import Counts, JunitError, first_problem, read_counts
from ..packing.gpus import GpuPacker, PackItem
from ..registry.rules import MAX_JOB_TIMEOUT_MINUTES
from ..sources import read_tail
from .compile_cache import STATS_ENV, CompileCache, CompileStats, read_stats
from .hardware import Gpu
from .leases import Lease, LeaseDir
from .progress import Progress
from .retry import Classification, classify

if TYPE_CHECKING:
    from ..audit.observe import Recording

PLUGIN_MODULE = "mizzen_ci.pytest_plugin"
PLUGIN_MODULES = (PLUGIN_MODULE, "mizzen_ci.flakes.pytest_plugin")  # the flaky quarantine
POLL_S = 0.05
CLASSIFY_BYTES = 8 * 1024 * 1024  # of a failed file's log, read for the retry classifier
MAX_FILE_TIMEOUT_S = MAX_JOB_TIMEOUT_MINUTES * 60.0  # the job running the lane ends by then


@dataclass(frozen=True)
class LaneFile:
    """One test file to run: its path, what pytest is given, its GPUs, its estimate and whether
    it may share its GPU (``register_*_ci(shares_gpu=True)``)."""

    file: str
    target: str
    num_gpus: int
    est_seconds: float
    shares_gpu: bool = False
    #: the plan runs it as the base declares it (its overrides): a head's disabled= does not stop it
    as_planned: bool = False

    @property
    def pack_item(self) -> PackItem:
        return PackItem(self.target, self.num_gpus, self.est_seconds, self.shares_gpu)


@dataclass(frozen=True)
class RunnerConfig:
    root: Path
    arch: str
    gpus: tuple[Gpu, ...]
    report_dir: Path
    lease_dir: Path
    timeout_factor: float = 3.0
    min_timeout_s: float = 120.0
    lease_timeout_s: float = 1800.0
    retries: int = 1
    kill_grace_s: float = 5.0
    pythonpath: tuple[str, ...] = ()
    pytest_args: tuple[str, ...] = ()
    compile_cache: CompileCache | None = None
    gpu_seats: int = 1  # files that share a GPU, at most, on one GPU (1: no sharing)
    collect_only: bool = False  # a dry run: each file is collected (imported), no test body runs
    #: observed execution (``--record-execution``): each file's pytest runs under coverage
    recording: Recording | None = None

    def timeout_for(self, est_seconds: float) -> float:
        wanted = max(self.min_timeout_s, est_seconds * self.timeout_factor)
        return wanted if wanted <= MAX_FILE_TIMEOUT_S else MAX_FILE_TIMEOUT_S  # nan: the cap

    @property
    def vendor(self) -> Vendor:
        """The vendor of the lane's GPUs (one per lane: :func:`.hardware.lane_gpus`)."""
        vendors = {g.vendor for g in self.gpus}
        if len(vendors) > 1:
            raise ValueError(f"a lane's GPUs are of one vendor, got {sorted(vendors)}")
        return VENDORS[vendors.pop()] if vendors else NVIDIA


@dataclass
class Attempt:
    number: int
    gpus: tuple[Gpu, ...]
    seconds: float
    outcome: str  # "passed" | "failed" | "timeout"
    detail: str  # why it did not pass ("" when it did)
    log: Path | None
    junit: Path | None
    exit_code: int | None = None
    counts: Counts | None = None
    classification: Classification | None = None
    compile_stats: CompileStats | None = None  # None: the child never imported torch
    compile_warning: str | None = None  # why its counts file was not believed
    started: float = 0.0  # seconds after the lane started
    sharing: bool = False  # on a sharable seat: ``shares_gpu`` with seats > 1 (maybe alone)


@dataclass
class FileResult:
    lane_file: LaneFile
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def final(self) -> Attempt:
        return self.attempts[-1]

    @property
    def passed(self) -> bool:
        return bool(self.attempts) and self.final.outcome == "passed"


@dataclass
class _Running:
    item: PackItem
    lane_file: LaneFile
    gpus: tuple[Gpu, ...]
    lease: Lease
    proc: subprocess.Popen
    log: Path
    junit: Path
    started: float
    timeout: float
    term_sent: float | None = None
    kill_sent: bool = False
    stats: Path | None = None


def plugin_args() -> list[str]:
    """``-p MODULE`` for each of mizzen's plugins (:data:`PLUGIN_MODULES`) that pytest will not
    load from its entry point anyway (a GPU image runs the workspace from the path, uninstalled)."""
    loaded = set()
    if not os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        loaded = {ep.value for ep in importlib.metadata.entry_points(group="pytest11")}
    return [arg for module in PLUGIN_MODULES if module not in loaded for arg in ("-p", module)]


def slug(target: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", target.replace("/", "__").replace("::", "--"))


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in process group ``pgid``."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def _kill_group_and_wait(pgid: int, wait_s: float = 5.0) -> None:
    _signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)


class GpuLaneRunner:
    """Runs the files of one lane on the host's GPUs; :meth:`run` returns one result per file."""

    def __init__(self, config: RunnerConfig, progress: Progress):
        self.config = config
        self.progress = progress
        self.gpu_of = {g.lease_key: g for g in config.gpus}
        self.leases = LeaseDir(config.lease_dir)
        self.leases.check()  # an unsafe lease directory refuses the lane before anything runs
        self.files_dir = config.report_dir / "files"
        self._plugin_args = plugin_args()
        self._running: dict[str, _Running] = {}
        self._shared: dict[str, Lease] = {}  # GPU -> the runner's lease of a GPU files share
        self._started_at = time.monotonic()

    # -- starting ---------------------------------------------------------------------------

    def _child_env(self, gpus: tuple[Gpu, ...], stats: Path | None = None) -> dict[str, str]:
        env = dict(os.environ)
        if self.config.compile_cache is not None:  # never one the lane's environment sets
            env.update(self.config.compile_cache.env)
        if stats is not None:
            env[STATS_ENV] = str(stats)
        # The child loads this package's pytest plugin (`-p mizzen_ci.pytest_plugin`) and runs in
        # the lane's root: put the running mizzen_ci on its path, and make inherited entries
        # absolute so a relative PYTHONPATH keeps meaning what it meant here.
        own = str(Path(_package_init).resolve().parents[1])  # the dir that holds mizzen_ci/
        inherited = [str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(":") if p]
        path = [*self.config.pythonpath, own, *inherited]
        vendor = self.config.vendor
        for name in vendor.pinning_variables:  # only the one the lane sets decides
            env.pop(name, None)
        env[vendor.visible_devices] = ",".join(g.visible_id for g in gpus)
        if vendor is NVIDIA:
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env.update(
            MIZZEN_LANE=self.config.arch,
            MIZZEN_COMPUTE_CAPABILITY=",".join(sorted({g.target for g in gpus})),
            PYTHONPATH=":".join(dict.fromkeys(path)),
            PYTHONUNBUFFERED="1",
        )
        return env

    def _start(
        self, item: PackItem, lane_file: LaneFile, keys: tuple[str, ...], lease: Lease, attempt: int
    ) -> _Running:
        gpus = tuple(self.gpu_of[k] for k in keys)
        self.files_dir.mkdir(parents=True, exist_ok=True)
        base = self.files_dir / f"{slug(lane_file.target)}.attempt{attempt}"
        log, junit = base.with_name(base.name + ".log"), base.with_name(base.name + ".xml")
        stats = base.with_name(base.name + ".compile.json")
        junit.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # a leftover that cannot go is read as hostile anyway
            stats.unlink(missing_ok=True)
        cmd = [
            sys.executable, "-m", "pytest", lane_file.target,
            "--mizzen-lane", self.config.arch, f"--junitxml={junit}",
            "-p", "no:cacheprovider", "-rfEs", *self._plugin_args, *self.config.pytest_args,
            *(["--collect-only", "-q"] if self.config.collect_only else []),
            *(["--mizzen-as-planned", lane_file.file] if lane_file.as_planned else []),
        ]  # fmt: skip
        env = self._child_env(gpus, stats)
        if self.config.recording is not None:
            cmd = self.config.recording.command(cmd)
            env.update(self.config.recording.env())
        with log.open("w") as out:
            pin = self.config.vendor.visible_devices
            out.write(f"$ {pin}={','.join(g.visible_id for g in gpus)} ")
            out.write(" ".join(cmd) + "\n")
            out.flush()
            proc = subprocess.Popen(
                cmd,
                cwd=self.config.root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=lease.fds,
            )
        try:
            timeout = self.config.timeout_for(lane_file.est_seconds)
            self.progress.event(
                f"START {lane_file.target} on GPU {_gpu_list(gpus)}"
                f"{f' (attempt {attempt})' if attempt > 1 else ''}, timeout {timeout:.0f} s"
            )
            return _Running(
                item, lane_file, gpus, lease, proc, log, junit, time.monotonic(), timeout,
                stats=stats,
            )  # fmt: skip
        except BaseException:  # a child the runner would not track: its group goes now
            _kill_group_and_wait(proc.pid)
            raise

    # -- finishing --------------------------------------------------------------------------

    def _evaluate(self, r: _Running, number: int, code: int, timed_out: bool) -> Attempt:
        seconds = time.monotonic() - r.started
        counts = None
        if r.junit.is_file():
            with contextlib.suppress(JunitError):
                counts = read_counts(r.junit)
        if timed_out:
            outcome = "timeout"
            detail = (
                f"timed out after {r.timeout:.0f} s (estimate {r.lane_file.est_seconds:g} s × "
                f"{self.config.timeout_factor:g}, at least {self.config.min_timeout_s:g} s); "
                "process group killed"
            )
        elif code == 0 and counts is not None and counts.ok and counts.skipped == 0:
            outcome, detail = "passed", ""
        elif code == 0 and self.config.collect_only:  # collected: all a dry run asks
            outcome, detail = "passed", "collected only (--collect-only: no test body ran)"
        else:
            outcome = "failed"
            if counts is None:
                detail = f"pytest exited {code} and wrote no junit report"
            elif code == 5 or counts.tests == 0:
                detail = "no test ran (pytest exit 5): a file that runs nothing does not pass"
            elif counts.skipped and not (counts.failures or counts.errors):
                detail = f"{counts.skipped} test(s) skipped on hardware they declared"
            else:
                bad = [f"{counts.failures} failed"] if counts.failures else []
                bad += [f"{counts.errors} errors"] if counts.errors else []
                detail = f"{', '.join(bad) or f'pytest exit {code}'} of {counts.tests}"
                with contextlib.suppress(JunitError):
                    first = first_problem(r.junit, limit=170)
                    if first:
                        detail += f"; first: {first}"
        classification = None
        if outcome != "passed":
            try:  # a log may be any size (the test writes it): its end holds the evidence
                text = read_tail(r.log, CLASSIFY_BYTES).decode("utf-8", errors="replace")
            except OSError:
                text = ""
            classification = classify(text, timed_out=timed_out)
        compile_stats, compile_warning = read_stats(r.stats) if r.stats else (None, None)
        return Attempt(
            number, r.gpus, seconds, outcome, detail, r.log, r.junit, code, counts, classification,
            compile_stats, compile_warning, started=r.started - self._started_at,
            sharing=r.item.shares_gpu and self.config.gpu_seats > 1,
        )  # fmt: skip

    def _finish(self, r: _Running, timed_out: bool) -> None:
        _kill_group_and_wait(r.proc.pid)
        if timed_out:
            with r.log.open("a") as out:
                out.write(
                    f"\nmizzen: the test file timed out after {r.timeout:.0f} s; its process "
                    "group was killed\n"
                )
        r.lease.release()

    # -- the loop ---------------------------------------------------------------------------

    def run(self, files: list[LaneFile]) -> list[FileResult]:
        by_target = {f.target: f for f in files}
        if len(by_target) != len(files):
            raise ValueError("a test file is listed twice")
        results = {f.target: FileResult(f) for f in files}
        packer = GpuPacker(
            [f.pack_item for f in files],
            [g.lease_key for g in self.config.gpus],
            seats=self.config.gpu_seats,
        )
        taken: dict[str, Lease] = {}
        self._started_at = time.monotonic()

        def acquire(item: PackItem, free: tuple[str, ...]) -> tuple[str, ...] | None:
            if item.shares_gpu and free[0] in self._shared:  # join the lease of a shared GPU
                taken[item.key] = self._shared[free[0]].share()
                return free
            what = "files sharing the GPU" if item.shares_gpu else item.key
            lease = self.leases.try_acquire(
                free, item.num_gpus, holder=f"mizzen {nox_session_name(self.config.arch)} {what}"
            )
            if lease is None:
                return None
            if item.shares_gpu and self.config.gpu_seats > 1:
                self._shared[lease.keys[0]] = lease  # the runner's handle, until the GPU is free
                lease = lease.share()
            taken[item.key] = lease
            return lease.keys

        blocked_since: float | None = None
        try:
            while not packer.done():
                for item, keys in packer.start_ready(acquire):
                    attempt = len(results[item.key].attempts) + 1
                    lease = taken.pop(item.key)
                    try:
                        self._running[item.key] = self._start(
                            item, by_target[item.key], keys, lease, attempt
                        )
                    except BaseException:  # no process holds it: a failed start frees its GPUs
                        lease.release()
                        raise
                    blocked_since = None
                now = time.monotonic()
                for key, r in list(self._running.items()):
                    code = r.proc.poll()
                    if code is None:
                        if r.term_sent is None and now - r.started > r.timeout:
                            r.term_sent = now
                            _signal_group(r.proc.pid, signal.SIGTERM)
                        elif (
                            r.term_sent is not None
                            and not r.kill_sent
                            and now - r.term_sent > self.config.kill_grace_s
                        ):
                            r.kill_sent = True
                            _signal_group(r.proc.pid, signal.SIGKILL)
                        continue
                    del self._running[key]
                    timed_out = r.term_sent is not None
                    self._finish(r, timed_out)
                    for gpu in packer.finish(key):
                        if gpu in self._shared:  # its last sharing file is gone
                            self._shared.pop(gpu).release()
                    result = results[key]
                    attempt = self._evaluate(r, len(result.attempts) + 1, code, timed_out)
                    self._record(result, attempt, packer)
                if packer.pending and not self._running:
                    if blocked_since is None:
                        blocked_since = now
                    elif now - blocked_since > self.config.lease_timeout_s:
                        self._lease_timeout(packer, results, now - blocked_since)
                        blocked_since = None
                self.progress.status(
                    {k: tuple(g.lease_key for g in r.gpus) for k, r in self._running.items()}
                )
                time.sleep(POLL_S)
        finally:
            for lease in taken.values():  # acquired in a batch whose start failed before theirs
                lease.release()
            self.kill_all()
        return [results[f.target] for f in files]

    def _lease_timeout(self, packer: GpuPacker, results: dict[str, FileResult], waited: float):
        item = packer.pending[0]
        packer.withdraw(item.key)
        keys = [g.lease_key for g in self.config.gpus]
        detail = (
            f"mizzen: GPU lease timeout: waited {waited:.0f} s for {item.num_gpus} GPU(s) leased "
            f"by another lane ({self.leases.describe_holders(keys)})"
        )
        result = results[item.key]
        attempt = Attempt(
            len(result.attempts) + 1, (), 0.0, "failed", detail, None, None,
            classification=classify(detail),
        )  # fmt: skip
        self._record(result, attempt, packer)

    def _record(self, result: FileResult, attempt: Attempt, packer: GpuPacker) -> None:
        result.attempts.append(attempt)
        lf = result.lane_file
        c = attempt.classification
        retry = (
            attempt.outcome != "passed"
            and c is not None
            and c.retry
            and len(result.attempts) <= self.config.retries
        )
        if retry:
            self.progress.event(
                f"RETRY {lf.target}: {c.name} ({c.evidence}); attempt {len(result.attempts) + 1}"
            )
            packer.add(lf.pack_item)
            return
        self.progress.done += 1
        word = {"passed": "PASS", "failed": "FAIL", "timeout": "TIMEOUT"}[attempt.outcome]
        why = f": {attempt.detail}" if attempt.detail else ""
        klass = f" [{c.name}]" if c is not None and attempt.outcome != "passed" else ""
        self.progress.event(
            f"[{self.progress.done}/{self.progress.total}] {word} {lf.target} "
            f"(GPU {_gpu_list(attempt.gpus)}, {attempt.seconds:.1f} s){klass}{why}"
            + (f"\n    log: {attempt.log}" if attempt.outcome != "passed" and attempt.log else "")
        )

    def kill_all(self) -> None:
        """Kill every running file's process group and release its GPUs."""
        for r in self._running.values():
            _signal_group(r.proc.pid, signal.SIGKILL)
        for r in self._running.values():
            with contextlib.suppress(Exception):
                r.proc.wait(timeout=10)
            _kill_group_and_wait(r.proc.pid, 2.0)
            r.lease.release()
        self._running.clear()
        for lease in self._shared.values():
            lease.release()
        self._shared.clear()


def _gpu_list(gpus: tuple[Gpu, ...]) -> str:
    return ",".join(str(g.index) for g in gpus) or "-"
