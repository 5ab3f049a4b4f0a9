"""``mizzen-train``: run SFT and RL jobs and plot their curves.

    mizzen-train rl --config example:rl_tiny           # two LoRA tenants learn two toy tasks by RL
    mizzen-train rl --config rl.toml --resume          # continue from the newest checkpoint
    mizzen-train sft --config run.toml                 # train; evaluate snapshots on the side
    mizzen-train sft --config run.toml --resume        # continue from the newest checkpoint
    mizzen-train sft --config run.toml --run.steps 120 --set tenants.0.lr=5e-4
    mizzen-train sft --help-config                     # every configuration field
    mizzen-train plot runs/demo/metrics.jsonl -o curves.png

Invariants:
- Every configuration field is settable from the command line: ``--<section>.<field> VALUE`` for
  the single-table sections (sft: [run], [model], [data], [eval]; rl: [run], [model],
  [rollout], [algo], [eval]), generated from the one field table of each command's config
  module, and ``--set KEY=VALUE`` for anything (``tenants.0.lr=1e-4``).
- Exit codes: 0 done; 2 a configuration, data or model-directory error (one message naming the
  field or file, the rule and the fix -- no traceback; under torchrun, a step every rank agrees
  on is reported by the rank that failed it, the others exit 2 silently); 1 the run failed while
  training.
- Importing this module imports nothing heavy; the trainer loads torch and megatron when it runs.
- Output (:mod:`mizzen_rollout.cli_surface`): a usage error is one line with the fix; third-party
  warnings are hidden before any heavy import and counted in one summary line, printed before
  the last line (the resume command) and left out when the command ends on an error line;
  ``--verbose`` shows them instead; ``--version`` is the installed distribution's.
- One rule for what the commands print (errors, the resume command, "wrote ..." lines; the
  trainers' progress lines alike): each line goes through rollout's ``shown_line`` -- masked, its
  control characters escaped, one terminal line -- since it may carry names read from disk.
- A ``--section.field`` flag is a typed value (a ``str`` field's text as given), applied before
  ``--set``; it is never re-serialised into ``--set`` text.
- Reading a run directory (``export``) imports no code its ``run.json`` names: the stored table is
  parsed as data; only a training command resolves rewards and estimators.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def _add_run_command(sub, name: str, sections: dict, **parser_kwargs) -> None:
    from mizzen_rollout.api import HelpFormatter

    command = sub.add_parser(name, formatter_class=HelpFormatter, **parser_kwargs)
    command.add_argument("--config", default=None, help="the run's TOML configuration")
    command.add_argument(
        "--resume", action="store_true", help="continue the run in run.dir from its checkpoint"
    )
    command.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any field (dotted; list items by index): --set tenants.0.lr=1e-4",
    )
    command.add_argument("--help-config", action="store_true", help="list every field and exit")
    _add_verbose(command)
    flags = command.add_argument_group("configuration fields")
    from mizzen_train.run.config import flag_sections

    for section in flag_sections(sections):
        for spec in dataclasses.fields(sections[section].cls):
            kind = spec.metadata["kind"]
            if kind in ("tables", "table"):
                continue
            flags.add_argument(
                f"--{section}.{spec.name}",
                dest=f"field:{section}.{spec.name}:{kind}",
                default=None,
                metavar=kind.upper().replace("[", "_").replace("]", ""),
                help=spec.metadata["help"],
            )


def _add_verbose(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--verbose",
        action="store_true",
        help="show the warnings of third-party libraries (megatron, torch, ...): by default "
        "one line counts them",
    )


def build_parser() -> argparse.ArgumentParser:
    from mizzen_rollout.api import HelpFormatter, OneLineParser, package_version
    from mizzen_train.rl.config import SECTIONS as RL_SECTIONS
    from mizzen_train.sft.config import SECTIONS

    parser = OneLineParser(
        prog="mizzen-train",
        description="Fine-tune language models on megatron-core.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"mizzen-train {package_version('mizzen-train')}"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_command(
        sub,
        "sft",
        SECTIONS,
        help="supervised fine-tuning with checkpoint-snapshot evaluation",
        description="Train K LoRA tenants on one base model; evaluate exported snapshots on "
        "the side. See --help-config for every field of the TOML configuration.",
    )
    _add_run_command(
        sub,
        "rl",
        RL_SECTIONS,
        help="RL (GRPO) on K LoRA tenants: rollout, reward, policy step, adapter sync",
        description="Train K LoRA tenants by RL on one base model: each step samples through "
        "the engines with the tenant's adapter, scores, steps and re-publishes the adapter. "
        "See --help-config for every field of the TOML configuration.",
    )

    export = sub.add_parser(
        "export",
        formatter_class=HelpFormatter,
        help="export a run's checkpoint: a PEFT adapter per tenant (and merged HF models)",
        description="Write <run_dir>/export/step-N/<tenant>/adapter (and merged/ with --merged) "
        "from a complete checkpoint of an existing sft or rl run.",
    )
    export.add_argument("run_dir", help="the run's directory (its run.dir)")
    export.add_argument("--step", type=int, default=None, help="the checkpoint (default: newest)")
    export.add_argument("--merged", action="store_true", help="also write merged HF models")
    _add_verbose(export)

    from mizzen_train.serve.command import add_serve_command

    add_serve_command(sub)
    _add_verbose(sub.choices["serve"])

    plot = sub.add_parser(
        "plot",
        formatter_class=HelpFormatter,
        help="draw loss and eval curves of a metrics.jsonl",
        description="Draw the loss and eval curves of a run's metrics.jsonl into an image.",
    )
    plot.add_argument("metrics", help="a run's metrics.jsonl")
    plot.add_argument("-o", "--output", required=True, help="the image to write (.png)")
    _add_verbose(plot)
    return parser


def _field_values(args: argparse.Namespace) -> list[tuple[str, object]]:
    """``(key, value)`` of every ``--section.field`` flag given, typed by its field's kind."""
    from mizzen_train.run.config import flag_value

    values = []
    for dest, text in vars(args).items():
        if dest.startswith("field:") and text is not None:
            _, key, kind = dest.split(":")
            values.append((key, flag_value(key, kind, text)))
    return values


def _say(text: str, *, stream=None) -> None:
    """Print one line of the command (the module docstring's rule: ``shown_line``)."""
    from mizzen_rollout.api import shown_line

    print(shown_line(text), file=stream or sys.stdout)


def _config_errors() -> tuple[type[BaseException], ...]:
    from mizzen_rollout.api import DataError, RewardSpecError
    from mizzen_train.errors import HFModelError, SlotCheckpointError, SlotConfigError
    from mizzen_train.eval_dispatch import EvalSpecError
    from mizzen_train.run.config import ConfigError
    from mizzen_train.run.state import RunStateError

    return (
        ConfigError, DataError, HFModelError, RunStateError, RewardSpecError, EvalSpecError,
        SlotConfigError, SlotCheckpointError,
    )  # fmt: skip


def _config_class(name: str):
    """The configuration class of the run command ``name`` (no torch imported)."""
    if name == "sft":
        from mizzen_train.sft.config import SftConfig

        return SftConfig
    from mizzen_train.rl.config import RlConfig

    return RlConfig


def _trainer_class(name: str):
    """The trainer of the run command ``name`` (imports torch and megatron)."""
    if name == "sft":
        from mizzen_train.sft.trainer import SftTrainer

        return SftTrainer
    from mizzen_train.rl.trainer import RlTrainer

    return RlTrainer


def cmd_run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``mizzen-train sft|rl``: help, or the run; Ctrl-C says how to resume."""
    config_cls = _config_class(args.command)
    if args.help_config:
        print(config_cls.help_text())
        return 0
    values = _field_values(args)
    if args.config is None and not args.set and not values:
        _say(
            f"mizzen-train {args.command}: error: give --config run.toml (see --help-config)",
            stream=sys.stderr,
        )
        return 2
    from mizzen_train.run.config import read_config_source

    raw, source = read_config_source(args.config, args.set, values)
    config = config_cls.parse(raw, source=source)
    config.check_input_files()  # before torch is imported and the base model is written
    from mizzen_train.run.trainer import run_trainer

    try:
        run_trainer(_trainer_class(args.command), config, resume=args.resume, stream=None)
    except KeyboardInterrupt:
        raise _Interrupted(_how_to_resume(args.command, config.run_dir, argv)) from None
    return 0


def _how_to_resume(command: str, run_dir, argv: Sequence[str]) -> str:
    import shlex

    from mizzen_train.run.state import complete_checkpoints

    checkpoints = complete_checkpoints(run_dir) if run_dir.is_dir() else []
    resume = [*argv, *([] if "--resume" in argv else ["--resume"])]
    where = f"the newest checkpoint is {checkpoints[-1]}" if checkpoints else "no checkpoint yet"
    return (
        f"mizzen-train {command}: interrupted; {where}. Resume with: mizzen-train "
        f"{shlex.join(resume)}"
    )


def cmd_export(args: argparse.Namespace) -> int:
    """``mizzen-train export RUN_DIR``: the run's own configuration (run.json) says its command."""
    from pathlib import Path

    from mizzen_train.run.state import (
        RunStateError,
        checkpoint_step,
        complete_checkpoints,
        read_run_config,
    )
    from mizzen_train.run.trainer import export_run

    run_dir = Path(args.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunStateError(f"{run_dir} is not a directory; give a run's run.dir")
    stored, source = read_run_config(run_dir)
    steps = [checkpoint_step(c) for c in complete_checkpoints(run_dir)]
    if args.step is not None and args.step not in steps:  # checked before a model is built
        have = ", ".join(map(str, steps)) or "none"
        raise RunStateError(
            f"{run_dir}: no complete checkpoint of step {args.step} (checkpoints: {have}); "
            "give --step one of them"
        )
    command = "rl" if "rollout" in stored else "sft"
    config_cls = _config_class(command)
    # eval: None, or not needed: an export evaluates nothing, and a stored [eval] that a newer
    # rule refuses (a snapshot_dir inside the run's own entries) must not keep a run's
    # checkpoints from being exported
    table = {name: value for name, value in stored.items() if value is not None and name != "eval"}
    table["run"] = {**stored["run"], "dir": str(run_dir)}
    config = config_cls.parse(table, source=source)
    path = export_run(_trainer_class(command), config, step=args.step, merged=args.merged)
    _say(f"mizzen-train export: wrote {path}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    import importlib.util

    from mizzen_train.run.plot import plot_metrics

    if importlib.util.find_spec("matplotlib") is None:
        _say(
            "mizzen-train plot: error: matplotlib is not installed; pip install "
            "'mizzen-train[plot]'",
            stream=sys.stderr,
        )
        return 2
    out = plot_metrics(args.metrics, args.output)
    _say(f"mizzen-train plot: wrote {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Output masks first (rollout's mask set: stdout/stderr and logging; the password-like
    environment and every engine URL's credentials are registered), then the command."""
    from mizzen_rollout.api import install_output_masks, register_environment

    restore = install_output_masks()
    try:
        register_environment()
        return _main(argv)
    finally:
        restore()


def _main(argv: Sequence[str] | None) -> int:
    """Parse, hide third-party noise (unless --verbose), run; the hidden warnings' summary line
    comes before the last line (an error or the resume command) and is left out on an error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    from mizzen_rollout.api import quiet_third_party

    finish = quiet_third_party(f"mizzen-train {args.command}", verbose=args.verbose)
    code, last_line = 1, None
    try:
        code, last_line = _run_command(args, argv)
    finally:
        # one summary per command: under torchrun only rank 0 (the run's writer) prints it
        finish(show_summary=code != 2 and os.environ.get("RANK", "0") == "0")
    if last_line:
        _say(last_line, stream=sys.stderr)
    return code


class _Interrupted(Exception):
    """Ctrl-C during a run; the message says how to resume it."""


def _run_command(args: argparse.Namespace, argv: list[str]) -> tuple[int, str | None]:
    """(exit code, the last line for stderr)."""
    from mizzen_train.run.parallel import RankFailed
    from mizzen_train.run.plot import PlotError

    errors = (*_config_errors(), PlotError)
    try:
        if args.command in ("sft", "rl"):
            return cmd_run(args, argv), None
        if args.command == "export":
            return cmd_export(args), None
        if args.command == "serve":
            from mizzen_train.serve.command import run_serve

            return run_serve(args), None
        return cmd_plot(args), None
    except RankFailed:  # another rank of a torchrun launch failed a step and said why
        return 2, None
    except errors as exc:
        return 2, f"mizzen-train {args.command}: error: {exc}"
    except _Interrupted as exc:
        return 130, str(exc)
    except KeyboardInterrupt:
        return 130, f"mizzen-train {args.command}: interrupted"
