"""The schedule's store: its connections (the main thread blocks in ``get`` on a ``clone()`` of the job's store, as a
blocking operation holds its connection; the watch uses the job's store), its keys, and the failure records."""

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
        """Claimed once: by the rank when it acknowledges, or by its first reporter, who acknowledges for it."""
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
    wake_keys: list[str]  # every rank's

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
            self._count(view, gone, reads=False)

    def acknowledge(self, view: StoreView, rank: int, reads: bool = True) -> bool:
        """(a rank itself) Acknowledge, unless a peer did for it (reported gone, it came back); ``reads=False``: it
        will not read the reports either. Whether it counted."""
        if view.add(self.keys.gone(rank), 1) != 1:
            return False
        self._count(view, 1, reads)
        return True

    def _count(self, view: StoreView, acknowledged: int, reads: bool) -> None:
        if not reads:  # counted first: every count of acked a reader sees has its reads counted
            view.add(self.keys.reads, acknowledged)
        # the one that completes the count sets all_acked to the reports, all posted by then: the others read them there
        if view.add(self.keys.acked, acknowledged) >= len(self.wake_keys):
            view.set(self.keys.all_acked, _REPORTS + (view.get_if_set(self.keys.reports) or ""))

    def read_done(self, view: StoreView, all_acked: str) -> None:
        """The read that catches up with every acknowledgement (all R, if the count set ``all_acked``) says so."""
        acked = len(self.wake_keys) if all_acked.startswith(_REPORTS) else view.add(self.keys.acked, 0)
        if view.add(self.keys.reads, 1) >= acked:
            view.set(self.keys.all_read, "1")

    def reports(self, view: StoreView, all_acked: str = "") -> list[RankFailure]:
        """The failure records, from ``all_acked`` if the count set it, else from their key; a line that is not ours
        (any process that can reach the store can write to it) becomes a failure that says so."""
        failures = []
        carried = all_acked.startswith(_REPORTS)
        text = all_acked[len(_REPORTS) :] if carried else view.get_if_set(self.keys.reports)
        for line in (text or "").splitlines():
            if line.strip():
                try:
                    failures.append(RankFailure.from_json(line))
                except ValueError as err:
                    failures.append(malformed_report(self.keys.stage, line, err))
        return failures
