"""Liveness: while a rank takes part in a stage, its :class:`Watch` keeps it visible and ends every wait in its bound.

One watch per rank and stage, on the rank's side connection: **heartbeat**; **peer watch** (a process of its node gone
from this machine, or silent for the heartbeat timeout, is posted); **turn timeout** (re-checks of what the main thread
waits for: lost wake-ups repaired, stalls diagnosed, the failure exchange's waits set free at their bound).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple, Protocol

from serialized_restore._diagnosis import diagnose_stall
from serialized_restore._errors import RankFailure, gone_failure
from serialized_restore._order import NodeLog
from serialized_restore._stack import where
from serialized_restore._store import StageStore, StoreView, heartbeat_key, identity_key

log = logging.getLogger(__name__)

_TICK = 0.5


def beat_interval(heartbeat_timeout: float) -> float:
    """Seconds between two heartbeats: four per timeout, so that a short timeout never fires on a live rank."""
    return max(0.05, min(heartbeat_timeout / 4, 15.0))


def recheck_interval(turn_timeout: float) -> float:
    return max(0.05, min(1.0, turn_timeout / 10))


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process on this machine."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: the heartbeat decides
    state = stat[stat.rfind(b")") + 2 :][:1]  # "pid (comm) state ...": comm may contain spaces and parentheses
    return state not in (b"Z", b"X")


class Identity(NamedTuple):
    """Who a rank's process is, so that ranks on the same machine can tell whether it still exists. ``machine`` (host,
    boot id, pid namespace) is equal only for processes that see the same pids; empty off Linux."""

    global_rank: int
    pid: int
    machine: str

    @classmethod
    def of_this_process(cls, global_rank: int) -> Identity:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                machine = f"{socket.gethostname()}/{f.read().strip()}/{os.stat('/proc/self/ns/pid').st_ino}"
        except OSError:
            machine = ""  # not Linux: heartbeats only
        return cls(global_rank, os.getpid(), machine)

    @classmethod
    def from_json(cls, text: str) -> Identity | None:
        try:
            rank, pid, machine = json.loads(text)
            return cls(int(rank), int(pid), str(machine))
        except (TypeError, ValueError):  # not one (any process that can reach the store can write to it)
            return None


def announce(side: StoreView, placement: Any) -> None:
    """(once per schedule) Start this rank's heartbeat, then say who it is: a peer that knows it can read its beat."""
    side.add(heartbeat_key(placement.node_rank, placement.local_rank), 1)
    identity = Identity.of_this_process(placement.global_rank)
    side.set(identity_key(placement.node_rank, placement.local_rank), json.dumps(identity))


class PeerWatch:
    """(one rank, one schedule) What it knows of the other local ranks of its node; no store access."""

    def __init__(self, global_rank: int, local_rank: int, local_world_size: int, heartbeat_timeout: float) -> None:
        self._local, self._lws, self._timeout = local_rank, local_world_size, heartbeat_timeout
        self._me = Identity.of_this_process(global_rank)
        self.identities: dict[int, Identity] = {}
        self._beats: dict[int, tuple[int, float]] = {}

    def missing(self) -> list[int]:
        return [r for r in range(self._lws) if r != self._local and r not in self.identities]

    def new_stage(self) -> None:
        """Forget heartbeat observations: between stages nobody beats."""
        self._beats.clear()

    def exited(self) -> list[int]:
        here = self._me.machine
        return sorted(r for r, i in self.identities.items() if here and i.machine == here and not process_alive(i.pid))

    def observe(self, beats: dict[int, int], now: float) -> list[tuple[int, float]]:
        """Record heartbeat counters read at ``now``; the peers silent for longer than the timeout, and for how long.
        Silence counts from the first sight of the current value: an observer that looked late blames nobody."""
        silent = []
        for local, beat in beats.items():
            seen, since = self._beats.get(local, (-1, now))
            if beat != seen:
                self._beats[local] = (beat, now)
            elif now - since > self._timeout:
                silent.append((local, now - since))
        return silent


class WaitKind(Enum):
    """Where the main thread is: what the watch does for it."""

    TURN = "turn"  # waits for the predecessor's end
    BODY = "body"  # inside its turn
    END = "end"  # waits for every rank to end the stage
    RELEASE = "release"  # in a wait of the failure exchange, set free at a deadline


@dataclass
class _Wait:
    kind: WaitKind
    key: str
    due: float  # the next re-check; for RELEASE, when the key is set
    predecessor: int | None = None
    last_progress: int = -1  # the first re-check sees progress: the timeout counts from it
    last_change: float = 0.0  # infinite once timed out and diagnosed


class WatchHost(Protocol):
    """Runs watches (the seam the coordination benchmark uses): ``watch.step(now)`` every ``watch.tick`` seconds from
    ``start`` until ``stop`` or a step returns ``False``; ``runs`` says whether it still does."""

    def start(self, watch: Watch) -> None: ...

    def stop(self, watch: Watch) -> None: ...

    def runs(self, watch: Watch) -> bool: ...


class OwnThread:
    """The default :class:`WatchHost`: each watch on a daemon thread of its own."""

    def __init__(self) -> None:
        self._threads: dict[Watch, tuple[threading.Thread, threading.Event]] = {}

    def start(self, watch: Watch) -> None:
        stopped = threading.Event()

        def run() -> None:
            while not stopped.wait(watch.tick) and watch.step(time.monotonic()):
                pass

        thread = threading.Thread(target=run, name="serialized-restore-watch", daemon=True)
        self._threads[watch] = (thread, stopped)
        thread.start()

    def stop(self, watch: Watch) -> None:
        """(main thread) Once this returns, no step of ``watch`` runs (it waits up to 5 s for one in progress)."""
        thread, stopped = self._threads.pop(watch)
        stopped.set()
        thread.join(5.0)

    def runs(self, watch: Watch) -> bool:
        entry = self._threads.get(watch)
        return entry is not None and entry[0].is_alive()


class Watch:
    """(one rank, one stage) The rank's watch: see the module docstring. While the main thread is inside its turn,
    it publishes where (``_stack.where``) and keeps the failure reports (to name them after losing the store)."""

    def __init__(self, schedule: Any, store: StageStore) -> None:
        self._s, self._store, self._p = schedule, store, schedule.placement
        beat_every, self._recheck = beat_interval(schedule.heartbeat_timeout), recheck_interval(schedule.turn_timeout)
        self.tick = min(_TICK, beat_every, self._recheck)
        self._beat_every = beat_every
        # each written whole by one thread: where the main thread is; the failure reports as last read (None: not read)
        self._wait: _Wait | None = None
        self.reports: list[RankFailure] | None = None
        self._reported: set[int] = set()
        self._log_seen = False
        now = time.monotonic()
        # the first look one beat in: a short stage costs no heartbeat at all
        self._next_beat = self._next_read = now + beat_every
        self._next_identity = now
        self._main = threading.get_ident()
        schedule.peers.new_stage()

    @property
    def alive(self) -> bool:
        """Whether its steps still run (they stop on a lost store or an error of their own)."""
        return self._s.host.runs(self)

    @contextlib.contextmanager
    def waiting(self, kind: WaitKind, key: str = "", predecessor: int | None = None, *, release_after: float = 0.0
                ) -> Iterator[None]:  # fmt: skip
        """(main thread) While it is inside its turn (``BODY``) or blocks on ``key``: re-check, time it out, or
        (``RELEASE``) set it after ``release_after`` seconds."""
        now = time.monotonic()
        due = now + (release_after if kind is WaitKind.RELEASE else self._recheck)
        self._wait = _Wait(kind, key, due, predecessor)
        try:
            yield
        finally:
            self._wait = None

    def step(self, now: float) -> bool:
        """One step; ``False`` once it must not run again."""
        try:
            if now >= self._next_beat:
                self._store.side.add(heartbeat_key(self._p.node_rank, self._p.local_rank), 1)
                self._next_beat = now + self._beat_every
            self._watch_peers(now)
            wait = self._wait
            if wait is not None and now >= wait.due:
                self._check_wait(now, wait)
        except Exception:  # a lost store, which the main thread finds out on its next operation, or a bug here
            log.debug("serialized restore: a watch stopped", exc_info=True)
            return False
        return True

    def _watch_peers(self, now: float) -> None:
        p, view, peers = self._p, self._store.side, self._s.peers
        missing = peers.missing()
        if missing and now >= self._next_identity:
            self._next_identity = now + self._recheck
            keys = [identity_key(p.node_rank, local) for local in missing]
            # everyone has arrived (the usual case): two operations, whatever the node's size
            values = view.multi_get(keys) if view.check(keys) else [view.get_if_set(key) for key in keys]
            found = {lr: Identity.from_json(v) for lr, v in zip(missing, values) if v is not None}
            peers.identities.update({lr: who for lr, who in found.items() if who is not None})
        gone = dict.fromkeys(peers.exited(), 0.0)
        if now >= self._next_read and peers.identities:
            self._next_read = now + self._beat_every
            locals_ = sorted(peers.identities)
            values = view.multi_get([heartbeat_key(p.node_rank, local) for local in locals_])
            for local, silent in peers.observe({lr: int(v) for lr, v in zip(locals_, values)}, now):
                gone.setdefault(local, silent)
        new = {local: silent for local, silent in gone.items() if local not in self._reported}
        if not new:
            return
        self._reported.update(new)
        if view.check([self._store.keys.closed]):
            return  # the stage ended, or failed and its ranks are raising: a peer that exits now has left it
        node_log, stage, timeout = self._node_log(), self._store.keys.stage, self._s.heartbeat_timeout
        failures = [
            gone_failure(stage, p, local, peers.identities[local], node_log.doing(local), silent, timeout)
            for local, silent in sorted(new.items())
        ]
        self._store.post(failures, view)

    def _node_log(self) -> NodeLog:
        """This node's log (once it exists, read without a check first)."""
        key = self._store.keys.log(self._p.node_rank)
        if self._log_seen:
            return NodeLog.parse(self._store.side.get(key))
        raw = self._store.side.get_if_set(key)
        self._log_seen = raw is not None
        return NodeLog.parse(raw)

    def _check_wait(self, now: float, wait: _Wait) -> None:
        p, keys, view = self._p, self._store.keys, self._store.side
        if wait.kind is WaitKind.RELEASE:
            wait.due = float("inf")
            view.set(wait.key, "deadline")
            return
        wait.due = now + self._recheck
        if wait.kind is WaitKind.BODY:
            text = where(self._main)
            if text is not None:
                view.set(keys.where(p.node_rank, p.local_rank), text)
            if self.reports is None and view.get_if_set(keys.closed) == "failed":
                self.reports = self._store.reports(view)
            return
        node_log: NodeLog | None = None  # for a turn's wait: the node's
        if wait.kind is WaitKind.TURN:
            node_log = self._node_log()
            progress = node_log.events
            if wait.predecessor is not None and node_log.ended(wait.predecessor):
                view.compare_set(wait.key, "", "go")  # the predecessor's wake-up was lost
            elif view.get_if_set(keys.closed) == "failed":
                view.compare_set(wait.key, "", "failed")  # the poster's wake-up was lost
        else:
            progress = view.add(keys.finished, 0)
            if progress >= p.world_size:
                view.compare_set(keys.closed, "", "ended")  # the last rank's close was lost
        if progress != wait.last_progress:
            wait.last_progress, wait.last_change = progress, now
        elif now - wait.last_change > self._s.turn_timeout:
            failures = diagnose_stall(self._s, self._store, now - wait.last_change, node_log, wait.predecessor)
            wait.last_change = float("inf")
            if failures:
                self._store.post(failures, view)
