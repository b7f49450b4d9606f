"""A real ``TCPStore`` shared by the processes of a test, as after a rendezvous."""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import torch.distributed as dist

from serialized_restore._coordination.placement import RankPlacement
from serialized_restore._coordination.turns import TurnSchedule


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
    """A ``TurnSchedule`` of rank ``rank`` of a one-node job of ``world`` ranks over ``store``: a 30 s turn timeout,
    its keys under ``serialized_restore/0/``."""
    placement = RankPlacement(rank, world, 0, rank, world)
    return TurnSchedule(
        store=store,
        placement=placement,
        checkpoint_path=checkpoint_path,
        turn_timeout=30.0,
        namespace="0",
    )


class AttemptStore(dist.Store):
    """One attempt's view of a store that outlives the job's processes (as torchrun's agent store does across
    restarts): the package's keys go to the outliving store as they are, so that a restarted attempt sees every key
    an earlier attempt left; everything else (gloo's own rendezvous keys) under a prefix of the attempt, since gloo
    cannot set up a process group over a store that holds an earlier group's keys."""

    def __init__(self, outliving: dist.Store, attempt: int) -> None:
        super().__init__()
        self._shared = outliving
        self._own = dist.PrefixStore(f"attempt{attempt}/", outliving)
        dist.Store.set_timeout(self, outliving.timeout)

    def _for(self, key: str) -> dist.Store:
        return self._shared if "serialized_restore/" in key else self._own

    def set(self, key, value):  # noqa: ANN001, ANN201
        return self._for(key).set(key, value)

    def get(self, key):  # noqa: ANN001, ANN201
        store = self._for(key)
        store.set_timeout(self.timeout)
        return store.get(key)

    def add(self, key, value):  # noqa: ANN001, ANN201
        return self._for(key).add(key, value)

    def compare_set(self, key, expected, desired):  # noqa: ANN001, ANN201
        return self._for(key).compare_set(key, expected, desired)

    def check(self, keys):  # noqa: ANN001, ANN201
        return self._for(keys[0]).check(keys)

    def wait(self, keys, timeout=None):  # noqa: ANN001, ANN201
        return self._for(keys[0]).wait(keys, self.timeout if timeout is None else timeout)

    def multi_get(self, keys):  # noqa: ANN001, ANN201
        return [self.get(key) for key in keys]

    def multi_set(self, keys, values):  # noqa: ANN001, ANN201
        for key, value in zip(keys, values):
            self.set(key, value)

    def set_timeout(self, timeout):  # noqa: ANN001, ANN201
        dist.Store.set_timeout(self, timeout)
