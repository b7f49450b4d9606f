"""The turn schedule: which local rank of a node restores when, and how a failure reaches every rank, on the job's own
store client (``docs/design.md``, *The turn schedule*): blocking ``get`` with a timeout, ``add``, ``set``,
``compare_set`` and ``multi_set``; no collective, no second connection, no polling. Every call that waits for the
store's answer runs on a short-lived worker thread and is bounded: a store whose host stopped cannot hold a rank."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import functools
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

import torch.distributed as dist

from serialized_restore._errors import (
    CheckpointRestoreError,
    FailureKind,
    RankFailure,
    failure_from_exception,
    restore_error,
    stalled_failure,
    store_lost_failure,
    timeout_failure,
    unresponsive_store_failure,
    verdict_failures,
)
from serialized_restore._memory import TurnRecord, private_memory, turn_end_line
from serialized_restore._placement import RankPlacement

log = logging.getLogger(__name__)

GO, FAILED, ENDED = "go", "failed", "ended"
_LINGER = 2.0  # how long a failed stage keeps the store's host, rank 0, for the other ranks to read the verdict
_ANSWER = 5.0  # how long past a blocking get's own timeout its answer may take before the store counts as unresponsive


class StoreLost(Exception):
    """The job's store could not be reached: its host exited or the connection broke."""


class StoreUnresponsive(StoreLost):
    """The job's store did not answer a call within its bound: its host is stopped, hung or overloaded."""


class _Stage:
    """One stage's keys. ``verdict`` is decided once (``compare_set``: ``ended`` by the rank whose end completes
    ``done``, else the first failure's record) and copied to ``closed``, the key ranks wait on."""

    def __init__(self, prefix: str, stage: str, p: RankPlacement, k: int, doing: str | None = None) -> None:
        self.name, self.k, self.doing = stage, k, doing
        self._p = f"{prefix}{stage.replace(' ', '_')}/"
        self.done, self.verdict, self.closed = self._p + "done", self._p + "verdict", self._p + "closed"
        self.reads, self.all_read = self._p + "reads", self._p + "all_read"
        self._nodes, self._lws = p.nodes, p.local_world_size

    def every_wake(self) -> list[str]:
        """Every rank's wake-up key, and per chain the key ``L + i`` its last turn sets (its timer waits for it)."""
        return [self.wake(n, r) for n in range(self._nodes) for r in range(self._lws + self.k)]

    def wake(self, node: int, local: int) -> str:
        """Set to ``go`` by the rank ``k`` places ahead at the end of its turn, or to ``failed`` by a failing rank."""
        return f"{self._p}wake/{node}/{local}"


class TurnSchedule:
    """Runs the stages of a restore in turns: every rank calls :meth:`turn` once per stage, in the same order; per
    node, local rank ``r`` starts when ``r - k`` has ended (``k = max_concurrent``), and every rank waits for the job
    to end the stage. A turn is timed (``turn_timeout``, from when it could start) by the rank waiting for it, or for
    a chain's last turn by the rank before it. One failure decides the stage: the failing rank raises its own
    exception, every other rank a :class:`CheckpointRestoreError`."""

    def __init__(self, *, store: dist.Store | None, placement: RankPlacement, max_concurrent: int,
                 checkpoint_path: str, turn_timeout: float, namespace: str = "", logger: logging.Logger = log,
                 on_stuck: Callable[[TurnSchedule, list[int]], bool] | None = None) -> None:  # fmt: skip
        """``namespace``: the keys' prefix under ``serialized_restore/``, the same on every rank of this schedule and
        never used by another (a later restore, a restarted attempt of the job): see ``RestorePlan.schedule``.
        ``on_stuck(schedule, ranks)``: called before this rank raises an error that names ``ranks`` as stuck;
        whether the job's own processes end them now (False: only the launcher does, once this rank has exited)."""
        self.placement = p = placement
        self.max_concurrent = max(1, min(max_concurrent, p.local_world_size))
        self.checkpoint_path = checkpoint_path
        self.turn_timeout = turn_timeout
        self.log = logger
        self._store = store if p.world_size > 1 else None
        self._prefix = f"serialized_restore/{namespace}/"
        self._unresponsive: StoreUnresponsive | None = None  # once a call found the store wedged: no call after it
        self._pending: threading.Event | None = None  # set when a call this rank's thread left (Ctrl-C) ends
        self._on_stuck = on_stuck

    def read(self, key: str) -> str | None:
        """(one rank) The value of ``key`` (a whole key) if it is set; ``None`` otherwise or if the store fails."""
        with contextlib.suppress(StoreLost):
            return self._get(key, 0.001)
        return None

    def turn(self, stage: str, *, ordered: bool = True, logged: bool | None = None, doing: str | None = None) -> _Turn:
        """(all ranks) Run the ``with`` block as this rank's turn of ``stage``; ``ordered=False``: every rank at once.
        ``logged`` (default: ``ordered``): the rank logs its turn's start and end. ``doing``: what a turn does, where
        a turn past the timeout is most likely just slow at it (``"downloading the checkpoint"``), for its error."""
        k = self.max_concurrent if ordered else self.placement.local_world_size
        logged = (ordered if logged is None else logged) and self.log.isEnabledFor(logging.INFO)
        return _Turn(self, _Stage(self._prefix, stage, self.placement, k, doing), ordered, logged)

    def on_one_rank(
        self,
        stage: str,
        compute: Callable[[], str | None],
        *,
        central: bool,
        per_node: bool = False,
        doing: str | None = None,
    ) -> str | None:
        """(all ranks) ``compute()`` on the ``central`` rank (of the job, or of each node) in its turn of ``stage``
        (all ranks at once; ``doing`` as for :meth:`turn`); its result (text, never evaluated) on every rank, or the
        same error on every rank."""
        value: str | None = None
        key = f"{self._prefix}{stage.replace(' ', '_')}/decision/{self.placement.node_rank if per_node else -1}"
        with self.turn(stage, ordered=False, doing=doing):
            if central:
                value = compute()
                if self._store is not None:
                    with self._store_lost_raises(stage):
                        self._call("set", key, "" if value is None else value)
        if not central and self._store is not None:  # set before the stage ended: never blocks
            with self._store_lost_raises(stage):
                value = self._call("get", key) or None
        return value

    def _wait_for_turn(self, keys: _Stage, arrived: float) -> None:
        """Block until the rank ``k`` places ahead ended its turn: first until it could start (the backstop bound is a
        turn timeout per turn ahead of it), then for at most the turn timeout."""
        p, k, timeout = self.placement, keys.k, self.turn_timeout
        ahead = p.local_rank - k
        if ahead < 0:
            return
        if ahead >= k:
            bound = timeout * (ahead // k + 1)  # a turn more than it needs: the timers of those turns come first
            if self._get(keys.wake(p.node_rank, ahead), bound - (time.monotonic() - arrived)) is None:
                waited = f"local rank {ahead - k} of node {p.node_rank} to end its turn"
                self._raise_verdict(keys, self._post(keys, stalled_failure(p, keys.name, waited, bound, timeout)))
        value = self._get(keys.wake(p.node_rank, p.local_rank), timeout)
        if value is None:
            self._raise_verdict(
                keys, self._post(keys, timeout_failure(p, keys.name, ahead, self.turn_timeout, keys.doing))
            )
        elif value != GO:
            self._raise_verdict(keys, self._get(keys.closed, math.inf) or "")

    def _end_turn(self, keys: _Stage, arrived: float) -> None:
        """Count this turn as ended and wake the rank ``k`` places behind (or mark the chain's end); time that rank
        when its turn ends the chain; then wait for every rank of the job to end the stage: its fate."""
        p, k, lws = self.placement, keys.k, self.placement.local_world_size
        closing = int(self._call("add", keys.done, 1)) >= p.world_size
        behind = p.local_rank + k
        # wakes the rank k places behind, or marks the end of a chain; with every rank of the node at once (k = L),
        # says that this rank ended, for the rank that finds the stage stalled to name who did not
        self._call("set", keys.wake(p.node_rank, behind), GO)
        if closing:
            verdict = self._call("compare_set", keys.verdict, "", ENDED)
            self._call("set", keys.closed, verdict)
        else:
            if behind < lws <= behind + k and self._get(keys.wake(p.node_rank, behind + k), self.turn_timeout) is None:
                self._post(keys, timeout_failure(p, keys.name, behind, self.turn_timeout, keys.doing))
            # a turn more than the chain needs where turns have timers (no stage of all ranks at once waits longer)
            bound = self.turn_timeout * (math.ceil(lws / k) + (k < lws))
            closed = self._get(keys.closed, bound - (time.monotonic() - arrived))
            if closed is None:
                closed = self._stalled(keys, bound)
            verdict = closed
        self._raise_verdict(keys, verdict)

    def _stalled(self, keys: _Stage, bound: float) -> str:
        """(a rank that waited ``bound`` for the stage to end) Post who stalled it; the verdict. In a stage of every
        rank at once no rank times another: the first local rank of this node that did not end it is named; a node
        whose ranks all ended leaves a moment to another node to name its own, then posts a stall."""
        p, k, lws = self.placement, keys.k, self.placement.local_world_size
        missing = self._not_ended_on_node(keys) if k >= lws else []
        if missing:
            return self._post(keys, timeout_failure(p, keys.name, missing[0], self.turn_timeout, keys.doing))
        if k >= lws and p.nodes > 1 and (closed := self._get(keys.closed, _ANSWER)) is not None:
            return closed
        ended = f"every rank to end the stage ({self._call('add', keys.done, 0)} of {p.world_size} ranks had)"
        return self._post(keys, stalled_failure(p, keys.name, ended, bound, self.turn_timeout))

    def _not_ended_on_node(self, keys: _Stage) -> list[int]:
        """(a rank that found a stage of every rank at once stalled) The local ranks of its node that did not say they
        ended it: one ``check`` per local rank, on this failure path only."""
        p = self.placement
        ended = keys.wake(p.node_rank, p.local_world_size + p.local_rank)
        return [r for r in range(p.local_world_size)
                if (key := keys.wake(p.node_rank, p.local_world_size + r)) != ended
                and self._call("check", [key]) != "True"]  # fmt: skip

    def _fail_own_turn(self, keys: _Stage, err: BaseException) -> None:
        """Post this rank's exception (``KeyboardInterrupt`` included: nobody waits for a rank that left). When the
        stage had failed already because this rank's turn timed out, raise that error instead, from ``err``."""
        p = self.placement
        with contextlib.suppress(StoreLost):
            verdict = self._post(keys, failure_from_exception(p, keys.name, err, self.checkpoint_path))
            first = verdict_failures(keys.name, verdict)[0]
            if first.kind is FailureKind.TIMEOUT and first.global_rank == p.global_rank:
                self._raise_verdict(keys, verdict, err)
            if not (isinstance(err, KeyboardInterrupt) and p.global_rank == 0):  # Ctrl-C: the user wants out now
                self._acknowledge(keys)

    def _post(self, keys: _Stage, failure: RankFailure, store: dist.Store | None = None) -> str:
        """Decide the stage as failed unless it was decided already, wake every waiting rank of the job; the verdict.
        A rank named as timed out, which may never read it, is counted as having read it. ``store``: another client
        of the job's store than this rank's own."""
        record = FAILED + "\n" + failure.to_json()
        verdict = self._call("compare_set", keys.verdict, "", record, store=store)
        self._call("set", keys.closed, verdict, store=store)
        if verdict != ENDED:
            wake = keys.every_wake()
            self._call("multi_set", wake, [FAILED] * len(wake), store=store)
        if verdict == record and failure.kind is FailureKind.TIMEOUT and failure.global_rank > 0:
            self._count_read(keys)
        return verdict

    def _raise_verdict(self, keys: _Stage, verdict: str, own: BaseException | None = None) -> None:
        """Raise the error of a failed stage's ``verdict``, once this rank has acknowledged it."""
        if verdict == ENDED:
            return
        failures = verdict_failures(keys.name, verdict)
        me = self.placement.global_rank
        # a rank named as timed out was counted as having read the verdict by the rank that named it
        if not any(f.kind is FailureKind.TIMEOUT and f.global_rank == me for f in failures):
            with contextlib.suppress(StoreLost):
                self._acknowledge(keys)
        self._stuck(failures)
        raise restore_error(self.checkpoint_path, failures, self.placement.global_rank, own) from own

    def _stuck(self, failures: list[RankFailure]) -> None:
        """Before raising ``failures``: have the ranks it names as stuck ended (``on_stuck``), then let a call still
        waiting on the store (its host stopped, and maybe killed just now) return first, if it does within seconds:
        one that returned while Python finalizes the process would abort it. Where no process of the job ends a
        stuck host now (under torchrun and ``ddp_spawn`` the launcher does, after this rank has exited), the call
        cannot return before this rank exits, and waiting would only delay its error."""
        me = self.placement.global_rank
        stuck = [f.global_rank for f in failures if f.kind in _STUCK and f.global_rank >= 0 and f.global_rank != me]
        ended_now = True
        if stuck and self._on_stuck is not None:
            ended_now = self._on_stuck(self, stuck)
        pending, self._pending = self._pending, None
        if pending is not None and ended_now:
            pending.wait(_ANSWER)

    def _acknowledge(self, keys: _Stage) -> None:
        """(a rank that knows the stage failed) Rank 0 hosts the store, and its exit ends it: it waits (at most
        ``_LINGER``) for every other rank to have read the verdict; the others say they have."""
        if self.placement.global_rank != 0:
            self._count_read(keys)
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
            self._get(keys.all_read, _LINGER)

    def _count_read(self, keys: _Stage) -> None:
        if int(self._call("add", keys.reads, 1)) == self.placement.world_size - 1:
            self._call("set", keys.all_read, "1")

    def _get(self, key: str, timeout: float) -> str | None:
        """``key``'s value once set, or ``None`` after ``timeout`` seconds: one blocking ``get`` on the job's client."""
        store = self._store
        assert store is not None
        seconds = min(max(timeout, 0.001), 10**7)

        def get() -> Any:
            previous = store.timeout  # type: ignore[attr-defined]
            store.set_timeout(datetime.timedelta(seconds=seconds))
            try:
                return store.get(key)
            finally:
                store.set_timeout(previous)

        try:
            return self._call(get, bound=seconds + _ANSWER)
        except _Timeout:
            return None

    def _call(
        self, method: str | Callable[[], Any], *args: object, bound: float | None = None, store: Any = None
    ) -> str:
        """One operation on the job's store (a method's name and arguments, or a function of the store; on ``store``,
        another client, if given); its failure as :class:`StoreLost` (or ``_Timeout``). An operation that waits for
        the store's answer gets at most ``bound`` seconds (default: the turn timeout), on a worker thread while this
        thread waits for it, where Ctrl-C raises at once (:meth:`_interrupted`); past that the store is
        unresponsive, and no later call touches it."""
        if self._unresponsive is not None:
            raise self._unresponsive
        call = method if callable(method) else functools.partial(getattr(store or self._store, method), *args)
        try:
            if method in _UNANSWERED:  # sent without waiting for an answer: cannot block
                value = call()
            else:
                value = _bounded(call, self.turn_timeout if bound is None else bound, self)
        except _NoAnswer as err:
            self._unresponsive = StoreUnresponsive(f"the store did not answer within {err.seconds:g}s")
            self._pending = err.done
            raise self._unresponsive from None
        except dist.DistStoreError as err:
            if "timeout" in str(err).lower():
                raise _Timeout() from err
            raise StoreLost(str(err)) from err
        except Exception as err:  # DistNetworkError, RuntimeError depending on the torch version
            raise StoreLost(str(err)) from err
        return value.decode(errors="replace") if isinstance(value, bytes) else str(value)

    def _interrupted(self, keys: _Stage, err: BaseException) -> None:
        """(a rank whose thread left a wait, on Ctrl-C) Post the interruption on a client of its own, since the call
        left waiting holds this rank's client until it returns: that wakes every waiting rank of the job, the call
        included, which then ends before the rank goes on (a call that returned while Python finalizes the process
        would abort it)."""
        pending, self._pending = self._pending, None
        if pending is None or self._unresponsive is not None:
            return
        with contextlib.suppress(Exception):  # the rank is leaving: its successor times it out if this fails
            clone = _bounded(self._store.clone, _ANSWER)  # type: ignore[union-attr]
            self._post(keys, failure_from_exception(self.placement, keys.name, err, self.checkpoint_path), clone)
        pending.wait(_ANSWER)

    @contextlib.contextmanager
    def _store_lost_raises(self, stage: str) -> Iterator[None]:
        try:
            yield
        except StoreLost as err:
            observer = self.placement.global_rank
            make = unresponsive_store_failure if isinstance(err, StoreUnresponsive) else store_lost_failure
            failures = [make(stage, observer, err)]
            self._stuck(failures)
            raise restore_error(self.checkpoint_path, failures, observer) from None


class _Turn:
    """One rank's turn of a stage (:meth:`TurnSchedule.turn`). A verdict is raised from ``__enter__`` or ``__exit__``
    with its traceback cut there: a failed restore's traceback shows one frame of the turn, not the wait's."""

    def __init__(self, schedule: TurnSchedule, keys: _Stage, ordered: bool, logged: bool) -> None:
        self.schedule, self.keys, self.ordered, self.logged = schedule, keys, ordered, logged
        self.record = TurnRecord(stage=keys.name)
        self.arrived = self.started = time.monotonic()
        self.memory_before = 0
        self.watchdog: _StackOnTimeout | None = None

    def __enter__(self) -> TurnRecord:
        schedule, record = self.schedule, self.record
        try:
            if schedule._store is not None:
                with schedule._store_lost_raises(record.stage):
                    schedule._wait_for_turn(self.keys, self.arrived)
        except CheckpointRestoreError as err:
            raise err.with_traceback(None) from err.__cause__
        except BaseException as err:  # Ctrl-C while waiting
            schedule._interrupted(self.keys, err)
            raise
        record.waited = time.monotonic() - self.arrived
        record.at_once = not self.ordered and schedule.placement.local_world_size > 1
        # a rank that waits for a turn says when it starts; one that starts at once has its end line only
        if self.logged and self.ordered and schedule.placement.local_rank >= self.keys.k:
            message = f"turn for {record.stage!r} started after waiting {record.waited:.2f}s"
            schedule.log.info(f"[rank {schedule.placement.global_rank}] serialized restore: {message}")
        self.memory_before = private_memory() if self.logged else 0
        self.started = time.monotonic()
        if schedule._store is not None:
            self.watchdog = _StackOnTimeout(schedule.turn_timeout)
        return record

    def __exit__(self, kind: object, err: BaseException | None, tb: object) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
        schedule, record = self.schedule, self.record
        try:
            if err is not None:
                if schedule._store is not None:
                    schedule._fail_own_turn(self.keys, err)
                return  # the rank's own exception goes on unchanged, as upstream raises it
            record.duration = time.monotonic() - self.started
            if self.logged:  # before the successor is woken: log lines of consecutive turns never overlap
                schedule.log.info(turn_end_line(schedule.placement.global_rank, record, self.memory_before))
            if schedule._store is not None:
                with schedule._store_lost_raises(record.stage):
                    schedule._end_turn(self.keys, self.arrived)
        except CheckpointRestoreError as error:
            raise error.with_traceback(None) from error.__cause__
        except BaseException as error:  # Ctrl-C while waiting
            schedule._interrupted(self.keys, error)
            raise


class _Timeout(Exception):
    pass


class _NoAnswer(Exception):
    def __init__(self, seconds: float, done: threading.Event) -> None:
        super().__init__(seconds)
        self.seconds, self.done = seconds, done


# the failures that name a rank that did not end: stuck in its turn, or the store's host not answering
_STUCK = (FailureKind.TIMEOUT, FailureKind.STORE_UNRESPONSIVE)
# the store calls that send without waiting for an answer (a stopped host cannot block them)
_UNANSWERED = ("set", "multi_set")


def _bounded(call: Callable[[], Any], seconds: float, owner: TurnSchedule | None = None) -> Any:
    """``call()`` on a daemon worker thread; its value or exception, or ``_NoAnswer`` once ``seconds`` have passed (the
    call then goes on alone: torch's store client waits for an answer without a bound, even after its own timeout).
    Where this thread leaves the wait early (Ctrl-C), the call still running is ``owner``'s pending call. (An event,
    not ``Thread.join``: a ``join`` that Ctrl-C interrupts marks the thread as ended while it runs on.)"""
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
        if owner is not None:
            owner._pending = done
        raise
    if not outcome:
        raise _NoAnswer(seconds, done)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


class _StackOnTimeout:
    """While a rank is in its turn: at the turn timeout, when the ranks timing it give up on it, print this process's
    stack (every thread's) to stderr, which shows the collective or read it is blocked in. A thread of its own, so that
    the process's ``faulthandler`` timer, which may be the user's, is left alone."""

    def __init__(self, seconds: float) -> None:
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(seconds,), name="serialized-restore-turn", daemon=True)
        self._thread.start()

    def _run(self, seconds: float) -> None:
        if not self._done.wait(seconds):
            with contextlib.suppress(Exception):  # no stderr file descriptor: no stack
                sys.stderr.write(f"serialized restore: turn still running after {seconds:g}s (turn timeout):\n")
                sys.stderr.flush()
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    def cancel(self) -> None:
        self._done.set()
        self._thread.join()
