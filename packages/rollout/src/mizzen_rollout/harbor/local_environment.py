"""`LocalSandboxEnvironment`: a Harbor environment that runs a trial on this machine, sandboxed.

Load it in Harbor by import path (`EnvironmentConfig(import_path=LOCAL_ENVIRONMENT_IMPORT_PATH)`,
or `harbor run --environment-import-path mizzen_rollout.harbor.local_environment:LocalSandboxEnvironment`).
Each trial gets its own `NamespaceSandbox` (see `namespace_sandbox` for the guarantees): a private
mount and PID namespace over an overlay of `/` with a per-trial writable layer, so Harbor's fixed
paths (`/logs`, `/tests`, `/solution`) work and nothing a trial writes touches the real root.

Invariants:
- Importing this module does not import Harbor: the class is built on first attribute access
  (module `__getattr__`), so the lazy-import policy of `mizzen_rollout` holds.
- The task's image is NOT built: commands run over this machine's root. A task meant for it must
  need only what the host has (its `environment/Dockerfile` is ignored; `workdir` is created).
- Network: public by default; a task asking for `no-network` gets a private network namespace
  (loopback only). Allowlists are not supported (Harbor rejects such tasks before start).
- Needs root; construction fails with the reason otherwise. NOT a security boundary for untrusted
  code: root in the sandbox is root on the host kernel (devices, kernel interfaces).

Environment kwargs (`EnvironmentConfig.kwargs`): `layers_root` (directory for the per-trial
layers; default `<tmp>/mizzen-local-sandbox`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

LOCAL_ENVIRONMENT_IMPORT_PATH = "mizzen_rollout.harbor.local_environment:LocalSandboxEnvironment"
LOCAL_ENVIRONMENT_TYPE = "mizzen-local-sandbox"
DEFAULT_LAYERS_ROOT = Path(tempfile.gettempdir()) / "mizzen-local-sandbox"

_built: dict[str, type] = {}


def _build_class() -> type:
    from harbor.environments.base import BaseEnvironment, ExecResult
    from harbor.environments.capabilities import EnvironmentCapabilities
    from harbor.models.task.config import TaskOS

    from mizzen_rollout.harbor.namespace_sandbox import (
        NamespaceSandbox,
        SandboxError,
        sandbox_unavailable_reason,
    )

    class LocalSandboxEnvironment(BaseEnvironment):
        """Harbor adapter over `NamespaceSandbox`; see the module docstring."""

        def __init__(self, *args: Any, layers_root: str | Path | None = None, **kwargs: Any):
            self._layers_root = Path(layers_root) if layers_root else DEFAULT_LAYERS_ROOT
            super().__init__(*args, **kwargs)
            self._sandbox = NamespaceSandbox(
                self._layers_root,
                self.session_id,
                workdir=self.task_env_config.workdir,
                isolate_network=self._network_disabled,
            )

        @staticmethod
        def type() -> str:
            return LOCAL_ENVIRONMENT_TYPE

        @classmethod
        def preflight(cls) -> None:
            reason = sandbox_unavailable_reason()
            if reason is not None:
                raise SystemExit(reason)

        @property
        def capabilities(self) -> EnvironmentCapabilities:
            return EnvironmentCapabilities(disable_internet=True)

        @property
        def upper_dir(self) -> Path:
            """This trial's writable layer on the host (inspection and tests)."""
            return self._sandbox.upper_dir

        def _validate_definition(self) -> None:
            if self.task_env_config.os != TaskOS.LINUX:
                raise SandboxError(
                    f"task {self.environment_name} declares os={self.task_env_config.os.value}; "
                    "the local sandbox runs Linux tasks only."
                )
            reason = sandbox_unavailable_reason()
            if reason is not None:
                raise SandboxError(reason)

        async def start(self, force_build: bool) -> None:
            await self._sandbox.start()
            await self.ensure_dirs(self._mount_targets(writable_only=True))

        async def stop(self, delete: bool) -> None:
            await self._sandbox.stop(delete=delete)

        async def exec(
            self,
            command: str,
            cwd: str | None = None,
            env: dict[str, str] | None = None,
            timeout_sec: int | None = None,
            user: str | int | None = None,
        ) -> ExecResult:
            try:
                result = await self._sandbox.run(
                    command,
                    cwd=cwd or self.task_env_config.workdir,
                    env=self._merge_env(env),
                    user=self._resolve_user(user),
                    timeout_s=timeout_sec,
                )
            except TimeoutError as exc:
                # Same contract as Harbor's docker environment: a timed-out command raises.
                raise RuntimeError(str(exc)) from None
            return ExecResult(
                stdout=result.stdout or None,
                stderr=result.stderr or None,
                return_code=result.return_code,
            )

        async def upload_file(self, source_path: Path | str, target_path: str) -> None:
            await self._sandbox.put_file(Path(source_path), str(target_path))

        async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
            await self._sandbox.put_dir(Path(source_dir), str(target_dir))

        async def download_file(self, source_path: str, target_path: Path | str) -> None:
            await self._sandbox.get_file(str(source_path), Path(target_path))

        async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
            await self._sandbox.get_dir(str(source_dir), Path(target_dir))

    LocalSandboxEnvironment.__module__ = __name__
    return LocalSandboxEnvironment


def __getattr__(name: str) -> Any:
    if name == "LocalSandboxEnvironment":
        if name not in _built:
            _built[name] = _build_class()
        return _built[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
