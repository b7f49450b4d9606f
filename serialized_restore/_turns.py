"""The turn schedule: which local rank of a node restores when, and how a failure reaches every rank, through the
default process group's store, never through collectives (``docs/design.md``). Per stage, a rank's main thread (here)
and its watch (``_liveness.Watch``) share one ``_store.StageStore``."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

import torch.distributed as dist

from serialized_restore._errors import (
    CheckpointRestoreError,
    RankFailure,
    failure_from_exception,
    restore_error,
    store_lost_failure,
)
from serialized_restore._liveness import OwnThread, PeerWatch, WaitKind, Watch, WatchHost, announce
from serialized_restore._memory import format_bytes, private_memory
from serialized_restore._order import NodeLog
from serialized_restore._store import StageKeys, StageStore, StoreLost, StoreTimeout, StoreView, open_namespace

log = logging.getLogger(__name__)

_BACKSTOP = 3600.0  # the main connection's timeout: a wait is issued again after it while the watch lives
_SIGNAL_CHECK = 1.0  # how often a waiting main thread wakes to let Python run signal handlers (no store traffic)
_GATHER_GRACE = 1.0  # how long a failed stage waits for every rank to acknowledge (one inside its turn does at its end)
_LINGER = 2.0  # how long it waits for every rank that acknowledged to read the reports (rank 0 hosts the store)


class Outcome(str, Enum):
    """How a wait ends: the value its key was set to; any other value (another client of the store) is a failure."""

    GO = "go"  # the predecessor ended its turn (or there is none)
    ENDED = "ended"  # every rank ended the stage
    FAILED = "failed"  # a rank posted a failure first

    @classmethod
    def of(cls, value: str) -> Outcome:
        return cls._value2member_map_.get(value, cls.FAILED)  # type: ignore[return-value]


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
    """What one rank's turn did; its body fills in the bytes read (or mapped) and copied, and the ``reader``."""

    stage: str
    waited: float = 0.0
    duration: float = 0.0
    bytes_read: int = 0
    bytes_copied: int = 0
    reader: str = ""


class TurnSchedule:
    """Runs the stages of a restore in turns: every rank calls :meth:`turn` once per stage, in the same order; per
    node, local rank ``r`` starts when ``r - k`` has ended (``k = max_concurrent``), and every rank waits for the job
    to end the stage before the next one (which may run collectives). ``host`` runs the rank's watches."""

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
        host: WatchHost | None = None,
    ) -> None:
        self.placement = p = placement
        self.max_concurrent = max(1, min(max_concurrent, p.local_world_size))
        self.checkpoint_path = checkpoint_path
        self.turn_timeout, self.heartbeat_timeout = turn_timeout, heartbeat_timeout
        self.log = logger
        self.host: WatchHost = host if host is not None else OwnThread()
        self.peers = PeerWatch(p.global_rank, p.local_rank, p.local_world_size, heartbeat_timeout)
        self._job_store = store if p.world_size > 1 else None
        self._views: tuple[StoreView, StoreView] | None = None

    @contextlib.contextmanager
    def turn(self, stage: str, *, ordered: bool = True, logged: bool | None = None) -> Iterator[TurnRecord]:
        """Run the body of the ``with`` block as this rank's turn of ``stage``; :class:`CheckpointRestoreError` on
        every rank if any rank fails, times out or stops responding. ``ordered=False``: every turn at once.
        ``logged`` (default: ``ordered``): each rank logs its turn, and local rank 0 the node's summary."""
        p, record = self.placement, TurnRecord(stage=stage)
        logged = ordered if logged is None else logged
        if self._job_store is None:
            if logged:
                self.log.info(f"[rank {p.global_rank}] serialized restore: turn for {stage!r} started")
            start = time.monotonic()
            yield record  # nothing to coordinate: an exception is raised as it is, exactly as upstream raises it
            record.duration = time.monotonic() - start
            if logged:
                self._log_turn_end(record)
            return
        try:
            store = self._open(StageKeys(stage))
        except StoreLost as err:
            failure = store_lost_failure(stage, p.global_rank, err)
            raise restore_error(self.checkpoint_path, [failure], p.global_rank) from None
        watch = Watch(self, store)
        self.host.start(watch)
        try:
            waited_from = time.monotonic()
            if self._wait_for_turn(store, watch, ordered) is not Outcome.GO:
                raise self._abort(store, watch, [])
            record.waited = time.monotonic() - waited_from
            store.main.append(store.keys.log(p.node_rank), NodeLog.start_line(p.local_rank, time.time()))
            if logged:
                waited = f"after waiting {record.waited:.2f}s" if ordered else "with the node's other ranks at once"
                self.log.info(f"[rank {p.global_rank}] serialized restore: turn for {stage!r} started {waited}")
            started, memory_before = time.monotonic(), private_memory()
            try:
                with watch.waiting(WaitKind.BODY):
                    yield record
            except (KeyboardInterrupt, SystemExit) as err:
                with contextlib.suppress(StoreLost):  # tell the others, without waiting for them
                    store.post([failure_from_exception(p, stage, err, self.checkpoint_path)], store.main)
                    store.acknowledge(store.main, p.global_rank, reads=False)
                raise
            except BaseException as err:
                error = self._abort(store, watch, [failure_from_exception(p, stage, err, self.checkpoint_path)], err)
                # one traceback, down to where the body raised; the body's exception stays the error's __context__
                raise error.with_traceback(err.__traceback__) from None
            record.duration = time.monotonic() - started
            # logged before the turn is announced as ended: log timestamps of consecutive turns never overlap
            if logged:
                self._log_turn_end(record)
            if self._end_turn(store, watch, record, ordered, memory_before) is not Outcome.ENDED:
                raise self._abort(store, watch, [])
            if logged and p.local_rank == 0:
                self._log_node_summary(store, ordered)
        except StoreLost as err:  # the store's own operations above; the body's exceptions never get here
            raise self._store_lost(store, watch, err) from None
        finally:
            self.host.stop(watch)

    def on_one_rank(
        self, stage: str, compute: Callable[[], str | None], *, central: bool, per_node: bool = False
    ) -> str | None:
        """(all ranks) ``compute()`` on the ``central`` rank (of the job, or of each node) in its turn of ``stage``
        (all at once); its result (text, never evaluated) on every rank, or the same error on every rank."""
        key = StageKeys(stage).decision(self.placement.node_rank if per_node else -1)
        value: str | None = None
        with self.turn(stage, ordered=False):
            if central:
                value = compute()
                if value is not None and self._views is not None:
                    self._views[0].set(key, value)
        if not central and self._views is not None:
            value = self._views[0].get_if_set(key)
        return value

    def predecessor(self, local: int) -> int | None:
        """Whom local rank ``local`` waits for: ``k`` chains of turns, one turn at a time each."""
        return local - self.max_concurrent if local >= self.max_concurrent else None

    def successor(self, local: int) -> int | None:
        after = local + self.max_concurrent
        return after if after < self.placement.local_world_size else None

    def _open(self, keys: StageKeys) -> StageStore:
        """(all ranks) The stage's store; in the schedule's first stage, take its namespace and say who this rank is."""
        p = self.placement
        if self._views is None:
            self._views = open_namespace(self._job_store, p.global_rank, _BACKSTOP)
            announce(self._views[1], p)
        nodes = max(1, p.world_size // p.local_world_size)
        wake_keys = [keys.wake(n, r) for n in range(nodes) for r in range(p.local_world_size)]
        return StageStore(keys, self._views[0], self._views[1], wake_keys)

    def _wait_for_turn(self, store: StageStore, watch: Watch, ordered: bool) -> Outcome:
        # unordered, every rank runs its body, as every upstream rank would have, and learns of a failure at the end
        p, keys, predecessor = self.placement, store.keys, self.predecessor(self.placement.local_rank)
        if not ordered:
            return Outcome.GO
        if predecessor is None:
            return Outcome.of(store.main.get_if_set(keys.closed) or Outcome.GO)
        key = keys.wake(p.node_rank, p.local_rank)
        with watch.waiting(WaitKind.TURN, key, predecessor):
            return Outcome.of(self._block(store, key, watch))

    def _end_turn(self, store: StageStore, watch: Watch, record: TurnRecord, ordered: bool, memory_before: int
                  ) -> Outcome:  # fmt: skip
        """Log the end of this rank's turn, wake its successor and wait for every rank to end the stage: its fate."""
        p, keys, main = self.placement, store.keys, store.main
        memory = private_memory()
        mapped = record.bytes_read if record.reader == "mmap" else 0
        line = NodeLog.end_line(p.local_rank, record.duration, mapped, record.bytes_read - mapped,
                                record.bytes_copied, memory, memory - memory_before)  # fmt: skip
        main.append(keys.log(p.node_rank), line)
        if ordered:
            self._wake_successor(main, keys)
        if main.add(keys.finished, 1) >= p.world_size:
            return Outcome.of(main.compare_set(keys.closed, "", Outcome.ENDED.value))
        with watch.waiting(WaitKind.END, keys.closed):
            return Outcome.of(self._block(store, keys.closed, watch))

    def _wake_successor(self, main: StoreView, keys: StageKeys) -> None:
        successor = self.successor(self.placement.local_rank)
        if successor is not None:
            main.compare_set(keys.wake(self.placement.node_rank, successor), "", Outcome.GO.value)  # "failed" stays

    @staticmethod
    def _block(store: StageStore, key: str, watch: Watch, release_at: float = math.inf) -> str:
        """The value of ``key`` once set, by a rank or the watch (past ``release_at``, a dead watch's rank itself). The
        ``get`` runs in a helper thread: a signal (Ctrl-C, a launcher's SIGTERM) reaches the main thread at once."""
        outcome: list[Any] = []

        def wait() -> None:
            try:
                while not outcome:
                    try:
                        outcome.append(store.main.get(key))
                    except StoreTimeout:
                        if not watch.alive:
                            raise
            except BaseException as err:
                outcome.append(err)

        thread = threading.Thread(target=wait, name="serialized-restore-wait", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(_SIGNAL_CHECK)
            if time.monotonic() > release_at and not watch.alive:
                release_at = math.inf
                store.side.set(key, "deadline")
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return str(outcome[0])

    def _abort(
        self, store: StageStore, watch: Watch, own: list[RankFailure], raised: BaseException | None = None
    ) -> CheckpointRestoreError:
        """End a failed stage on this rank (``docs/design.md``): post ``own``, acknowledge, wait (``_GATHER_GRACE``)
        for every rank to, read the reports, wait (``_LINGER``) for every rank to read them. The error to raise."""
        view, keys = store.main, store.keys
        try:
            if own:
                store.post(own, view)
            counted = store.acknowledge(view, self.placement.global_rank)
            all_acked = self._await(store, watch, keys.all_acked, _GATHER_GRACE)
            failures = watch.reports = store.reports(view, all_acked)
            if counted:  # else counted on its behalf, read included
                store.read_done(view, all_acked)
            self._await(store, watch, keys.all_read, _LINGER)
        except StoreLost as err:
            return self._store_lost(store, watch, err, own, raised)
        return restore_error(self.checkpoint_path, failures + own, self.placement.global_rank, raised)

    def _await(self, store: StageStore, watch: Watch, key: str, bound: float) -> str:
        """``key``'s value once set, or ``"deadline"`` once the watch (if it died, this rank) set it at the bound."""
        with watch.waiting(WaitKind.RELEASE, key, release_after=bound):
            try:
                if watch.alive:  # a wait of a second or two: the blocking get itself, no helper thread
                    return store.main.get(key)
                return self._block(store, key, watch, time.monotonic() + bound)
            except StoreTimeout:
                return ""

    def _store_lost(self, store: StageStore, watch: Watch, err: BaseException, own: Sequence[RankFailure] = (),
                    raised: BaseException | None = None) -> CheckpointRestoreError:  # fmt: skip
        """The error once the store is gone: what this rank read before and its own failures, else the loss itself."""
        rank = self.placement.global_rank
        failures = [*(watch.reports or []), *own] or [store_lost_failure(store.keys.stage, rank, err)]
        return restore_error(self.checkpoint_path, failures, rank, raised)

    def _log_turn_end(self, record: TurnRecord) -> None:
        """``... ended in 0.31s, read 1.4 GiB memory-mapped, copied 16.1 MiB out of the mapped file``."""
        how = {"mmap": " memory-mapped", "eager": " eagerly"}.get(record.reader, "")
        done = [f"read {format_bytes(record.bytes_read)}{how}"] if record.bytes_read or record.reader else []
        done += [f"copied {format_bytes(record.bytes_copied)} out of the mapped file"] if record.bytes_copied else []
        self.log.info(
            f"[rank {self.placement.global_rank}] serialized restore: turn for {record.stage!r} ended in"
            f" {record.duration:.2f}s, {', '.join(done) or 'read nothing'}"
        )

    def _log_node_summary(self, store: StageStore, ordered: bool) -> None:
        # this rank's own turn is in the node's log: it is set, and ``ranks`` is never empty
        node_log = NodeLog.parse(store.main.get(store.keys.log(self.placement.node_rank)))
        ranks = [r for r in sorted(node_log.durations) if r in node_log.started]
        took = max(node_log.started[r] + node_log.durations[r] for r in ranks) - min(node_log.started[r] for r in ranks)
        ends = [node_log.ends[r] for r in ranks if r in node_log.ends]
        mapped, eager, copied = (sum(e[i] for e in ends) for i in range(3))
        did = [f"{sum(1 for e in ends if e[0])} rank(s) mapped the file ({format_bytes(max(e[0] for e in ends))},"
               " pages shared in the page cache)"] if mapped else []  # fmt: skip
        did += [f"read {format_bytes(eager)} eagerly"] if eager else []
        did += [f"copied {format_bytes(copied)} out of the mapping"] if copied else []
        at_once = f"at most {self.max_concurrent}" if ordered else "all"
        self.log.info(
            f"serialized restore: node {self.placement.node_rank} ran {len(ranks)} turns of {store.keys.stage!r}"
            f" ({at_once} at once) in {took:.2f}s: {', '.join(did) or 'read nothing'}; longest turn"
            f" {max(node_log.durations[r] for r in ranks):.2f}s; at the end of its turn a rank's process held at most"
            f" {format_bytes(max((e[3] for e in ends), default=0))} of private memory, of which its turn added at most"
            f" {format_bytes(max((e[4] for e in ends), default=0))}"
        )
