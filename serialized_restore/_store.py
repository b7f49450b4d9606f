"""The schedule's store: its key names, its two connections, and the translation of a lost store.

A schedule talks to the job's ``TCPStore`` (the default process group's store) through two connections:

* the *main* connection, a ``clone()`` of the job's store, on which the rank's main thread blocks in ``get`` until a
  wake-up key is set. A blocking operation holds its connection: another operation on the same client waits behind
  it, so nothing else uses this one.
* the *monitor* connection, the job's store itself, for the short, never-blocking operations of the rank's monitor
  thread (``_liveness.Monitor``).

A blocking ``get`` that times out logs a c10d warning on stderr that Python cannot filter, so no wait here relies on a
timeout to end: every wait ends when a key is set, by another rank or by the rank's own monitor (see
``_liveness.Monitor``). The connection's timeout is only a backstop.

Every error from the store becomes :class:`StoreLost`, except a backstop timeout (:class:`StoreTimeout`).
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch.distributed as dist


class StoreLost(Exception):
    """The job's store could not be reached (its host exited, the connection broke)."""


class StoreTimeout(StoreLost):
    """A blocking operation reached the connection's backstop timeout; the store itself may be fine."""


def _is_timeout(err: BaseException) -> bool:
    store_error = getattr(dist, "DistStoreError", None)
    return store_error is not None and isinstance(err, store_error) and "timeout" in str(err).lower()


class StoreView:
    """One connection to a restore's namespace in the store; every failure raises :class:`StoreLost`."""

    def __init__(self, store: Any) -> None:
        self.raw = store

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.raw, method)(*args)
        except Exception as err:  # DistNetworkError, DistStoreError, RuntimeError depending on torch version
            if _is_timeout(err):
                raise StoreTimeout(str(err)) from err
            raise StoreLost(str(err)) from err

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, amount))

    def check(self, key: str) -> bool:
        return bool(self._call("check", [key]))

    def check_all(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` is set."""
        return bool(self._call("check", keys))

    def set(self, key: str, value: str) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> str:
        """The value of ``key``; blocks until it is set (up to the connection's backstop timeout)."""
        return _text(self._call("get", key))

    def get_if_set(self, key: str) -> str | None:
        """The value of ``key``, or ``None`` if it is not set; never blocks."""
        return self.get(key) if self.check(key) else None

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        """Set ``key`` to ``desired`` if its value is ``expected`` (``""``: unset); the value it has afterwards."""
        return _text(self._call("compare_set", key, expected, desired))

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        if keys:
            self._call("multi_set", keys, values)

    def multi_get(self, keys: list[str]) -> list[str]:
        """Values of keys known to be set (a missing key blocks)."""
        return [_text(v) for v in self._call("multi_get", keys)] if keys else []

    def append(self, key: str, value: str) -> None:
        self._call("append", key, value)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, (bytes, bytearray)) else str(value)


def open_namespace(job_store: Any, global_rank: int, backstop: float) -> tuple[StoreView, StoreView]:
    """(all ranks, once per schedule) This schedule's own key namespace: ``(main, monitor)`` connections.

    Every rank counts its own schedules, so the n-th schedule of each rank meets the n-th schedule of every other rank
    even when several Trainers share one process group.
    """
    try:
        generation = job_store.add(f"serialized_restore/generation/{global_rank}", 1)
    except Exception as err:
        raise StoreLost(str(err)) from err
    prefix = f"serialized_restore/{generation}/"
    try:
        connection = _second_connection(job_store)
        connection.set_timeout(datetime.timedelta(seconds=backstop))
    except Exception as err:
        if _is_connection_error(err):
            raise StoreLost(str(err)) from err
        # a store without clone(): the monitor's operations then wait behind the main thread's blocking ones, which
        # delays wake-ups set by this rank's own monitor but loses none
        connection = job_store
    return StoreView(dist.PrefixStore(prefix, connection)), StoreView(dist.PrefixStore(prefix, job_store))


_CONNECTIONS: dict[int, tuple[Any, Any]] = {}
"""Per job store (by identity; the store itself is kept, so that its ``id`` is not reused): its clone."""
_CONNECTIONS_LOCK = threading.Lock()


def _second_connection(job_store: Any) -> Any:
    """(each process, first schedule) A second connection to the job's store, opened once per process and store and
    reused by every later schedule: a new connection costs a round of the store server's accept (which may resolve
    the peer's name), and schedules follow one another, never overlap, in a process."""
    with _CONNECTIONS_LOCK:
        cached = _CONNECTIONS.get(id(job_store))
        if cached is not None and cached[0] is job_store:
            return cached[1]
        connection = job_store.clone()
        _CONNECTIONS[id(job_store)] = (job_store, connection)
        return connection


def _is_connection_error(err: BaseException) -> bool:
    network_error = getattr(dist, "DistNetworkError", None)
    return network_error is not None and isinstance(err, network_error)


class ScheduleKeys:
    """Keys of one schedule that outlive its stages: who each rank is, and its heartbeat."""

    @staticmethod
    def identity(node: int, local: int) -> str:
        return f"identity/{node}/{local}"

    @staticmethod
    def heartbeat(node: int, local: int) -> str:
        return f"heartbeat/{node}/{local}"


class StageKeys:
    """Keys of one stage of one schedule.

    ``closed`` decides the stage's fate once: ``"ended"`` (set by the rank whose turn end completes ``finished``) or
    ``"failed"`` (set by the first rank to post a failure), whichever comes first (``compare_set``).
    """

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self._p = stage.replace(" ", "_") + "/"
        p = self._p
        self.reports = p + "reports"
        self.failures = p + "failures"
        self.closed = p + "closed"
        self.finished = p + "finished"
        self.acked = p + "acked"
        self.reads = p + "reads"
        self.all_acked = p + "all_acked"
        self.all_read = p + "all_read"
        self.coordinator = p + "coordinator"
        self.diagnosis = p + "diagnosis"

    def wake(self, node: int, local: int) -> str:
        """Set by the rank's predecessor when its turn ends, and by a rank posting a failure."""
        return f"{self._p}wake/{node}/{local}"

    def log(self, node: int) -> str:
        """The node's turn starts and ends, appended as lines (``_order.NodeLog``)."""
        return f"{self._p}log/{node}"

    def where(self, node: int, local: int) -> str:
        return f"{self._p}where/{node}/{local}"

    # series: auto
    def decision(self, node: int) -> str:
        return f"{self._p}decision/{node}"

    # series: end

    def all_wake_keys(self, nodes: int, local_world_size: int) -> list[str]:
        return [self.wake(n, r) for n in range(nodes) for r in range(local_world_size)]
