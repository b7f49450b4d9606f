"""Memory figures: a process's private memory for the turns' log lines, and how many local ranks
``serialized_checkpoint_loading="auto"`` lets restore at once, from the memory available."""

from __future__ import annotations

import math
from dataclasses import dataclass

from serialized_restore._options import PSUTIL_AVAILABLE

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
        how = "memory-mapped" if self.reader == "mmap" else "eagerly"
        return (
            f"{format_bytes(self.available)} available ({self.available_source}), {SAFETY_MARGIN:.0%} kept as margin;"
            f" one turn needs about {format_bytes(self.need_per_turn)}"
            f" (checkpoint {format_bytes(self.checkpoint_size)}, read {how}); {self.local_world_size} local ranks"
        )


def format_bytes(count: int) -> str:
    """``1.4 GiB``, ``35.2 KiB``, ``12 B``: a unit that fits, at every checkpoint size."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def private_memory() -> int:
    """This process's private (anonymous) resident memory in bytes, for the turns' log lines: ``RssAnon`` on Linux,
    which leaves out pages of a memory-mapped checkpoint; the resident set size elsewhere (psutil), or 0 where
    neither can be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if not PSUTIL_AVAILABLE:
        return 0
    import psutil

    return int(psutil.Process().memory_info().rss)


def plan_auto(checkpoint_size: int, reader: str, local_world_size: int, available_memory: int | None) -> AutoPlan:
    """(local rank 0 of each node) Choose ``k`` in ``[1, local_world_size]``, or 0 if even one turn does not fit.
    ``available_memory``: the bytes to assume available, or ``None`` to measure them."""
    if available_memory is not None:
        available, source = available_memory, "given"
    else:
        # RestoreOptions refused "auto" without psutil and without a memory figure already
        import psutil

        available, source = int(psutil.virtual_memory().available), "psutil"
    need = checkpoint_size if reader == "eager" else math.ceil(MMAP_PRIVATE_FRACTION * checkpoint_size)
    usable = available * (1 - SAFETY_MARGIN)
    k = local_world_size if need == 0 else min(local_world_size, int(usable // need))
    return AutoPlan(max(k, 0), local_world_size, available, source, checkpoint_size, reader, need)
