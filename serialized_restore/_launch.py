"""``serialized-restore run`` and ``SERIALIZED_RESTORE``: the serialized restore on by default for every ``Trainer``
and ``Fabric`` of a job, through the bootstrap ``sitecustomize``'s import hook (``docs/launcher.md``)."""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import os
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

from serialized_restore._flavour import lightning_names

VARIABLE = "SERIALIZED_RESTORE"
BOOTSTRAP = os.path.join(os.path.dirname(os.path.realpath(__file__)), "_bootstrap")  # its ``sitecustomize.py``
PTH = "serialized_restore.pth"  # the start-up line that lets the variable alone switch it on (``hook``)
_PARAMETER = "serialized_checkpoint_loading"

# the project's module for each Lightning package, and the names each of its classes takes once the module has run
_OURS = {
    "lightning": "serialized_restore.lightning",
    "pytorch_lightning": "serialized_restore.pytorch_lightning",
    "lightning_fabric": "serialized_restore.fabric",
}
# (the modules that define the classes too: a program may import them from there)
_REPLACED: dict[str, dict[str, tuple[str, ...]]] = {
    "serialized_restore.lightning": {
        "Trainer": ("lightning", "lightning.pytorch", "lightning.pytorch.trainer", "lightning.pytorch.trainer.trainer"),
        "Fabric": ("lightning", "lightning.fabric", "lightning.fabric.fabric"),
    },
    "serialized_restore.pytorch_lightning": {
        "Trainer": ("pytorch_lightning", "pytorch_lightning.trainer", "pytorch_lightning.trainer.trainer")
    },
    "serialized_restore.fabric": {"Fabric": ("lightning_fabric", "lightning_fabric.fabric")},
}
_announced = False


def parse(raw: str) -> bool | int:
    """The ``serialized_checkpoint_loading`` value ``SERIALIZED_RESTORE=raw`` stands for, else ``ValueError``."""
    text = raw.strip()
    if text.isascii() and text.isdigit():
        k = int(text)
        return False if k == 0 else True if k == 1 else k
    raise ValueError(
        f"`{VARIABLE}={raw!r}` is not supported. Accepted values: `1` (the local ranks of a node restore one at a"
        " time), a positive int k (at most k at once) or `0` (off, as unset)."
    )


def switch_on(imported: str, raw: str, launched: bool, announce: bool = True) -> None:
    """(each process) After a Lightning package ran, import our module for it; after that module ran, give its classes
    the package's names, defaulting to the value ``SERIALIZED_RESTORE=raw`` stands for; the first built says so at
    INFO (rank 0) unless not ``announce``."""
    value = parse(raw)
    if value is False:
        return
    if imported in _OURS:
        # while the module itself imports the package, this returns it unfinished: the hook calls again when it is done
        importlib.import_module(_OURS[imported])
        return
    by = f"by `serialized-restore run` ({VARIABLE}={raw})" if launched else f"by {VARIABLE}={raw}"
    for name, modules in _REPLACED[imported].items():
        cls = getattr(sys.modules[imported], name)
        _default_to(cls, value, by, fabric=name == "Fabric", announce=announce)
        for module in modules:
            setattr(sys.modules[module], name, cls)


def _default_to(cls: type, value: object, by: str, fabric: bool, announce: bool) -> None:
    """Make ``value`` the default of ``cls(serialized_checkpoint_loading=...)``, in its signature too (LightningCLI)."""
    init: Callable[..., None] = cls.__init__  # type: ignore[misc]  # the class's own, as built by its module
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        global _announced
        given = kwargs.setdefault(_PARAMETER, value)
        init(self, *args, **kwargs)
        if _announced or not announce:
            return
        _announced = True
        owner = type(self).__name__
        if given == value:
            message = f"serialized restore: {owner}(serialized_checkpoint_loading={value!r}) switched on {by}"
        else:
            message = (
                f"serialized restore: the program builds {owner}(serialized_checkpoint_loading={given!r}) itself,"
                f" which wins over {value!r} set {by}"
            )
        names = lightning_names(self)
        (names.fabric_rank_zero_info if fabric else names.rank_zero_info)(message)

    parameters = [p.replace(default=value) if p.name == _PARAMETER else p for p in signature.parameters.values()]
    __init__.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    del __init__.__wrapped__  # type: ignore[attr-defined]  # the signature is the one set above
    cls.__init__ = __init__  # type: ignore[misc]


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


def hook(install: bool) -> int:
    """``serialized-restore hook install|remove``: add or remove, in this environment's site-packages, the ``.pth``
    line through which ``SERIALIZED_RESTORE`` alone switches the option on (a wheel install ships it; an editable
    install does not)."""
    line = Path(BOOTSTRAP, PTH).read_text()
    target = Path(sysconfig.get_paths()["purelib"], PTH)
    present = target.read_text() if target.is_file() else None
    if present not in (None, line):
        print(f"serialized-restore hook: {target} exists and is not this package's: left as it is", file=sys.stderr)
        return 1
    if install and present is None:
        target.write_text(line)
    elif not install and present is not None:
        target.unlink()
    state = f"on: {VARIABLE} switches the option on" if install else f"off: {VARIABLE} does nothing"
    print(f"serialized-restore hook: {state} in every Python process of {sys.prefix} ({target})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``serialized-restore run [--k K] -- <command ...>``: replaces this process with the command."""
    parser = argparse.ArgumentParser(
        prog="serialized-restore",
        description="Resume Lightning jobs from large checkpoints without running out of memory.",
    )
    commands = parser.add_subparsers(dest="subcommand", required=True, metavar="{run,hook,plan}")
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
    from serialized_restore import _preflight  # only here: the bootstrap imports this module in every process

    plan = commands.add_parser("plan", help=_preflight.HELP, description=_preflight.DESCRIPTION)
    _preflight.add_arguments(plan, _positive_int)
    args = parser.parse_args(argv)
    if args.subcommand == "hook":
        return hook(args.action == "install")
    if args.subcommand == "plan":
        return _preflight.run(args)
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
