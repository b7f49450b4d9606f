"""Which way a strategy restores with the option on, for the Trainer and Fabric alike, and the schedule its ranks
restore on (``docs/design.md``, *Strategies*).

Turns serialize the ranks of a node, so nothing inside a turn may run a collective: single device and the DDP family
restore in turns, FSDP with its ranks together (``_fsdp.py``), anything else as upstream.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Callable

import torch.distributed as dist

from serialized_restore._flavour import flavour_of
from serialized_restore._options import SerializedLoading
from serialized_restore._turns import RankPlacement, TurnSchedule

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


def strategy_path(strategy: Any, owner: str, value: object, warned: set[type]) -> StrategyPath:
    """(all ranks) The path of ``strategy``, a strategy of a ``Trainer`` or of a ``Fabric`` (``owner``).

    ``UPSTREAM`` comes with one warning on rank zero per strategy class (``warned``), quoting the option's ``value``.
    """
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
        why = (
            f"it overrides {', '.join(overridden)}"
            if overridden
            else "its restore may run collectives, which cannot run while ranks take turns"
        )
        done = "loaded" if fabric else "restored"
        flavour.import_("utilities.rank_zero", "rank_zero_warn", fabric=fabric)(
            f"`{owner}(serialized_checkpoint_loading={value!r})` has no effect with {type(strategy).__name__}:"
            f" {why}. The checkpoint is {done} as upstream Lightning does."
        )
    return StrategyPath.UPSTREAM


def placement_of(owner: Any) -> RankPlacement:
    """Where this process sits in the job, from a ``Trainer`` or a ``Fabric`` (both name the ranks alike)."""
    return RankPlacement(
        global_rank=owner.global_rank,
        world_size=owner.world_size,
        node_rank=owner.node_rank,
        local_rank=owner.local_rank,
        local_world_size=max(1, int(getattr(owner.strategy, "num_processes", 1))),
    )


def job_schedule(
    placement: RankPlacement,
    checkpoint_path: Any,
    settings: SerializedLoading,
    logger: logging.Logger,
    max_concurrent: int | None = None,
) -> TurnSchedule:
    """(all ranks) A schedule over the job's default store (none for a single process); ``max_concurrent``: by
    default every local rank at once."""
    initialized = dist.is_available() and dist.is_initialized()
    store = dist.distributed_c10d._get_default_store() if initialized and placement.world_size > 1 else None
    return TurnSchedule(
        store=store,
        placement=placement,
        max_concurrent=max_concurrent or placement.local_world_size,
        checkpoint_path=str(checkpoint_path),
        turn_timeout=float(settings.turn_timeout),
        heartbeat_timeout=float(settings.heartbeat_timeout),
        logger=logger,
    )


_noted_one_rank_per_node = False


def note_one_rank_per_node(placement: RankPlacement, info: Callable[[str], None]) -> None:
    """(every rank; ``info`` logs on global rank 0) Say once per process that with one rank per node no two ranks
    share a node's memory: turns serialize nothing and save nothing."""
    global _noted_one_rank_per_node
    if placement.local_world_size > 1 or placement.world_size == 1 or _noted_one_rank_per_node:
        return
    _noted_one_rank_per_node = True
    info(
        f"serialized restore: each of the {placement.world_size} nodes runs one rank, so no two ranks restore on the"
        " same node: the turns serialize nothing and save no memory (each rank still reads memory-mapped where it"
        " can and keeps only what it restores)."
    )
