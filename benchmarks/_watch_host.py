"""One thread for the watches of every simulated rank of a benchmark worker process.

The coordination benchmark hosts hundreds of ranks in one process (``_coordination_sim.py``). With the package's
default host (``serialized_restore._liveness.OwnThread``) each rank's watch has a thread of its own: hundreds of
threads per process that a real job, with one rank per process, never has. :class:`SharedThread` is a
``serialized_restore._liveness.WatchHost`` that runs every watch of the process on one daemon thread, each at its own
tick. The schedule takes it through ``TurnSchedule(host=...)``.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class SharedThread:
    """Runs every watch given to it on one daemon thread, each every ``watch.tick`` seconds."""

    stuck_after = 60.0
    """Seconds one step may take before the thread counts as not running (a store operation that never answers):
    the waits of its watches then end at their backstop instead of being issued again."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[Any, float] = {}
        self._stepping: Any = None
        self._step_started = 0.0
        self._thread = threading.Thread(target=self._run, name="benchmark-watches", daemon=True)
        self._thread.start()

    def start(self, watch: Any) -> None:
        with self._cond:
            self._due[watch] = time.monotonic() + watch.tick
            self._cond.notify_all()

    def stop(self, watch: Any, timeout: float = 5.0) -> None:
        """Drop ``watch``; wait (up to ``timeout``) for a step of it in progress to end, unless called by it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._due.pop(watch, None)
            if threading.current_thread() is self._thread:
                return
            while self._stepping is watch and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)

    def runs(self, watch: Any) -> bool:
        """Whether ``watch``'s steps still run: it is on the thread, which is alive and not stuck in a step."""
        with self._cond:
            stuck = self._stepping is not None and time.monotonic() - self._step_started > self.stuck_after
            return self._thread.is_alive() and watch in self._due and not stuck

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = sorted((at, i, w) for i, (w, at) in enumerate(self._due.items()) if at <= now)
                if not due:
                    self._cond.wait(min(self._due.values()) - now if self._due else None)
                    continue
            for _, _, watch in due:
                with self._cond:
                    if watch not in self._due:
                        continue  # stopped meanwhile
                    self._stepping, self._step_started = watch, time.monotonic()
                keep = False
                try:
                    keep = watch.step(time.monotonic())
                finally:
                    with self._cond:
                        self._stepping = None
                        if watch in self._due:
                            if keep:
                                self._due[watch] = time.monotonic() + watch.tick
                            else:
                                del self._due[watch]
                        self._cond.notify_all()
