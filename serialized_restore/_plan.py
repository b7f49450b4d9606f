"""How many ranks of a node restore at once, and the turn schedule over the job's store: shared by the Trainer's
connector (``_connector.py``) and by Fabric (``_fabric.py``)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch.distributed as dist

from serialized_restore._memory import plan_auto
from serialized_restore._options import AVAILABLE_MEMORY_SETTING, READER_SETTING, RestoreOptions
from serialized_restore._readers import choose_reader, local_path
from serialized_restore._turns import RankPlacement, TurnSchedule

STAGE_PLAN = "plan restore"


def job_schedule(
    placement: RankPlacement, checkpoint_path: Any, max_concurrent: int, options: RestoreOptions, logger: logging.Logger
) -> TurnSchedule:
    """(all ranks) A schedule over the job's default store (none for a single process)."""
    initialized = dist.is_available() and dist.is_initialized()
    store = dist.distributed_c10d._get_default_store() if initialized and placement.world_size > 1 else None
    return TurnSchedule(
        store=store,
        placement=placement,
        max_concurrent=max_concurrent,
        checkpoint_path=str(checkpoint_path),
        turn_timeout=options.turn_timeout,
        heartbeat_timeout=options.heartbeat_timeout,
        logger=logger,
    )


def decide_max_concurrent(
    options: RestoreOptions,
    strategy: Any,
    placement: RankPlacement,
    path: Any,
    source: Any,
    logger: logging.Logger,
    owner: str = "Trainer",
) -> int:
    """(all ranks) ``k`` as given, or for ``"auto"`` as local rank 0 of the node chose it from free memory for reading
    ``source`` (``path``, or its node-local copy).

    The node's other ranks wait for the decision as they wait for a turn (``STAGE_PLAN``): a local rank 0 that
    dies or raises before deciding ends the restore on every rank within the same bounds as a failed turn.
    Raises ``MemoryError`` when not even one rank fits; ``owner`` (``"Trainer"`` or ``"Fabric"``) names the class
    the option was given to in that message.
    """
    if options.max_concurrent is not None:
        return options.max_concurrent
    reader, _ = choose_reader(strategy, source, options.reader)
    size = os.path.getsize(local) if (local := local_path(source)) and os.path.isfile(local) else 0

    def decide() -> str:
        plan = plan_auto(size, reader, placement.local_world_size, options.available_memory)
        return json.dumps([plan.max_concurrent, plan.describe()])

    schedule = job_schedule(placement, path, placement.local_world_size, options, logger)
    k, figures = parse_plan(schedule.decide_per_node(STAGE_PLAN, decide))
    if placement.local_rank == 0:
        logger.info(f'serialized restore: "auto" chose k={k} for node {placement.node_rank}: {figures}')
    if k < 1:
        raise MemoryError(
            f'`{owner}(serialized_checkpoint_loading="auto")` found that not even one rank of node'
            f" {placement.node_rank} can restore {str(path)!r} in the memory available ({figures})."
            + (
                " Free memory, let it be read memory-mapped (a local checkpoint in torch's zip format, read by the"
                f" stock TorchCheckpointIO, and {READER_SETTING} not `eager`),"
                if reader == "eager"
                else " Free memory,"
            )
            + f" or set {AVAILABLE_MEMORY_SETTING} if the estimate is wrong."
        )
    return int(k)


def parse_plan(text: str) -> tuple[int, str]:
    """``[k, figures]`` as local rank 0 wrote it to the store; a clear ``ValueError`` for anything else (the store is
    not authenticated: see docs/security.md)."""
    try:
        k, figures = json.loads(text)
    except (TypeError, ValueError) as err:
        raise ValueError(f'"auto" read a malformed decision from the job\'s store: {text[:200]!r} ({err})') from None
    if isinstance(k, bool) or not isinstance(k, int) or not isinstance(figures, str):
        raise ValueError(f'"auto" read a malformed decision from the job\'s store: {text[:200]!r}')
    return k, figures


def local_world_size(strategy: Any) -> int:
    """The number of ranks on this node (Trainer and Fabric strategies alike)."""
    return max(1, int(getattr(strategy, "num_processes", 1)))


def placement_of(owner: Any, strategy: Any) -> RankPlacement:
    """Where this process sits in the job, from a ``Trainer`` or a ``Fabric`` (both name the ranks alike)."""
    return RankPlacement(
        global_rank=owner.global_rank,
        world_size=owner.world_size,
        node_rank=owner.node_rank,
        local_rank=owner.local_rank,
        local_world_size=local_world_size(strategy),
    )
