"""Liveness: each rank's monitor thread keeps the rank visible, watches its node's other ranks, and ends its waits.

While a rank takes part in a stage, its :class:`Monitor`, run by the process's monitor thread on the monitor
connection (``_store.open_namespace``):

* beats the rank's heartbeat a few times per heartbeat timeout (every ``heartbeat_timeout / 4``
  seconds, at most ``_BEAT_MAX``);
* watches the other local ranks of its node (:class:`PeerWatch`): a process gone from this machine is seen in
  ``/proc`` within ``_TICK`` (no store traffic), a silent heartbeat is read at the beat rate;
* while the main thread is blocked in a wait, re-checks every ``_RECHECK`` seconds (sooner with a short turn
  timeout) what it waits for: if the wake-up was lost (its predecessor ended, the stage ended or failed, but the key
  was not set) it sets the rank's own wake-up key; if nothing on the node moved for the turn timeout it posts the
  timeout; and it ends the failure exchange's waits at their bound if their coordinator vanished;
* while the main thread is inside its turn, publishes where that thread is (for the timeout message) and keeps a copy
  of the stage's failure reports, so that the rank can still name a failure if the store disappears.

Every failure it finds is posted through ``_exchange.post_failures``, which wakes every waiting rank.

One daemon thread per process (:class:`_MonitorThread`) runs the monitors of every schedule in the process, each at
its own tick. A job has one rank per process, so that is one thread per rank, as if each monitor had its own; where
many ranks share a process (the coordination benchmark's simulated ranks), they cost one thread's wake-ups instead
of one per rank.
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
from typing import Any

from serialized_restore._diagnosis import Where, gone_failure, timeout_failures
from serialized_restore._errors import RankFailure
from serialized_restore._exchange import post_failures, read_reports
from serialized_restore._order import NodeLog, TurnOrder
from serialized_restore._store import ScheduleKeys, StageKeys, StoreLost, StoreView

log = logging.getLogger(__name__)

_TICK = 0.5
_RECHECK = 1.0
_BEAT_MAX = 15.0
_WHERE_AFTER = 1.0
_WHERE_EVERY = 1.0
_DIAGNOSIS_BUDGET = 5.0
"""The longest the rank that diagnoses a job-wide stall spends reading the other nodes' state."""


def beat_interval(heartbeat_timeout: float) -> float:
    """Seconds between two heartbeats: four per timeout, so that a short timeout never fires on a live rank."""
    return max(0.05, min(heartbeat_timeout / 4, _BEAT_MAX))


def recheck_interval(turn_timeout: float) -> float:
    return max(0.05, min(_RECHECK, turn_timeout / 10))


_alive_cache: dict[int, tuple[float, bool]] = {}
_alive_lock = threading.Lock()


def process_alive_recently(pid: int, now: float, within: float) -> bool:
    """:func:`process_alive`, shared by the monitors of one process for ``within`` seconds: where several ranks live
    in one process (threads, as in a simulation), each pid is looked up once per tick, not once per rank."""
    with _alive_lock:
        cached = _alive_cache.get(pid)
        if cached is not None and now - cached[0] < within:
            return cached[1]
    alive = process_alive(pid)
    with _alive_lock:
        _alive_cache[pid] = (now, alive)
    return alive


def process_alive(pid: int) -> bool:
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
class Identity:
    """Who a rank's process is, so that ranks on the same machine can tell whether it still exists."""

    global_rank: int
    pid: int
    machine: str
    """Boot id and pid namespace: equal only for processes that see the same pids."""

    @classmethod
    def of_this_process(cls, global_rank: int) -> Identity:
        return cls(global_rank, os.getpid(), _machine())

    def same_machine(self, other: Identity) -> bool:
        return bool(self.machine) and self.machine == other.machine

    def to_json(self) -> str:
        return json.dumps([self.global_rank, self.pid, self.machine])

    @classmethod
    def from_json(cls, text: str) -> Identity:
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


class PeerWatch:
    """(one rank, one schedule) What it knows of the other local ranks of its node; no store access of its own."""

    def __init__(self, global_rank: int, local_rank: int, local_world_size: int, heartbeat_timeout: float) -> None:
        self._local = local_rank
        self._lws = local_world_size
        self._timeout = heartbeat_timeout
        self._me = Identity.of_this_process(global_rank)
        self.identities: dict[int, Identity] = {}
        self._beats: dict[int, tuple[int, float]] = {}

    def missing(self) -> list[int]:
        """Peers that have not published who they are yet."""
        return [r for r in range(self._lws) if r != self._local and r not in self.identities]

    def learn(self, local: int, identity: Identity) -> None:
        self.identities[local] = identity

    def new_stage(self) -> None:
        """Forget heartbeat observations: between stages nobody beats."""
        self._beats.clear()

    def exited(self, now: float | None = None, within: float = 0.0) -> list[int]:
        """Peers on this machine whose process is gone (as seen at most ``within`` seconds before ``now``)."""
        now = time.monotonic() if now is None else now
        return sorted(
            r
            for r, i in self.identities.items()
            if i.same_machine(self._me) and not process_alive_recently(i.pid, now, within)
        )

    def observe(self, beats: dict[int, int], now: float) -> list[tuple[int, float]]:
        """Record heartbeat counters read at ``now``; the peers silent for longer than the timeout, and for how long.

        Silence is measured from the first time the current value was seen, so an observer that looked late never
        blames a peer for its own delay."""
        silent = []
        for local, beat in beats.items():
            seen, since = self._beats.get(local, (-1, now))
            if beat != seen:
                self._beats[local] = (beat, now)
                continue
            if now - since > self._timeout:
                silent.append((local, now - since))
        return silent


@dataclass
class _Wait:
    kind: str
    """``"turn"`` (for the predecessor's end), ``"end"`` (for the stage's end), ``"release"`` (an exchange wait)."""
    key: str
    since: float
    predecessor: int | None = None
    release_at: float = 0.0
    next_check: float = 0.0
    last_progress: int | None = None
    last_change: float = 0.0
    timed_out: bool = False
    released: bool = False


class Monitor:
    """(one rank, one stage) The monitor thread: see the module docstring."""

    def __init__(
        self,
        *,
        view: StoreView,
        keys: StageKeys,
        placement: Any,
        order: TurnOrder,
        watch: PeerWatch,
        turn_timeout: float,
        heartbeat_timeout: float,
        wake_keys: list[str],
    ) -> None:
        self._view = view
        self._keys = keys
        self._p = placement
        self._order = order
        self._watch = watch
        self._turn_timeout = turn_timeout
        self._heartbeat_timeout = heartbeat_timeout
        self._wake_keys = wake_keys
        self._beat_every = beat_interval(heartbeat_timeout)
        self._recheck = recheck_interval(turn_timeout)
        self._tick = min(_TICK, self._beat_every, self._recheck)
        self._nodes = max(1, placement.world_size // placement.local_world_size)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._turn_started: float | None = None
        self._wait: _Wait | None = None
        self._reports: list[RankFailure] = []
        self._reported: set[int] = set()
        self._copied = False
        self._log_seen = False
        now = time.monotonic()
        self._next_beat = now + self._beat_every
        # the first look one beat in: a short stage costs no heartbeat read at all
        self._next_beats_read = now + self._beat_every
        self._next_identity = now
        self._next_where = self._next_closed = 0.0
        self._main = threading.get_ident()
        self._runner: _MonitorThread | None = None
        watch.new_stage()

    @property
    def tick(self) -> float:
        """Seconds between two of its steps."""
        return self._tick

    # ------------------------------------------------------------ main thread

    def start(self) -> None:
        self._runner = _MonitorThread.of_this_process()
        self._runner.add(self)

    def stop(self) -> None:
        """Take it off the monitor thread; once this returns no step of it runs (unless called from a step)."""
        self._stopped.set()
        if self._runner is not None:
            self._runner.remove(self, timeout=5.0)

    @property
    def alive(self) -> bool:
        """Whether its steps still run (stopped on a lost store or an error of its own)."""
        return self._runner is not None and self._runner.runs(self)

    def enter_turn(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._turn_started = now
            # with a short turn timeout, where the body is must be known well before any rank can time it out
            self._next_where = now + min(_WHERE_AFTER, self._recheck)
            self._next_closed = now + self._recheck

    def leave_turn(self) -> None:
        with self._lock:
            self._turn_started = None

    @contextlib.contextmanager
    def waiting(self, kind: str, key: str, predecessor: int | None = None) -> Iterator[None]:
        """While the main thread blocks on ``key``: re-check what it waits for, post a timeout."""
        now = time.monotonic()
        with self._set_wait(_Wait(kind, key, now, predecessor, next_check=now + self._recheck, last_change=now)):
            yield

    def releasing(self, key: str, after: float) -> contextlib.AbstractContextManager[None]:
        """While the main thread blocks on ``key`` in the failure exchange: set it after ``after`` seconds."""
        now = time.monotonic()
        return self._set_wait(_Wait("release", key, now, release_at=now + after))

    @contextlib.contextmanager
    def _set_wait(self, wait: _Wait) -> Iterator[None]:
        with self._lock:
            self._wait = wait
        try:
            yield
        finally:
            with self._lock:
                self._wait = None

    def reports(self) -> list[RankFailure]:
        with self._lock:
            return list(self._reports)

    def keep(self, reports: list[RankFailure]) -> None:
        with self._lock:
            self._reports = list(reports)
            self._copied = True

    # --------------------------------------------------------- monitor thread

    def step(self, now: float) -> bool:
        """One step on the monitor thread; ``False`` once it must not run again."""
        if self._stopped.is_set():
            return False
        try:
            self._step(now)
        except StoreLost:
            return False  # the store is gone: the main thread finds out on its next store operation
        except Exception:  # never let a bug here end the process; the main thread's waits have a backstop
            log.debug("serialized restore: a monitor stopped", exc_info=True)
            return False
        return True

    def _step(self, now: float) -> None:
        p, keys = self._p, self._keys
        if now >= self._next_beat:
            self._view.add(ScheduleKeys.heartbeat(p.node_rank, p.local_rank), 1)
            self._next_beat = now + self._beat_every
        self._watch_peers(now)
        with self._lock:
            turn_started, wait = self._turn_started, self._wait
        if turn_started is not None:
            if now >= self._next_where:
                self._next_where = now + min(_WHERE_EVERY, self._recheck)
                where = Where.of_thread(self._main)
                if where is not None:
                    self._view.set(keys.where(p.node_rank, p.local_rank), where.to_json())
            if now >= self._next_closed and not self._copied:
                self._next_closed = now + self._recheck
                if self._view.get_if_set(keys.closed) == "failed":
                    self.keep(read_reports(self._view, keys))
        if wait is not None:
            self._check_wait(now, wait)

    def _watch_peers(self, now: float) -> None:
        p, watch = self._p, self._watch
        missing = watch.missing()
        if missing and now >= self._next_identity:
            self._next_identity = now + self._recheck
            keys = [ScheduleKeys.identity(p.node_rank, local) for local in missing]
            if len(keys) > 1 and self._view.check_all(keys):
                # everyone has arrived (the usual case): two operations, whatever the node's size
                for local, raw in zip(missing, self._view.multi_get(keys)):
                    watch.learn(local, Identity.from_json(raw))
            else:
                for local, key in zip(missing, keys):
                    arrived = self._view.get_if_set(key)
                    if arrived is not None:
                        watch.learn(local, Identity.from_json(arrived))
        gone: dict[int, tuple[bool, float]] = dict.fromkeys(watch.exited(now, self._tick / 2), (True, 0.0))
        if now >= self._next_beats_read and watch.identities:
            self._next_beats_read = now + self._beat_every
            peers = sorted(watch.identities)
            values = self._view.multi_get([ScheduleKeys.heartbeat(p.node_rank, local) for local in peers])
            beats = {local: int(value) for local, value in zip(peers, values)}
            for local, silent in watch.observe(beats, now):
                gone.setdefault(local, (False, silent))
        new = {local: g for local, g in gone.items() if local not in self._reported}
        if not new:
            return
        self._reported.update(new)
        if self._view.check(self._keys.closed):
            # the stage ended, or failed and its ranks are raising: a peer that exits now has left it
            return
        node_log = self._node_log()
        failures = []
        for local, (exited, silent) in sorted(new.items()):
            ident = watch.identities[local]
            failures.append(
                gone_failure(
                    stage=self._keys.stage,
                    observer=p.global_rank,
                    node=p.node_rank,
                    local=local,
                    global_rank=ident.global_rank,
                    pid=ident.pid,
                    exited=exited,
                    doing=node_log.doing(local),
                    silent=silent,
                    heartbeat_timeout=self._heartbeat_timeout,
                )
            )
        post_failures(self._view, self._keys, failures, self._wake_keys)

    def _node_log(self) -> NodeLog:
        """This node's log; once it exists, read without a check first."""
        key = self._keys.log(self._p.node_rank)
        if self._log_seen:
            return NodeLog.parse(self._view.get(key))
        raw = self._view.get_if_set(key)
        self._log_seen = raw is not None
        return NodeLog.parse(raw)

    def _check_wait(self, now: float, wait: _Wait) -> None:
        p, keys, view = self._p, self._keys, self._view
        if wait.kind == "release":
            if not wait.released and now >= wait.release_at:
                wait.released = True
                view.set(wait.key, "deadline")
            return
        if now < wait.next_check:
            return
        wait.next_check = now + self._recheck
        node_log: NodeLog | None = None
        if wait.kind == "turn":
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
        if wait.last_progress is None:
            wait.last_progress = progress
        elif progress != wait.last_progress:
            wait.last_progress, wait.last_change = progress, now
        if not wait.timed_out and now - wait.last_change > self._turn_timeout:
            wait.timed_out = True
            failures = self._diagnose(wait, now - wait.last_change, node_log)
            if failures:
                post_failures(view, keys, failures, self._wake_keys)

    def _diagnose(self, wait: _Wait, idle: float, node_log: NodeLog | None) -> list[RankFailure]:
        """The timeout failures to post: for the own node when waiting for a predecessor; for every unfinished node
        when waiting for the stage to end, by the one rank that claims the diagnosis."""
        p, keys, view = self._p, self._keys, self._view
        deadline = time.monotonic() + _DIAGNOSIS_BUDGET
        logs: dict[int, NodeLog] = {}
        if wait.kind == "turn" and node_log is not None:
            logs[p.node_rank] = node_log
            what = f"the end of local rank {wait.predecessor}'s turn"
        else:
            if view.compare_set(keys.diagnosis, "", str(p.global_rank)) != str(p.global_rank):
                return []  # another rank diagnoses the stall
            what = "every rank to end the stage"
            for node in range(self._nodes):
                if time.monotonic() > deadline:
                    break
                node_log = NodeLog.parse(view.get_if_set(keys.log(node)))
                if len(node_log.durations) < p.local_world_size:
                    logs[node] = node_log
        arrived = {(p.node_rank, p.local_rank): p.global_rank}
        arrived.update({(p.node_rank, local): ident.global_rank for local, ident in self._watch.identities.items()})
        wheres: dict[tuple[int, int], Where] = {}
        for node, node_log in logs.items():
            for local in range(p.local_world_size):
                if time.monotonic() > deadline:
                    break
                if node != p.node_rank and (node, local) not in arrived:
                    raw = view.get_if_set(ScheduleKeys.identity(node, local))
                    if raw is not None:
                        arrived[(node, local)] = Identity.from_json(raw).global_rank
                if local in node_log.inside():
                    raw = view.get_if_set(keys.where(node, local))
                    if raw is not None:
                        wheres[(node, local)] = Where.from_json(raw)
        return timeout_failures(
            stage=keys.stage,
            observer=(p.global_rank, p.node_rank, p.local_rank),
            local_world_size=p.local_world_size,
            turn_timeout=self._turn_timeout,
            idle=idle,
            what=what,
            logs=logs,
            arrived=arrived,
            wheres=wheres,
        )


class _MonitorThread:
    """The daemon thread that runs every :class:`Monitor` of this process, each every ``monitor.tick`` seconds."""

    _current: _MonitorThread | None = None
    _create_lock = threading.Lock()
    stuck_after = 60.0
    """Seconds one step may take before the thread counts as not running (a store operation that never answers):
    the waits of its monitors then end at their backstop instead of being issued again."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._due: dict[Monitor, float] = {}
        self._stepping: Monitor | None = None
        self._step_started = 0.0
        self._thread = threading.Thread(target=self._run, name="serialized-restore-monitor", daemon=True)
        self._thread.start()

    @classmethod
    def of_this_process(cls) -> _MonitorThread:
        """The process's monitor thread, started on first use (and again in a forked child, which has none)."""
        with cls._create_lock:
            current = cls._current
            if current is None or current._pid != os.getpid() or not current._thread.is_alive():
                current = cls._current = cls()
            return current

    def add(self, monitor: Monitor) -> None:
        with self._cond:
            self._due[monitor] = time.monotonic() + monitor.tick
            self._cond.notify_all()

    def remove(self, monitor: Monitor, timeout: float) -> None:
        """Drop ``monitor``; wait (up to ``timeout``) for a step of it in progress to end, unless called by it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._due.pop(monitor, None)
            if threading.current_thread() is self._thread:
                return
            while self._stepping is monitor and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)

    def runs(self, monitor: Monitor) -> bool:
        """Whether ``monitor``'s steps still run: it is on the thread, which is alive and not stuck in a step."""
        with self._cond:
            stuck = self._stepping is not None and time.monotonic() - self._step_started > self.stuck_after
            return self._thread.is_alive() and monitor in self._due and not stuck

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = sorted((at, i, m) for i, (m, at) in enumerate(self._due.items()) if at <= now)
                if not due:
                    self._cond.wait(min(self._due.values()) - now if self._due else None)
                    continue
            for _, _, monitor in due:
                with self._cond:
                    if monitor not in self._due:
                        continue  # stopped meanwhile
                    self._stepping, self._step_started = monitor, time.monotonic()
                keep = False
                try:
                    keep = monitor.step(time.monotonic())
                finally:
                    with self._cond:
                        self._stepping = None
                        if monitor in self._due:
                            if keep:
                                self._due[monitor] = time.monotonic() + monitor.tick
                            else:
                                del self._due[monitor]
                        self._cond.notify_all()


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's threads: new locks (one may have been held by a thread that is not
    there), and no monitor thread until a schedule of the child starts one."""
    global _alive_lock
    _alive_lock = threading.Lock()
    _alive_cache.clear()
    _MonitorThread._create_lock = threading.Lock()
    _MonitorThread._current = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
