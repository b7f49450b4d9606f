"""The turn schedule: which local rank of a node restores when, and how failures reach every rank.

This module knows nothing about checkpoints beyond the path it names in its errors. It coordinates through the
key-value store of the default process group (the same ``TCPStore`` that ``torch.distributed`` rendezvoused through)
rather than through collectives, so that:

* a waiting rank never sits in one barrier for ``N - 1`` turns: it polls, and its wait is bounded by the time since
  the last turn on its node started or ended (``SERIALIZED_RESTORE_TURN_TIMEOUT``);
* a rank that fails inside its turn tells all others within one poll, and every rank raises the same
  :class:`~serialized_restore.CheckpointRestoreError`;
* a rank that dies (SIGKILL, OOM killer) is reported at once by the ranks on its machine, which see its process
  gone, and otherwise when its heartbeat has been silent for ``SERIALIZED_RESTORE_HEARTBEAT_TIMEOUT`` seconds;
* nothing in a turn runs a collective on behalf of the schedule, so the body of a turn is free to not be one.

How a failure reaches every rank (``_abort``), in store keys of the stage:

1. the rank that saw it appends a JSON record to ``reports`` and then bumps ``failures``;
2. every rank, on seeing ``failures > 0`` in its wait loop, sets ``ack/<rank>``; a rank busy inside its turn (its
   body may be blocked, for example in a collective) is acknowledged by its watcher thread instead;
3. every rank waits (bounded) until each rank has acknowledged or is known to be gone, reads ``reports``, sets
   ``read/<rank>`` and waits (bounded) until the others have read as well, then raises. Waiting for the others' reads
   matters because a launcher kills the whole job once the first process exits, and because the process hosting the
   store (global rank 0 in Lightning's launchers) takes the store with it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable, Optional

import torch.distributed as dist

from serialized_restore._errors import (
    GONE_KINDS,
    CheckpointRestoreError,
    RankFailure,
    failure_from_exception,
    malformed_report,
    restore_error,
)
from serialized_restore._options import HEARTBEAT_TIMEOUT_ENV, TURN_TIMEOUT_ENV

log = logging.getLogger(__name__)

_POLL_INTERVAL = 0.02
_LIVENESS_INTERVAL = 0.25
_HEARTBEAT_INTERVAL = 0.5
# the longest a rank waits for the others to acknowledge a failure, and then to read it; both are reached only when a
# rank neither answers nor is known to be gone
_GATHER_GRACE = 10.0
_LINGER = 2.0
# a rank that has been inside its turn this long publishes where its main thread is, for the timeout message
_WHERE_AFTER = 1.0
_WHERE_FRAMES = 8


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

    With ``store=None`` (a single process) the body simply runs, and an exception in it propagates unchanged.
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
        self._job_store = store if placement.world_size > 1 else None
        self._store: Optional[dist.Store] = None

    # ------------------------------------------------------------------ public

    @contextlib.contextmanager
    def turn(self, stage: str) -> Iterator[TurnRecord]:
        """Run the body of the ``with`` block as this rank's turn of ``stage``.

        (all ranks) wait for the predecessor on the node -> run the body -> announce the end -> wait for every rank
        of the job to end the stage. Raises :class:`CheckpointRestoreError` on every rank if any rank fails, times
        out or stops responding; on the rank whose body raised, the body's exception is its ``__cause__``.
        """
        record = TurnRecord(stage=stage)
        if self._job_store is None:
            self.log.info(f"[rank {self.placement.global_rank}] serialized restore: turn for {stage!r} started")
            start = time.monotonic()
            # nothing to coordinate: an exception in the body is raised as it is, exactly as upstream raises it
            yield record
            record.duration = time.monotonic() - start
            self._log_turn_end(record)
            return

        p = self.placement
        keys = _StageKeys(stage)
        try:
            self._open_namespace()
        except _StoreLost as err:
            raise self._store_lost(keys, None, [], err) from err.__cause__
        assert self._store is not None
        # several beats per heartbeat timeout, so that a short timeout never fires on a live rank
        watcher = _Watcher(self._store, keys, p, interval=min(_HEARTBEAT_INTERVAL, self.heartbeat_timeout / 4))
        try:
            try:
                watcher.start()
                waited_from = time.monotonic()
                self._wait_for_predecessor(keys, watcher)
                record.waited = time.monotonic() - waited_from
                self._set(keys.start(p.node_rank, p.local_rank), str(time.time()))
                self._add(keys.node_progress(p.node_rank), 1)
                self.log.info(
                    f"[rank {p.global_rank}] serialized restore: turn for {stage!r} started"
                    f" after waiting {record.waited:.2f}s"
                )
            except _StoreLost as err:
                raise self._store_lost(keys, watcher, [], err) from err.__cause__
            started = time.monotonic()
            watcher.enter_turn()
            try:
                yield record
            except (KeyboardInterrupt, SystemExit) as err:
                watcher.leave_turn()
                self._post_failures(keys, [self._failure_from_exception(stage, err)])
                with contextlib.suppress(_StoreLost):
                    self._set(keys.ack(p.global_rank), "main")
                raise
            except BaseException as err:
                watcher.leave_turn()
                raise self._abort(keys, watcher, [self._failure_from_exception(stage, err)], err) from err
            watcher.leave_turn()
            record.duration = time.monotonic() - started
            try:
                # logged before the turn is announced as ended, so that log timestamps of consecutive turns on a
                # node never overlap
                self._log_turn_end(record)
                self._set(keys.done(p.node_rank, p.local_rank), f"{record.duration}")
                self._add(keys.node_progress(p.node_rank), 1)
                self._add(keys.finished, 1)
                self._wait_for_everyone(keys, watcher)
                if p.local_rank == 0:
                    self._log_node_summary(keys, stage)
            except _StoreLost as err:
                raise self._store_lost(keys, watcher, [], err) from err.__cause__
        finally:
            watcher.stop()

    def decide_per_node(self, stage: str, decide: Callable[[], str]) -> str:
        """(all ranks) Local rank 0 of each node runs ``decide()`` in its turn of ``stage``; every rank of the node
        returns that value.

        The other ranks wait for it as for a turn, so local rank 0 dying, hanging or raising before it decides ends
        the wait on every rank of the job, within the bounds of a turn, with the same error. Build the schedule with
        ``max_concurrent`` equal to the local world size so that nobody waits for the non-deciding ranks' empty turns.
        The value is plain text (JSON where it has structure): it is read back from the store, never evaluated.
        """
        p = self.placement
        value: Optional[str] = None
        with self.turn(stage):
            if p.local_rank == 0:
                value = decide()
                if self._store is not None:
                    self._set(_StageKeys(stage).decision(p.node_rank), value)
        if value is None:
            value = self._get(_StageKeys(stage).decision(p.node_rank))
        return value

    def _open_namespace(self) -> None:
        """(all ranks, first turn of a restore) Take this restore's own key namespace in the store.

        Every rank counts its own restores, so the n-th restore of each rank meets the n-th restore of every other
        rank even when several Trainers share one process group.
        """
        if self._store is not None:
            return
        assert self._job_store is not None
        try:
            generation = self._job_store.add(f"serialized_restore/generation/{self.placement.global_rank}", 1)
        except Exception as err:
            raise _StoreLost(str(err)) from err
        self._store = dist.PrefixStore(f"serialized_restore/{generation}/", self._job_store)

    # ---------------------------------------------------------------- waiting

    def _wait_for_predecessor(self, keys: _StageKeys, watcher: _Watcher) -> None:
        p = self.placement
        predecessor = p.local_rank - self.max_concurrent
        if predecessor < 0:
            self._check_failures(keys, watcher)
            return
        done_key = keys.done(p.node_rank, predecessor)
        self._wait(keys, watcher, lambda: self._check(done_key), f"the end of local rank {predecessor}'s turn")

    def _wait_for_everyone(self, keys: _StageKeys, watcher: _Watcher) -> None:
        world = self.placement.world_size
        self._wait(keys, watcher, lambda: self._add(keys.finished, 0) >= world, "every rank to end the stage")

    def _wait(self, keys: _StageKeys, watcher: _Watcher, ready: Callable[[], bool], what: str) -> None:
        """Poll until ``ready()``; raise (on every rank) on a failure elsewhere, a stalled node or a dead rank."""
        p = self.placement
        last_progress: tuple[int, int] = (-1, -1)
        last_change = time.monotonic()
        liveness = _Liveness(self, keys)
        while True:
            self._check_failures(keys, watcher)
            if ready():
                return
            now = time.monotonic()
            progress = (self._add(keys.node_progress(p.node_rank), 0), self._add(keys.finished, 0))
            if progress != last_progress:
                last_progress, last_change = progress, now
            elif now - last_change > self.turn_timeout:
                failures = self._timeout_failures(keys, what, now - last_change)
                # the last turn may have ended meanwhile: ranks that saw it are gone to the next stage's collectives
                if not ready():
                    raise self._abort(keys, watcher, failures)
            gone = liveness.poll(now)
            if gone and not ready():
                raise self._abort(keys, watcher, gone)
            time.sleep(_POLL_INTERVAL)

    # --------------------------------------------------------------- failures

    def _failure_from_exception(self, stage: str, err: BaseException) -> RankFailure:
        return failure_from_exception(self.placement, stage, err, self.checkpoint_path)

    def _post_failures(self, keys: _StageKeys, failures: list[RankFailure]) -> bool:
        """Append ``failures`` to the stage's reports; ``False`` if the store is gone."""
        if not failures:
            return True
        assert self._store is not None
        try:
            self._store.append(keys.reports, "".join(f.to_json() + "\n" for f in failures))  # type: ignore[attr-defined]
            self._store.add(keys.failures, 1)
        except Exception:
            return False
        return True

    def _check_failures(self, keys: _StageKeys, watcher: _Watcher) -> None:
        if self._add(keys.failures, 0) > 0:
            raise self._abort(keys, watcher, [])

    def _read_reports(self, keys: _StageKeys) -> list[RankFailure]:
        assert self._store is not None
        if self._add(keys.failures, 0) == 0:
            return []
        try:
            raw = self._store.get(keys.reports)
        except Exception as err:
            raise _StoreLost(str(err)) from err
        return _parse_reports(raw, keys.stage)

    def _abort(
        self, keys: _StageKeys, watcher: _Watcher, own: list[RankFailure], raised: Optional[BaseException] = None
    ) -> CheckpointRestoreError:
        """Gather every rank's failures and build the error this rank raises.

        (all ranks, once a failure is known) post own failures -> acknowledge -> wait until every other rank has
        acknowledged or is known to be gone (bounded) -> read all failures -> mark them read -> wait until the others
        have read them too (bounded). See the module docstring for why.
        """
        p = self.placement
        try:
            if not self._post_failures(keys, own):
                raise _StoreLost("could not post a failure")
            self._set(keys.ack(p.global_rank), "main")
            failures = self._gather(keys)
            self._set(keys.read(p.global_rank), "1")
            self._linger(keys, failures)
        except _StoreLost as err:
            return self._store_lost(keys, watcher, own, err, raised)
        return restore_error(self.checkpoint_path, failures + own, p.global_rank, raised)

    def _gather(self, keys: _StageKeys) -> list[RankFailure]:
        p = self.placement
        pending = set(range(p.world_size)) - {p.global_rank}
        liveness = _Liveness(self, keys)
        deadline = time.monotonic() + min(_GATHER_GRACE, self.heartbeat_timeout)
        while True:
            failures = self._read_reports(keys)
            gone = {f.global_rank for f in failures if f.kind in GONE_KINDS}
            pending = {r for r in pending if r not in gone and not self._check(keys.ack(r))}
            now = time.monotonic()
            if not pending or now > deadline:
                if pending:
                    self.log.warning(
                        f"[rank {p.global_rank}] serialized restore: rank(s) {sorted(pending)} did not acknowledge"
                        f" the failure within {min(_GATHER_GRACE, self.heartbeat_timeout):g}s"
                    )
                return failures
            newly_gone = [f for f in liveness.poll(now) if f.global_rank not in gone]
            if newly_gone and not self._post_failures(keys, newly_gone):
                raise _StoreLost("could not post a failure")
            time.sleep(_POLL_INTERVAL)

    def _linger(self, keys: _StageKeys, failures: list[RankFailure]) -> None:
        """Wait until the others have read the failures too, so that no rank's exit cuts another rank's read short."""
        assert self._store is not None
        p = self.placement
        gone = {f.global_rank for f in failures if f.kind in GONE_KINDS}
        pending = set(range(p.world_size)) - {p.global_rank} - gone
        deadline = time.monotonic() + _LINGER
        while pending and time.monotonic() < deadline:
            # a rank acknowledged by its watcher is busy inside its turn and reads when (if) its body returns
            pending = {
                r
                for r in pending
                if not self._check(keys.read(r)) and not (self._check(keys.ack(r)) and self._get(keys.ack(r)) == "busy")
            }
            if pending:
                time.sleep(_POLL_INTERVAL)

    def _timeout_failures(self, keys: _StageKeys, what: str, idle: float) -> list[RankFailure]:
        """The ranks to blame when nothing moved for longer than the turn timeout: those inside their turn, else those
        that have not arrived."""
        p = self.placement
        busy: list[tuple[int, int]] = []
        absent: list[tuple[int, int]] = []
        nodes = max(1, p.world_size // p.local_world_size)
        for node in range(nodes):
            for local in range(p.local_world_size):
                if (node, local) == (p.node_rank, p.local_rank):
                    continue
                if self._check(keys.start(node, local)):
                    if not self._check(keys.done(node, local)):
                        busy.append((node, local))
                elif not self._check(keys.identity(node, local)):
                    absent.append((node, local))
        setting = f"{TURN_TIMEOUT_ENV} (seconds, now {self.turn_timeout:g})"
        failures = []
        for node, local in busy:
            ident = self._identity(keys, node, local)
            started = float(self._get(keys.start(node, local)))
            where = self._where(keys, node, local)
            if where is not None and where.collective:
                cause = (
                    f" It is blocked in the collective `torch.distributed.{where.collective}`, called from"
                    f" {where.caller}: a collective inside a turn cannot complete while the other ranks wait for"
                    " their turn. Hooks that run during the restore (`on_load_checkpoint`, a callback's"
                    " `load_state_dict`) must not run collectives while `serialized_checkpoint_loading` is on;"
                    " move the collective to `setup` or `on_fit_start`, or turn the option off."
                )
            else:
                cause = (
                    " Either reading the checkpoint is that slow (for example a slow or overloaded file system: set"
                    f" {TURN_TIMEOUT_ENV} to a larger number of seconds), or code in the turn waits for other ranks,"
                    " for example a collective such as `broadcast` or `barrier` in `on_load_checkpoint` or in a"
                    " callback's `load_state_dict`, which cannot complete while they wait for their turn."
                )
            failures.append(
                RankFailure(
                    global_rank=ident.global_rank if ident else node * p.local_world_size + local,
                    node_rank=node,
                    local_rank=local,
                    stage=keys.stage,
                    kind="timeout",
                    message=(
                        f"still inside its turn after {time.time() - started:.1f}s, and no turn on node {node} has"
                        f" started or ended for {idle:.1f}s: longer than the turn timeout, {setting}.{cause}"
                        + (f"\n  Where its main thread was:\n{where.text}" if where is not None else "")
                    ),
                    reported_by=p.global_rank,
                )
            )
        if not failures:
            blamed = absent or [(p.node_rank, p.local_rank)]
            for node, local in blamed:
                failures.append(
                    RankFailure(
                        global_rank=node * p.local_world_size + local,
                        node_rank=node,
                        local_rank=local,
                        stage=keys.stage,
                        kind="timeout",
                        message=(
                            f"rank {p.global_rank} waited {idle:.1f}s for {what} with no turn starting or ending,"
                            f" longer than the turn timeout, {setting}: "
                            + (
                                "this rank has not reached the restore (it may be slower to start, or stuck before it)."
                                if absent
                                else "no rank is inside its turn."
                            )
                        ),
                        reported_by=p.global_rank,
                    )
                )
        return failures

    def _store_lost(
        self,
        keys: _StageKeys,
        watcher: Optional[_Watcher],
        own: list[RankFailure],
        err: BaseException,
        raised: Optional[BaseException] = None,
    ) -> CheckpointRestoreError:
        """The error to raise once the store is gone: what the watcher saw before, this rank's own failures, and the
        loss of the store itself when nothing else explains it."""
        failures = (watcher.reports() if watcher is not None else []) + own
        if not failures:
            failures = [self._store_lost_failure(keys.stage, err)]
        return restore_error(self.checkpoint_path, failures, self.placement.global_rank, raised)

    def _store_lost_failure(self, stage: str, err: BaseException) -> RankFailure:
        p = self.placement
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        host = "the launcher's agent (torchrun)" if agent else "global rank 0"
        cause = err.__cause__ or err
        return RankFailure(
            global_rank=p.global_rank if agent else 0,
            node_rank=None if agent else 0,
            local_rank=None if agent else 0,
            stage=stage,
            kind="store lost",
            message=(
                f"lost contact with the process group's store, which is hosted by {host}: that process probably"
                f" exited, was killed (for example by the out-of-memory killer) or crashed"
                f" ({type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''})."
            ),
            reported_by=p.global_rank,
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

    def _set(self, key: str, value: str) -> None:
        assert self._store is not None
        try:
            self._store.set(key, value)
        except Exception as err:
            raise _StoreLost(str(err)) from err

    def _get(self, key: str) -> str:
        """The value of a key known to exist (``get`` of a missing key blocks for the store's timeout)."""
        assert self._store is not None
        try:
            return self._store.get(key).decode()
        except Exception as err:
            raise _StoreLost(str(err)) from err

    def _identity(self, keys: _StageKeys, node: int, local: int) -> Optional[_Identity]:
        key = keys.identity(node, local)
        return _Identity.from_json(self._get(key)) if self._check(key) else None

    def _where(self, keys: _StageKeys, node: int, local: int) -> Optional[_Where]:
        key = keys.where(node, local)
        return _Where.from_json(self._get(key)) if self._check(key) else None

    # ---------------------------------------------------------------- logging

    def _log_turn_end(self, record: TurnRecord) -> None:
        self.log.info(
            f"[rank {self.placement.global_rank}] serialized restore: turn for {record.stage!r} ended in"
            f" {record.duration:.2f}s, read {_format_bytes(record.bytes_read)}"
        )

    def _log_node_summary(self, keys: _StageKeys, stage: str) -> None:
        p = self.placement
        durations = [float(self._get(keys.done(p.node_rank, local))) for local in range(p.local_world_size)]
        starts = [float(self._get(keys.start(p.node_rank, local))) for local in range(p.local_world_size)]
        ends = [s + d for s, d in zip(starts, durations)]
        self.log.info(
            f"serialized restore: node {p.node_rank} ran {len(durations)} turns of {stage!r}"
            f" (at most {self.max_concurrent} at once) in {max(ends) - min(starts):.2f}s;"
            f" longest turn {max(durations):.2f}s"
        )


class _Liveness:
    """(one waiting rank) Watches the ranks of its node that have not ended their turn: a process that is gone from
    this machine is reported at once, a silent heartbeat after ``heartbeat_timeout``."""

    def __init__(self, schedule: TurnSchedule, keys: _StageKeys) -> None:
        self._s = schedule
        self._keys = keys
        self._next = time.monotonic()
        self._beats: dict[int, tuple[int, float]] = {}
        self._identities: dict[int, _Identity] = {}
        self._me = _Identity.of_this_process(schedule.placement.global_rank)

    def poll(self, now: float) -> list[RankFailure]:
        if now < self._next:
            return []
        self._next = now + _LIVENESS_INTERVAL
        s, keys, p = self._s, self._keys, self._s.placement
        failures = []
        for local in range(p.local_world_size):
            if local == p.local_rank or s._check(keys.done(p.node_rank, local)):
                continue
            ident = self._identities.get(local)
            if ident is None:
                ident = s._identity(keys, p.node_rank, local)
                if ident is None:
                    continue  # not arrived yet: covered by the turn timeout
                self._identities[local] = ident
            beat = s._add(keys.heartbeat(p.node_rank, local), 0)
            seen, since = self._beats.get(local, (-1, now))
            if beat != seen:
                self._beats[local] = (beat, now)
                since = now
            silent = now - since
            exited = ident.same_machine(self._me) and not _process_alive(ident.pid)
            if not exited and silent <= s.heartbeat_timeout:
                continue
            if s._check(keys.done(p.node_rank, local)):
                continue  # it ended its turn after all, and may have left the stage since
            doing = "inside its turn" if s._check(keys.start(p.node_rank, local)) else "waiting for its turn"
            bound = f"{HEARTBEAT_TIMEOUT_ENV} (seconds, now {s.heartbeat_timeout:g})"
            if exited:
                message = (
                    f"its process (pid {ident.pid}) exited while {doing} of stage {keys.stage!r}: it was probably"
                    " killed (for example by the out-of-memory killer) or crashed without raising. Ranks on other"
                    f" machines are declared dead after {bound} without a heartbeat."
                )
            else:
                message = (
                    f"stopped responding while {doing} of stage {keys.stage!r}: no heartbeat for {silent:.1f}s. The"
                    " process probably died (killed, out of memory) or its machine is unreachable. Set"
                    f" {bound} to change how long ranks wait for a silent rank."
                )
            failures.append(
                RankFailure(
                    global_rank=ident.global_rank,
                    node_rank=p.node_rank,
                    local_rank=local,
                    stage=keys.stage,
                    kind="died" if exited else "unresponsive",
                    message=message,
                    reported_by=p.global_rank,
                )
            )
        return failures


def _process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process on this machine."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        pass
    else:
        # "pid (comm) state ...": comm may contain spaces and parentheses
        return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class _Identity:
    """Who a rank's process is, so that ranks on the same machine can tell whether it still exists."""

    global_rank: int
    pid: int
    machine: str
    """Boot id and pid namespace: equal only for processes that see the same pids."""

    @classmethod
    def of_this_process(cls, global_rank: int) -> _Identity:
        return cls(global_rank, os.getpid(), _machine())

    def same_machine(self, other: _Identity) -> bool:
        return bool(self.machine) and self.machine == other.machine

    def to_json(self) -> str:
        return json.dumps([self.global_rank, self.pid, self.machine])

    @classmethod
    def from_json(cls, text: str) -> _Identity:
        rank, pid, machine = json.loads(text)
        return cls(int(rank), int(pid), str(machine))


def _machine() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""  # not Linux: rely on heartbeats only
    return f"{socket.gethostname()}/{boot}/{namespace}"


@dataclass(frozen=True)
class _Where:
    """The innermost frames of a rank's main thread while inside its turn: file, line number, function, source."""

    frames: list[tuple[str, int, str, str]]

    @property
    def collective(self) -> Optional[str]:
        """The ``torch.distributed`` function the thread is blocked in, if any."""
        run = self._distributed_run()
        return self.frames[run[1]][2] if run is not None else None

    @property
    def caller(self) -> str:
        """The frame that called into ``torch.distributed``."""
        run = self._distributed_run()
        if run is None or run[0] == 0:
            return "code outside the frames recorded"
        filename, line, name, _ = self.frames[run[0] - 1]
        return f"`{name}` ({filename}, line {line})"

    @property
    def text(self) -> str:
        lines = []
        for filename, line, name, source in self.frames:
            lines.append(f"    File {filename!r}, line {line}, in {name}")
            if source:
                lines.append(f"      {source}")
        return "\n".join(lines)

    def _distributed_run(self) -> Optional[tuple[int, int]]:
        """The innermost run of frames in ``torch.distributed``: its first frame and its public function's frame."""
        first = None
        for i in range(len(self.frames) - 1, -1, -1):
            if _in_torch_distributed(self.frames[i][0]):
                first = i
            elif first is not None:
                break
        if first is None:
            return None
        # skip decorators (`c10d_logger`'s `wrapper`) and private helpers to the public function
        api = first
        while api < len(self.frames) - 1 and self.frames[api][2].startswith(("wrapper", "_")):
            api += 1
        return first, api

    @classmethod
    def of_thread(cls, ident: int) -> Optional[_Where]:
        frame = sys._current_frames().get(ident)
        if frame is None:
            return None
        summary = traceback.extract_stack(frame)[-_WHERE_FRAMES:]
        return cls([(f.filename, f.lineno or 0, f.name, (f.line or "").strip()) for f in summary])

    def to_json(self) -> str:
        return json.dumps(self.frames)

    @classmethod
    def from_json(cls, text: str) -> _Where:
        return cls([(str(f), int(line), str(name), str(source)) for f, line, name, source in json.loads(text)])


def _in_torch_distributed(filename: str) -> bool:
    return f"torch{os.sep}distributed{os.sep}" in filename or "torch/distributed/" in filename


def _parse_reports(raw: bytes, stage: str) -> list[RankFailure]:
    """The failure records of a stage; a record that is not one of ours becomes a failure that says so."""
    failures = []
    for line in raw.decode(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            failures.append(RankFailure.from_json(line))
        except ValueError as err:
            failures.append(malformed_report(stage, line, err))
    return failures


class _StageKeys:
    """Store keys of one stage of one restore."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self._p = stage.replace(" ", "_") + "/"
        self.failures = self._p + "failures"
        self.reports = self._p + "reports"
        self.finished = self._p + "finished"

    def start(self, node: int, local: int) -> str:
        return f"{self._p}start/{node}/{local}"

    def done(self, node: int, local: int) -> str:
        return f"{self._p}done/{node}/{local}"

    def heartbeat(self, node: int, local: int) -> str:
        return f"{self._p}heartbeat/{node}/{local}"

    def identity(self, node: int, local: int) -> str:
        return f"{self._p}identity/{node}/{local}"

    def where(self, node: int, local: int) -> str:
        return f"{self._p}where/{node}/{local}"

    def decision(self, node: int) -> str:
        return f"{self._p}decision/{node}"

    def node_progress(self, node: int) -> str:
        return f"{self._p}progress/{node}"

    def ack(self, global_rank: int) -> str:
        return f"{self._p}ack/{global_rank}"

    def read(self, global_rank: int) -> str:
        return f"{self._p}read/{global_rank}"


class _Watcher:
    """A daemon thread that keeps one rank visible to the others while it takes part in a stage.

    Every ``interval`` seconds it bumps the rank's heartbeat and looks for failures; it keeps a copy of the reports
    (so that the rank can still name the failure if the store disappears) and, while the rank's main thread is inside
    its turn and cannot answer, acknowledges the failure on its behalf and publishes where the main thread is.
    """

    def __init__(self, store: dist.Store, keys: _StageKeys, placement: RankPlacement, interval: float) -> None:
        self._store = store
        self._interval = interval
        self._keys = keys
        self._p = placement
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._reports: list[RankFailure] = []
        self._seen_failures = 0
        self._turn_started: Optional[float] = None
        self._main = threading.get_ident()
        self._thread = threading.Thread(target=self._run, name="serialized-restore-watcher", daemon=True)

    def start(self) -> None:
        p, keys = self._p, self._keys
        try:
            self._store.set(
                keys.identity(p.node_rank, p.local_rank), _Identity.of_this_process(p.global_rank).to_json()
            )
            self._store.add(keys.heartbeat(p.node_rank, p.local_rank), 1)
        except Exception as err:
            raise _StoreLost(str(err)) from err
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def enter_turn(self) -> None:
        self._turn_started = time.monotonic()

    def leave_turn(self) -> None:
        self._turn_started = None

    def reports(self) -> list[RankFailure]:
        with self._lock:
            return list(self._reports)

    def _run(self) -> None:
        p, keys = self._p, self._keys
        while not self._stopped.wait(self._interval):
            try:
                self._store.add(keys.heartbeat(p.node_rank, p.local_rank), 1)
                started = self._turn_started
                if started is not None and time.monotonic() - started >= _WHERE_AFTER:
                    where = _Where.of_thread(self._main)
                    if where is not None:
                        self._store.set(keys.where(p.node_rank, p.local_rank), where.to_json())
                failures = int(self._store.add(keys.failures, 0))
                if failures > self._seen_failures:
                    reports = _parse_reports(self._store.get(keys.reports), keys.stage)
                    with self._lock:
                        self._reports, self._seen_failures = reports, failures
                    if self._turn_started is not None:
                        self._store.compare_set(keys.ack(p.global_rank), "", "busy")
            except Exception:
                return  # the store is gone: the main thread finds out on its next store operation


def _format_bytes(count: int) -> str:
    """``1.4 GiB``, ``35.2 KiB``, ``12 B``: readable at every checkpoint size."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
