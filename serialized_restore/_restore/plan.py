"""How one restore runs, decided once on every rank for the Trainer and Fabric alike (``docs/design.md``, *The path of
one restore*): the strategy's path, the name of the restore's keys, whether a remote file is fetched once per node
first (:class:`RestorePlan`); then, once the file to read is local, how it is read (:class:`Source`). Both are
immutable: what is decided here is passed down, never sent back."""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from serialized_restore._coordination.placement import RankPlacement
from serialized_restore._coordination.store import job_store
from serialized_restore._coordination.turns import TurnSchedule
from serialized_restore._files import is_remote
from serialized_restore._lightning.names import Owner
from serialized_restore._lightning.strategies import StrategyPath, lightning_launcher, strategy_path
from serialized_restore._restore.fsdp import FULL, checkpoint_kind, upstream_reason
from serialized_restore._restore.readers import MMAP, choose_reader, stock_checkpoint_io
from serialized_restore.settings import SerializedLoading


class Notices:
    """What an owner (a ``Trainer``'s connector, a ``Fabric``) has said about why the option does not act: each
    subject (a strategy's class, the missing store) once, on rank 0, however many restores meet it."""

    def __init__(self) -> None:
        self._said: set[object] = set()

    def once(self, subject: object, say: Callable[[str], None], message: str) -> None:
        if subject not in self._said:
            self._said.add(subject)
            say(message)


def decide_strategy_path(owner: Owner, strategy: Any, value: object, notices: Notices) -> StrategyPath:
    """(all ranks) :func:`strategy_path`; where the strategy restores as upstream, rank 0 says why, once per class."""
    how, why = strategy_path(strategy, owner)
    if how is StrategyPath.UPSTREAM:
        notices.once(
            type(strategy),
            owner.warn(strategy),
            f"`{owner}(serialized_checkpoint_loading={value!r})` has no effect with {type(strategy).__name__}:"
            f" {why}. The checkpoint is {owner.done} as upstream Lightning does.",
        )
    return how


@dataclass(frozen=True)
class RestorePlan:
    """One restore as every rank runs it (:func:`plan_restore`)."""

    owner: Owner
    strategy_path: StrategyPath
    placement: RankPlacement
    settings: SerializedLoading
    checkpoint_path: Any  # as the user gave it
    namespace: str = ""  # of this restore's keys in the job's store: the same on every rank, unique to this restore
    host_pid: int | None = None  # global rank 0's process id, sent with the namespace
    fetch: bool = False  # TURNS: a URL the stock CheckpointIO reads, fetched once per node and read from its copy
    fsdp_path: Any = None  # FSDP: the path as global rank 0 sent it (FSDP's own load broadcasts it first)

    def turns(self, strategy: Any, log: logging.Logger) -> TurnSchedule:
        """(all ranks, once per restore) The restore's turns over the job's store: each stage has keys of its own
        under the restore's namespace, so the order in which a rank makes its turns cannot mix them up."""
        return TurnSchedule(
            store=job_store(self.placement.world_size),
            placement=self.placement,
            checkpoint_path=str(self.checkpoint_path),
            turn_timeout=float(self.settings.turn_timeout),
            namespace=self.namespace,
            logger=log,
            launcher=lightning_launcher(strategy),
            first_process=self.host_pid,
        )

    def k_for(self, stage: str, bounds_memory: bool, why: str, log: logging.Logger, say: bool = True) -> int | None:
        """(all ranks) How many local ranks of a node run ``stage`` at once (``None``: all): with ``k`` given, ``k``;
        decided per stage (``True``), one where a turn bounds memory (``bounds_memory``: the stage reads the file
        into memory, or copies what it is given), else all. Rank 0 of a job with several local ranks says which,
        and ``why``, at INFO (unless not ``say``)."""
        k = self.settings.max_concurrent
        lws = self.placement.local_world_size
        if say and lws > 1 and self.placement.global_rank == 0:
            if k is not None:
                how = f"in turns, {min(k, lws)} of the node's {lws} ranks at a time (k = {k})"
            elif bounds_memory:
                how = f"in turns, one of the node's {lws} ranks at a time: {why}"
            else:
                how = f"with the node's {lws} ranks at once: {why} (an explicit k takes turns anyway)"
            log.info(f"serialized restore: {str(stage)!r} {how}")
        return k if k is not None else 1 if bounds_memory else None

    def k_to_read(self, stage: str, source: Source, log: logging.Logger) -> int | None:
        """(all ranks) :meth:`k_for` the ``stage`` that reads ``source``: a read into memory bounds memory with turns;
        a memory-mapped one allocates only what a rank keeps. Where no checkpoint is there to read, nothing is said:
        the first rank's read raises upstream's own error, and every other rank names it."""
        if source.reason == "":
            return self.k_for(stage, True, "", log, say=False)
        if source.reader == MMAP:
            why = "the checkpoint is memory-mapped, so a rank allocates only what it keeps"
        else:
            why = "the checkpoint is read into memory" + (f" ({source.reason})" if source.reason else "")
        return self.k_for(stage, source.reader != MMAP, why, log)


@dataclass(frozen=True)
class Source:
    """What a rank reads, the checkpoint or its node-local copy, and how: ``"mmap"`` where the settings and the file
    allow it, else ``"eager"`` with the reason to log (``None``: eager was asked for; ``""``: nothing is there to
    read)."""

    path: Any
    reader: str
    reason: str | None = None

    @classmethod
    def of(cls, strategy: Any, path: Any, settings: SerializedLoading) -> Source:
        """(all ranks) How ``path`` is read with ``strategy``'s ``CheckpointIO`` under ``settings``."""
        return cls(path, *choose_reader(strategy, path, settings.reader))


def plan_restore(
    owner: Owner,
    strategy: Any,
    placement: RankPlacement,
    how: StrategyPath,
    value: object,
    settings: SerializedLoading,
    checkpoint_path: Any,
    notices: Notices,
    fetch_remote: bool = False,
) -> RestorePlan:
    """(all ranks) How ``owner`` restores ``checkpoint_path`` on the strategy path ``how`` decided for it: FSDP only
    with a full checkpoint; as upstream where the processes share no store. Sends a name for the restore's keys (and
    global rank 0's process id) to every rank with the strategy's own ``broadcast``: no other restore, also not a
    restarted attempt of the job on a store that outlived the first, reads them. ``fetch_remote``: a URL the stock
    ``CheckpointIO`` reads is to be fetched once per node first (``plan.fetch``)."""
    plan = RestorePlan(owner, how, placement, settings, checkpoint_path, fsdp_path=checkpoint_path)
    upstream = dataclasses.replace(plan, strategy_path=StrategyPath.UPSTREAM)
    if how is StrategyPath.UPSTREAM:
        return plan
    if placement.world_size > 1:
        if job_store(placement.world_size) is None:
            notices.once(
                "no store",
                owner.info(strategy),
                f"`{owner}(serialized_checkpoint_loading={value!r})` has no effect with {type(strategy).__name__}:"
                f" its {placement.world_size} processes share no `torch.distributed` process group, whose store the"
                " turns need. The checkpoint is restored as upstream Lightning does.",
            )
            return upstream
        sent = (checkpoint_path if how is StrategyPath.FSDP else None, uuid.uuid4().hex, os.getpid())
        fsdp_path, namespace, host_pid = strategy.broadcast(sent if placement.global_rank == 0 else None)
        plan = dataclasses.replace(plan, namespace=namespace, host_pid=host_pid, fsdp_path=fsdp_path)
    if how is StrategyPath.FSDP:
        kind, why = checkpoint_kind(strategy, plan.fsdp_path)
        if kind != FULL:
            owner.info(strategy)(upstream_reason(kind, why, owner.verb))
            return upstream
        return plan
    # a CheckpointIO of the user's own reads a URL itself, as upstream lets it (each rank in its turn)
    return dataclasses.replace(
        plan, fetch=fetch_remote and is_remote(checkpoint_path) and stock_checkpoint_io(strategy)
    )
