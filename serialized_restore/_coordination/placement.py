"""Where a process sits in the job: the one shared type every part of the restore reads ranks from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RankPlacement:
    """Global and node-local rank of a process; global rank ``node_rank * local_world_size + local_rank``."""

    global_rank: int
    world_size: int
    node_rank: int
    local_rank: int
    local_world_size: int

    def global_rank_of(self, local_rank: int) -> int:
        """The global rank of local rank ``local_rank`` of this process's node."""
        return self.node_rank * self.local_world_size + local_rank

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)

    @classmethod
    def of(cls, owner: Any) -> RankPlacement:
        """From a ``Trainer`` or a ``Fabric``, which name the ranks alike."""
        return cls(
            global_rank=owner.global_rank,
            world_size=owner.world_size,
            node_rank=owner.node_rank,
            local_rank=owner.local_rank,
            local_world_size=max(1, int(getattr(owner.strategy, "num_processes", 1))),
        )
