"""``_liveness``: heartbeats, the peer watch and the watch that ends a rank's waits. A real ``TCPStore`` in this
process where the store is involved; the multi-process protocol is tested in ``test_turns.py``."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
import time

import torch.distributed as dist

from serialized_restore._liveness import (
    Identity,
    OwnThread,
    PeerWatch,
    WaitKind,
    Watch,
    beat_interval,
    process_alive,
    recheck_interval,
)
from serialized_restore._order import NodeLog
from serialized_restore._store import StageKeys, StageStore, identity_key, open_namespace
from serialized_restore._turns import RankPlacement, TurnSchedule
from tests.helpers.watches import Ticking

STAGE = "restore modules and callbacks"


def test_rates_follow_the_timeouts():
    """The heartbeat interval is a quarter of the heartbeat timeout, at most 15 s; the recheck interval a tenth of
    the turn timeout, at most 1 s."""
    assert beat_interval(60.0) == 15.0 and beat_interval(2.0) == 0.5 and beat_interval(3600.0) == 15.0
    assert recheck_interval(1800.0) == 1.0 and abs(recheck_interval(1.5) - 0.15) < 1e-9


def test_silence_is_measured_from_the_first_sight_of_a_value():
    """A peer is blamed only when its heartbeat counter has kept one value for longer than the timeout since the
    observer first saw that value: never for the observer's own late look, nor for time before a new stage."""
    watch = PeerWatch(global_rank=0, local_rank=0, local_world_size=3, heartbeat_timeout=2.0)
    assert watch.missing() == [1, 2]
    assert watch.observe({1: 5, 2: 7}, now=0.0) == []
    # rank 1 beats, rank 2 is silent: blamed only once more than the timeout has passed since its value was seen
    assert watch.observe({1: 6, 2: 7}, now=1.5) == []
    assert watch.observe({1: 7, 2: 7}, now=2.5) == [(2, 2.5)]
    # an observer that looked late sees a changed value: no blame for its own delay
    assert watch.observe({1: 9, 2: 8}, now=10.0) == []
    watch.new_stage()
    assert watch.observe({1: 9, 2: 8}, now=20.0) == []  # between stages nobody beats: observations start over


def _exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_process_gone_from_this_machine_is_seen_exited():
    """A peer on this machine whose pid has exited is reported by ``exited()``; one on another machine is left to
    the heartbeats, even with the same dead pid."""
    pid = _exited_pid()
    watch = PeerWatch(global_rank=0, local_rank=0, local_world_size=3, heartbeat_timeout=60.0)
    me = Identity.of_this_process(0)
    watch.identities[1] = Identity(1, pid, me.machine)
    watch.identities[2] = Identity(2, pid, "another machine")  # not ours to look at: heartbeats only
    assert process_alive(me.pid) and not process_alive(pid)
    assert watch.exited() == [1] and watch.missing() == []
    assert Identity.from_json(json.dumps(me)) == me


def test_the_default_host_steps_each_watch_on_a_thread_of_its_own_until_stopped():
    """``OwnThread`` steps a watch every tick on a thread that is not the caller's, runs it no more once a step
    returns ``False``, and ``stop`` waits for a step in progress, after which no step runs."""
    host = OwnThread()
    fast, once, slow = Ticking(0.01), Ticking(0.01, steps_before_stop=1), Ticking(0.01, step_seconds=0.3)
    for watch in (fast, once, slow):
        host.start(watch)
    deadline = time.monotonic() + 10.0
    while (fast.steps < 5 or not slow.running) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fast.steps >= 5 and host.runs(fast) and threading.get_ident() not in fast.threads
    assert fast.threads.isdisjoint(slow.threads)
    assert once.steps == 1 and not host.runs(once)
    host.stop(slow)
    assert not slow.running and not host.runs(slow)
    host.stop(fast)
    counts = (fast.steps, slow.steps)
    time.sleep(0.2)
    assert (fast.steps, slow.steps) == counts


def _stage(world: int, local: int, pid: int, heartbeat_timeout: float = 60.0) -> tuple[TurnSchedule, StageStore]:
    """A schedule of rank ``local`` of a one-node job over a real store (which the schedule keeps alive), whose other
    ranks are the process ``pid`` on this machine."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    schedule = TurnSchedule(
        store=server,
        placement=RankPlacement(local, world, 0, local, world),
        max_concurrent=1,
        checkpoint_path="/x.ckpt",
        turn_timeout=1.0,
        heartbeat_timeout=heartbeat_timeout,
    )
    main, side = open_namespace(server, local, 30.0)
    machine = Identity.of_this_process(0).machine
    for peer in range(world):
        if peer != local:
            side.set(identity_key(0, peer), json.dumps(Identity(peer, pid, machine)))
    keys = StageKeys(STAGE)
    store = StageStore(keys, main, side, [keys.wake(0, r) for r in range(world)])
    return schedule, store


def test_a_watch_posts_a_dead_peer_and_wakes_every_rank():
    """A watch whose node has a rank with an exited process posts it as ``died`` within a second, naming what it was
    doing, closes the stage as failed and sets every rank's wake-up key."""
    schedule, store = _stage(world=2, local=1, pid=_exited_pid())
    watch = Watch(schedule, store)
    schedule.host.start(watch)
    try:
        deadline = time.monotonic() + 5.0
        while store.main.get_if_set(store.keys.closed) is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        schedule.host.stop(watch)
    (failure,) = store.reports(store.main)
    assert (failure.global_rank, failure.kind, failure.reported_by) == (0, "died", 1)
    assert "exited while waiting for its turn" in failure.message
    assert store.main.get(store.keys.closed) == "failed"
    assert [store.main.get(k) for k in store.wake_keys] == ["failed", "failed"]


def test_a_watch_repairs_a_lost_wake_up_and_releases_an_exchange_wait():
    """While the main thread waits for its turn, a predecessor's end in the node log with no wake-up set makes the
    watch set the wake-up itself within a recheck; a release wait is set free at its deadline."""
    schedule, store = _stage(world=2, local=1, pid=os.getpid())
    store.main.append(store.keys.log(0), NodeLog.start_line(0, time.time()) + NodeLog.end_line(0, 0.1))
    watch = Watch(schedule, store)
    schedule.host.start(watch)
    try:
        wake = store.keys.wake(0, 1)
        with watch.waiting(WaitKind.TURN, wake, predecessor=0):
            started = time.monotonic()
            assert store.main.get(wake) == "go" and time.monotonic() - started < 3.0
        with watch.waiting(WaitKind.RELEASE, store.keys.all_acked, release_after=0.3):
            started = time.monotonic()
            assert store.main.get(store.keys.all_acked) == "deadline"
            assert 0.25 < time.monotonic() - started < 3.0
    finally:
        schedule.host.stop(watch)


def test_a_foreign_identity_leaves_the_watch_running():
    """A value in a peer's identity key that is not one (any process that can reach the store can write to it)
    leaves that peer unknown, and the watch runs on."""
    schedule, store = _stage(world=2, local=1, pid=os.getpid())
    store.side.set(identity_key(0, 0), "{not json")
    watch = Watch(schedule, store)
    now = time.monotonic()
    assert watch.step(now) and watch.step(now + 2.0)
    assert schedule.peers.identities == {} and Identity.from_json("[1, 2]") is None
