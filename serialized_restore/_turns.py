"""The turn schedule: which local rank of a node restores when, and how failures reach every rank.

This module knows nothing about checkpoints beyond the path it names in its errors. It coordinates through the
key-value store of the default process group (the same ``TCPStore`` that ``torch.distributed`` rendezvoused through)
rather than through collectives, so that:

* a waiting rank never sits in one barrier for ``N - 1`` turns: it blocks on a wake-up key, and its wait is bounded by
  the time since the last turn on its node started or ended (``SerializedLoading.turn_timeout``);
* a rank that fails inside its turn wakes every waiting rank at once, and every rank raises the same
  :class:`~serialized_restore.CheckpointRestoreError`;
* a rank that dies (SIGKILL, OOM killer) is reported at once by the ranks on its machine, which see its process
  gone, and otherwise when its heartbeat has been silent for ``SerializedLoading.heartbeat_timeout`` seconds;
* nothing in a turn runs a collective on behalf of the schedule, so the body of a turn is free to not be one.

The parts, each in its own module: store keys and connections (``_store``), turn order and the node log
(``_order``), the failure exchange (``_exchange``), liveness and the monitor thread (``_liveness``), and the failure
messages (``_diagnosis``). ``docs/design.md`` describes the protocol and its store load.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from serialized_restore._diagnosis import store_lost_failure
from serialized_restore._errors import RankFailure, failure_from_exception, restore_error
from serialized_restore._exchange import Exchange
from serialized_restore._liveness import Identity, Monitor, PeerWatch
from serialized_restore._memory import format_bytes, private_memory
from serialized_restore._order import NodeLog, TurnOrder
from serialized_restore._store import ScheduleKeys, StageKeys, StoreLost, StoreTimeout, StoreView, open_namespace

log = logging.getLogger(__name__)

_BACKSTOP = 3600.0
"""The main connection's timeout: a wait is re-issued after it (with one c10d warning) while the monitor lives."""
_SIGNAL_CHECK = 1.0
"""How often the main thread wakes from a wait to let Python run signal handlers (no store traffic)."""


@dataclass(frozen=True)
class RankPlacement:
    """Where a process sits in the job."""

    global_rank: int
    world_size: int
    node_rank: int
    local_rank: int
    local_world_size: int


@dataclass
class TurnRecord:
    """What one rank's turn did; the body of a turn fills in ``bytes_read``, ``bytes_copied`` and ``reader``."""

    stage: str
    waited: float = 0.0
    duration: float = 0.0
    bytes_read: int = 0
    """Bytes of the file read (or mapped) in the turn."""
    bytes_copied: int = 0
    """Bytes copied out of the memory-mapped file into private memory in the turn."""
    reader: str = ""
    """``"mmap"`` or ``"eager"`` when the turn read the file."""

    def describe(self) -> str:
        """What the turn moved, in words: ``read 1.4 GiB memory-mapped``, ``copied 16.1 MiB out of the mapped file``."""
        done = []
        if self.bytes_read or self.reader:
            how = {"mmap": " memory-mapped", "eager": " eagerly"}.get(self.reader, "")
            done.append(f"read {format_bytes(self.bytes_read)}{how}")
        if self.bytes_copied:
            done.append(f"copied {format_bytes(self.bytes_copied)} out of the mapped file")
        return ", ".join(done) or "read nothing"


class TurnSchedule:
    """Runs one stage of a restore in turns across the local ranks of each node.

    Every rank of the job calls :meth:`turn` once per stage, in the same order of stages. Per node, local rank ``r``
    starts its turn when local rank ``r - k`` has ended its own (``k = max_concurrent``), so at most ``k`` local
    ranks of a node are inside a turn at once and nodes proceed independently. After its turn a rank waits until
    every rank of the job has ended the stage, so the next stage (which may run collectives, like DDP's parameter
    broadcast in ``strategy.setup``) starts with everyone present.

    With ``store=None`` (a single process) the body simply runs, and an exception in it propagates unchanged.
    """

    def __init__(
        self,
        *,
        store: dist.Store | None,
        placement: RankPlacement,
        max_concurrent: int,
        checkpoint_path: str,
        turn_timeout: float,
        heartbeat_timeout: float,
        logger: logging.Logger = log,
    ) -> None:
        self.placement = placement
        self.max_concurrent = max(1, min(max_concurrent, placement.local_world_size))
        self.checkpoint_path = checkpoint_path
        self.turn_timeout = turn_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.log = logger
        self._order = TurnOrder(placement.local_world_size, self.max_concurrent)
        self._job_store = store if placement.world_size > 1 else None
        self._main: StoreView | None = None
        self._monitor_view: StoreView | None = None
        self._watch = PeerWatch(
            placement.global_rank, placement.local_rank, placement.local_world_size, heartbeat_timeout
        )

    # ------------------------------------------------------------------ public

    @contextlib.contextmanager
    def turn(self, stage: str, *, ordered: bool = True, logged: bool | None = None) -> Iterator[TurnRecord]:
        """Run the body of the ``with`` block as this rank's turn of ``stage``.

        (all ranks) wait for the predecessor on the node -> run the body -> announce the end -> wait for every rank
        of the job to end the stage. Raises :class:`CheckpointRestoreError` on every rank if any rank fails, times
        out or stops responding; on the rank whose body raised, the body's exception is its ``__cause__``.
        With ``ordered=False`` every rank's turn starts at once (nobody waits for a predecessor): a stage that
        allocates nothing transient, or an exchange of one rank's result. ``logged`` (default: ``ordered``) says
        whether each rank logs its turn's start and end and local rank 0 the node's summary.
        """
        record = TurnRecord(stage=stage)
        logged = ordered if logged is None else logged
        if self._job_store is None:
            if logged:
                self.log.info(f"[rank {self.placement.global_rank}] serialized restore: turn for {stage!r} started")
            start = time.monotonic()
            # nothing to coordinate: an exception in the body is raised as it is, exactly as upstream raises it
            yield record
            record.duration = time.monotonic() - start
            if logged:
                self._log_turn_end(record)
            return

        p = self.placement
        keys = StageKeys(stage)
        try:
            main, monitor_view = self._open()
        except StoreLost as err:
            failure = store_lost_failure(stage, p.global_rank, err)
            raise restore_error(self.checkpoint_path, [failure], p.global_rank) from err.__cause__
        wake_keys = keys.all_wake_keys(max(1, p.world_size // p.local_world_size), p.local_world_size)
        monitor = Monitor(
            view=monitor_view,
            keys=keys,
            placement=p,
            order=self._order,
            watch=self._watch,
            turn_timeout=self.turn_timeout,
            heartbeat_timeout=self.heartbeat_timeout,
            wake_keys=wake_keys,
        )
        exchange = Exchange(
            view=main,
            keys=keys,
            placement=p,
            checkpoint_path=self.checkpoint_path,
            wake_keys=wake_keys,
            monitor=monitor,
            logger=self.log,
        )
        try:
            try:
                monitor.start()
                waited_from = time.monotonic()
                if self._wait_for_turn(main, keys, monitor, ordered) != "go":
                    raise exchange.abort([])
                record.waited = time.monotonic() - waited_from
                main.append(keys.log(p.node_rank), NodeLog.start_line(p.local_rank, time.time()))
                if logged:
                    waited = f"after waiting {record.waited:.2f}s" if ordered else "with the node's other ranks at once"
                    self.log.info(f"[rank {p.global_rank}] serialized restore: turn for {stage!r} started {waited}")
            except StoreLost as err:
                raise exchange.store_lost([], err) from err.__cause__
            started = time.monotonic()
            monitor.enter_turn()
            try:
                yield record
            except (KeyboardInterrupt, SystemExit) as err:
                monitor.leave_turn()
                exchange.acknowledge([self._failure_from_exception(stage, err)])
                raise
            except BaseException as err:
                monitor.leave_turn()
                raise exchange.abort([self._failure_from_exception(stage, err)], err) from err
            monitor.leave_turn()
            record.duration = time.monotonic() - started
            try:
                # logged before the turn is announced as ended, so that log timestamps of consecutive turns on a
                # node never overlap
                if logged:
                    self._log_turn_end(record)
                if self._end_turn(main, keys, monitor, record, ordered) != "ended":
                    raise exchange.abort([])
                if logged and p.local_rank == 0:
                    self._log_node_summary(main, keys, stage, ordered)
            except StoreLost as err:
                raise exchange.store_lost([], err) from err.__cause__
        finally:
            monitor.stop()

    # series: auto
    def on_one_rank(
        self, stage: str, compute: Callable[[], str | None], *, central: bool, per_node: bool = False
    ) -> str | None:
        """(all ranks) Run ``compute()`` on one rank and share its result, or its failure, with the others.

        ``central`` is true on exactly one rank of the job (of each node with ``per_node``). Every rank takes its
        turn of ``stage`` at once (no rank waits for another's turn); the central rank runs ``compute()`` in its turn,
        and every rank waits for the whole job to end the stage. Every rank then returns the central rank's result
        (plain text, read back from the store, never evaluated; ``None`` if it returned ``None``). If the central rank
        raises, dies or hangs, every rank raises the same :class:`CheckpointRestoreError`, within the bounds of a
        turn, and a single process raises the original exception unchanged. This is the one place where a decision
        or a step taken on one rank is shared: ``"auto"``'s per-node decision and FSDP's rank-0 step use it.
        """
        p = self.placement
        key = StageKeys(stage).decision(p.node_rank if per_node else -1)
        value: str | None = None
        with self.turn(stage, ordered=False):
            if central:
                value = compute()
                if value is not None and self._main is not None:
                    self._main.set(key, value)
        if not central and self._main is not None:
            value = self._main.get_if_set(key)
        return value

    def decide_per_node(self, stage: str, decide: Callable[[], str]) -> str:
        """(all ranks) Local rank 0 of each node runs ``decide()`` in its turn of ``stage``; every rank of the node
        returns that value (:meth:`on_one_rank`): local rank 0 dying, hanging or raising before it decides ends the
        wait on every rank of the job, within the bounds of a turn, with the same error."""
        value = self.on_one_rank(stage, decide, central=self.placement.local_rank == 0, per_node=True)
        assert value is not None, "decide() returned None"
        return value

    # series: end

    # ---------------------------------------------------------------- waiting

    def _open(self) -> tuple[StoreView, StoreView]:
        """(all ranks, first turn of a schedule) Take the schedule's key namespace; say who this rank is."""
        if self._main is None or self._monitor_view is None:
            assert self._job_store is not None
            p = self.placement
            main, monitor_view = open_namespace(self._job_store, p.global_rank, _BACKSTOP)
            # the heartbeat exists before the identity: a peer that knows who this rank is can read it
            monitor_view.add(ScheduleKeys.heartbeat(p.node_rank, p.local_rank), 1)
            monitor_view.set(
                ScheduleKeys.identity(p.node_rank, p.local_rank), Identity.of_this_process(p.global_rank).to_json()
            )
            self._main, self._monitor_view = main, monitor_view
        return self._main, self._monitor_view

    def _wait_for_turn(self, main: StoreView, keys: StageKeys, monitor: Monitor, ordered: bool) -> str:
        """``"go"`` once this rank may start its turn, ``"failed"`` if the stage failed first."""
        p = self.placement
        if not ordered:
            # nobody waits for anybody: every rank runs its body, as every upstream rank would have, whichever rank
            # fails first, and learns of a failure when the stage ends
            return "go"
        predecessor = self._order.predecessor(p.local_rank)
        if predecessor is None:
            return "failed" if main.get_if_set(keys.closed) == "failed" else "go"
        key = keys.wake(p.node_rank, p.local_rank)
        with monitor.waiting("turn", key, predecessor):
            return self._block(main, key, monitor)

    def _end_turn(self, main: StoreView, keys: StageKeys, monitor: Monitor, record: TurnRecord, ordered: bool) -> str:
        """Announce the end of this rank's turn, wake its successor, and wait for every rank of the job to end the
        stage; the stage's fate: ``"ended"`` or ``"failed"``."""
        p = self.placement
        moved = record.bytes_read + record.bytes_copied
        main.append(keys.log(p.node_rank), NodeLog.end_line(p.local_rank, record.duration, moved, private_memory()))
        if ordered:
            self._wake_successor(main, keys)
        if main.add(keys.finished, 1) >= p.world_size:
            return main.compare_set(keys.closed, "", "ended")
        with monitor.waiting("end", keys.closed):
            return self._block(main, keys.closed, monitor)

    def _wake_successor(self, main: StoreView, keys: StageKeys) -> None:
        successor = self._order.successor(self.placement.local_rank)
        if successor is not None:
            # compare_set: a failure's "failed" stays
            main.compare_set(keys.wake(self.placement.node_rank, successor), "", "go")

    @staticmethod
    def _block(main: StoreView, key: str, monitor: Monitor) -> str:
        """The value of ``key`` once set. Every wait here ends by a key being set, never by its timeout, which is a
        backstop for a dead monitor thread.

        The blocking ``get`` runs in a helper thread while the main thread waits on an event: a signal (Ctrl-C, a
        launcher's SIGTERM) reaches the main thread's Python handlers at once, not when the store answers.
        """
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def wait() -> None:
            try:
                while True:
                    try:
                        outcome["value"] = main.get(key)
                        return
                    except StoreTimeout:
                        if not monitor.alive:
                            raise
            except BaseException as err:
                outcome["error"] = err
            finally:
                done.set()

        threading.Thread(target=wait, name="serialized-restore-wait", daemon=True).start()
        while not done.wait(_SIGNAL_CHECK):
            pass
        if "error" in outcome:
            raise outcome["error"]
        return str(outcome["value"])

    def _failure_from_exception(self, stage: str, err: BaseException) -> RankFailure:
        return failure_from_exception(self.placement, stage, err, self.checkpoint_path)

    # ---------------------------------------------------------------- logging

    def _log_turn_end(self, record: TurnRecord) -> None:
        self.log.info(
            f"[rank {self.placement.global_rank}] serialized restore: turn for {record.stage!r} ended in"
            f" {record.duration:.2f}s, {record.describe()}"
        )

    def _log_node_summary(self, main: StoreView, keys: StageKeys, stage: str, ordered: bool) -> None:
        p = self.placement
        node_log = NodeLog.parse(main.get(keys.log(p.node_rank)))  # set: this rank's own turn is in it
        if not node_log.durations or not node_log.started:
            return
        durations = [node_log.durations[r] for r in sorted(node_log.durations)]
        starts = [node_log.started[r] for r in sorted(node_log.durations) if r in node_log.started]
        ends = [node_log.started[r] + node_log.durations[r] for r in node_log.durations if r in node_log.started]
        moved = sum(node_log.moved.values())
        private = max(node_log.private.values(), default=0)
        at_once = f"at most {self.max_concurrent}" if ordered else "all"
        self.log.info(
            f"serialized restore: node {p.node_rank} ran {len(durations)} turns of {stage!r}"
            f" ({at_once} at once) in {max(ends) - min(starts):.2f}s, moving"
            f" {format_bytes(moved)}; longest turn {max(durations):.2f}s; largest private memory of a rank at the end"
            f" of its turn {format_bytes(private)}"
        )
