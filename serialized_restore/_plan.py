"""How a restore runs, decided once on every rank for the Trainer and Fabric alike (``docs/design.md``, *Strategies*):
the strategy's path, the node-local copy of a remote file, the reader and ``k``."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from serialized_restore._flavour import flavour_of
from serialized_restore._fsdp import FULL, checkpoint_kind, upstream_reason
from serialized_restore._options import SerializedLoading
from serialized_restore._placement import RankPlacement
from serialized_restore._readers import choose_reader
from serialized_restore._turns import TurnSchedule

# the methods through which a strategy restores: a subclass that overrides one may run collectives there
RESTORE_METHODS = {
    "Trainer": ("load_checkpoint", "load_model_state_dict", "load_optimizer_state_dict"),
    "Fabric": ("load_checkpoint", "load_module_state_dict"),
}


class StrategyPath(enum.Enum):
    """How the option restores with a strategy (:func:`strategy_path`)."""

    TURNS = "turns"
    FSDP = "fsdp"
    UPSTREAM = "upstream"


def choose_strategy_path(strategy: Any, owner: str, value: object, warned: set[type]) -> StrategyPath:
    """(all ranks) The path of a ``Trainer``'s or ``Fabric``'s (``owner``) strategy; ``UPSTREAM`` warns once per class.
    Nothing in a turn may run a collective: single device and DDP in turns, FSDP together, anything else upstream."""
    fabric = owner == "Fabric"
    flavour = flavour_of(strategy)
    ddp, single, fsdp = (
        flavour.import_("strategies", name, fabric=fabric)
        for name in ("DDPStrategy", "SingleDeviceStrategy", "FSDPStrategy")
    )
    base = next((b for b in (ddp, single, fsdp) if isinstance(strategy, b)), None)
    overridden = [m for m in RESTORE_METHODS[owner] if base and getattr(type(strategy), m) is not getattr(base, m)]
    if base is fsdp and not overridden:
        return StrategyPath.FSDP
    # a Trainer strategy that restores after setup restores with its model wrapped: collectives may run
    if base is not None and not overridden and not getattr(strategy, "restore_checkpoint_after_setup", False):
        return StrategyPath.TURNS
    if type(strategy) not in warned:
        warned.add(type(strategy))
        collectives = "its restore may run collectives, which cannot run while ranks take turns"
        why = f"it overrides {', '.join(overridden)}" if overridden else collectives
        done = "loaded" if fabric else "restored"
        flavour.import_("utilities.rank_zero", "rank_zero_warn", fabric=fabric)(
            f"`{owner}(serialized_checkpoint_loading={value!r})` has no effect with {type(strategy).__name__}:"
            f" {why}. The checkpoint is {done} as upstream Lightning does."
        )
    return StrategyPath.UPSTREAM


@dataclass
class RestorePlan:
    """One restore as every rank runs it (:func:`plan_restore`)."""

    strategy_path: StrategyPath
    placement: RankPlacement
    settings: SerializedLoading
    checkpoint_path: Any  # as the user gave it
    log: logging.Logger
    source: Any = None  # what is read: the checkpoint, or the node-local copy of a remote one
    reader: str = "eager"  # TURNS: "mmap" or "eager", with the reason for "eager" when there is one to log
    reason: str | None = None

    def schedule(self, in_turns: bool = False) -> TurnSchedule:
        """(all ranks) A schedule over the job's default store: ``in_turns``, with the settings' ``k``; else every
        local rank at once."""
        initialized = dist.is_available() and dist.is_initialized()
        store = dist.distributed_c10d._get_default_store() if initialized and self.placement.world_size > 1 else None
        return TurnSchedule(
            store=store,
            placement=self.placement,
            max_concurrent=int(self.settings.max_concurrent) if in_turns else self.placement.local_world_size,
            checkpoint_path=str(self.checkpoint_path),
            turn_timeout=float(self.settings.turn_timeout),
            logger=self.log,
        )


def plan_restore(
    owner: Any,
    owner_name: str,
    value: object,
    settings: SerializedLoading,
    checkpoint_path: Any,
    warned: set[type],
    log: logging.Logger,
    fetch: Callable[[RestorePlan], Any] | None = None,
    fsdp: bool = True,
) -> RestorePlan:
    """(all ranks) How ``owner`` (``owner_name``) restores ``checkpoint_path``: FSDP only with a full checkpoint (and
    ``fsdp``); in turns, the file ``fetch`` returns, with the reader the settings and the file allow."""
    strategy = owner.strategy
    path = choose_strategy_path(strategy, owner_name, value, warned)
    plan = RestorePlan(path, RankPlacement.of(owner), settings, checkpoint_path, log, source=checkpoint_path)
    info = flavour_of(strategy).import_("utilities.rank_zero", "rank_zero_info", fabric=owner_name == "Fabric")
    if path is StrategyPath.FSDP and not fsdp:
        plan.strategy_path = StrategyPath.UPSTREAM
    elif path is StrategyPath.FSDP:
        # FSDP's own load_checkpoint broadcasts the path from rank 0 first: every rank decides on the same path
        plan.source = strategy.broadcast(checkpoint_path)
        kind, why = checkpoint_kind(strategy, plan.source)
        if kind != FULL:
            info(upstream_reason(kind, why, "load" if owner_name == "Fabric" else "restore"))
            plan.strategy_path = StrategyPath.UPSTREAM
    if plan.strategy_path is not StrategyPath.TURNS:
        return plan
    if fetch is not None:
        plan.source = fetch(plan)
    plan.reader, plan.reason = choose_reader(strategy, plan.source, settings.reader)
    return plan
