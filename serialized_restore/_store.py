"""The schedule's store: its connections, its key names, and the failure records a stage's ranks post and read.

A rank's main thread blocks in ``get`` on the *main* connection, a ``clone()`` of the job's store (a blocking operation
holds its connection); its watch thread makes short operations on the *side* one, the job's store itself. Every error
from the store becomes :class:`StoreLost`; the main connection's backstop timeout :class:`StoreTimeout`.
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from serialized_restore._errors import RankFailure, malformed_report


class StoreLost(Exception):
    """The job's store could not be reached (its host exited, the connection broke)."""


class StoreTimeout(StoreLost):
    """A blocking operation reached the connection's backstop timeout; the store itself may be fine."""


class StoreView:
    """One connection to a schedule's namespace in the store; every failure raises :class:`StoreLost`."""

    def __init__(self, store: Any) -> None:
        self.raw = store

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.raw, method)(*args)
        except Exception as err:  # DistNetworkError, DistStoreError, RuntimeError depending on torch version
            timeout = isinstance(err, dist.DistStoreError) and "timeout" in str(err).lower()
            raise (StoreTimeout if timeout else StoreLost)(str(err)) from err

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, amount))

    def check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` is set."""
        return bool(self._call("check", keys))

    def set(self, key: str, value: str) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> str:
        """The value of ``key``; blocks until it is set (up to the connection's backstop timeout)."""
        return _text(self._call("get", key))

    def get_if_set(self, key: str) -> str | None:
        """The value of ``key``, or ``None`` if it is not set; never blocks."""
        return self.get(key) if self.check([key]) else None

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        """Set ``key`` to ``desired`` if its value is ``expected`` (``""``: unset); the value it has afterwards."""
        return _text(self._call("compare_set", key, expected, desired))

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        self._call("multi_set", keys, values)

    def multi_get(self, keys: list[str]) -> list[str]:
        """Values of keys known to be set (a missing key blocks); ``keys`` is never empty here."""
        return [_text(v) for v in self._call("multi_get", keys)]

    def append(self, key: str, value: str) -> None:
        self._call("append", key, value)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, (bytes, bytearray)) else str(value)


def open_namespace(job_store: Any, global_rank: int, backstop: float) -> tuple[StoreView, StoreView]:
    """(all ranks, once per schedule) This schedule's own key namespace: ``(main, side)`` connections.

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
    except Exception as err:  # every store a process group is built on clones; an error here is a lost store
        raise StoreLost(str(err)) from err
    return StoreView(dist.PrefixStore(prefix, connection)), StoreView(dist.PrefixStore(prefix, job_store))


_CONNECTIONS: dict[int, tuple[Any, Any]] = {}
"""Per job store (by identity; the store itself is kept, so that its ``id`` is not reused): its clone."""
_CONNECTIONS_LOCK = threading.Lock()


def _second_connection(job_store: Any) -> Any:
    """The clone of the job's store, opened once per process and store: a new connection costs a round of the store
    server's accept (which may resolve the peer's name), and a process's schedules follow one another."""
    with _CONNECTIONS_LOCK:
        cached = _CONNECTIONS.get(id(job_store))
        if cached is not None and cached[0] is job_store:
            return cached[1]
        connection = job_store.clone()
        _CONNECTIONS[id(job_store)] = (job_store, connection)
        return connection


def identity_key(node: int, local: int) -> str:
    """Who a rank is (``_liveness.Identity``), set once per schedule."""
    return f"identity/{node}/{local}"


def heartbeat_key(node: int, local: int) -> str:
    return f"heartbeat/{node}/{local}"


class StageKeys:
    """Keys of one stage of one schedule.

    ``closed`` decides the stage's fate once: ``"ended"`` (set by the rank whose turn end completes ``finished``) or
    ``"failed"`` (set by the first rank to post a failure), whichever comes first (``compare_set``).
    """

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self._p = p = stage.replace(" ", "_") + "/"
        self.reports, self.failures, self.closed = p + "reports", p + "failures", p + "closed"
        self.finished, self.acked, self.reads = p + "finished", p + "acked", p + "reads"
        self.all_acked, self.all_read = p + "all_acked", p + "all_read"
        self.coordinator, self.diagnosis = p + "coordinator", p + "diagnosis"

    def wake(self, node: int, local: int) -> str:
        """Set by the rank's predecessor when its turn ends, and by a rank posting a failure."""
        return f"{self._p}wake/{node}/{local}"

    def log(self, node: int) -> str:
        """The node's turn starts and ends, appended as lines (``_order.NodeLog``)."""
        return f"{self._p}log/{node}"

    def where(self, node: int, local: int) -> str:
        return f"{self._p}where/{node}/{local}"

    def decision(self, node: int) -> str:
        return f"{self._p}decision/{node}"


@dataclass(frozen=True)
class StageStore:
    """One stage of one rank in the store: its keys, the rank's two connections and every rank's wake-up key. The
    turn (main thread, ``main``) and the watch (its own thread, ``side``) share it."""

    keys: StageKeys
    main: StoreView
    side: StoreView
    wake_keys: list[str]

    def post(self, failures: list[RankFailure], view: StoreView) -> None:
        """(any rank, any thread) Post ``failures`` and close the stage as failed, unless every rank had ended it
        before (the failures then change nothing)."""
        keys = self.keys
        view.append(keys.reports, "".join(f.to_json() + "\n" for f in failures))
        view.add(keys.failures, 1)
        if view.compare_set(keys.closed, "", "failed") != "ended":
            # every poster wakes everyone: a poster that died between its close and this line would leave waiters
            view.multi_set(self.wake_keys, ["failed"] * len(self.wake_keys))

    def reports(self, view: StoreView) -> list[RankFailure]:
        """The stage's failure records, each checked field by field; a record that is not one of ours becomes a
        failure that says so (any process that can reach the store can write to it)."""
        failures = []
        for line in (view.get_if_set(self.keys.reports) or "").splitlines():
            if line.strip():
                try:
                    failures.append(RankFailure.from_json(line))
                except ValueError as err:
                    failures.append(malformed_report(self.keys.stage, line, err))
        return failures
