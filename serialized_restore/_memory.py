"""``serialized_checkpoint_loading="auto"``: how many local ranks may restore at once, from the memory available."""

from __future__ import annotations

import math
from dataclasses import dataclass

import psutil

from serialized_restore._options import AVAILABLE_MEMORY_ENV, available_memory_override

SAFETY_MARGIN = 0.2
"""Fraction of the available memory left untouched by the estimate."""

MMAP_PRIVATE_FRACTION = 0.1
"""Private memory one memory-mapped turn is assumed to need, as a fraction of the checkpoint's size.

A memory-mapped turn keeps the file's pages in the (shared, reclaimable) page cache; what it allocates privately is
transient: tensors that hooks or dtype conversions copy. Optimizer state copied out of the file is not counted: the
job holds it for training anyway.
"""


@dataclass(frozen=True)
class AutoPlan:
    """The choice of ``k`` for one node and the figures it was made from."""

    max_concurrent: int
    """0 when not even one turn fits."""
    local_world_size: int
    available: int
    available_source: str
    checkpoint_size: int
    reader: str
    need_per_turn: int

    def describe(self) -> str:
        gib = 2**30
        return (
            f"{self.available / gib:.2f} GiB available ({self.available_source}), {SAFETY_MARGIN:.0%} kept as margin;"
            f" one turn needs about {self.need_per_turn / gib:.2f} GiB (checkpoint {self.checkpoint_size / gib:.2f}"
            f" GiB, read {self.reader}); {self.local_world_size} local ranks"
        )


def plan_auto(checkpoint_size: int, reader: str, local_world_size: int) -> AutoPlan:
    """(local rank 0 of each node) Choose ``k`` in ``[1, local_world_size]``, or 0 if even one turn does not fit."""
    override = available_memory_override()
    if override is not None:
        available, source = override, AVAILABLE_MEMORY_ENV
    else:
        available, source = int(psutil.virtual_memory().available), "psutil"
    if reader == "eager":
        need = checkpoint_size
    else:
        need = math.ceil(MMAP_PRIVATE_FRACTION * checkpoint_size)
    usable = available * (1 - SAFETY_MARGIN)
    k = local_world_size if need == 0 else min(local_world_size, int(usable // need))
    return AutoPlan(max(k, 0), local_world_size, available, source, checkpoint_size, reader, need)
