"""The pure parts of the turn schedule, without processes or a store: turn order, the node log, liveness bookkeeping
and the failure messages. The protocol itself is tested with real processes in ``test_turns.py``."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from serialized_restore._diagnosis import Where, gone_failure, parse_reports, store_lost_failure, timeout_failures
from serialized_restore._errors import RankFailure
from serialized_restore._liveness import (
    Identity,
    PeerWatch,
    _MonitorThread,
    beat_interval,
    process_alive,
    recheck_interval,
)
from serialized_restore._options import HEARTBEAT_TIMEOUT_SETTING, TURN_TIMEOUT_SETTING
from serialized_restore._order import NodeLog, TurnOrder

STAGE = "restore modules and callbacks"


def test_turn_order_forms_k_chains():
    """With 8 local ranks and k = 3, local rank r waits for r - 3 and hands over to r + 3: the first three wait for
    nobody and the last three hand over to nobody; a single rank has neither."""
    order = TurnOrder(local_world_size=8, max_concurrent=3)
    assert [order.predecessor(r) for r in range(8)] == [None, None, None, 0, 1, 2, 3, 4]
    assert [order.successor(r) for r in range(8)] == [3, 4, 5, 6, 7, None, None, None]
    single = TurnOrder(local_world_size=1, max_concurrent=1)
    assert single.predecessor(0) is None and single.successor(0) is None


def test_node_log_reads_starts_and_ends_and_skips_foreign_lines():
    """``NodeLog.parse`` counts the ``start`` and ``end`` lines it writes and ignores any other; the log tells which
    local ranks are inside, after or still waiting for their turn; no text at all is an empty log."""
    text = NodeLog.start_line(0, 100.0) + NodeLog.end_line(0, 2.5) + NodeLog.start_line(1, 102.5) + "junk\nend x y\n"
    log = NodeLog.parse(text)
    assert log.events == 3
    assert log.started == {0: 100.0, 1: 102.5} and log.durations == {0: 2.5}
    assert log.ended(0) and not log.ended(1) and log.inside() == [1]
    assert log.doing(1) == "inside its turn" and log.doing(2) == "waiting for its turn"
    assert log.doing(0).startswith("after its turn")
    assert NodeLog.parse(None).events == 0


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


def test_a_process_gone_from_this_machine_is_seen_exited():
    """A peer on this machine whose pid has exited is reported by ``exited()``; one on another machine is left to
    the heartbeats, even with the same dead pid."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    watch = PeerWatch(global_rank=0, local_rank=0, local_world_size=3, heartbeat_timeout=60.0)
    me = Identity.of_this_process(0)
    watch.learn(1, Identity(1, child.pid, me.machine))
    watch.learn(2, Identity(2, child.pid, "another machine"))  # not ours to look at: heartbeats only
    assert process_alive(me.pid) and not process_alive(child.pid)
    assert watch.exited() == [1]
    assert watch.missing() == []


def _where(*frames: tuple[str, int, str, str]) -> Where:
    return Where(list(frames))


def test_timeout_names_the_rank_inside_its_turn_and_its_collective():
    """A turn timeout blames the rank still inside its turn, with how long, the turn timeout setting, the
    ``torch.distributed`` collective it is blocked in and the hook that called it, and says hooks must not run
    collectives."""
    log = NodeLog.parse(NodeLog.start_line(0, 1000.0))
    where = _where(
        ("train.py", 42, "on_load_checkpoint", "dist.broadcast(t, 0)"),
        ("/x/torch/distributed/c10d_logger.py", 80, "wrapper", ""),
        ("/x/torch/distributed/distributed_c10d.py", 2000, "broadcast", ""),
    )
    (failure,) = timeout_failures(
        stage=STAGE,
        observer=(1, 0, 1),
        local_world_size=3,
        turn_timeout=8.0,
        idle=8.5,
        what="the end of local rank 0's turn",
        logs={0: log},
        arrived={(0, 0): 0, (0, 1): 1, (0, 2): 2},
        wheres={(0, 0): where},
        now=1009.0,
    )
    assert (failure.global_rank, failure.kind, failure.reported_by) == (0, "timeout", 1)
    assert failure.message.startswith("still inside its turn after 9.0s, and no turn on node 0")
    assert f"{TURN_TIMEOUT_SETTING} (seconds, now 8)" in failure.message
    assert "blocked in the collective `torch.distributed.broadcast`" in failure.message
    assert "`on_load_checkpoint` (train.py, line 42)" in failure.message
    assert "must not run collectives" in failure.message


def test_timeout_names_ranks_that_never_arrived_else_the_observer():
    """With no rank inside its turn, a turn timeout blames the ranks that have not reached the restore; when every
    rank has, it blames the observer itself and says that no rank is inside its turn."""
    log = NodeLog.parse(NodeLog.start_line(0, 1.0) + NodeLog.end_line(0, 1.0))
    common = dict(stage=STAGE, observer=(0, 0, 0), local_world_size=2, turn_timeout=1.5, idle=2.0, what="x", now=5.0)
    (absent,) = timeout_failures(logs={0: log}, arrived={(0, 0): 0}, wheres={}, **common)
    assert absent.global_rank == 1 and "has not reached the restore" in absent.message
    (nobody,) = timeout_failures(logs={0: log}, arrived={(0, 0): 0, (0, 1): 1}, wheres={}, **common)
    assert nobody.global_rank == 0 and "no rank is inside its turn" in nobody.message


def test_gone_messages_say_what_the_rank_was_doing_and_the_setting():
    """A peer whose process exited is ``died``, one silent past the heartbeat timeout ``unresponsive``; each message
    says what the rank was doing and names the heartbeat setting, the second also how long the rank was silent."""
    common = dict(stage=STAGE, observer=0, node=0, local=1, global_rank=1, pid=1234, heartbeat_timeout=3.0)
    died = gone_failure(exited=True, doing="inside its turn", silent=0.0, **common)
    assert died.kind == "died" and "(pid 1234) exited while inside its turn" in died.message
    assert "killed" in died.message and HEARTBEAT_TIMEOUT_SETTING in died.message
    silent = gone_failure(exited=False, doing="waiting for its turn", silent=3.4, **common)
    assert silent.kind == "unresponsive" and "stopped responding while waiting for its turn" in silent.message
    assert f"Set {HEARTBEAT_TIMEOUT_SETTING} (seconds, now 3)" in silent.message and "3.4s" in silent.message


def test_store_lost_names_rank_zero_and_the_cause(monkeypatch):
    """Without torchrun's agent store, a lost store blames global rank 0, which hosts it, as reported by the
    observer, and quotes the type and first line of the error that revealed the loss."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    failure = store_lost_failure(STAGE, 2, ConnectionResetError("Connection reset by peer\nmore"))
    assert (failure.global_rank, failure.kind, failure.reported_by) == (0, "store lost", 2)
    assert "hosted by global rank 0" in failure.message and "ConnectionResetError: Connection reset by peer)" in (
        failure.message
    )


def test_reports_that_are_not_ours_are_named_as_such():
    """``parse_reports`` gives back a record written by ``RankFailure.to_json`` unchanged, and turns a line that is
    not one into a ``malformed report`` failure of no rank (-1)."""
    good = RankFailure(1, 0, 1, STAGE, "exception", "ValueError: x")
    parsed = parse_reports(good.to_json() + "\n\n{not json\n", STAGE)
    assert parsed[0] == good
    assert parsed[1].kind == "malformed report" and parsed[1].global_rank == -1


class _Ticking:
    """Stands in for a ``Monitor`` on the monitor thread: counts its steps and the threads that ran them."""

    def __init__(self, tick: float, step_seconds: float = 0.0, steps_before_stop: int = -1) -> None:
        self.tick = tick
        self.step_seconds = step_seconds
        self.steps_before_stop = steps_before_stop
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


def test_one_monitor_thread_runs_every_monitor_of_a_process_at_its_own_tick():
    """Monitors of several schedules in one process share one thread; each is stepped at its own rate; one whose step
    asks to stop is no longer run; a removed one is not stepped again, and removal waits for a step in progress."""
    runner = _MonitorThread.of_this_process()
    assert _MonitorThread.of_this_process() is runner
    fast, slow, once = _Ticking(0.01), _Ticking(0.1), _Ticking(0.01, steps_before_stop=1)
    for monitor in (fast, slow, once):
        runner.add(monitor)
    deadline = time.monotonic() + 10.0  # a loaded machine may hold the thread back; the rates are what counts
    while not (slow.steps >= 3 and fast.steps > 2 * slow.steps) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slow.steps >= 3 and fast.steps > 2 * slow.steps, (fast.steps, slow.steps)
    assert once.steps == 1 and not runner.runs(once)
    assert len(fast.threads | slow.threads) == 1 and threading.get_ident() not in fast.threads
    assert runner.runs(fast) and runner.runs(slow)

    long = _Ticking(0.01, step_seconds=0.3)
    runner.add(long)
    deadline = time.monotonic() + 2.0
    while not long.running and time.monotonic() < deadline:
        time.sleep(0.001)
    assert long.running
    runner.remove(long, timeout=2.0)
    assert not long.running and long.steps == 1  # removal waited for the step in progress to end
    for monitor in (fast, slow):
        runner.remove(monitor, timeout=2.0)
    counts = (fast.steps, slow.steps, long.steps)
    time.sleep(0.2)
    assert (fast.steps, slow.steps, long.steps) == counts


def test_a_monitor_thread_stuck_in_one_step_counts_as_not_running():
    """A step that does not end (a store operation that never answers) makes every monitor of the thread count as
    not running once ``stuck_after`` has passed, so that their waits end at the backstop; it runs again after."""
    runner = _MonitorThread()
    runner.stuck_after = 0.5
    stuck, other = _Ticking(0.01, step_seconds=2.0), _Ticking(0.01)
    runner.add(stuck)
    runner.add(other)
    deadline = time.monotonic() + 5.0
    while not stuck.running and time.monotonic() < deadline:
        time.sleep(0.001)
    assert stuck.running and runner.runs(other)
    time.sleep(0.8)
    assert stuck.running and not runner.runs(other) and not runner.runs(stuck)
    runner.remove(stuck, timeout=2.0)
    deadline = time.monotonic() + 5.0
    while not runner.runs(other) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner.runs(other)
    runner.remove(other, timeout=2.0)
