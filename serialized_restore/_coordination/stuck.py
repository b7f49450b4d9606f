"""A rank named stuck ends with the job under Lightning's own launcher (``docs/failures.md``, *A stuck rank*).

torchrun's agent and ``ddp_spawn``'s parent process end every worker once one exits with an error. Lightning's
``_SubprocessScriptLauncher`` does not: its observer thread, in the first process, ends the job when a child process
exits with an error, but nothing ends a child whose first process exits, and nothing ends a stopped first process.
So when a restore names a rank of this node as stuck, the process that launched it, or that it launched, kills it:
the first process its children (it holds their ``Popen``), a child its first process (checked to be its parent)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from serialized_restore._coordination.placement import RankPlacement
from serialized_restore._coordination.store import BoundedStore


@dataclass(frozen=True)
class StuckRanks:
    """How this rank ends the ranks of its node a restore names as stuck, where Lightning's own launcher started the
    job (``launcher``: its ``procs``, which the first process of a node holds, are the other local ranks' processes).

    ``first_process``: node 0's local rank 0's process id (global rank 0's, sent as the restore started);
    ``first_process_key``: where another node's local rank 0 writes its own (:meth:`announce`)."""

    placement: RankPlacement
    launcher: Any
    first_process: int | None
    first_process_key: str

    def announce(self, store: BoundedStore) -> None:
        """(local rank 0 of a node other than node 0, as the restore starts) Write this process's id, which the node's
        other ranks read only if they must end it; sent without waiting for an answer."""
        p = self.placement
        if p.local_rank == 0 and p.node_rank > 0:
            store.call("set", self.first_process_key, str(os.getpid()))

    def end(self, stuck: list[int], store: BoundedStore | None) -> bool:
        """(each rank, before it raises an error naming ``stuck`` global ranks) Kill those of this node that this
        process launched, or this node's first process when that launched this one. Whether the job's processes end
        stuck ranks now, here or on the node that launched them (else the launcher does, later)."""
        p = self.placement
        children: Sequence[Any] = getattr(self.launcher, "procs", None) or []
        local = [r - p.node_rank * p.local_world_size for r in stuck if r // p.local_world_size == p.node_rank]
        for local_rank in local:
            if p.local_rank == 0 and 1 <= local_rank <= len(children):
                with contextlib.suppress(OSError):
                    children[local_rank - 1].kill()  # SIGKILL: also ends a stopped process
        if p.local_rank > 0 and 0 in local and (parent := self._first_process(store)) is not None:
            if parent == os.getppid():
                with contextlib.suppress(OSError):
                    os.kill(parent, signal.SIGKILL)
        return True

    def _first_process(self, store: BoundedStore | None) -> int | None:
        if self.placement.node_rank == 0:
            return self.first_process
        value = store.read(self.first_process_key) if store is not None else None
        return int(value) if value is not None and value.isascii() and value.isdigit() else None
