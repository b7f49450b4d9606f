"""A stand-in for a watch (``serialized_restore._liveness.Watch``) on a host: what the hosts' tests step."""

from __future__ import annotations

import threading
import time


class Ticking:
    """Stands in for a ``Watch`` on its host: counts its steps and the threads that ran them."""

    def __init__(self, tick: float, step_seconds: float = 0.0, steps_before_stop: int = -1) -> None:
        self.tick, self.step_seconds, self.steps_before_stop = tick, step_seconds, steps_before_stop
        self.steps = 0
        self.running = False
        self.threads: set[int] = set()

    def step(self, now: float) -> bool:
        self.running = True
        self.threads.add(threading.get_ident())
        time.sleep(self.step_seconds)
        self.steps += 1
        self.running = False
        return self.steps != self.steps_before_stop
