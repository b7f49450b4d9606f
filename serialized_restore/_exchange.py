"""The failure exchange: how a failure seen on one rank reaches every rank, in O(1) store operations per rank.

In store keys of the stage (``_store.StageKeys``):

1. *Post.* The rank that saw a failure (its own exception, or a peer it found dead, silent or stalled) appends a JSON
   record to ``reports``, bumps ``failures``, and closes the stage as failed: ``compare_set(closed, "", "failed")``.
   The first to close decides the stage's fate; a failure seen after the stage ``ended`` changes nothing (every rank
   has ended its turn and left for the next stage). The poster then sets every rank's wake-up key in one
   ``multi_set``, so that every waiting rank wakes at once, wherever it waits.
2. *Acknowledge.* Every rank, once it knows (its wait returned ``"failed"``, or its turn ended and found the stage
   failed), posts its own failures first and then bumps ``acked``. The first rank to acknowledge claims the
   ``coordinator`` key.
3. *Gather.* The coordinator watches two counters until every rank has acknowledged or is known to be gone, for at
   most ``_GATHER_GRACE`` seconds, and then sets ``all_acked``. A rank still inside its turn acknowledges only when
   its turn ends (a turn's body cannot be interrupted), so failures that happen within the grace of each other are
   named together on every rank; a rank blocked in its turn (a collective) is not waited for beyond it. The others
   block in ``get(all_acked)``.
4. *Read.* Every rank reads ``reports`` once and bumps ``reads``; the coordinator waits (at most ``_LINGER``) until
   every rank that acknowledged has read, and sets ``all_read``; then every rank raises. Waiting for the reads
   matters because a launcher kills the whole job once the first process exits, and because the process hosting
   the store (global rank 0 in Lightning's launchers) takes the store with it.

If the coordinator dies, each rank's own monitor ends its wait a few seconds after the bound (``_RELEASE_MARGIN``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Protocol

from serialized_restore._diagnosis import parse_reports, store_lost_failure
from serialized_restore._errors import GONE_KINDS, CheckpointRestoreError, RankFailure, restore_error
from serialized_restore._store import StageKeys, StoreLost, StoreTimeout, StoreView

_GATHER_GRACE = 1.0
_LINGER = 2.0
_RELEASE_MARGIN = 3.0
_POLL_FIRST, _POLL_MAX = 0.01, 0.05


class _Releaser(Protocol):
    """What the exchange needs from the rank's monitor (``_liveness.Monitor``)."""

    def releasing(self, key: str, after: float) -> contextlib.AbstractContextManager[None]: ...

    def reports(self) -> list[RankFailure]: ...

    def keep(self, reports: list[RankFailure]) -> None: ...


def post_failures(view: StoreView, keys: StageKeys, failures: list[RankFailure], wake_keys: list[str]) -> str:
    """(any rank, any thread) Post ``failures`` and close the stage as failed; the stage's fate afterwards:
    ``"failed"``, or ``"ended"`` if every rank had ended the stage before (the failures then change nothing)."""
    view.append(keys.reports, "".join(f.to_json() + "\n" for f in failures))
    view.add(keys.failures, 1)
    fate = view.compare_set(keys.closed, "", "failed")
    if fate != "ended":
        # every poster wakes everyone: a poster that died between its close and this line would leave waiters asleep
        view.multi_set(wake_keys, ["failed"] * len(wake_keys))
    return fate


def read_reports(view: StoreView, keys: StageKeys) -> list[RankFailure]:
    raw = view.get_if_set(keys.reports)
    return parse_reports(raw, keys.stage) if raw else []


class Exchange:
    """(one rank, one stage) Ends a failed stage on this rank: see the module docstring."""

    def __init__(
        self,
        *,
        view: StoreView,
        keys: StageKeys,
        placement: Any,
        checkpoint_path: str,
        wake_keys: list[str],
        monitor: _Releaser,
        logger: logging.Logger,
    ) -> None:
        self._view = view
        self._keys = keys
        self._p = placement
        self._path = checkpoint_path
        self._wake_keys = wake_keys
        self._monitor = monitor
        self._log = logger

    def abort(self, own: list[RankFailure], raised: BaseException | None = None) -> CheckpointRestoreError:
        """(main thread) Post ``own`` failures, gather everyone's, and build the error this rank raises."""
        view, keys, rank = self._view, self._keys, self._p.global_rank
        try:
            if own:
                post_failures(view, keys, own, self._wake_keys)
            if view.add(keys.acked, 1) >= self._p.world_size:
                view.set(keys.all_acked, "1")
            if view.compare_set(keys.coordinator, "", str(rank)) == str(rank):
                failures = self._gather()
                self._monitor.keep(failures)
                view.add(keys.reads, 1)
                self._linger()
            else:
                self._await(keys.all_acked, _GATHER_GRACE)
                failures = read_reports(view, keys)
                self._monitor.keep(failures)
                view.add(keys.reads, 1)
                self._await(keys.all_read, _LINGER)
        except StoreLost as err:
            return self.store_lost(own, err, raised)
        return restore_error(self._path, failures + own, rank, raised)

    def acknowledge(self, own: list[RankFailure]) -> None:
        """(main thread, on KeyboardInterrupt or SystemExit) Post ``own`` and acknowledge, without waiting."""
        with contextlib.suppress(StoreLost):
            post_failures(self._view, self._keys, own, self._wake_keys)
            if self._view.add(self._keys.acked, 1) >= self._p.world_size:
                self._view.set(self._keys.all_acked, "1")

    def store_lost(
        self, own: list[RankFailure], err: BaseException, raised: BaseException | None = None
    ) -> CheckpointRestoreError:
        """The error to raise once the store is gone: what this rank read before, its own failures, and the loss of
        the store itself when nothing else explains it."""
        failures = self._monitor.reports() + own
        if not failures:
            failures = [store_lost_failure(self._keys.stage, self._p.global_rank, err)]
        return restore_error(self._path, failures, self._p.global_rank, raised)

    def _await(self, key: str, bound: float) -> None:
        with self._monitor.releasing(key, after=bound + _RELEASE_MARGIN), contextlib.suppress(StoreTimeout):
            self._view.get(key)

    def _gather(self) -> list[RankFailure]:
        """(the coordinator) Until every rank acknowledged or is gone, at most ``_GATHER_GRACE``; then release."""
        view, keys, world = self._view, self._keys, self._p.world_size
        started = time.monotonic()
        seen, failures, pause = -1, [], _POLL_FIRST
        while True:
            acked = view.add(keys.acked, 0)
            count = view.add(keys.failures, 0)
            if count != seen:
                seen, failures = count, read_reports(view, keys)
            gone = {f.global_rank for f in failures if f.kind in GONE_KINDS}
            if acked + len(gone) >= world or time.monotonic() - started >= _GATHER_GRACE:
                break
            time.sleep(pause)
            pause = min(_POLL_MAX, pause * 2)
        view.set(keys.all_acked, "1")
        if view.add(keys.failures, 0) != seen:
            failures = read_reports(view, keys)
        if acked + len(gone) < world:
            self._log.info(
                f"[rank {self._p.global_rank}] serialized restore: {world - acked - len(gone)} rank(s) had not"
                f" acknowledged the failure after {_GATHER_GRACE:g}s (inside their turn, or not answering)"
            )
        return failures

    def _linger(self) -> None:
        """(the coordinator) Until every rank that acknowledged has read, at most ``_LINGER``; then release."""
        view, keys = self._view, self._keys
        started, pause = time.monotonic(), _POLL_FIRST
        while time.monotonic() - started < _LINGER:
            if view.add(keys.reads, 0) >= view.add(keys.acked, 0):
                break
            time.sleep(pause)
            pause = min(_POLL_MAX, pause * 2)
        view.set(keys.all_read, "1")
