"""A per-trial sandbox made of Linux namespaces over an overlay of this machine's root.

This module is the mechanism only (no Harbor import); `local_environment` adapts it to Harbor's
`BaseEnvironment`.

Invariants:
- One sandbox = one private mount namespace and one private PID namespace, created by
  `unshare --mount --pid --fork` and held open by a small init process. Inside it `/` is
  `overlay(lower=/, upper=<layers>/upper)`: reads see the host root, every write lands in the
  per-trial upper layer. The host's mount table is never changed (propagation is private).
- `/proc` is the namespace's own (only the sandbox's processes are visible), `/tmp` and `/dev/shm`
  are private tmpfs, `/dev` and `/sys` are bound from the host. Only the root filesystem is
  overlaid: other host mounts appear as their (empty) mount-point directories.
- Every command enters the namespaces with `nsenter`, chrooted into the overlay, with a clean
  environment (PATH, HOME, LANG, TERM plus what the caller passes); the worker's own environment,
  which may hold provider keys, never reaches a sandboxed command. Commands run as root unless a
  user is given (`runuser -u NAME`, or `setpriv` for a numeric uid).
- File transfers run `tar`/`cat` inside the sandbox root, so a symlink made in the sandbox resolves
  inside the sandbox and cannot make a transfer read or write the host's real files.
- `stop()` SIGKILLs the namespace's init; the kernel then kills every process left in the PID
  namespace and the mounts vanish with it. `stop(delete=True)` also removes the layers. A worker
  that dies without stop() takes its sandbox down too (parent-death signal on `unshare
  --kill-child`); only the layers directory is left behind then.
- Needs root (mounting, entering namespaces). It is a development and test tool, NOT a security
  boundary: root inside is root on the host kernel, host devices are reachable through `/dev`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shlex
import shutil
import signal
import tarfile
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

_READY = "MIZZEN_SANDBOX_READY"
_START_TIMEOUT_S = 60.0
_BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_REQUIRED_TOOLS = ("unshare", "nsenter", "mount", "chroot", "tar")

# The init of the sandbox (PID 1 of its PID namespace). It mounts the overlay and the private
# special filesystems, reports readiness, then chroots into the overlay and sleeps: `nsenter
# --root` takes the root of this process, so every command lands in the overlay.
_INIT_SCRIPT = r"""
set -eu
merged=$1 upper=$2 work=$3 net=$4
mount -t overlay mizzen-sandbox -o "lowerdir=/,upperdir=$upper,workdir=$work" "$merged"
mount -t proc proc "$merged/proc"
mount --rbind /dev "$merged/dev"
mount -t tmpfs -o mode=1777 tmpfs "$merged/dev/shm"
mount --rbind /sys "$merged/sys"
mount -t tmpfs -o mode=1777 tmpfs "$merged/tmp"
if [ "$net" = isolated ] && command -v ip >/dev/null 2>&1; then ip link set lo up || true; fi
echo MIZZEN_SANDBOX_READY
exec chroot "$merged" /bin/sh -c 'exec sleep infinity'
"""


class SandboxError(RuntimeError):
    """The sandbox could not be created, entered or used."""


def sandbox_unavailable_reason() -> str | None:
    """Why a sandbox cannot run on this machine (None when it can)."""
    if os.geteuid() != 0:
        return (
            "the local sandbox needs root: it mounts an overlay of / and enters Linux namespaces "
            f"(running as uid {os.geteuid()}). Run the trial as root (CI and the dev containers "
            "do), or use a container environment type such as 'docker'."
        )
    missing = [tool for tool in _REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        return (
            f"the local sandbox needs the util-linux/coreutils tools {', '.join(missing)} on PATH "
            "(apt-get install util-linux tar)."
        )
    return None


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` (the longest mount point in /proc/self/mounts)."""
    resolved = str(path.resolve())
    best, best_type = "", "unknown"
    with open("/proc/self/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) < 3:
                continue
            mount_point = fields[1].replace("\\040", " ")
            inside = resolved == mount_point or resolved.startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) >= len(best):
                best, best_type = mount_point, fields[2]
    return best_type


def _die_with_parent() -> None:
    """Child-side hook: SIGKILL this process when the process that started it dies.

    The sandbox init is started with `unshare --kill-child`, so a worker that crashes without
    calling stop() still takes its sandbox (and every process in it) down with it.
    """
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _safe_member(member: tarfile.TarInfo, dest_path: str) -> tarfile.TarInfo | None:
    """`tarfile.data_filter`, skipping what it refuses instead of aborting the whole download.

    Skipped: FIFOs and device nodes (no content) and links that would point outside the target
    (absolute or escaping symlinks made inside the sandbox); they mean nothing on the host.
    """
    if member.isdev():
        return None
    try:
        return tarfile.data_filter(member, dest_path)
    except tarfile.FilterError:
        return None


@dataclass(frozen=True)
class CommandResult:
    return_code: int
    stdout: str
    stderr: str


class NamespaceSandbox:
    """One trial's sandbox; see the module docstring for what it guarantees."""

    def __init__(
        self,
        layers_root: Path,
        name: str,
        *,
        workdir: str | None = None,
        isolate_network: bool = False,
    ) -> None:
        reason = sandbox_unavailable_reason()
        if reason is not None:
            raise SandboxError(reason)
        layers_root = Path(layers_root)
        layers_root.mkdir(parents=True, exist_ok=True)
        fs_type = filesystem_type(layers_root)
        if fs_type == "overlay":
            raise SandboxError(
                f"layers_root {layers_root} is on an overlay filesystem, which cannot hold an "
                "overlay's upper layer; point layers_root at a directory on ext4, xfs or tmpfs "
                "(environment kwarg layers_root=...)."
            )
        safe_name = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80]
        self.layers_dir = layers_root / f"{safe_name}-{uuid.uuid4().hex[:8]}"
        self.workdir = workdir
        self.isolate_network = isolate_network
        self._holder: asyncio.subprocess.Process | None = None
        self._init_pid: int | None = None
        self._shell = "/bin/bash" if Path("/bin/bash").exists() else "/bin/sh"

    @property
    def upper_dir(self) -> Path:
        """The per-trial writable layer (what the trial wrote, as seen from the host)."""
        return self.layers_dir / "upper"

    @property
    def running(self) -> bool:
        return self._init_pid is not None

    # ----------------------------------------------------------------------------------- life

    async def start(self) -> None:
        if self.running:
            return
        merged = self.layers_dir / "merged"
        work = self.layers_dir / "work"
        for directory in (self.upper_dir, work, merged):
            directory.mkdir(parents=True, exist_ok=True)
        argv = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private"]
        if self.isolate_network:
            argv.append("--net")
        argv += [
            "/bin/sh",
            "-c",
            _INIT_SCRIPT,
            "mizzen-sandbox-init",
            str(merged),
            str(self.upper_dir),
            str(work),
            "isolated" if self.isolate_network else "host",
        ]
        self._holder = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={"PATH": _BASE_PATH, "LANG": "C.UTF-8"},
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        assert self._holder.stdout is not None
        try:
            line = await asyncio.wait_for(self._holder.stdout.readline(), _START_TIMEOUT_S)
        except TimeoutError:
            line = b""
        if line.decode(errors="replace").strip() != _READY:
            holder = self._holder
            with contextlib.suppress(ProcessLookupError):
                os.killpg(holder.pid, signal.SIGKILL)
            stderr = b""
            if holder.stderr is not None:
                with contextlib.suppress(TimeoutError):
                    stderr = await asyncio.wait_for(holder.stderr.read(), 5)
            await self._kill_holder()
            raise SandboxError(
                f"the sandbox init in {self.layers_dir} did not come up: "
                f"{stderr.decode(errors='replace').strip() or 'no output'}. The overlay needs "
                "root, a kernel with overlayfs and a layers_root that is not itself on overlayfs."
            )
        self._init_pid = await self._find_init_pid(self._holder.pid)
        if self.workdir:
            result = await self.run(f"mkdir -p {shlex.quote(self.workdir)}", cwd="/")
            if result.return_code != 0:
                raise SandboxError(f"could not create workdir {self.workdir}: {result.stderr}")

    @staticmethod
    async def _find_init_pid(unshare_pid: int) -> int:
        children = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children")
        for _ in range(200):
            with contextlib.suppress(OSError):
                pids = children.read_text().split()
                if pids:
                    return int(pids[0])
            await asyncio.sleep(0.01)
        raise SandboxError(f"could not find the sandbox init (child of unshare pid {unshare_pid})")

    async def stop(self, delete: bool) -> None:
        await self._kill_holder()
        if delete and self.layers_dir.exists():
            await asyncio.to_thread(shutil.rmtree, self.layers_dir, True)

    async def _kill_holder(self) -> None:
        if self._init_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._init_pid, signal.SIGKILL)
            self._init_pid = None
        if self._holder is not None:
            # unshare reaps the dead init and exits; kill it only if it does not.
            try:
                await asyncio.wait_for(self._holder.wait(), 5)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._holder.pid, signal.SIGKILL)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._holder.wait(), 5)
            self._holder = None

    # ------------------------------------------------------------------------------- commands

    def _enter_argv(self) -> list[str]:
        if self._init_pid is None:
            raise SandboxError("the sandbox is not running; call start() first")
        argv = ["nsenter", "--target", str(self._init_pid), "--mount", "--pid", "--root", "--wd"]
        if self.isolate_network:
            argv.append("--net")
        return [*argv, "--"]

    def _command_env(self, env: dict[str, str] | None, home: str) -> dict[str, str]:
        base = {"PATH": _BASE_PATH, "HOME": home, "LANG": "C.UTF-8", "TERM": "xterm-256color"}
        return {**base, **(env or {})}

    def _user_argv(self, user: str | int | None) -> tuple[list[str], str]:
        """The command prefix that drops to `user`, and that user's HOME."""
        if user is None or str(user) in ("root", "0"):
            return [], "/root"
        spec = str(user)
        if spec.isdigit():
            return ["setpriv", f"--reuid={spec}", f"--regid={spec}", "--clear-groups"], "/tmp"
        try:
            home = pwd.getpwnam(spec).pw_dir  # the sandbox's passwd is the host's (lower layer)
        except KeyError:
            home = "/tmp"
        return ["runuser", "-u", spec, "--"], home

    async def run(
        self,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | int | None = None,
        timeout_s: float | None = None,
        stdin_path: Path | None = None,
        stdout_path: Path | None = None,
    ) -> CommandResult:
        """Run `command` with the shell inside the sandbox; raises on timeout (killing it)."""
        directory = cwd or self.workdir or "/"
        script = f"cd {shlex.quote(directory)} || exit 125\n{command}"
        user_argv, home = self._user_argv(user)
        argv = [*self._enter_argv(), *user_argv, self._shell, "-c", script]
        stdin_file = open(stdin_path, "rb") if stdin_path is not None else None  # noqa: SIM115
        stdout_file = open(stdout_path, "wb") if stdout_path is not None else None  # noqa: SIM115
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=stdin_file if stdin_file is not None else asyncio.subprocess.DEVNULL,
                stdout=stdout_file if stdout_file is not None else asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self._command_env(env, home),
                start_new_session=True,
            )
            try:
                stdout, stderr = await asyncio.wait_for(process.communicate(), timeout_s)
            except (TimeoutError, asyncio.CancelledError):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
                raise
        except TimeoutError:
            raise TimeoutError(f"Command timed out after {timeout_s} seconds") from None
        finally:
            for handle in (stdin_file, stdout_file):
                if handle is not None:
                    handle.close()
        return CommandResult(
            return_code=process.returncode if process.returncode is not None else -1,
            stdout=(stdout or b"").decode(errors="replace"),
            stderr=(stderr or b"").decode(errors="replace"),
        )

    # ------------------------------------------------------------------------------ transfers

    async def put_dir(self, source_dir: Path, target_dir: str) -> None:
        """Copy the contents of host `source_dir` into sandbox `target_dir`."""
        source_dir = Path(source_dir)
        if not source_dir.is_dir():
            raise FileNotFoundError(f"upload source is not a directory: {source_dir}")
        await self._put_tar(target_dir, [(source_dir, ".")])

    async def put_file(self, source_path: Path, target_path: str) -> None:
        source_path = Path(source_path)
        if not source_path.is_file():
            raise FileNotFoundError(f"upload source is not a file: {source_path}")
        target = PurePosixPath(target_path)
        await self._put_tar(str(target.parent), [(source_path, target.name)])

    async def _put_tar(self, target_dir: str, members: list[tuple[Path, str]]) -> None:
        with tempfile.TemporaryDirectory(prefix="mizzen-sandbox-put-") as scratch:
            archive = Path(scratch) / "payload.tar"
            with tarfile.open(archive, "w") as tar:
                for path, arcname in members:
                    tar.add(path, arcname=arcname)
            quoted = shlex.quote(target_dir)
            result = await self.run(
                f"mkdir -p {quoted} && tar -x -f - -C {quoted}", cwd="/", stdin_path=archive
            )
        if result.return_code != 0:
            raise SandboxError(f"upload into {target_dir} failed: {result.stderr.strip()}")

    async def get_file(self, source_path: str, target_path: Path) -> None:
        target_path = Path(target_path)
        target_path.parent.mkdir(parents=True, exist_ok=True)
        partial = target_path.with_name(f".{target_path.name}.partial")
        result = await self.run(f"cat -- {shlex.quote(source_path)}", cwd="/", stdout_path=partial)
        if result.return_code != 0:
            partial.unlink(missing_ok=True)
            raise FileNotFoundError(
                f"download of {source_path} from the sandbox failed: {result.stderr.strip()}"
            )
        partial.replace(target_path)

    async def get_dir(self, source_dir: str, target_dir: Path) -> None:
        """Copy the contents of sandbox `source_dir` into host `target_dir`."""
        target_dir = Path(target_dir)
        target_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="mizzen-sandbox-get-") as scratch:
            archive = Path(scratch) / "payload.tar"
            result = await self.run(
                f"tar -c -f - -C {shlex.quote(source_dir)} .", cwd="/", stdout_path=archive
            )
            if result.return_code != 0:
                raise FileNotFoundError(
                    f"download of {source_dir} from the sandbox failed: {result.stderr.strip()}"
                )
            with tarfile.open(archive, "r") as tar:
                tar.extractall(target_dir, filter=_safe_member)
