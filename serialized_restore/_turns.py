"""The turn schedule: which local rank of a node restores when, and how failures reach every rank.

This module knows nothing about checkpoints. It coordinates through the key-value store of the default process group
(the same ``TCPStore`` that ``torch.distributed`` rendezvoused through) rather than through collectives, so that:

* a waiting rank never sits in one barrier for ``N - 1`` turns: it polls, and its wait is bounded by the time since
  the last turn on its node started or ended (``SERIALIZED_RESTORE_TURN_TIMEOUT``);
* a rank that fails inside its turn tells all others within one poll, and every rank raises the same
  :class:`~serialized_restore.CheckpointRestoreError`;
* a rank that dies (SIGKILL, OOM killer) stops its heartbeat and is reported after
  ``SERIALIZED_RESTORE_HEARTBEAT_TIMEOUT`` seconds;
* nothing in a turn runs a collective on behalf of the schedule, so the body of a turn is free to not be one.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from serialized_restore._errors import CheckpointRestoreError, RankFailure
from serialized_restore._options import HEARTBEAT_TIMEOUT_ENV, TURN_TIMEOUT_ENV

log = logging.getLogger(__name__)

_POLL_INTERVAL = 0.02
_GATHER_GRACE = 10.0


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
    """What one rank's turn did; the body of a turn fills in ``bytes_read``."""

    stage: str
    waited: float = 0.0
    duration: float = 0.0
    bytes_read: int = 0


class _StoreLost(Exception):
    pass


class TurnSchedule:
    """Runs one stage of a restore in turns across the local ranks of each node.

    Every rank of the job calls :meth:`turn` once per stage, in the same order of stages. Per node, local rank ``r``
    starts its turn when local rank ``r - k`` has ended its own (``k = max_concurrent``), so at most ``k`` local
    ranks of a node are inside a turn at once and nodes proceed independently. After its turn a rank waits until
    every rank of the job has ended the stage, so the next stage (which may run collectives, like DDP's parameter
    broadcast in ``strategy.setup``) starts with everyone present.

    With ``store=None`` (a single process) the body simply runs.
    """

    def __init__(
        self,
        *,
        store: Optional[dist.Store],
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
        self._store: Optional[dist.Store] = None
        if store is not None and placement.world_size > 1:
            # one namespace per restore: every rank counts its own restores, so the n-th restore of each rank meets
            # the n-th restore of every other rank even when several Trainers share one process group
            generation = store.add(f"serialized_restore/generation/{placement.global_rank}", 1)
            self._store = dist.PrefixStore(f"serialized_restore/{generation}/", store)

    # ------------------------------------------------------------------ public

    @contextlib.contextmanager
    def turn(self, stage: str) -> Iterator[TurnRecord]:
        """Run the body of the ``with`` block as this rank's turn of ``stage``.

        (all ranks) wait for the predecessor on the node -> run the body -> announce the end -> wait for every rank
        of the job to end the stage. Raises :class:`CheckpointRestoreError` on every rank if any rank fails, times
        out or stops responding.
        """
        record = TurnRecord(stage=stage)
        if self._store is None:
            start = time.monotonic()
            try:
                yield record
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as err:
                failure = self._failure_from_exception(stage, err)
                raise CheckpointRestoreError(self.checkpoint_path, [failure], self.placement.global_rank) from err
            record.duration = time.monotonic() - start
            self._log_turn_end(record)
            return

        keys = _StageKeys(stage, self.placement)
        heartbeat = _Heartbeat(self._store, keys.heartbeat(self.placement.node_rank, self.placement.local_rank))
        heartbeat.start()
        try:
            try:
                waited_from = time.monotonic()
                self._wait_for_predecessor(keys)
                record.waited = time.monotonic() - waited_from
                self._store.set(keys.start(self.placement.node_rank, self.placement.local_rank), str(time.time()))
                self._store.add(keys.node_progress(self.placement.node_rank), 1)
                self.log.info(
                    f"[rank {self.placement.global_rank}] serialized restore: turn for {stage!r} started"
                    f" after waiting {record.waited:.2f}s"
                )
            except _StoreLost as err:
                raise self._store_lost(stage, err) from err
            started = time.monotonic()
            try:
                yield record
            except (KeyboardInterrupt, SystemExit) as err:
                self._post_failure(keys, self._failure_from_exception(stage, err))
                raise
            except BaseException as err:
                raise self._abort(keys, self._failure_from_exception(stage, err)) from err
            record.duration = time.monotonic() - started
            try:
                # logged before the turn is announced as ended, so that log timestamps of consecutive turns on a
                # node never overlap
                self._log_turn_end(record)
                self._store.set(keys.done(self.placement.node_rank, self.placement.local_rank), f"{record.duration}")
                self._store.add(keys.node_progress(self.placement.node_rank), 1)
                self._store.add(keys.finished, 1)
                self._wait_for_everyone(keys)
                if self.placement.local_rank == 0:
                    self._log_node_summary(keys, stage)
            except _StoreLost as err:
                raise self._store_lost(stage, err) from err
        finally:
            heartbeat.stop()

    # ---------------------------------------------------------------- waiting

    def _wait_for_predecessor(self, keys: _StageKeys) -> None:
        p = self.placement
        predecessor = p.local_rank - self.max_concurrent
        if predecessor < 0:
            self._check_failures(keys)
            return
        done_key = keys.done(p.node_rank, predecessor)
        self._wait(keys, lambda: self._check(done_key), f"the end of local rank {predecessor}'s turn")

    def _wait_for_everyone(self, keys: _StageKeys) -> None:
        world = self.placement.world_size
        self._wait(keys, lambda: self._add(keys.finished, 0) >= world, "every rank of the job to end the stage")

    def _wait(self, keys: _StageKeys, ready, what: str) -> None:  # type: ignore[no-untyped-def]
        """Poll until ``ready()``; raise (on every rank) on a failure elsewhere, a stalled node or a dead rank."""
        p = self.placement
        last_progress: tuple[int, int] = (-1, -1)
        last_change = time.monotonic()
        heartbeats: dict[int, tuple[int, float]] = {}
        next_heartbeat_check = time.monotonic() + 1.0
        while True:
            self._check_failures(keys)
            if ready():
                return
            now = time.monotonic()
            progress = (self._add(keys.node_progress(p.node_rank), 0), self._add(keys.finished, 0))
            if progress != last_progress:
                last_progress, last_change = progress, now
            elif now - last_change > self.turn_timeout:
                raise self._abort(keys, self._timeout_failure(keys, what, now - last_change))
            if now >= next_heartbeat_check:
                next_heartbeat_check = now + 1.0
                dead = self._unresponsive_rank(keys, heartbeats, now)
                if dead is not None:
                    raise self._abort(keys, dead)
            time.sleep(_POLL_INTERVAL)

    def _unresponsive_rank(
        self, keys: _StageKeys, heartbeats: dict[int, tuple[int, float]], now: float
    ) -> Optional[RankFailure]:
        p = self.placement
        for local in range(p.local_world_size):
            if local == p.local_rank or self._check(keys.done(p.node_rank, local)):
                continue
            beat = self._add(keys.heartbeat(p.node_rank, local), 0)
            if beat == 0:
                continue  # not arrived yet: covered by the turn timeout
            seen, since = heartbeats.get(local, (-1, now))
            if beat != seen:
                heartbeats[local] = (beat, now)
                continue
            if now - since > self.heartbeat_timeout:
                in_turn = self._check(keys.start(p.node_rank, local))
                doing = "inside its turn" if in_turn else "waiting for its turn"
                return RankFailure(
                    global_rank=p.global_rank,
                    node_rank=p.node_rank,
                    local_rank=p.local_rank,
                    stage=keys.stage,
                    kind="unresponsive",
                    message=(
                        f"local rank {local} of node {p.node_rank} stopped responding while {doing} of stage"
                        f" {keys.stage!r}: no heartbeat for {now - since:.1f}s. The process probably died (killed,"
                        f" or out of memory). Set {HEARTBEAT_TIMEOUT_ENV} (seconds, now {self.heartbeat_timeout:g})"
                        " to change how long ranks wait for a silent rank."
                    ),
                )
        return None

    def _timeout_failure(self, keys: _StageKeys, what: str, idle: float) -> RankFailure:
        p = self.placement
        busy = [
            local
            for local in range(p.local_world_size)
            if self._check(keys.start(p.node_rank, local)) and not self._check(keys.done(p.node_rank, local))
        ]
        if busy:
            culprit = (
                f"local rank(s) {', '.join(map(str, busy))} of node {p.node_rank} have been inside their turn with no"
                f" turn starting or ending for {idle:.1f}s. Either reading the checkpoint is that slow, or code in the"
                " turn (for example a collective such as `broadcast` or `barrier` in `on_load_checkpoint` or a"
                " callback's `load_state_dict`) waits for ranks that are themselves waiting for their turn: hooks"
                " must not run collectives while `serialized_checkpoint_loading` is on."
            )
        else:
            culprit = (
                f"no rank has started or ended a turn for {idle:.1f}s while this rank waited for {what}; some rank"
                " has not reached the restore."
            )
        return RankFailure(
            global_rank=p.global_rank,
            node_rank=p.node_rank,
            local_rank=p.local_rank,
            stage=keys.stage,
            kind="timeout",
            message=(
                f"timed out waiting for {what}: {culprit} Set {TURN_TIMEOUT_ENV} (seconds, now {self.turn_timeout:g})"
                " to allow longer turns."
            ),
        )

    # --------------------------------------------------------------- failures

    def _failure_from_exception(self, stage: str, err: BaseException) -> RankFailure:
        p = self.placement
        return RankFailure(
            global_rank=p.global_rank,
            node_rank=p.node_rank,
            local_rank=p.local_rank,
            stage=stage,
            kind="exception",
            message=f"{type(err).__name__}: {err}",
            traceback="".join(traceback.format_exception(err)),
        )

    def _post_failure(self, keys: _StageKeys, failure: RankFailure) -> None:
        assert self._store is not None
        with contextlib.suppress(Exception):
            self._store.set(keys.failure(failure.global_rank), pickle.dumps(failure))
            self._store.add(keys.failures, 1)

    def _check_failures(self, keys: _StageKeys) -> None:
        if self._add(keys.failures, 0) > 0:
            raise self._abort(keys, None)

    def _abort(self, keys: _StageKeys, own: Optional[RankFailure]) -> CheckpointRestoreError:
        """Gather every rank's failure and build the error this rank raises.

        (all ranks, once a failure is known) post own failure -> acknowledge -> wait for the other ranks to
        acknowledge (bounded) -> read all failures -> confirm the read. Rank 0 returns last, because in Lightning's
        launcher it hosts the store and its exit ends the job.
        """
        assert self._store is not None
        p = self.placement
        try:
            if own is not None:
                self._post_failure(keys, own)
            self._store.add(keys.acks, 1)
            self._wait_count(keys.acks, p.world_size, _GATHER_GRACE)
            failures = []
            for rank in range(p.world_size):
                key = keys.failure(rank)
                if self._check(key):
                    failures.append(pickle.loads(self._store.get(key)))
            self._store.add(keys.reads, 1)
            if p.global_rank == 0:
                self._wait_count(keys.reads, p.world_size, _GATHER_GRACE)
        except _StoreLost as err:
            failures = [own] if own is not None else [self._store_lost_failure(keys.stage, err)]
        if own is not None and all(f.global_rank != own.global_rank for f in failures):
            failures.append(own)
        return CheckpointRestoreError(self.checkpoint_path, failures, p.global_rank)

    def _wait_count(self, key: str, target: int, limit: float) -> None:
        deadline = time.monotonic() + limit
        while self._add(key, 0) < target and time.monotonic() < deadline:
            time.sleep(_POLL_INTERVAL)

    def _store_lost_failure(self, stage: str, err: BaseException) -> RankFailure:
        p = self.placement
        return RankFailure(
            global_rank=p.global_rank,
            node_rank=p.node_rank,
            local_rank=p.local_rank,
            stage=stage,
            kind="unresponsive",
            message=(
                "lost contact with the process group's store, which is hosted by global rank 0 (or the launcher's"
                f" agent): that process probably exited or was killed ({type(err.__cause__ or err).__name__}:"
                f" {err.__cause__ or err})."
            ),
        )

    def _store_lost(self, stage: str, err: BaseException) -> CheckpointRestoreError:
        return CheckpointRestoreError(
            self.checkpoint_path, [self._store_lost_failure(stage, err)], self.placement.global_rank
        )

    # ------------------------------------------------------------------ store

    def _add(self, key: str, amount: int) -> int:
        assert self._store is not None
        try:
            return int(self._store.add(key, amount))
        except Exception as err:  # DistNetworkError, DistStoreError, RuntimeError depending on torch version
            raise _StoreLost(str(err)) from err

    def _check(self, key: str) -> bool:
        assert self._store is not None
        try:
            return bool(self._store.check([key]))
        except Exception as err:
            raise _StoreLost(str(err)) from err

    # ---------------------------------------------------------------- logging

    def _log_turn_end(self, record: TurnRecord) -> None:
        self.log.info(
            f"[rank {self.placement.global_rank}] serialized restore: turn for {record.stage!r} ended in"
            f" {record.duration:.2f}s, read {record.bytes_read / 2**20:.1f} MiB"
        )

    def _log_node_summary(self, keys: _StageKeys, stage: str) -> None:
        assert self._store is not None
        p = self.placement
        durations = [float(self._store.get(keys.done(p.node_rank, local))) for local in range(p.local_world_size)]
        starts = [float(self._store.get(keys.start(p.node_rank, local))) for local in range(p.local_world_size)]
        ends = [s + d for s, d in zip(starts, durations)]
        self.log.info(
            f"serialized restore: node {p.node_rank} ran {len(durations)} turns of {stage!r}"
            f" (at most {self.max_concurrent} at once) in {max(ends) - min(starts):.2f}s;"
            f" longest turn {max(durations):.2f}s"
        )


class _StageKeys:
    """Store keys of one stage of one restore."""

    def __init__(self, stage: str, placement: RankPlacement) -> None:
        self.stage = stage
        self._p = stage.replace(" ", "_") + "/"
        self.failures = self._p + "failures"
        self.acks = self._p + "acks"
        self.reads = self._p + "reads"
        self.finished = self._p + "finished"

    def start(self, node: int, local: int) -> str:
        return f"{self._p}start/{node}/{local}"

    def done(self, node: int, local: int) -> str:
        return f"{self._p}done/{node}/{local}"

    def heartbeat(self, node: int, local: int) -> str:
        return f"{self._p}heartbeat/{node}/{local}"

    def node_progress(self, node: int) -> str:
        return f"{self._p}progress/{node}"

    def failure(self, global_rank: int) -> str:
        return f"{self._p}failure/{global_rank}"


class _Heartbeat:
    """A daemon thread that bumps this rank's heartbeat counter once a second while it takes part in a stage."""

    def __init__(self, store: dist.Store, key: str, interval: float = 0.5) -> None:
        self._store = store
        self._key = key
        self._interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="serialized-restore-heartbeat", daemon=True)

    def start(self) -> None:
        self._store.add(self._key, 1)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self._store.add(self._key, 1)
            except Exception:
                return
