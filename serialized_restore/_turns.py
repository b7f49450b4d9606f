"""The turn schedule: which local rank of a node restores when, and how a failure reaches every rank, on the job's own
store client (``docs/design.md``, *The turn schedule*): blocking ``get`` with a timeout, ``add``, ``set``,
``compare_set`` and ``multi_set``; no collective, no thread, no second connection, no polling."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import logging
import math
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

from serialized_restore._errors import (
    FailureKind,
    RankFailure,
    failure_from_exception,
    restore_error,
    store_lost_failure,
)
from serialized_restore._memory import format_bytes, private_memory
from serialized_restore._options import TURN_TIMEOUT_SETTING
from serialized_restore._placement import RankPlacement

log = logging.getLogger(__name__)

GO, FAILED, ENDED = "go", "failed", "ended"
_LINGER = 2.0  # how long a failed stage keeps the store's host, rank 0, for the other ranks to read the verdict
_GENERATIONS: dict[int, tuple[dist.Store, int]] = {}  # per job store: how many schedules this process has made on it


class StoreLost(Exception):
    """The job's store could not be reached: its host (rank 0, or torchrun's agent) exited or the connection broke."""


@dataclass
class TurnRecord:
    """What one rank's turn did; its body fills in the bytes read (or mapped) and copied, and the ``reader``."""

    stage: str
    waited: float = 0.0
    duration: float = 0.0
    bytes_read: int = 0
    bytes_copied: int = 0
    reader: str = ""


class _Stage:
    """One stage's keys. ``verdict`` is decided once (``compare_set``: ``ended`` by the rank whose end completes
    ``done``, else the first failure's record) and copied to ``closed``, the key ranks wait on."""

    def __init__(self, prefix: str, stage: str, p: RankPlacement, k: int) -> None:
        self.name, self.k = stage, k
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

    def decision(self, node: int) -> str:
        return f"{self._p}decision/{node}"


class TurnSchedule:
    """Runs the stages of a restore in turns. Every rank calls :meth:`turn` once per stage, in the same order. Per
    node, local rank ``r`` starts when ``r - k`` has ended (``k = max_concurrent``): ``k`` chains of turns. Every rank
    waits for the whole job to end the stage before the next one, which may run collectives.

    Each turn has two timers: its successor, waiting for it, counts ``turn_timeout`` from the moment the turn could
    start; its predecessor counts from its own end when it has no successor (the chain's last turn). Either posts a
    timeout naming the rank whose turn it is; a rank's own exception is posted by that rank. One failure decides the
    stage on every rank: the failing rank raises its own exception, every other rank a :class:`CheckpointRestoreError`.
    """

    def __init__(
        self,
        *,
        store: dist.Store | None,
        placement: RankPlacement,
        max_concurrent: int,
        checkpoint_path: str,
        turn_timeout: float,
        logger: logging.Logger = log,
    ) -> None:
        self.placement = p = placement
        self.max_concurrent = max(1, min(max_concurrent, p.local_world_size))
        self.checkpoint_path = checkpoint_path
        self.turn_timeout = turn_timeout
        self.log = logger
        self._store = store if p.world_size > 1 else None
        self._prefix = ""
        if self._store is not None:
            # the n-th schedule of each rank meets the n-th of every other: ranks make them in the same order
            _, generation = _GENERATIONS.get(id(self._store), (self._store, 0))
            _GENERATIONS[id(self._store)] = (self._store, generation + 1)
            self._prefix = f"serialized_restore/{generation}/"

    @contextlib.contextmanager
    def turn(self, stage: str, *, ordered: bool = True, logged: bool | None = None) -> Iterator[TurnRecord]:
        """(all ranks) Run the ``with`` block as this rank's turn of ``stage``; ``ordered=False``: every rank at once.
        ``logged`` (default: ``ordered``): the rank logs its turn's start and end."""
        p, record = self.placement, TurnRecord(stage=stage)
        logged = ordered if logged is None else logged
        keys = _Stage(self._prefix, stage, p, self.max_concurrent if ordered else p.local_world_size)
        arrived = time.monotonic()
        if self._store is not None:
            with self._store_lost_raises(stage):
                self._wait_for_turn(keys, arrived)
        record.waited = time.monotonic() - arrived
        if logged:
            waited = f"after waiting {record.waited:.2f}s" if ordered else "with the node's other ranks at once"
            self.log.info(f"[rank {p.global_rank}] serialized restore: turn for {stage!r} started {waited}")
        started, memory_before = time.monotonic(), private_memory()
        with contextlib.suppress(Exception):  # no stderr file descriptor: no stack, as without faulthandler
            # the stack of a rank stuck in its turn, printed by that rank when its timers give up on it
            faulthandler.dump_traceback_later(self.turn_timeout, exit=False)
        try:
            yield record
        except BaseException as err:
            faulthandler.cancel_dump_traceback_later()
            if self._store is not None:
                self._fail_own_turn(keys, err)
            raise  # unchanged, as upstream raises it
        faulthandler.cancel_dump_traceback_later()
        record.duration = time.monotonic() - started
        if logged:  # before the successor is woken: log lines of consecutive turns never overlap
            self._log_turn_end(record, private_memory() - memory_before)
        if self._store is not None:
            with self._store_lost_raises(stage):
                self._end_turn(keys, arrived)

    def on_one_rank(
        self, stage: str, compute: Callable[[], str | None], *, central: bool, per_node: bool = False
    ) -> str | None:
        """(all ranks) ``compute()`` on the ``central`` rank (of the job, or of each node) in its turn of ``stage``
        (all ranks at once); its result (text, never evaluated) on every rank, or the same error on every rank."""
        value: str | None = None
        key = f"{self._prefix}{stage.replace(' ', '_')}/decision/{self.placement.node_rank if per_node else -1}"
        with self.turn(stage, ordered=False):
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
                self._raise_verdict(keys, self._post(keys, self._stalled(keys, ahead - k, bound)))
        value = self._get(keys.wake(p.node_rank, p.local_rank), timeout)
        if value is None:
            self._raise_verdict(keys, self._post(keys, self._timed_out(keys, ahead)))
        elif value != GO:
            self._raise_verdict(keys, self._get(keys.closed, math.inf) or "")

    def _end_turn(self, keys: _Stage, arrived: float) -> None:
        """Count this turn as ended and wake the rank ``k`` places behind (or mark the chain's end); time that rank
        when its turn ends the chain; then wait for every rank of the job to end the stage: its fate."""
        p, k, lws = self.placement, keys.k, self.placement.local_world_size
        closing = int(self._call("add", keys.done, 1)) >= p.world_size
        behind = p.local_rank + k
        if k < lws:
            self._call("set", keys.wake(p.node_rank, behind), GO)
        if closing:
            verdict = self._call("compare_set", keys.verdict, "", ENDED)
            self._call("set", keys.closed, verdict)
        else:
            if behind < lws <= behind + k and self._get(keys.wake(p.node_rank, behind + k), self.turn_timeout) is None:
                self._post(keys, self._timed_out(keys, behind))
            # a turn more than the chain needs where turns have timers (no stage of all ranks at once waits longer)
            bound = self.turn_timeout * (math.ceil(lws / k) + (k < lws))
            verdict = self._get(keys.closed, bound - (time.monotonic() - arrived)) or self._post(
                keys, self._stalled(keys, None, bound)
            )
        self._raise_verdict(keys, verdict)

    def _fail_own_turn(self, keys: _Stage, err: BaseException) -> None:
        """Post this rank's exception (``KeyboardInterrupt`` included: nobody waits for a rank that left). When the
        stage had failed already because this rank's turn timed out, raise that error instead, from ``err``."""
        p = self.placement
        with contextlib.suppress(StoreLost):
            verdict = self._post(keys, failure_from_exception(p, keys.name, err, self.checkpoint_path))
            first = self._failures(keys, verdict)[0]
            if first.kind is FailureKind.TIMEOUT and first.global_rank == p.global_rank:
                self._raise_verdict(keys, verdict, err)
            self._acknowledge(keys)

    def _post(self, keys: _Stage, failure: RankFailure) -> str:
        """Decide the stage as failed unless it was decided already, wake every waiting rank of the job; the verdict.
        A rank named as timed out, which may never read it, is counted as having read it."""
        record = FAILED + "\n" + failure.to_json()
        verdict = self._call("compare_set", keys.verdict, "", record)
        self._call("set", keys.closed, verdict)
        if verdict != ENDED:
            wake = keys.every_wake()
            self._call("multi_set", wake, [FAILED] * len(wake))
        if verdict == record and failure.kind is FailureKind.TIMEOUT and failure.global_rank > 0:
            self._count_read(keys)
        return verdict

    def _raise_verdict(self, keys: _Stage, verdict: str, own: BaseException | None = None) -> None:
        """Raise the error of a failed stage's ``verdict``, once this rank has acknowledged it."""
        if verdict == ENDED:
            return
        with contextlib.suppress(StoreLost):
            self._acknowledge(keys)
        failures = self._failures(keys, verdict)
        raise restore_error(self.checkpoint_path, failures, self.placement.global_rank, own) from own

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

    @staticmethod
    def _failures(keys: _Stage, verdict: str) -> list[RankFailure]:
        """The failure a verdict carries (plain JSON, checked field by field: any process can write to the store)."""
        try:
            return [RankFailure.from_json(verdict.partition("\n")[2])]
        except ValueError as err:
            return [RankFailure.malformed(keys.name, verdict, err)]

    def _timed_out(self, keys: _Stage, local: int) -> RankFailure:
        p = self.placement
        message = (
            f"did not end its turn within the turn timeout, {TURN_TIMEOUT_SETTING} (seconds, now"
            f" {self.turn_timeout:g}), counted from when it could start; it is stuck in its turn, has not reached the"
            " restore, or its process ended. Likely causes: a slow file system (raise the timeout), or a collective"
            " (such as `strategy.barrier()`) in `LightningModule.on_load_checkpoint` or a callback's"
            " `on_load_checkpoint` / `load_state_dict`, which cannot complete while the other ranks wait for their"
            " turns. A rank stuck in its turn prints its stack (faulthandler) at the timeout."
        )
        at = (p.global_rank_of(local), p.node_rank, local, keys.name)
        return RankFailure(*at, FailureKind.TIMEOUT, message, reported_by=p.global_rank)

    def _stalled(self, keys: _Stage, local: int | None, bound: float) -> RankFailure:
        """The backstop: no timer posted, yet the stage did not move for a turn timeout per turn that could run."""
        p = self.placement
        if local is not None:
            waited = f"local rank {local} of node {p.node_rank} to end its turn"
        else:
            ended = int(self._call("add", keys.done, 0))
            waited = f"every rank to end the stage ({ended} of {p.world_size} ranks ended their turn)"
        message = (
            f"rank {p.global_rank} waited {bound:g}s for {waited}: one turn timeout ({TURN_TIMEOUT_SETTING}, now"
            f" {self.turn_timeout:g}s) for each turn that had to end first. A rank stopped or its process ended"
            " outside a turn another rank times (a stage all ranks run at once, or a rank that never arrived)."
        )
        return RankFailure(-1, None, None, keys.name, FailureKind.TIMEOUT, message, reported_by=p.global_rank)

    def _get(self, key: str, timeout: float) -> str | None:
        """``key``'s value once set, or ``None`` after ``timeout`` seconds: one blocking ``get`` on the job's client.
        While it blocks, Ctrl-C ends the process at once instead of after the wait (``docs/failures.md``)."""
        store = self._store
        assert store is not None
        previous = store.timeout  # type: ignore[attr-defined]
        store.set_timeout(datetime.timedelta(seconds=min(max(timeout, 0.001), 10**7)))
        try:
            with _sigint_ends_process():
                return self._call("get", key)
        except _Timeout:
            return None
        finally:
            store.set_timeout(previous)

    def _call(self, method: str, *args: object) -> str:
        """One operation on the job's store; its failure as :class:`StoreLost` (or ``_Timeout``)."""
        try:
            value = getattr(self._store, method)(*args)
        except dist.DistStoreError as err:
            if "timeout" in str(err).lower():
                raise _Timeout() from err
            raise StoreLost(str(err)) from err
        except Exception as err:  # DistNetworkError, RuntimeError depending on the torch version
            raise StoreLost(str(err)) from err
        return value.decode(errors="replace") if isinstance(value, bytes) else str(value)

    @contextlib.contextmanager
    def _store_lost_raises(self, stage: str) -> Iterator[None]:
        try:
            yield
        except StoreLost as err:
            failure = store_lost_failure(stage, self.placement.global_rank, err)
            raise restore_error(self.checkpoint_path, [failure], self.placement.global_rank) from None

    def _log_turn_end(self, record: TurnRecord, added: int) -> None:
        """``... ended in 0.31s, read 1.4 GiB memory-mapped, copied 16.1 MiB out of the mapped file``."""
        how = {"mmap": " memory-mapped", "eager": " eagerly"}.get(record.reader, "")
        done = [f"read {format_bytes(record.bytes_read)}{how}"] if record.bytes_read or record.reader else []
        done += [f"copied {format_bytes(record.bytes_copied)} out of the mapped file"] if record.bytes_copied else []
        self.log.info(
            f"[rank {self.placement.global_rank}] serialized restore: turn for {record.stage!r} ended in"
            f" {record.duration:.2f}s, {', '.join(done) or 'read nothing'}; the process holds"
            f" {format_bytes(private_memory())} of private memory, {format_bytes(added)} more than before its turn"
        )


class _Timeout(Exception):
    """A blocking ``get`` reached its timeout."""


@contextlib.contextmanager
def _sigint_ends_process() -> Iterator[None]:
    """While the main thread blocks in the store, SIGINT takes its default action: Python's own handler would run only
    once the wait returns, and the store client restarts a wait a signal interrupted."""
    try:
        default = signal.getsignal(signal.SIGINT) is signal.default_int_handler
        if default:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
    except ValueError:  # not the main thread: signals are not delivered here anyway
        default = False
    try:
        yield
    finally:
        if default:
            signal.signal(signal.SIGINT, signal.default_int_handler)
