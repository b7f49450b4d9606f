"""What the package knows of Lightning's strategies: how a strategy's restore can run (:class:`StrategyPath`), and
whether Lightning's own launcher started the job (whose first process then holds the other ranks' processes)."""

from __future__ import annotations

import enum
from typing import Any

from serialized_restore._lightning.names import Owner, lightning_names

# the methods through which a strategy restores: a subclass that overrides one may run collectives there
RESTORE_METHODS = {
    Owner.TRAINER: ("load_checkpoint", "load_model_state_dict", "load_optimizer_state_dict"),
    Owner.FABRIC: ("load_checkpoint", "load_module_state_dict"),
}


class StrategyPath(enum.Enum):
    """How the option restores with a strategy (:func:`strategy_path`)."""

    TURNS = "turns"
    FSDP = "fsdp"
    UPSTREAM = "upstream"


def strategy_path(strategy: Any, owner: Owner) -> tuple[StrategyPath, str]:
    """(all ranks) The path of ``owner``'s strategy, and for ``UPSTREAM`` why. Nothing in a turn may run a collective:
    single device and DDP in turns, FSDP together, anything else (a subclass that overrides a method it restores
    through, a method set on the instance, a strategy that restores after setup) as upstream."""
    names = lightning_names(strategy)
    ddp, single, fsdp = (
        (names.FabricDDPStrategy, names.FabricSingleDeviceStrategy, names.FabricFSDPStrategy)
        if owner is Owner.FABRIC
        else (names.DDPStrategy, names.SingleDeviceStrategy, names.FSDPStrategy)
    )
    base = next((b for b in (ddp, single, fsdp) if isinstance(strategy, b)), None)
    # a subclass's method, or one set on the instance (a framework's or a test's patch)
    patched = {m for m, f in vars(strategy).items() if callable(f)}
    overridden = [
        m
        for m in RESTORE_METHODS[owner]
        if base and (m in patched or getattr(type(strategy), m) is not getattr(base, m))
    ]
    if base is fsdp and not overridden:
        return StrategyPath.FSDP, ""
    # a Trainer strategy that restores after setup restores with its model wrapped: collectives may run
    if base is not None and not overridden and not getattr(strategy, "restore_checkpoint_after_setup", False):
        return StrategyPath.TURNS, ""
    on_instance = [m for m in overridden if m in patched]
    if on_instance:
        return StrategyPath.UPSTREAM, f"its {', '.join(on_instance)} is set on the instance"
    if overridden:
        return StrategyPath.UPSTREAM, f"it overrides {', '.join(overridden)}"
    return StrategyPath.UPSTREAM, "its restore may run collectives, which cannot run while ranks take turns"


def lightning_launcher(strategy: Any) -> Any:
    """The strategy's launcher where it is Lightning's own (the Trainer's or Fabric's), which keeps the processes of
    the other local ranks in the first process of a node (``procs``); else ``None``."""
    names = lightning_names(strategy)
    launcher = getattr(strategy, "launcher", None)
    return (
        launcher
        if isinstance(launcher, (names.SubprocessScriptLauncher, names.FabricSubprocessScriptLauncher))
        else None
    )
