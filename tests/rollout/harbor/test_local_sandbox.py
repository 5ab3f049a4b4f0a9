"""The local namespace sandbox: isolation from the real root, clean environment, safe transfers.

These run real `unshare`/`nsenter`/overlay mounts and need root (CI runs as root); without root
they fail with the sandbox's own explanation, which is tested separately.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.harbor.namespace_sandbox import NamespaceSandbox, SandboxError

register_cpu_ci(est_time=8, labels=["rollout", "harbor"])


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def layers(tmp_path: Path) -> Path:
    return tmp_path / "layers"


def test_writes_land_in_the_trial_layer_never_on_the_real_root(layers: Path) -> None:
    marker = f"/mizzen-sandbox-probe-{uuid.uuid4().hex}"
    # a host file on the root filesystem (not /tmp, which is a private tmpfs in the sandbox)
    host_dir = Path("/var/tmp") / f"mizzen-sandbox-probe-{uuid.uuid4().hex}"
    host_dir.mkdir(parents=True)
    host_file = host_dir / "host.txt"
    host_file.write_text("original")

    async def scenario() -> None:
        sandbox = NamespaceSandbox(layers, "iso", workdir="/app")
        await sandbox.start()
        try:
            result = await sandbox.run(
                f"pwd && mkdir -p {marker}/logs && echo inside > {marker}/logs/x "
                f"&& echo changed > {host_file} && cat {host_file} && rm {host_file} "
                "&& mkdir -p /logs /tests /solution && ls /proc | grep -c '^[0-9]'"
            )
            assert result.return_code == 0, result.stderr
            lines = result.stdout.split()
            assert lines[0] == "/app" and lines[1] == "changed"
            assert int(lines[2]) <= 5  # private PID namespace: only the sandbox's processes
            assert (sandbox.upper_dir / marker.lstrip("/") / "logs" / "x").read_text() == "inside\n"
        finally:
            await sandbox.stop(delete=True)
        assert not sandbox.layers_dir.exists()

    try:
        run(scenario())
        assert not Path(marker).exists()
        assert host_file.read_text() == "original"  # modified, then deleted, in the sandbox only
    finally:
        host_file.unlink(missing_ok=True)
        host_dir.rmdir()


def test_commands_get_a_clean_environment(layers: Path, monkeypatch) -> None:
    secret = "sk-sandbox-env-secret-9876543210"
    monkeypatch.setenv("DAYTONA_API_KEY", secret)

    async def scenario() -> str:
        sandbox = NamespaceSandbox(layers, "env")
        await sandbox.start()
        try:
            result = await sandbox.run(
                "env; cat /proc/1/environ | tr '\\0' '\\n'", env={"GIVEN": "yes"}
            )
            as_nobody = await sandbox.run("id -u", user="nobody")
            as_uid = await sandbox.run("id -u", user=65534)
            assert as_nobody.stdout.strip() == as_uid.stdout.strip() == "65534"
            return result.stdout
        finally:
            await sandbox.stop(delete=True)

    output = run(scenario())
    assert "GIVEN=yes" in output and "PATH=" in output
    assert secret not in output and "DAYTONA_API_KEY" not in output


def test_command_env_values_never_appear_in_any_argv(layers: Path) -> None:
    """Env values handed to a command (an installed agent's API key) travel in the process
    environment, never in an argv: every host user can read /proc/*/cmdline."""
    secret = "Q55-argv-secret-0f9e8d7c"

    def argv_holding_the_secret() -> list[str]:
        found = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if secret.encode() in cmdline.read_bytes():
                    found.append(str(cmdline))
            except OSError:  # the process ended while we looked
                continue
        return found

    async def scenario() -> tuple[list[str], str]:
        sandbox = NamespaceSandbox(layers, "argv")
        await sandbox.start()
        try:
            command = asyncio.ensure_future(
                sandbox.run('sleep 1.5; printf %s "$AGENT_API_KEY"', env={"AGENT_API_KEY": secret})
            )
            await asyncio.sleep(0.7)  # the command (nsenter, shell, sleep) is running now
            found = argv_holding_the_secret()
            return found, (await command).stdout
        finally:
            await sandbox.stop(delete=True)

    found, output = run(scenario())
    assert output == secret  # the command did receive the value (so the scan is not vacuous)
    assert found == []


def test_transfers_resolve_symlinks_inside_the_sandbox(layers: Path, tmp_path: Path) -> None:
    payload = tmp_path / "payload"
    (payload / "sub").mkdir(parents=True)
    (payload / "sub" / "f.txt").write_text("data")
    out = tmp_path / "out"

    async def scenario() -> None:
        sandbox = NamespaceSandbox(layers, "xfer")
        await sandbox.start()
        try:
            await sandbox.put_dir(payload, "/tests")
            # a symlink to an absolute path: must point at the SANDBOX's /etc, and writing
            # through it must stay in the sandbox
            await sandbox.run("ln -s /etc /tests/etc && ln -s /etc/hostname /tests/host")
            await sandbox.put_file(payload / "sub" / "f.txt", "/tests/etc/mizzen-probe")
            check = await sandbox.run("cat /tests/sub/f.txt /etc/mizzen-probe")
            assert check.stdout == "datadata"
            await sandbox.get_dir("/tests", out)
            await sandbox.get_file("/tests/sub/f.txt", out / "copy.txt")
            with pytest.raises(FileNotFoundError):
                await sandbox.get_file("/no/such/file", out / "missing.txt")
        finally:
            await sandbox.stop(delete=True)

    run(scenario())
    assert not Path("/etc/mizzen-probe").exists()
    assert (out / "sub" / "f.txt").read_text() == "data"
    assert (out / "copy.txt").read_text() == "data"
    assert not (out / "etc").exists() and not (out / "host").exists()  # escaping links skipped


def test_timeout_kills_the_command_and_stop_kills_everything(layers: Path) -> None:
    async def scenario() -> int:
        sandbox = NamespaceSandbox(layers, "kill")
        await sandbox.start()
        init_pid = sandbox._init_pid
        with pytest.raises(TimeoutError, match=r"timed out after 0\.5"):
            await sandbox.run("sleep 30", timeout_s=0.5)
        daemon = await sandbox.run("setsid sleep 300 > /dev/null 2>&1 & echo started")
        assert daemon.stdout.strip() == "started"
        await sandbox.stop(delete=True)
        return init_pid

    init_pid = run(scenario())
    assert not Path(f"/proc/{init_pid}").exists()
    leftovers = subprocess.run(["pgrep", "-f", "sleep 300"], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""


def test_a_crashed_worker_takes_its_sandbox_down(layers: Path) -> None:
    code = (
        "import asyncio, os, sys\n"
        "from pathlib import Path\n"
        "from mizzen_rollout.harbor.namespace_sandbox import NamespaceSandbox\n"
        "async def main():\n"
        f"    s = NamespaceSandbox(Path({str(layers)!r}), 'crash')\n"
        "    await s.start()\n"
        "    await s.run('setsid sleep 301 > /dev/null 2>&1 &')\n"
        "    print(s._init_pid, flush=True)\n"
        "    os._exit(3)\n"
        "asyncio.run(main())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 3, result.stderr
    init_pid = int(result.stdout.strip())
    for _ in range(100):
        if not Path(f"/proc/{init_pid}").exists():
            break
        asyncio.run(asyncio.sleep(0.05))
    assert not Path(f"/proc/{init_pid}").exists()
    assert subprocess.run(["pgrep", "-f", "sleep 301"], capture_output=True).stdout == b""


def test_non_root_gets_a_clear_explanation() -> None:
    # Fork (the interpreter is already loaded: nothing under /root needs to be readable), drop
    # to nobody, and report what the sandbox says.
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():  # the child only drops privileges and builds one object
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # child
        os.close(read_end)
        message = b""
        try:
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            NamespaceSandbox(Path("/tmp/mizzen-nonroot-layers"), "x")
        except SandboxError as exc:
            message = str(exc).encode()
        except BaseException as exc:  # anything else is a failure of the test
            message = f"unexpected {type(exc).__name__}: {exc}".encode()
        os.write(write_end, message)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        message = reader.read().decode()
    os.waitpid(pid, 0)
    assert "needs root" in message and "uid 65534" in message, message


def test_layers_on_overlayfs_are_refused(tmp_path: Path, monkeypatch) -> None:
    import mizzen_rollout.harbor.namespace_sandbox as module

    monkeypatch.setattr(module, "filesystem_type", lambda path: "overlay")
    with pytest.raises(SandboxError, match="overlay filesystem"):
        NamespaceSandbox(tmp_path, "x")
