"""The failure exchange: how a failed stage ends on every rank, in O(1) store operations per rank.

1. *Post* (``_store.StageStore.post``): the record, the count, ``closed`` set to ``"failed"`` (the first close decides
   the stage's fate), every rank's wake-up key.
2. *Acknowledge*: every rank, once it knows, posts its own failures and bumps ``acked``; the first claims
   ``coordinator``.
3. *Gather*: the coordinator waits until every rank acknowledged or is known to be gone, at most ``_GATHER_GRACE``
   (a rank inside its turn acknowledges when its turn ends: failures within the grace are named together, a rank
   blocked in its turn costs the others the grace, not a hang), then sets ``all_acked``.
4. *Read*: every rank reads the reports once and bumps ``reads``; the coordinator waits, at most ``_LINGER``, until
   every rank that acknowledged has read (a launcher kills the job once a process exits, and rank 0 hosts the
   store), then sets ``all_read``, and every rank raises.

If the coordinator dies, each rank's watch sets its wait free a few seconds after the bound (``_RELEASE_MARGIN``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any, Callable

from serialized_restore._errors import CheckpointRestoreError, RankFailure, restore_error, store_lost_failure
from serialized_restore._liveness import WaitKind, Watch
from serialized_restore._store import StageStore, StoreLost, StoreTimeout

_GATHER_GRACE = 1.0
_LINGER = 2.0
_RELEASE_MARGIN = 3.0
_POLL_FIRST, _POLL_MAX = 0.01, 0.05


class Exchange:
    """(one rank, one stage, main thread) Ends a failed stage on this rank: see the module docstring. ``schedule``
    (``_turns.TurnSchedule``) says who the rank is, ``store`` and ``watch`` are the stage's."""

    def __init__(self, schedule: Any, store: StageStore, watch: Watch) -> None:
        self._s, self._store, self._watch, self._p = schedule, store, watch, schedule.placement

    def abort(self, own: list[RankFailure], raised: BaseException | None = None) -> CheckpointRestoreError:
        """Post ``own`` failures, gather everyone's, and build the error this rank raises."""
        store, keys, rank, view = self._store, self._store.keys, self._p.global_rank, self._store.main
        try:
            self.acknowledge(own)
            coordinator = view.compare_set(keys.coordinator, "", str(rank)) == str(rank)
            if coordinator:
                failures = self._gather()
            else:
                self._await(keys.all_acked, _GATHER_GRACE)
                failures = store.reports(view)
            self._watch.reports = failures
            view.add(keys.reads, 1)
            if coordinator:
                # until every rank that acknowledged has read: a launcher kills the job once a process exits
                self._poll(lambda: view.add(keys.reads, 0) >= view.add(keys.acked, 0), _LINGER)
                view.set(keys.all_read, "1")
            else:
                self._await(keys.all_read, _LINGER)
        except StoreLost as err:
            return self.store_lost(err, own, raised)
        return restore_error(self._s.checkpoint_path, failures + own, rank, raised)

    def acknowledge(self, own: list[RankFailure]) -> None:
        """Post ``own`` and acknowledge, without waiting (alone: on KeyboardInterrupt or SystemExit)."""
        view, keys = self._store.main, self._store.keys
        if own:
            self._store.post(own, view)
        if view.add(keys.acked, 1) >= self._p.world_size:
            view.set(keys.all_acked, "1")

    def store_lost(
        self, err: BaseException, own: Sequence[RankFailure] = (), raised: BaseException | None = None
    ) -> CheckpointRestoreError:
        """The error to raise once the store is gone: what this rank read before, its own failures, and the loss of
        the store itself when nothing else explains it."""
        rank = self._p.global_rank
        failures = [*(self._watch.reports or []), *own] or [store_lost_failure(self._store.keys.stage, rank, err)]
        return restore_error(self._s.checkpoint_path, failures, rank, raised)

    def _await(self, key: str, bound: float) -> None:
        release_after = bound + _RELEASE_MARGIN
        with self._watch.waiting(WaitKind.RELEASE, key, release_after=release_after), contextlib.suppress(StoreTimeout):
            self._store.main.get(key)

    def _gather(self) -> list[RankFailure]:
        """(the coordinator) Until every rank acknowledged or is gone, at most ``_GATHER_GRACE``; then release."""
        store, keys, view, world = self._store, self._store.keys, self._store.main, self._p.world_size
        seen, failures, missing = -1, [], world

        def everyone() -> bool:
            nonlocal seen, failures, missing
            acked, count = view.add(keys.acked, 0), view.add(keys.failures, 0)
            if count != seen:
                seen, failures = count, store.reports(view)
            missing = world - acked - len({f.global_rank for f in failures if f.kind.gone})
            return missing <= 0

        self._poll(everyone, _GATHER_GRACE)
        view.set(keys.all_acked, "1")
        if view.add(keys.failures, 0) != seen:
            failures = store.reports(view)
        if missing > 0:
            self._s.log.info(
                f"[rank {self._p.global_rank}] serialized restore: {missing} rank(s) had not acknowledged the failure"
                f" after {_GATHER_GRACE:g}s (inside their turn, or not answering)"
            )
        return failures

    @staticmethod
    def _poll(done: Callable[[], bool], bound: float) -> None:
        """Until ``done()``, at most ``bound`` seconds, at a falling rate (the coordinator's counter reads)."""
        started, pause = time.monotonic(), _POLL_FIRST
        while not done() and time.monotonic() - started < bound:
            time.sleep(pause)
            pause = min(_POLL_MAX, pause * 2)
