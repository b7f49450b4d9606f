"""The turn schedule: which local rank of a node restores when, and how a failure reaches every rank.

It coordinates through the default process group's key-value store, never through collectives. Per stage, a rank's
main thread (here) and its watch (``_liveness.Watch``) share one ``_store.StageStore``; a failed stage ends through
``_exchange.Exchange``. ``docs/design.md`` describes the protocol and its store load.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

import torch.distributed as dist

from serialized_restore._errors import failure_from_exception, restore_error, store_lost_failure
from serialized_restore._exchange import Exchange
from serialized_restore._liveness import Identity, OwnThread, PeerWatch, WaitKind, Watch, WatchHost
from serialized_restore._memory import format_bytes, private_memory
from serialized_restore._order import NodeLog, TurnOrder
from serialized_restore._store import (
    StageKeys,
    StageStore,
    StoreLost,
    StoreTimeout,
    StoreView,
    heartbeat_key,
    identity_key,
    open_namespace,
)

log = logging.getLogger(__name__)

_BACKSTOP = 3600.0
"""The main connection's timeout: a wait is re-issued after it (with one c10d warning) while the watch lives."""
_SIGNAL_CHECK = 1.0
"""How often the main thread wakes from a wait to let Python run signal handlers (no store traffic)."""


class Outcome(str, Enum):
    """How a wait ends: the value its key was set to."""

    GO = "go"  # the predecessor ended its turn (or there is none)
    ENDED = "ended"  # every rank ended the stage
    FAILED = "failed"  # a rank posted a failure first

    @classmethod
    def of(cls, value: str) -> Outcome:
        """The outcome a key's value means; anything but ours (another client of the store wrote it) ends the stage as
        failed, so that the failure exchange names what is wrong."""
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
    ``host`` runs the rank's watch (default: a thread of its own per stage, ``_liveness.OwnThread``).
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
        host: WatchHost | None = None,
    ) -> None:
        self.placement = p = placement
        self.max_concurrent = max(1, min(max_concurrent, p.local_world_size))
        self.checkpoint_path = checkpoint_path
        self.turn_timeout, self.heartbeat_timeout = turn_timeout, heartbeat_timeout
        self.log = logger
        self.host: WatchHost = host if host is not None else OwnThread()
        self.order = TurnOrder(p.local_world_size, self.max_concurrent)
        self.peers = PeerWatch(p.global_rank, p.local_rank, p.local_world_size, heartbeat_timeout)
        self._job_store = store if p.world_size > 1 else None
        self._views: tuple[StoreView, StoreView] | None = None

    @contextlib.contextmanager
    def turn(self, stage: str, *, ordered: bool = True, logged: bool | None = None) -> Iterator[TurnRecord]:
        """Run the body of the ``with`` block as this rank's turn of ``stage``.

        (all ranks) wait for the predecessor on the node -> run the body -> announce the end -> wait for every rank
        of the job to end the stage. Raises :class:`CheckpointRestoreError` on every rank if any rank fails, times
        out or stops responding. On the rank whose body raised, the error's traceback runs down to where the body
        raised, and the body's exception is its ``__context__``. With ``ordered=False`` every rank's turn starts at
        once: a stage that allocates nothing transient, or an exchange of one rank's result. ``logged`` (default:
        ``ordered``) says whether each rank logs its turn's start and end and local rank 0 the node's summary.
        """
        p, record = self.placement, TurnRecord(stage=stage)
        logged = ordered if logged is None else logged
        if self._job_store is None:
            if logged:
                self.log.info(f"[rank {p.global_rank}] serialized restore: turn for {stage!r} started")
            start = time.monotonic()
            # nothing to coordinate: an exception in the body is raised as it is, exactly as upstream raises it
            yield record
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
        exchange = Exchange(self, store, watch)
        keys, main = store.keys, store.main
        self.host.start(watch)
        try:
            try:
                waited_from = time.monotonic()
                if self._wait_for_turn(store, watch, ordered) is not Outcome.GO:
                    raise exchange.abort([])
                record.waited = time.monotonic() - waited_from
                main.append(keys.log(p.node_rank), NodeLog.start_line(p.local_rank, time.time()))
                if logged:
                    waited = f"after waiting {record.waited:.2f}s" if ordered else "with the node's other ranks at once"
                    self.log.info(f"[rank {p.global_rank}] serialized restore: turn for {stage!r} started {waited}")
            except StoreLost as err:
                raise exchange.store_lost(err) from None
            started, memory_before = time.monotonic(), private_memory()
            try:
                with watch.in_turn():
                    yield record
            except (KeyboardInterrupt, SystemExit) as err:
                with contextlib.suppress(StoreLost):
                    exchange.acknowledge([failure_from_exception(p, stage, err, self.checkpoint_path)])
                raise
            except BaseException as err:
                error = exchange.abort([failure_from_exception(p, stage, err, self.checkpoint_path)], err)
                # one traceback, down to where the body raised; the body's exception stays the error's __context__
                raise error.with_traceback(err.__traceback__) from None
            record.duration = time.monotonic() - started
            try:
                # logged before the turn is announced as ended, so that log timestamps of consecutive turns on a
                # node never overlap
                if logged:
                    self._log_turn_end(record)
                if self._end_turn(store, watch, record, ordered, memory_before) is not Outcome.ENDED:
                    raise exchange.abort([])
                if logged and p.local_rank == 0:
                    self._log_node_summary(main, keys, ordered)
            except StoreLost as err:
                raise exchange.store_lost(err) from None
        finally:
            self.host.stop(watch)

    def on_one_rank(
        self, stage: str, compute: Callable[[], str | None], *, central: bool, per_node: bool = False
    ) -> str | None:
        """(all ranks) Run ``compute()`` on one rank and share its result, or its failure, with the others.

        ``central`` is true on exactly one rank of the job (of each node with ``per_node``). Every rank takes its
        turn of ``stage`` at once; the central rank runs ``compute()`` in its turn, and every rank waits for the whole
        job to end the stage. Every rank then returns the central rank's result (plain text, read back from the store,
        never evaluated; ``None`` if it returned ``None``). If the central rank raises, dies or hangs, every rank
        raises the same :class:`CheckpointRestoreError` within the bounds of a turn; a single process raises the
        original exception unchanged. ``"auto"``'s per-node decision and FSDP's rank-0 step use it.
        """
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

    def decide_per_node(self, stage: str, decide: Callable[[], str]) -> str:
        """(all ranks) Local rank 0 of each node runs ``decide()`` in its turn of ``stage``; every rank of the node
        returns that value (:meth:`on_one_rank`)."""
        value = self.on_one_rank(stage, decide, central=self.placement.local_rank == 0, per_node=True)
        assert value is not None, "decide() returned None"
        return value

    def _open(self, keys: StageKeys) -> StageStore:
        """(all ranks) The stage's store; in the schedule's first stage, take its namespace and say who this rank is."""
        p = self.placement
        if self._views is None:
            assert self._job_store is not None
            main, side = open_namespace(self._job_store, p.global_rank, _BACKSTOP)
            # the heartbeat exists before the identity: a peer that knows who this rank is can read it
            side.add(heartbeat_key(p.node_rank, p.local_rank), 1)
            side.set(identity_key(p.node_rank, p.local_rank), json.dumps(Identity.of_this_process(p.global_rank)))
            self._views = (main, side)
        nodes = max(1, p.world_size // p.local_world_size)
        wake_keys = [keys.wake(n, r) for n in range(nodes) for r in range(p.local_world_size)]
        return StageStore(keys, self._views[0], self._views[1], wake_keys)

    def _wait_for_turn(self, store: StageStore, watch: Watch, ordered: bool) -> Outcome:
        p, keys = self.placement, store.keys
        if not ordered:
            # nobody waits for anybody: every rank runs its body, as every upstream rank would have, whichever rank
            # fails first, and learns of a failure when the stage ends
            return Outcome.GO
        predecessor = self.order.predecessor(p.local_rank)
        if predecessor is None:
            return Outcome.FAILED if store.main.get_if_set(keys.closed) == Outcome.FAILED else Outcome.GO
        key = keys.wake(p.node_rank, p.local_rank)
        with watch.waiting(WaitKind.TURN, key, predecessor):
            return self._block(store.main, key, watch)

    def _end_turn(self, store: StageStore, watch: Watch, record: TurnRecord, ordered: bool, memory_before: int
                  ) -> Outcome:  # fmt: skip
        """Announce the end of this rank's turn, wake its successor, and wait for every rank of the job to end the
        stage; the stage's fate."""
        p, keys, main = self.placement, store.keys, store.main
        memory = private_memory()
        mapped = record.bytes_read if record.reader == "mmap" else 0
        line = NodeLog.end_line(p.local_rank, record.duration, mapped, record.bytes_read - mapped,
                                record.bytes_copied, memory, memory - memory_before)  # fmt: skip
        main.append(keys.log(p.node_rank), line)
        successor = self.order.successor(p.local_rank)
        if ordered and successor is not None:
            # compare_set: a failure's "failed" stays
            main.compare_set(keys.wake(p.node_rank, successor), "", Outcome.GO.value)
        if main.add(keys.finished, 1) >= p.world_size:
            return Outcome.of(main.compare_set(keys.closed, "", Outcome.ENDED.value))
        with watch.waiting(WaitKind.END, keys.closed):
            return self._block(main, keys.closed, watch)

    @staticmethod
    def _block(main: StoreView, key: str, watch: Watch) -> Outcome:
        """The value of ``key`` once set. Every wait here ends by a key being set, never by its timeout, which is a
        backstop for a dead watch. The blocking ``get`` runs in a helper thread while the main thread waits on an
        event: a signal (Ctrl-C, a launcher's SIGTERM) reaches the main thread's Python handlers at once."""
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def wait() -> None:
            try:
                while True:
                    try:
                        outcome["value"] = main.get(key)
                        return
                    except StoreTimeout:
                        if not watch.alive:
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
        return Outcome.of(outcome["value"])

    def _log_turn_end(self, record: TurnRecord) -> None:
        self.log.info(
            f"[rank {self.placement.global_rank}] serialized restore: turn for {record.stage!r} ended in"
            f" {record.duration:.2f}s, {record.describe()}"
        )

    def _log_node_summary(self, main: StoreView, keys: StageKeys, ordered: bool) -> None:
        # this rank's own turn is in the node's log: it is set, and ``ranks`` is never empty
        node_log = NodeLog.parse(main.get(keys.log(self.placement.node_rank)))
        ranks = [r for r in sorted(node_log.durations) if r in node_log.started]
        took = max(node_log.started[r] + node_log.durations[r] for r in ranks) - min(node_log.started[r] for r in ranks)
        ends = [node_log.ends[r] for r in ranks if r in node_log.ends]
        mapped, eager, copied = (sum(e[i] for e in ends) for i in range(3))
        did = []
        if mapped:
            size = format_bytes(max(e[0] for e in ends))
            did.append(
                f"{sum(1 for e in ends if e[0])} rank(s) mapped the file ({size}, pages shared in the page cache)"
            )
        did += [f"read {format_bytes(eager)} eagerly"] if eager else []
        did += [f"copied {format_bytes(copied)} out of the mapping"] if copied else []
        at_once = f"at most {self.max_concurrent}" if ordered else "all"
        self.log.info(
            f"serialized restore: node {self.placement.node_rank} ran {len(ranks)} turns of {keys.stage!r} ({at_once}"
            f" at once) in {took:.2f}s: {', '.join(did) or 'read nothing'}; longest turn"
            f" {max(node_log.durations[r] for r in ranks):.2f}s; at the end of its turn a rank's process held at most"
            f" {format_bytes(max((e[3] for e in ends), default=0))} of private memory, of which its turn added at most"
            f" {format_bytes(max((e[4] for e in ends), default=0))}"
        )
