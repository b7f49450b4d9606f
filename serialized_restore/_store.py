"""The schedule's store: its two connections, its key names, and the failure records a stage's ranks post and read.

A rank's main thread blocks in ``get`` on the *main* connection, a ``clone()`` of the job's store (a blocking
operation holds its connection); its watch makes short operations on the *side* one, the job's store itself.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from serialized_restore._errors import RankFailure, malformed_report


class StoreLost(Exception):
    """The job's store could not be reached (its host exited, the connection broke)."""


class StoreTimeout(StoreLost):
    """A blocking operation reached the connection's backstop timeout; the store itself may be fine."""


class StoreView:
    """One connection to a schedule's namespace in the store; every error of the store raises :class:`StoreLost`."""

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
        return bool(self._call("check", keys))

    def set(self, key: str, value: str) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> str:
        """Blocks until ``key`` is set (up to the connection's backstop timeout)."""
        return _text(self._call("get", key))

    def get_if_set(self, key: str) -> str | None:
        """The value of ``key``, or ``None`` if it is not set; never blocks."""
        return self.get(key) if self.check([key]) else None

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        """Set ``key`` to ``desired`` if its value is ``expected`` (``""``: unset); its value afterwards."""
        return _text(self._call("compare_set", key, expected, desired))

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        self._call("multi_set", keys, values)

    def multi_get(self, keys: list[str]) -> list[str]:
        """Values of keys known to be set (a missing key blocks)."""
        return [_text(v) for v in self._call("multi_get", keys)]

    def append(self, key: str, value: str) -> None:
        self._call("append", key, value)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, (bytes, bytearray)) else str(value)


_CLONES: dict[int, tuple[Any, Any]] = {}  # id of a job store: the store (so that its id is not reused), its clone


def open_namespace(job_store: Any, global_rank: int, backstop: float) -> tuple[StoreView, StoreView]:
    """(all ranks, once per schedule) This schedule's own key namespace (the n-th schedule of each rank meets the
    n-th of every other), on ``(main, side)`` connections. The clone is made once per process and job store: a new
    connection costs a round of the server's accept, which may resolve the peer's name (seconds)."""
    try:
        generation = job_store.add(f"serialized_restore/generation/{global_rank}", 1)
        cached = _CLONES.get(id(job_store))
        if cached is None or cached[0] is not job_store:
            cached = _CLONES[id(job_store)] = (job_store, job_store.clone())
        cached[1].set_timeout(datetime.timedelta(seconds=backstop))
    except Exception as err:  # every store a process group is built on clones: an error here is a lost store
        raise StoreLost(str(err)) from err
    prefix = f"serialized_restore/{generation}/"
    return StoreView(dist.PrefixStore(prefix, cached[1])), StoreView(dist.PrefixStore(prefix, job_store))


def identity_key(node: int, local: int) -> str:
    """Who a rank is (``_liveness.Identity``), set once per schedule."""
    return f"identity/{node}/{local}"


def heartbeat_key(node: int, local: int) -> str:
    return f"heartbeat/{node}/{local}"


class StageKeys:
    """Keys of one stage of one schedule. ``closed`` decides the stage's fate once (``compare_set``): ``"ended"``
    by the rank whose end completes ``finished``, or ``"failed"`` by the first rank to post a failure."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self._p = p = stage.replace(" ", "_") + "/"
        self.reports, self.closed, self.finished = p + "reports", p + "closed", p + "finished"
        self.acked, self.all_acked, self.diagnosis = p + "acked", p + "all_acked", p + "diagnosis"
        self.reads, self.all_read = p + "reads", p + "all_read"

    def wake(self, node: int, local: int) -> str:
        """Set by the rank's predecessor, or by a rank posting a failure."""
        return f"{self._p}wake/{node}/{local}"

    def log(self, node: int) -> str:
        """The node's turn starts and ends (``_order.NodeLog``)."""
        return f"{self._p}log/{node}"

    def gone(self, global_rank: int) -> str:
        """Counts the reports of a rank that is gone: the first acknowledges on its behalf."""
        return f"{self._p}gone/{global_rank}"

    def where(self, node: int, local: int) -> str:
        return f"{self._p}where/{node}/{local}"

    def decision(self, node: int) -> str:
        return f"{self._p}decision/{node}"


_REPORTS = "reports\n"


@dataclass(frozen=True)
class StageStore:
    """One stage of one rank in the store, shared by the turn (main thread, ``main``) and the watch (``side``)."""

    keys: StageKeys
    main: StoreView
    side: StoreView
    wake_keys: list[str]
    """Every rank's wake-up key."""

    def post(self, failures: list[RankFailure], view: StoreView) -> None:
        """(any rank, any thread) Post ``failures`` and close the stage as failed, unless it had ended before; a rank
        that takes no further part (dead, silent, stuck in its turn) is acknowledged on its behalf, once."""
        keys = self.keys
        view.append(keys.reports, "".join(f.to_json() + "\n" for f in failures))
        if view.compare_set(keys.closed, "", "failed") != "ended":
            # every poster wakes everyone: a poster that died between its close and this line would leave waiters
            view.multi_set(self.wake_keys, ["failed"] * len(self.wake_keys))
        gone = sum(1 for f in failures if f.kind.gone and view.add(keys.gone(f.global_rank), 1) == 1)
        if gone:
            view.add(keys.reads, gone)  # first: every count of ``acked`` a reader sees has its reads counted
            self.acknowledge(view, gone)

    def acknowledge(self, view: StoreView, count: int = 1) -> None:
        """``count`` more ranks know that the stage failed; the one that completes the job's count sets ``all_acked``
        to the reports, which every rank has posted by then: the others read them from the key they wait on."""
        if view.add(self.keys.acked, count) >= len(self.wake_keys):
            view.set(self.keys.all_acked, _REPORTS + (view.get_if_set(self.keys.reports) or ""))

    def read(self, view: StoreView, all_acked: str) -> list[RankFailure]:
        """(a rank that acknowledged) The reports, from ``all_acked``'s value, else (set free at its bound) from their
        key; the read that catches up with every acknowledgement says so."""
        everyone = all_acked.startswith(_REPORTS)
        failures = self.reports(view, all_acked[len(_REPORTS) :] if everyone else None)
        acked = len(self.wake_keys) if everyone else view.add(self.keys.acked, 0)
        if view.add(self.keys.reads, 1) >= acked:
            view.set(self.keys.all_read, "1")
        return failures

    def reports(self, view: StoreView, text: str | None = None) -> list[RankFailure]:
        """The stage's failure records (``text``, or the key's value); a line that is not one of ours (any process
        that can reach the store can write to it) becomes a failure that says so."""
        failures = []
        text = view.get_if_set(self.keys.reports) if text is None else text
        for line in (text or "").splitlines():
            if line.strip():
                try:
                    failures.append(RankFailure.from_json(line))
                except ValueError as err:
                    failures.append(malformed_report(self.keys.stage, line, err))
        return failures
