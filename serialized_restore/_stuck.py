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
from typing import Any, Callable

from serialized_restore._flavour import lightning_names
from serialized_restore._placement import RankPlacement


def launched_by_lightning(strategy: Any) -> bool:
    """Whether the job's processes were started by Lightning's own launcher (Trainer's or Fabric's)."""
    names = lightning_names(strategy)
    return isinstance(
        getattr(strategy, "launcher", None), (names.SubprocessScriptLauncher, names.FabricSubprocessScriptLauncher)
    )


def end_stuck_ranks(
    strategy: Any, placement: RankPlacement, stuck: list[int], first_process: Callable[[], int | None]
) -> bool:
    """(each rank, before it raises an error naming ``stuck`` global ranks) Kill those of this node that this process
    launched, or this node's first process (its id: ``first_process()``) when that launched this one. Whether the
    job's processes end stuck ranks now, here or on the node that launched them (else the launcher does, later)."""
    if strategy is None or not launched_by_lightning(strategy):
        return False
    p = placement
    local = [r - p.node_rank * p.local_world_size for r in stuck if r // p.local_world_size == p.node_rank]
    procs = list(getattr(strategy.launcher, "procs", []) or [])
    for local_rank in local:
        if p.local_rank == 0 and 1 <= local_rank <= len(procs):
            with contextlib.suppress(OSError):
                procs[local_rank - 1].kill()  # SIGKILL: also ends a stopped process
    if p.local_rank > 0 and 0 in local and (parent := first_process()) is not None and parent == os.getppid():
        with contextlib.suppress(OSError):
            os.kill(parent, signal.SIGKILL)
    return True
