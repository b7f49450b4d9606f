"""How a restore runs, decided once on every rank for the Trainer and Fabric alike (``docs/design.md``, *Strategies*):
the strategy's path, the node-local copy of a remote file, the reader and ``k``."""

from __future__ import annotations

import enum
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from serialized_restore._flavour import lightning_names
from serialized_restore._fsdp import FULL, checkpoint_kind, upstream_reason
from serialized_restore._options import SerializedLoading
from serialized_restore._placement import RankPlacement
from serialized_restore._readers import choose_reader, stock_checkpoint_io
from serialized_restore._remote import is_remote
from serialized_restore._stuck import end_stuck_ranks, launched_by_lightning
from serialized_restore._turns import TurnSchedule

# the methods through which a strategy restores: a subclass that overrides one may run collectives there
RESTORE_METHODS = {
    "Trainer": ("load_checkpoint", "load_model_state_dict", "load_optimizer_state_dict"),
    "Fabric": ("load_checkpoint", "load_module_state_dict"),
}


IN_TURNS = "_serialized_restore_in_turns"  # marks the package's own method set on a strategy while Fabric loads


class StrategyPath(enum.Enum):
    """How the option restores with a strategy (:func:`strategy_path`)."""

    TURNS = "turns"
    FSDP = "fsdp"
    UPSTREAM = "upstream"


def choose_strategy_path(strategy: Any, owner: str, value: object, warned: set[Any]) -> StrategyPath:
    """(all ranks) The path of a ``Trainer``'s or ``Fabric``'s (``owner``) strategy; ``UPSTREAM`` warns once per class.
    Nothing in a turn may run a collective: single device and DDP in turns, FSDP together, anything else upstream."""
    fabric = owner == "Fabric"
    names = lightning_names(strategy)
    ddp, single, fsdp = (
        (names.FabricDDPStrategy, names.FabricSingleDeviceStrategy, names.FabricFSDPStrategy)
        if fabric
        else (names.DDPStrategy, names.SingleDeviceStrategy, names.FSDPStrategy)
    )
    base = next((b for b in (ddp, single, fsdp) if isinstance(strategy, b)), None)
    # a subclass's method, or one set on the instance (a framework's or a test's patch; not Fabric's own, in turns)
    patched = {m for m, f in vars(strategy).items() if callable(f) and not getattr(f, IN_TURNS, False)}
    overridden = [
        m
        for m in RESTORE_METHODS[owner]
        if base and (m in patched or getattr(type(strategy), m) is not getattr(base, m))
    ]
    if base is fsdp and not overridden:
        return StrategyPath.FSDP
    # a Trainer strategy that restores after setup restores with its model wrapped: collectives may run
    if base is not None and not overridden and not getattr(strategy, "restore_checkpoint_after_setup", False):
        return StrategyPath.TURNS
    if type(strategy) not in warned:
        warned.add(type(strategy))
        collectives = "its restore may run collectives, which cannot run while ranks take turns"
        on_instance = [m for m in overridden if m in patched]
        why = (
            f"its {', '.join(on_instance)} is set on the instance" if on_instance
            else f"it overrides {', '.join(overridden)}" if overridden
            else collectives
        )  # fmt: skip
        done = "loaded" if fabric else "restored"
        (names.fabric_rank_zero_warn if fabric else names.rank_zero_warn)(
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
    strategy: Any = None
    namespace: str = ""  # of this restore's keys in the job's store: the same on every rank, unique to this restore
    host_pid: int | None = None  # global rank 0's process id, sent with the namespace
    fetch: bool = False  # TURNS: a URL to fetch once per node before it is read (read_from its local copy)
    _schedules: int = field(default=0, repr=False)

    def schedule(self, in_turns: bool = False) -> TurnSchedule:
        """(all ranks, in the same order) A schedule over the job's default store whose turns (``ordered``) take ``k``
        ranks of a node at a time: ``in_turns``, the settings' ``k`` (1 where it is decided per stage); else every
        local rank. Each gets keys of its own under the restore's namespace."""
        self._schedules += 1
        k = (self.settings.max_concurrent or 1) if in_turns else self.placement.local_world_size
        return TurnSchedule(
            store=default_store(self.placement),
            placement=self.placement,
            max_concurrent=k,
            checkpoint_path=str(self.checkpoint_path),
            turn_timeout=float(self.settings.turn_timeout),
            namespace=f"{self.namespace}/{self._schedules}",
            logger=self.log,
            on_stuck=lambda schedule, ranks: end_stuck_ranks(
                self.strategy, self.placement, ranks, lambda: self._first_process(schedule)
            ),
        )

    def in_turns(self, stage: str, bounds_memory: bool, why: str) -> bool:
        """(all ranks) Whether ``stage`` runs in turns: with ``k`` given, always; decided per stage (``True``), where
        a turn bounds memory (``bounds_memory``: the stage reads the file into memory, or copies what it is given).
        Rank 0 of a job with several local ranks says which, and ``why``, at INFO."""
        k = self.settings.max_concurrent
        ordered = k is not None or bounds_memory
        lws = self.placement.local_world_size
        if lws > 1 and self.placement.global_rank == 0:
            if k is not None:
                how = f"in turns, {min(k, lws)} of the node's {lws} ranks at a time (k = {k})"
            elif ordered:
                how = f"in turns, one of the node's {lws} ranks at a time: {why}"
            else:
                how = f"with the node's {lws} ranks at once: {why} (an explicit k takes turns anyway)"
            self.log.info(f"serialized restore: {stage!r} {how}")
        return ordered

    def reads_in_turns(self, stage: str) -> bool:
        """(all ranks) :meth:`in_turns` for the ``stage`` that reads the file: a read into memory bounds memory with
        turns; a memory-mapped one allocates only what a rank keeps."""
        if self.reader == "mmap":
            why = "the checkpoint is memory-mapped, so a rank allocates only what it keeps"
        else:
            why = "the checkpoint is read into memory" + (f" ({self.reason})" if self.reason else "")
        return self.in_turns(stage, self.reader != "mmap", why)

    def read_from(self, source: Any) -> None:
        """(all ranks) Read ``source``, the checkpoint or its node-local copy, with the reader the settings and the
        file allow."""
        self.source = source
        self.reader, self.reason = choose_reader(self.strategy, source, self.settings.reader)

    def _first_process(self, schedule: TurnSchedule) -> int | None:
        """The process id of local rank 0 of this rank's node: global rank 0's came with the namespace; another node's
        local rank 0 wrote its own to the store as the restore started (:func:`plan_restore`)."""
        if self.placement.node_rank == 0:
            return self.host_pid
        value = schedule.read(_pid_key(self.namespace, self.placement.node_rank))
        return int(value) if value is not None and value.isascii() and value.isdigit() else None


def _pid_key(namespace: str, node: int) -> str:
    return f"serialized_restore/{namespace}/first process/{node}"


def default_store(placement: RankPlacement) -> Any:
    """The default process group's store, shared by every rank of the job; ``None`` for one process, or where the
    ranks did not initialise ``torch.distributed``."""
    if placement.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def plan_restore(
    owner: Any,
    owner_name: str,
    value: object,
    settings: SerializedLoading,
    checkpoint_path: Any,
    warned: set[Any],
    log: logging.Logger,
    fetch_remote: bool = False,
    fsdp: bool = True,
) -> RestorePlan:
    """(all ranks) How ``owner`` (``owner_name``) restores ``checkpoint_path``: FSDP only with a full checkpoint (and
    ``fsdp``); in turns, with the reader the settings and the file allow. ``fetch_remote``: a URL the stock
    ``CheckpointIO`` reads is to be fetched once per node first (``plan.fetch``); the caller fetches it and gives the
    plan the local copy (:meth:`RestorePlan.read_from`)."""
    strategy = owner.strategy
    path = choose_strategy_path(strategy, owner_name, value, warned)
    placement = RankPlacement.of(owner)
    plan = RestorePlan(path, placement, settings, checkpoint_path, log, source=checkpoint_path, strategy=strategy)
    names = lightning_names(strategy)
    info = names.fabric_rank_zero_info if owner_name == "Fabric" else names.rank_zero_info
    if path is StrategyPath.FSDP and not fsdp:
        plan.strategy_path = StrategyPath.UPSTREAM
    if plan.strategy_path is not StrategyPath.UPSTREAM and placement.world_size > 1:
        if default_store(placement) is None:
            if "no store" not in warned:
                warned.add("no store")
                info(
                    f"`{owner_name}(serialized_checkpoint_loading={value!r})` has no effect with"
                    f" {type(strategy).__name__}: its {placement.world_size} processes share no `torch.distributed`"
                    " process group, whose store the turns need. The checkpoint is restored as upstream Lightning does."
                )
            plan.strategy_path = StrategyPath.UPSTREAM
            return plan
        # a name for this restore's keys, from global rank 0 to every rank (the FSDP path with the checkpoint's path,
        # which FSDP's own load broadcasts first): no other restore, also not a restarted attempt of the job on a store
        # that outlived the first, reads them
        fsdp_path = checkpoint_path if plan.strategy_path is StrategyPath.FSDP else None
        sent = (fsdp_path, uuid.uuid4().hex, os.getpid()) if placement.global_rank == 0 else None
        source, plan.namespace, plan.host_pid = strategy.broadcast(sent)
        if placement.local_rank == 0 and placement.node_rank > 0 and launched_by_lightning(strategy):
            # read only if this process is named stuck (serialized_restore/_stuck.py); sent without an answer
            default_store(placement).set(_pid_key(plan.namespace, placement.node_rank), str(os.getpid()))
        if plan.strategy_path is StrategyPath.FSDP:
            plan.source = source
    if plan.strategy_path is StrategyPath.FSDP:
        kind, why = checkpoint_kind(strategy, plan.source)
        if kind != FULL:
            info(upstream_reason(kind, why, "load" if owner_name == "Fabric" else "restore"))
            plan.strategy_path = StrategyPath.UPSTREAM
    if plan.strategy_path is not StrategyPath.TURNS:
        return plan
    # a CheckpointIO of the user's own reads a URL itself, as upstream lets it (each rank in its turn)
    plan.fetch = fetch_remote and is_remote(checkpoint_path) and stock_checkpoint_io(strategy)
    if not plan.fetch:
        plan.read_from(checkpoint_path)
    return plan
