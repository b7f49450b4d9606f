"""The job's store as the turns use it: the key layout of a restore, in one place, and a client whose every call is
bounded (``docs/design.md``, *The turn schedule*).

torch's store client waits for an answer without a bound once the store's host is stopped, even past its own timeout,
and a blocking ``get`` defers Python's SIGINT handler until it returns. So every call that waits for an answer runs on
a short-lived worker thread while the calling thread waits on an event, where Ctrl-C raises at once; a call past its
bound makes the store unresponsive for the rest of the restore."""

from __future__ import annotations

import datetime
import functools
import os
import threading
from typing import Any, Callable

import torch.distributed as dist

GO, FAILED, ENDED = "go", "failed", "ended"
ANSWER = 5.0  # how long past a blocking get's own timeout its answer may take before the store counts as unresponsive
_UNANSWERED = ("set", "multi_set")  # sent without waiting for an answer: a stopped host cannot block them


def job_store(world_size: int) -> dist.Store | None:
    """The default process group's store, shared by every rank of the job; ``None`` for one process, or where the
    ranks did not initialise ``torch.distributed``."""
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def hosted_by_agent() -> bool:
    """Whether the job's store is hosted by torchrun's agent (which outlives the ranks), not by global rank 0."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


class RestoreKeys:
    """Every key of one restore, under ``serialized_restore/<namespace>/``: the namespace is the same on every rank of
    the restore and never used by another (a later restore, a restarted attempt of the job on a store that outlived
    the first)."""

    def __init__(self, namespace: str) -> None:
        self.root = f"serialized_restore/{namespace}/"

    def stage(self, stage: str) -> StageKeys:
        """The keys of ``stage``: a stage runs once per restore, so its name keeps them apart from every other's."""
        return StageKeys(f"{self.root}{stage.replace(' ', '_')}/")

    def first_process(self, node: int) -> str:
        """Where local rank 0 of ``node`` (> 0) writes its process id as the restore starts (``stuck.py`` reads it)."""
        return f"{self.root}first_process/{node}"


class StageKeys:
    """One stage's keys. ``verdict`` is decided once (``compare_set``: ``ended`` by the rank whose end completes
    ``done``, else the first failure's record) and copied to ``closed``, the key ranks wait on."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.done, self.verdict, self.closed = prefix + "done", prefix + "verdict", prefix + "closed"
        self.reads, self.all_read = prefix + "reads", prefix + "all_read"

    def wake(self, node: int, local: int) -> str:
        """Set to ``go`` by the rank ``k`` places ahead at the end of its turn, or to ``failed`` by a failing rank;
        ``local`` past the node's last rank: the end of a chain, or (every rank at once) that a rank ended."""
        return f"{self.prefix}wake/{node}/{local}"

    def every_wake(self, nodes: int, per_node: int) -> list[str]:
        """The first ``per_node`` wake-up keys of every node."""
        return [self.wake(n, r) for n in range(nodes) for r in range(per_node)]

    def decision(self, node: int | None) -> str:
        """The value one rank computed for the job (``node`` ``None``) or for its node."""
        return f"{self.prefix}decision/{-1 if node is None else node}"


class StoreLost(Exception):
    """The job's store could not be reached: its host exited or the connection broke."""


class StoreUnresponsive(StoreLost):
    """The job's store did not answer a call within its bound: its host is stopped, hung or overloaded."""


class BoundedStore:
    """A client of the job's store whose every call that waits for an answer is bounded (``bound`` seconds by
    default); after one call goes unanswered, no later call touches the store (it raises the same
    :class:`StoreUnresponsive`). A call this rank's thread left (Ctrl-C) or that went unanswered is its
    :attr:`pending` call: it may still return, and must before the process exits (one that returns while Python
    finalizes the process aborts it)."""

    def __init__(self, store: dist.Store, bound: float) -> None:
        self.store = store
        self.bound = bound
        self.unresponsive: StoreUnresponsive | None = None
        self.pending: threading.Event | None = None  # set when the call left running ends

    def call(self, method: str, *args: object, bound: float | None = None) -> str:
        """``store.<method>(*args)`` as text; its failure as :class:`StoreLost`."""
        return self._run(functools.partial(getattr(self.store, method), *args), method, bound)

    def get(self, key: str, timeout: float) -> str | None:
        """``key``'s value once set, or ``None`` after ``timeout`` seconds: one blocking ``get``."""
        store = self.store
        seconds = min(max(timeout, 0.001), 10**7)

        def get() -> Any:
            previous = store.timeout  # type: ignore[attr-defined]
            store.set_timeout(datetime.timedelta(seconds=seconds))
            try:
                return store.get(key)
            finally:
                store.set_timeout(previous)

        try:
            return self._run(get, "get", seconds + ANSWER)
        except _GetTimedOut:
            return None

    def read(self, key: str) -> str | None:
        """The value of ``key`` if it is set; ``None`` otherwise or if the store fails."""
        try:
            return self.get(key, 0.001)
        except StoreLost:
            return None

    def clone(self) -> BoundedStore:
        """A second client of the same store: for a rank whose own client is held by a call it left."""
        return BoundedStore(_within(self.store.clone, ANSWER), self.bound)

    def take_pending(self) -> threading.Event | None:
        pending, self.pending = self.pending, None
        return pending

    def _run(self, call: Callable[[], Any], method: str, bound: float | None) -> str:
        if self.unresponsive is not None:
            raise self.unresponsive
        try:
            value = call() if method in _UNANSWERED else self._bounded(call, self.bound if bound is None else bound)
        except _NoAnswer as err:
            self.unresponsive = StoreUnresponsive(f"the store did not answer within {err.seconds:g}s")
            self.pending = err.done
            raise self.unresponsive from None
        except dist.DistStoreError as err:
            if "timeout" in str(err).lower():
                raise _GetTimedOut() from err
            raise StoreLost(str(err)) from err
        except Exception as err:  # DistNetworkError, RuntimeError depending on the torch version
            raise StoreLost(str(err)) from err
        return value.decode(errors="replace") if isinstance(value, bytes) else str(value)

    def _bounded(self, call: Callable[[], Any], seconds: float) -> Any:
        return _within(call, seconds, on_leave=self._left)

    def _left(self, done: threading.Event) -> None:
        self.pending = done


class _GetTimedOut(Exception):
    pass


class _NoAnswer(Exception):
    def __init__(self, seconds: float, done: threading.Event) -> None:
        super().__init__(seconds)
        self.seconds, self.done = seconds, done


def _within(call: Callable[[], Any], seconds: float, on_leave: Callable[[threading.Event], None] | None = None) -> Any:
    """``call()`` on a daemon worker thread; its value or exception, or ``_NoAnswer`` once ``seconds`` have passed (the
    call then goes on alone). Where this thread leaves the wait early (Ctrl-C), ``on_leave`` gets the running call's
    event before the interruption goes on. (An event, not ``Thread.join``: a ``join`` that Ctrl-C interrupts marks the
    thread as ended while it runs on.)"""
    outcome: list[tuple[bool, Any]] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as err:  # handed to the waiting thread
            outcome.append((False, err))
        finally:
            done.set()

    threading.Thread(target=run, name="serialized-restore-store", daemon=True).start()
    try:
        done.wait(seconds)
    except BaseException:
        if on_leave is not None:
            on_leave(done)
        raise
    if not outcome:
        raise _NoAnswer(seconds, done)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
