"""``serialized_checkpoint_loading="auto"``: ``k`` chosen by local rank 0 of each node from the memory available."""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING

from serialized_restore._memory import format_bytes
from serialized_restore._options import AUTO, AVAILABLE_MEMORY_SETTING, READER_SETTING
from serialized_restore._readers import local_path

if TYPE_CHECKING:
    from serialized_restore._plan import RestorePlan

STAGE_PLAN = "plan restore"

SAFETY_MARGIN = 0.2
"""Fraction of the available memory left untouched by the estimate."""

MMAP_PRIVATE_FRACTION = 0.1
"""Private memory one memory-mapped turn is assumed to need, as a fraction of the checkpoint's size: what hooks or
dtype conversions copy (the file's pages are shared, reclaimable page cache; optimizer state copied out is kept for
training anyway)."""


def plan_auto(
    checkpoint_size: int, reader: str, local_world_size: int, available_memory: int | None
) -> tuple[int, str]:
    """(local rank 0 of each node) ``k`` in ``[1, local_world_size]`` (0: not one turn fits), and the figures used."""
    if available_memory is not None:
        available, source = available_memory, "given"
    else:
        # settings_of refused "auto" without psutil and without a memory figure already
        import psutil

        available, source = int(psutil.virtual_memory().available), "psutil"
    need = checkpoint_size if reader == "eager" else math.ceil(MMAP_PRIVATE_FRACTION * checkpoint_size)
    k = local_world_size if need == 0 else min(local_world_size, int(available * (1 - SAFETY_MARGIN) // need))
    how = "memory-mapped" if reader == "mmap" else "eagerly"
    figures = (
        f"{format_bytes(available)} available ({source}), {SAFETY_MARGIN:.0%} kept as margin;"
        f" one turn needs about {format_bytes(need)}"
        f" (checkpoint {format_bytes(checkpoint_size)}, read {how}); {local_world_size} local ranks"
    )
    return max(k, 0), figures


def decide_max_concurrent(plan: RestorePlan, owner: str = "Trainer") -> int:
    """(all ranks) ``k`` as given, or as local rank 0 of the node chose it for ``"auto"`` (the others wait for it as for
    a turn); ``MemoryError`` when not even one rank fits."""
    settings, placement, reader, logger = plan.settings, plan.placement, plan.reader, plan.log
    if settings.max_concurrent != AUTO:
        return int(settings.max_concurrent)
    size = os.path.getsize(local) if (local := local_path(plan.source)) and os.path.isfile(local) else 0
    path = plan.checkpoint_path

    def decide() -> str:
        return json.dumps(plan_auto(size, reader, placement.local_world_size, settings.available_memory))

    decision = plan.schedule().on_one_rank(STAGE_PLAN, decide, central=placement.local_rank == 0, per_node=True)
    k, figures = parse_plan(decision or "")
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
    """``[k, figures]`` as local rank 0 wrote it to the store; ``ValueError`` for anything else."""
    try:
        k, figures = json.loads(text)
    except (TypeError, ValueError) as err:
        raise ValueError(f'"auto" read a malformed decision from the job\'s store: {text[:200]!r} ({err})') from None
    if isinstance(k, bool) or not isinstance(k, int) or not isinstance(figures, str):
        raise ValueError(f'"auto" read a malformed decision from the job\'s store: {text[:200]!r}')
    return k, figures
