"""``serialized-restore``: the command line. ``run`` starts a command with the option switched on in every Python
process it starts (``docs/launcher.md``), ``hook`` installs or removes the start-up line, ``forecast`` (also ``plan``)
says before a resume how much host memory it adds (``docs/forecast.md``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from serialized_restore._launcher.hook import BOOTSTRAP, VARIABLE, hook

_DESCRIPTION = f"""\
Run a command with the serialized restore switched on for every Lightning Trainer and Fabric it builds, in every
Python process it starts (the ranks Lightning's launchers, torchrun or mp.spawn start included), without changing
its code: when a process imports Lightning, its Trainer and Fabric (lightning, lightning.pytorch, lightning.fabric,
pytorch_lightning, lightning_fabric) are replaced by serialized_restore's, whose serialized_checkpoint_loading
defaults to the value given here. A value the program passes itself wins. Processes that never import Lightning
are unchanged. Rank 0 logs one line saying what was switched on.

The launcher sets {VARIABLE} (1 or k) and puts serialized_restore's bootstrap sitecustomize first on
PYTHONPATH; a sitecustomize of your own is still imported after it. Without the launcher, setting {VARIABLE} in
the job's environment has the same effect where serialized_restore is installed from a wheel, or after
`serialized-restore hook install` in an editable install."""

_EXAMPLES = """\
examples:
  serialized-restore run -- python train.py --ckpt last.ckpt
  serialized-restore run --k 2 -- torchrun --nproc-per-node 8 train.py fit --ckpt_path last.ckpt
  SERIALIZED_RESTORE=2 python train.py            (the variable alone, same effect as --k 2)"""


def _positive_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    """``serialized-restore run [--k K] -- <command ...>``: replaces this process with the command."""
    parser = argparse.ArgumentParser(
        prog="serialized-restore",
        description="Resume Lightning jobs from large checkpoints without running out of memory.",
    )
    commands = parser.add_subparsers(dest="subcommand", required=True, metavar="{run,hook,forecast}")
    run = commands.add_parser(
        "run",
        help="run a command with the serialized restore switched on",
        description=_DESCRIPTION,
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="serialized-restore run [-h] [--k K] -- command [arg ...]",
    )
    run.add_argument("--k", type=_positive_int, help="at most K local ranks of a node restore at once (default: 1)")
    run.add_argument("command", nargs=argparse.REMAINDER, help="the command, after `--`")
    hook_parser = commands.add_parser(
        "hook",
        help=f"let {VARIABLE} alone switch it on in this environment (needed after an editable install)",
        description=f"install: put the one-line start-up hook through which {VARIABLE} alone switches the option on"
        " into this environment's site-packages (a wheel install ships it, `pip install -e` does not); remove: take"
        " it out again.",
    )
    hook_parser.add_argument("action", choices=("install", "remove"))
    _add_forecast(commands.add_parser("forecast", aliases=["plan"], help=_FORECAST_HELP, description=_FORECAST))
    args = parser.parse_args(argv)
    if args.subcommand == "hook":
        return hook(args.action == "install")
    if args.subcommand in ("forecast", "plan"):
        return forecast(args)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        run.error("no command given")
    env = {**os.environ, VARIABLE: str(args.k or 1)}
    path = env.get("PYTHONPATH", "")
    if path.split(os.pathsep)[0] != BOOTSTRAP:  # not twice for a launcher run under the launcher
        env["PYTHONPATH"] = BOOTSTRAP + (os.pathsep + path if path else "")
    try:
        os.execvpe(command[0], command, env)
    except OSError as err:
        print(f"serialized-restore run: cannot run {command[0]!r}: {err.strerror}", file=sys.stderr)
        return 126 if isinstance(err, PermissionError) else 127


_FORECAST_HELP = "say before resuming how much host memory a resume adds per node, upstream and serialized"
_FORECAST = """\
Read a checkpoint's tensor table (its zip records and data.pkl, never the tensor data; local paths and fsspec URLs)
and predict, per node, the host memory a resume adds above the same job started without a checkpoint: with upstream
Lightning and with serialized_checkpoint_loading=True. For fit the figure is net of the optimizer state the job
keeps (the raw peak beside it); for validate the raw peak. The model: docs/forecast.md. `plan` is its former name.
Exit code 2: the checkpoint cannot be forecast (legacy format, not a checkpoint, not found)."""


def _add_forecast(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a local path or an fsspec URL (memory://, http://, s3://, ...)")
    parser.add_argument("--devices", type=_positive_int, required=True, help="local ranks per node (as the Trainer's)")
    parser.add_argument("--nodes", type=_positive_int, default=1, help="nodes (default: 1; FSDP's shards only)")
    parser.add_argument("--entry", choices=("fit", "validate"), default="fit", help="the Trainer's entry point")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp", help="default: ddp")
    parser.add_argument("--k", type=_positive_int, default=1, help="at most K local ranks restore at once (default 1)")
    parser.add_argument(
        "--accelerator",
        choices=("cpu", "gpu"),
        default="cpu",
        help="where the optimizer state lives after the restore (default: cpu, as measured; gpu: not yet measured)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of the table")


def forecast(args: argparse.Namespace) -> int:
    """``serialized-restore forecast``: print the forecast; 2 if the checkpoint cannot be forecast."""
    # only here: the bootstrap imports the launcher's modules in every process, and this one imports fsspec
    from serialized_restore import forecast as model

    try:
        table = model.read_table(args.checkpoint)
    except model.CannotForecast as err:
        if args.json:
            print(json.dumps({"checkpoint": args.checkpoint, "plannable": False, "error": str(err)}))
        print(f"serialized-restore forecast: {err}", file=sys.stderr)
        return 2
    predicted = model.predict(
        table, args.devices, args.nodes, args.entry, args.strategy, args.k, accelerator=args.accelerator
    )
    available = model.memory_available()
    print(
        json.dumps(model.to_json(predicted, available), indent=2) if args.json else model.render(predicted, available)
    )
    return 0
