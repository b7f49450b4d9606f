"""The turn protocol: which local rank of a node runs a stage of the restore when, and how a failure reaches every
rank, on the job's own store (``docs/design.md``, *The turn schedule*): blocking ``get`` with a timeout, ``add``,
``set``, ``compare_set`` and ``multi_set`` (``store.py`` bounds each); no collective, no polling."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import math
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

import torch.distributed as dist

from serialized_restore._coordination.failures import (
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
from serialized_restore._coordination.placement import RankPlacement
from serialized_restore._coordination.store import (
    ANSWER,
    ENDED,
    FAILED,
    GO,
    BoundedStore,
    RestoreKeys,
    StageKeys,
    StoreLost,
    StoreUnresponsive,
    hosted_by_agent,
)
from serialized_restore._coordination.stuck import StuckRanks
from serialized_restore._coordination.turn_log import TurnRecord, private_memory, turn_end_line

log = logging.getLogger(__name__)

_LINGER = 2.0  # how long a failed stage keeps the store's host, rank 0, for the other ranks to read the verdict
# the failures that name a rank that did not end: stuck in its turn, or the store's host not answering
_STUCK = (FailureKind.TIMEOUT, FailureKind.STORE_UNRESPONSIVE)


def predecessor(local_rank: int, k: int) -> int | None:
    """The local rank whose end starts ``local_rank``'s turn when ``k`` ranks of a node run at once: ``local_rank -
    k``, so that the node's ranks form ``k`` chains; ``None`` for the first ``k``, which start at once."""
    return local_rank - k if local_rank >= k else None


class TurnSchedule:
    """The turns of one restore on one rank: every rank calls :meth:`turn` once per stage, in the same order of
    stages; per node, local rank ``r`` starts when ``r - k`` has ended, and every rank waits for the job to end the
    stage. A turn is timed (``turn_timeout``, from when it could start) by the rank waiting for it, or for a chain's
    last turn by the rank before it. One failure decides the stage: the failing rank raises its own exception, every
    other rank a :class:`CheckpointRestoreError`."""

    def __init__(self, *, store: dist.Store | None, placement: RankPlacement, checkpoint_path: str,
                 turn_timeout: float, namespace: str = "", logger: logging.Logger = log, launcher: Any = None,
                 first_process: int | None = None) -> None:  # fmt: skip
        """``store``: the job's store (``None`` for one process: a turn is its body alone). ``namespace``: see
        :class:`RestoreKeys`. ``launcher``: Lightning's own launcher, where it started the job: the job's processes then
        end a rank named stuck themselves (:class:`StuckRanks`, with ``first_process``, global rank 0's process id)."""
        self.placement = placement
        self.checkpoint_path = checkpoint_path
        self.turn_timeout = turn_timeout
        self.log = logger
        self.store = BoundedStore(store, turn_timeout) if store is not None and placement.world_size > 1 else None
        self.keys = RestoreKeys(namespace)
        self.stuck: StuckRanks | None = None
        if launcher is not None:
            self.stuck = StuckRanks(placement, launcher, first_process, self.keys.first_process(placement.node_rank))
            if self.store is not None:
                with contextlib.suppress(StoreLost):  # only ever read on a failure path: that path names the loss
                    self.stuck.announce(self.store)
        self._stages: set[str] = set()

    def turn(self, stage: str, *, k: int | None = 1, logged: bool | None = None, doing: str | None = None) -> Turn:
        """(all ranks) Run the ``with`` block as this rank's turn of ``stage``: at most ``k`` local ranks of a node
        at once, in local-rank order; ``k=None``: every local rank at once. ``logged`` (default: whether ``k`` is
        given): the rank logs its turn's start and end. ``doing``: what a turn does, where a turn past the timeout is
        most likely just slow at it (``"downloading the checkpoint"``), for its error."""
        stage, lws = str(stage), self.placement.local_world_size  # a str enum member: its value
        if stage in self._stages:  # its keys are the stage's own: a second turn would meet the first one's
            raise RuntimeError(f"serialized restore: the stage {stage!r} ran twice in one restore")
        self._stages.add(stage)
        ordered = k is not None
        logged = (ordered if logged is None else logged) and self.log.isEnabledFor(logging.INFO)
        return Turn(self, stage, max(1, min(k, lws)) if k is not None else lws, ordered, logged, doing)

    def on_one_rank(
        self, stage: str, compute: Callable[[], str | None], *, central: bool, per_node: bool = False,
        doing: str | None = None,
    ) -> str | None:  # fmt: skip
        """(all ranks) ``compute()`` on the ``central`` rank (of the job, or of each node) in its turn of ``stage``
        (all ranks at once; ``doing`` as for :meth:`turn`); its result (text, never evaluated) on every rank, or the
        same error on every rank."""
        stage = str(stage)  # a str enum member: its value
        value: str | None = None
        key = self.keys.stage(stage).decision(self.placement.node_rank if per_node else None)
        with self.turn(stage, k=None, doing=doing):
            if central:
                value = compute()
                if self.store is not None:
                    with self.store_lost_raises(stage):
                        self.store.call("set", key, "" if value is None else value)
        if not central and self.store is not None:  # set before the stage ended: never blocks
            with self.store_lost_raises(stage):
                value = self.store.call("get", key) or None
        return value

    @contextlib.contextmanager
    def store_lost_raises(self, stage: str) -> Iterator[None]:
        """Where losing the store ends the restore: raise the error that names its host, on this rank."""
        try:
            yield
        except StoreLost as err:
            observer = self.placement.global_rank
            make = unresponsive_store_failure if isinstance(err, StoreUnresponsive) else store_lost_failure
            failures = [make(stage, observer, err, hosted_by_agent())]
            self.end_stuck(failures)
            raise restore_error(self.checkpoint_path, failures, observer) from None

    def end_stuck(self, failures: list[RankFailure]) -> None:
        """Before raising ``failures``: have the ranks it names as stuck ended (``stuck``), then let a call still
        waiting on the store (its host stopped, and maybe killed just now) return first, if it does within seconds:
        one that returned while Python finalizes the process would abort it. Where no process of the job ends a
        stuck host now (under torchrun and ``ddp_spawn`` the launcher does, after this rank has exited), the call
        cannot return before this rank exits, and waiting would only delay its error."""
        me = self.placement.global_rank
        named = [f.global_rank for f in failures if f.kind in _STUCK and f.global_rank >= 0 and f.global_rank != me]
        ended_now = True
        if named:
            ended_now = self.stuck is not None and self.stuck.end(named, self.store)
        pending = self.store.take_pending() if self.store is not None else None
        if pending is not None and ended_now:
            pending.wait(ANSWER)


class Turn:
    """One rank's turn of a stage (:meth:`TurnSchedule.turn`). A verdict is raised from ``__enter__`` or ``__exit__``
    with its traceback cut there: a failed restore's traceback shows one frame of the turn, not the wait's."""

    def __init__(
        self, schedule: TurnSchedule, stage: str, k: int, ordered: bool, logged: bool, doing: str | None
    ) -> None:
        self.schedule, self.stage, self.k = schedule, stage, k
        self.ordered, self.logged, self.doing = ordered, logged, doing
        self.keys: StageKeys = schedule.keys.stage(stage)
        self.store = schedule.store
        self.placement = schedule.placement
        self.record = TurnRecord(stage=stage)
        self.arrived = self.started = time.monotonic()
        self.memory_before = 0
        self.watchdog: _StackOnTimeout | None = None

    def __enter__(self) -> TurnRecord:
        schedule, record, p = self.schedule, self.record, self.placement
        try:
            if self.store is not None:
                with schedule.store_lost_raises(self.stage):
                    self._wait_for_turn()
        except CheckpointRestoreError as err:
            raise err.with_traceback(None) from err.__cause__
        except BaseException as err:  # Ctrl-C while waiting
            self._interrupted(err)
            raise
        record.waited = time.monotonic() - self.arrived
        record.at_once = not self.ordered and p.local_world_size > 1
        # a rank that waits for a turn says when it starts; one that starts at once has its end line only
        if self.logged and self.ordered and p.local_rank >= self.k:
            message = f"turn for {self.stage!r} started after waiting {record.waited:.2f}s"
            schedule.log.info(
                f"[rank {p.global_rank}] serialized restore: {message}",
                extra={"turn": record.fields(p.global_rank, "started")},
            )
        self.memory_before = private_memory() if self.logged else 0
        self.started = time.monotonic()
        if self.store is not None:
            self.watchdog = _StackOnTimeout(schedule.turn_timeout)
        return record

    def __exit__(self, kind: object, err: BaseException | None, tb: object) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
        schedule, record, p = self.schedule, self.record, self.placement
        try:
            if err is not None:
                if self.store is not None:
                    self._fail_own_turn(err)
                return  # the rank's own exception goes on unchanged, as upstream raises it
            record.duration = time.monotonic() - self.started
            if self.logged:  # before the successor is woken: log lines of consecutive turns never overlap
                line = turn_end_line(p.global_rank, record, self.memory_before)
                schedule.log.info(line, extra={"turn": record.fields(p.global_rank, "ended")})
            if self.store is not None:
                with schedule.store_lost_raises(self.stage):
                    self._end_turn()
        except CheckpointRestoreError as error:
            raise error.with_traceback(None) from error.__cause__
        except BaseException as error:  # Ctrl-C while waiting
            self._interrupted(error)
            raise

    def _wait_for_turn(self) -> None:
        """Block until the rank ``k`` places ahead ended its turn: first until it could start (the backstop bound is a
        turn timeout per turn ahead of it), then for at most the turn timeout."""
        assert self.store is not None
        p, k, timeout = self.placement, self.k, self.schedule.turn_timeout
        ahead = predecessor(p.local_rank, k)
        if ahead is None:
            return
        before = predecessor(ahead, k)
        if before is not None:
            bound = timeout * (ahead // k + 1)  # a turn more than it needs: the timers of those turns come first
            if self.store.get(self.keys.wake(p.node_rank, ahead), bound - (time.monotonic() - self.arrived)) is None:
                waited = f"local rank {before} of node {p.node_rank} to end its turn"
                self._raise_verdict(self._post(stalled_failure(p, self.stage, waited, bound, timeout)))
        value = self.store.get(self.keys.wake(p.node_rank, p.local_rank), timeout)
        if value is None:
            self._raise_verdict(self._post(timeout_failure(p, self.stage, ahead, timeout, self.doing)))
        elif value != GO:
            self._raise_verdict(self.store.get(self.keys.closed, math.inf) or "")

    def _end_turn(self) -> None:
        """Count this turn as ended and wake the rank ``k`` places behind (or mark the chain's end); time that rank
        when its turn ends the chain; then wait for every rank of the job to end the stage: its fate."""
        assert self.store is not None
        store, keys, p, k = self.store, self.keys, self.placement, self.k
        lws, timeout = p.local_world_size, self.schedule.turn_timeout
        closing = int(store.call("add", keys.done, 1)) >= p.world_size
        behind = p.local_rank + k
        # wakes the rank k places behind, or marks the end of a chain; with every rank of the node at once (k = L),
        # says that this rank ended, for the rank that finds the stage stalled to name who did not
        store.call("set", keys.wake(p.node_rank, behind), GO)
        if closing:
            verdict = store.call("compare_set", keys.verdict, "", ENDED)
            store.call("set", keys.closed, verdict)
        else:
            if behind < lws <= behind + k and store.get(keys.wake(p.node_rank, behind + k), timeout) is None:
                self._post(timeout_failure(p, self.stage, behind, timeout, self.doing))
            # a turn more than the chain needs where turns have timers (no stage of all ranks at once waits longer)
            bound = timeout * (math.ceil(lws / k) + (k < lws))
            closed = store.get(keys.closed, bound - (time.monotonic() - self.arrived))
            verdict = closed if closed is not None else self._stalled(bound)
        self._raise_verdict(verdict)

    def _stalled(self, bound: float) -> str:
        """(a rank that waited ``bound`` for the stage to end) Post who stalled it; the verdict. In a stage of every
        rank at once no rank times another: the first local rank of this node that did not end it is named; a node
        whose ranks all ended leaves a moment to another node to name its own, then posts a stall."""
        assert self.store is not None
        p, k, lws, timeout = self.placement, self.k, self.placement.local_world_size, self.schedule.turn_timeout
        missing = self._not_ended_on_node() if k >= lws else []
        if missing:
            return self._post(timeout_failure(p, self.stage, missing[0], timeout, self.doing))
        if k >= lws and p.nodes > 1 and (closed := self.store.get(self.keys.closed, ANSWER)) is not None:
            return closed
        ended = f"every rank to end the stage ({self.store.call('add', self.keys.done, 0)} of {p.world_size} ranks had)"
        return self._post(stalled_failure(p, self.stage, ended, bound, timeout))

    def _not_ended_on_node(self) -> list[int]:
        """(a rank that found a stage of every rank at once stalled) The local ranks of its node that did not say they
        ended it: one ``check`` per local rank, on this failure path only."""
        assert self.store is not None
        p, lws = self.placement, self.placement.local_world_size
        own = self.keys.wake(p.node_rank, lws + p.local_rank)
        return [r for r in range(lws)
                if (key := self.keys.wake(p.node_rank, lws + r)) != own
                and self.store.call("check", [key]) != "True"]  # fmt: skip

    def _fail_own_turn(self, err: BaseException) -> None:
        """Post this rank's exception (``KeyboardInterrupt`` included: nobody waits for a rank that left). When the
        stage had failed already because this rank's turn timed out, raise that error instead, from ``err``."""
        p, schedule = self.placement, self.schedule
        with contextlib.suppress(StoreLost):
            verdict = self._post(failure_from_exception(p, self.stage, err, schedule.checkpoint_path))
            first = verdict_failures(self.stage, verdict)[0]
            if first.kind is FailureKind.TIMEOUT and first.global_rank == p.global_rank:
                self._raise_verdict(verdict, err)
            if not (isinstance(err, KeyboardInterrupt) and p.global_rank == 0):  # Ctrl-C: the user wants out now
                self._acknowledge()

    def _post(self, failure: RankFailure, store: BoundedStore | None = None) -> str:
        """Decide the stage as failed unless it was decided already, wake every waiting rank of the job; the verdict.
        A rank named as timed out, which may never read it, is counted as having read it. ``store``: another client
        of the job's store than this rank's own."""
        store = store or self.store
        assert store is not None
        p, keys = self.placement, self.keys
        posted = FAILED + "\n" + failure.to_json()
        verdict = store.call("compare_set", keys.verdict, "", posted)
        store.call("set", keys.closed, verdict)
        if verdict != ENDED:
            # every rank's wake-up key, and per chain the key L + i its last turn sets (its timer waits for it)
            wake = keys.every_wake(p.nodes, p.local_world_size + self.k)
            store.call("multi_set", wake, [FAILED] * len(wake))
        if verdict == posted and failure.kind is FailureKind.TIMEOUT and failure.global_rank > 0:
            self._count_read()
        return verdict

    def _raise_verdict(self, verdict: str, own: BaseException | None = None) -> None:
        """Raise the error of a failed stage's ``verdict``, once this rank has acknowledged it."""
        if verdict == ENDED:
            return
        failures = verdict_failures(self.stage, verdict)
        me = self.placement.global_rank
        # a rank named as timed out was counted as having read the verdict by the rank that named it
        if not any(f.kind is FailureKind.TIMEOUT and f.global_rank == me for f in failures):
            with contextlib.suppress(StoreLost):
                self._acknowledge()
        self.schedule.end_stuck(failures)
        raise restore_error(self.schedule.checkpoint_path, failures, me, own) from own

    def _acknowledge(self) -> None:
        """(a rank that knows the stage failed) Rank 0 hosts the store, and its exit ends it: it waits (at most
        ``_LINGER``) for every other rank to have read the verdict; the others say they have."""
        if self.placement.global_rank != 0:
            self._count_read()
        elif not hosted_by_agent():
            assert self.store is not None
            self.store.get(self.keys.all_read, _LINGER)

    def _count_read(self) -> None:
        assert self.store is not None
        if int(self.store.call("add", self.keys.reads, 1)) == self.placement.world_size - 1:
            self.store.call("set", self.keys.all_read, "1")

    def _interrupted(self, err: BaseException) -> None:
        """(a rank whose thread left a wait, on Ctrl-C) Post the interruption on a client of its own, since the call
        left waiting holds this rank's client until it returns: that wakes every waiting rank of the job, the call
        included, which then ends before the rank goes on (a call that returned while Python finalizes the process
        would abort it)."""
        store = self.store
        pending = store.take_pending() if store is not None else None
        if store is None or pending is None or store.unresponsive is not None:
            return
        with contextlib.suppress(Exception):  # the rank is leaving: its successor times it out if this fails
            failure = failure_from_exception(self.placement, self.stage, err, self.schedule.checkpoint_path)
            self._post(failure, store.clone())
        pending.wait(ANSWER)


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
