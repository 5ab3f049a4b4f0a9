"""`python -m mizzen_rollout.harbor run-trial ...`: run one Harbor trial the way a worker does.

It goes through the same path as a training run: `harbor_env_vars` (checks, credentials) sets this
process's worker environment, then the agent function `run` executes the trial and the outcome
(sample metadata) is printed as JSON. Exit code 0 when the trial ran (whatever its reward), 2 on a
configuration error. Everything it prints (and logs) goes through the process-wide mask set
(`mizzen_rollout.masking`), with the password-like environment registered first.

Example (local sandbox, needs root; oracle agent, no engine needed):

    python -m mizzen_rollout.harbor run-trial \
        --tasks-dir tests/rollout/harbor/tasks --task write-greeting --agent oracle
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from mizzen_rollout.harbor.agent import run_sync
from mizzen_rollout.harbor.errors import HarborConfigError
from mizzen_rollout.harbor.launcher import harbor_env_vars
from mizzen_rollout.harbor.local_environment import LOCAL_ENVIRONMENT_IMPORT_PATH
from mizzen_rollout.masking import install_output_masks, register_environment


def _sampling(pairs: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise HarborConfigError(f"--sampling {pair!r}: use KEY=VALUE, e.g. temperature=0.7")
        try:
            params[key] = json.loads(raw)
        except json.JSONDecodeError:
            params[key] = raw
    return params


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mizzen_rollout.harbor")
    commands = parser.add_subparsers(dest="command", required=True)
    trial = commands.add_parser("run-trial", help="run one Harbor trial and print its outcome")
    trial.add_argument("--tasks-dir", required=True, help="directory of task directories")
    trial.add_argument("--task", required=True, help="instance id (task directory name)")
    trial.add_argument("--agent", default="oracle", help="harness (default: oracle)")
    trial.add_argument(
        "--environment",
        default="local",
        help="'local' (the root-only local sandbox) or a Harbor environment type",
    )
    trial.add_argument("--environment-import-path", help="module:Class of a custom environment")
    trial.add_argument("--trials-dir", help="where trial directories go (default: a temp dir)")
    trial.add_argument("--model", default="default", help="model name the engine serves")
    trial.add_argument("--base-url", default="http://127.0.0.1:30000/v1", help="engine endpoint")
    trial.add_argument("--timeout", type=float, default=1800.0, help="trial wall-clock limit (s)")
    trial.add_argument("--max-iterations", type=int, help="agent turn limit (0 = none at all)")
    trial.add_argument("--response-too-long", default="abort", choices=["abort", "recover"])
    trial.add_argument("--sampling", nargs="*", default=[], metavar="KEY=VALUE")
    trial.add_argument("--keep-sandbox", action="store_true", help="keep the sandbox layers")
    return parser


def main(argv: list[str] | None = None) -> int:
    restore = install_output_masks()
    try:
        register_environment()
        return _run(argv)
    finally:
        restore()


def _run(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    import_path = args.environment_import_path
    environment_type = None
    if import_path is None:
        if args.environment.strip().lower() == "local":
            import_path = LOCAL_ENVIRONMENT_IMPORT_PATH
        else:
            environment_type = args.environment
    trials_dir = args.trials_dir or tempfile.mkdtemp(prefix="mizzen-trials-")
    try:
        env = harbor_env_vars(
            tasks_dir=args.tasks_dir,
            trials_dir=trials_dir,
            model_name=args.model,
            environment_type=environment_type,
            environment_import_path=import_path,
            agent=args.agent,
            trial_timeout_s=args.timeout,
            max_iterations=args.max_iterations,
            response_too_long=args.response_too_long,
            keep_sandbox=args.keep_sandbox,
            echo=lambda line: print(line, file=sys.stderr),
        )
        os.environ.update(env)
        outcome = run_sync(
            args.base_url, None, _sampling(args.sampling), {"instance_id": args.task}
        )
    except HarborConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(outcome, indent=2, default=str))
    print(f"trial directory: {Path(outcome['trial_dir'] or trials_dir)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
