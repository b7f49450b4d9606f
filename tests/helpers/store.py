"""A real ``TCPStore`` shared by the processes of a test, as after a rendezvous."""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import torch.distributed as dist

from serialized_restore._placement import RankPlacement
from serialized_restore._turns import TurnSchedule


def connect(rank: int, world: int, out_dir: Path) -> dist.TCPStore:
    """Rank 0 hosts the store on a port the system picks and tells the others through ``out_dir/store.port``; any
    process that reads the file may connect (as a client, like any rank but 0)."""
    timeout = datetime.timedelta(seconds=30)
    port_file = out_dir / "store.port"
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timeout, wait_for_workers=False)
        port_file.with_suffix(".tmp").write_text(str(store.port))
        port_file.with_suffix(".tmp").rename(port_file)
        return store
    deadline = time.monotonic() + 30
    while not port_file.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return dist.TCPStore("127.0.0.1", int(port_file.read_text()), world, False, timeout=timeout)


def one_node_schedule(store: dist.Store, rank: int, world: int, checkpoint_path: str) -> TurnSchedule:
    """A ``TurnSchedule`` of rank ``rank`` of a one-node job of ``world`` ranks over ``store``: one turn at a time,
    a 30 s turn timeout."""
    placement = RankPlacement(rank, world, 0, rank, world)
    return TurnSchedule(
        store=store,
        placement=placement,
        max_concurrent=1,
        checkpoint_path=checkpoint_path,
        turn_timeout=30.0,
    )
