"""The turn schedule on its own: real processes, a real ``TCPStore`` (gloo where a collective is needed), no Lightning.

Every test forks one process per rank, gives each rank a ``TurnSchedule`` over the same store and lets each rank write
what it ended with (its turns' timestamps, or the error it raised) to ``rank<r>.json``. A rank that misbehaves on
purpose first writes ``fault.json`` with the time it did so.
"""

from __future__ import annotations

import datetime
import json
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from serialized_restore import CheckpointRestoreError, RankFailure
from serialized_restore._errors import restore_error
from serialized_restore._liveness import Watch
from serialized_restore._options import HEARTBEAT_TIMEOUT_SETTING, TURN_TIMEOUT_SETTING
from serialized_restore._store import StageKeys
from serialized_restore._turns import RankPlacement, TurnSchedule
from tests.helpers.store import connect

CKPT = "/checkpoints/epoch=3.ckpt"
STAGES = ("restore modules and callbacks", "restore training state")


def _connect(rank: int, world: int, out_dir: Path) -> dist.TCPStore:
    """The test's store (``tests.helpers.store.connect``), once every rank has connected."""
    store = connect(rank, world, out_dir)
    # everyone connected before anyone goes on, as after a real rendezvous; rank 0 leaves last, so that no rank is
    # still in this barrier if rank 0 (and the store with it) dies right after
    for key in ("connected", "passed"):
        store.add(key, 1)
        while rank == 0 or key == "connected":
            if int(store.add(key, 0)) >= world:
                break
            time.sleep(0.01)
    return store


class _CountingStore(dist.Store):
    """A real store's client, wrapped: forwards every call (clones included) and counts it."""

    def __init__(self, inner: Any, counts: dict[str, int]) -> None:
        super().__init__()
        self.inner = inner
        self.counts = counts
        self._clones: list[Any] = []
        dist.Store.set_timeout(self, inner.timeout)

    def _hit(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def set(self, key, value):  # noqa: ANN001, ANN201
        self._hit("set")
        return self.inner.set(key, value)

    def get(self, key):  # noqa: ANN001, ANN201
        self._hit("get")
        if self.timeout != self.inner.timeout:
            self.inner.set_timeout(self.timeout)
        return self.inner.get(key)

    def add(self, key, value):  # noqa: ANN001, ANN201
        self._hit("add")
        return self.inner.add(key, value)

    def check(self, keys):  # noqa: ANN001, ANN201
        self._hit("check")
        return self.inner.check(keys)

    def compare_set(self, key, expected, desired):  # noqa: ANN001, ANN201
        self._hit("compare_set")
        return self.inner.compare_set(key, expected, desired)

    def append(self, key, value):  # noqa: ANN001, ANN201
        self._hit("append")
        return self.inner.append(key, value)

    def multi_get(self, keys):  # noqa: ANN001, ANN201
        self._hit("multi_get")
        return self.inner.multi_get(keys)

    def multi_set(self, keys, values):  # noqa: ANN001, ANN201
        self._hit("multi_set")
        return self.inner.multi_set(keys, values)

    def wait(self, keys, timeout=None):  # noqa: ANN001, ANN201
        self._hit("wait")
        return self.inner.wait(keys, self.timeout if timeout is None else timeout)

    def set_timeout(self, timeout):  # noqa: ANN001, ANN201
        dist.Store.set_timeout(self, timeout)
        self.inner.set_timeout(timeout)

    def clone(self):  # noqa: ANN201
        copy = _CountingStore(self.inner.clone(), self.counts)
        self._clones.append(copy)
        return copy


def _lose_wake_ups() -> None:
    """(in a forked rank) Drop every wake-up a rank sends its successor, as if the store had lost it."""
    TurnSchedule._wake_successor = lambda self, main, keys: None  # type: ignore[method-assign]


def _rank_main(rank: int, world: int, out: str, scenario: dict[str, Any]) -> None:
    """(one forked rank) take part in the stages of ``scenario`` and write the outcome; never returns."""
    out_dir = Path(out)
    outcome: dict[str, Any] = {"events": []}
    started = time.time()
    # what a new Python process starts with: the fork inherits whatever an earlier test in this pytest process left
    # (Lightning's `_destroy_dist_connection` leaves SIGINT at SIG_DFL, or SIG_IGN if destroying the group raised)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if scenario.get("capture_stderr"):
        # the file descriptor itself: c10d writes its warnings from C++, past Python's sys.stderr
        fd = os.open(str(out_dir / f"stderr{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 2)
    if scenario.get("lose_wake_ups"):
        _lose_wake_ups()
    counts: dict[str, int] = {}
    interrupt = scenario.get("interrupt", {}).get(str(rank))
    try:
        store = _connect(rank, world, out_dir)
        if interrupt is not None:
            # SIGINT to this process while its main thread waits for its turn, as Ctrl-C or a launcher would: counted
            # from the start of the turn it waits for (whose rank writes fault.json), since under load this process
            # may start seconds after that rank
            def _interrupt() -> None:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and not (out_dir / "fault.json").exists():
                    time.sleep(0.02)
                time.sleep(interrupt)
                outcome["interrupt_sent"] = time.time()
                os.kill(os.getpid(), signal.SIGINT)

            threading.Thread(target=_interrupt, daemon=True).start()
        if scenario.get("count_store_operations"):
            store = _CountingStore(store, counts)
        if scenario.get("gloo"):
            dist.init_process_group("gloo", store=dist.PrefixStore("pg/", store), rank=rank, world_size=world)
        lws = scenario.get("local_world_size", world)
        schedule = TurnSchedule(
            store=store,
            placement=RankPlacement(rank, world, rank // lws, rank % lws, lws),
            max_concurrent=scenario.get("k", 1),
            checkpoint_path=CKPT,
            turn_timeout=scenario.get("turn_timeout", 30.0),
            heartbeat_timeout=scenario.get("heartbeat_timeout", 30.0),
            logger=_ListLogger(outcome.setdefault("log", [])),
        )
        action = scenario.get("actions", {}).get(str(rank))
        if action == "absent":
            time.sleep(60)
        decide = scenario.get("decide")
        if decide is not None:
            # as "auto" plans a restore: local rank 0 of each node decides, its node's ranks take its value
            def _decision() -> str:
                if str(rank) in decide:
                    _misbehave(decide[str(rank)], rank, out_dir)
                return json.dumps({"decided_by": rank})

            value = schedule.on_one_rank("plan restore", _decision, central=rank % lws == 0, per_node=True)
            outcome["decision"] = json.loads(value or "null")
        for stage in STAGES[: scenario.get("stages", 1)]:
            with schedule.turn(stage) as record:
                outcome["events"].append((stage, time.time(), None))
                if "mapped" in scenario:
                    record.reader, record.bytes_read, record.bytes_copied = "mmap", scenario["mapped"], rank + 1
                if action is not None and stage == STAGES[0]:
                    _misbehave(action, rank, out_dir)
                time.sleep(scenario.get("body", 0.0))
                outcome["events"][-1] = (stage, outcome["events"][-1][1], time.time())
        outcome["ok"] = True
    except CheckpointRestoreError as err:
        outcome.update(
            error=str(err),
            failed_ranks=err.failed_ranks,
            kinds=[f.kind for f in err.failures],
            cause=repr(err.__cause__),
            context=repr(err.__context__),
            printed="".join(traceback.format_exception(type(err), err, err.__traceback__)),
            pickled=str(pickle.loads(pickle.dumps(err))) == str(err),
        )
    except KeyboardInterrupt as err:
        outcome["interrupted"] = time.time()
        if interrupt is None:
            outcome["unexpected"] = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    except BaseException as err:
        outcome["unexpected"] = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    outcome["ended"] = time.time()
    outcome["elapsed"] = outcome["ended"] - started
    outcome["store_operations"] = counts
    (out_dir / f"rank{rank}.json").write_text(json.dumps(outcome))
    if rank == 0:
        # the store lives in this process: stay until the others are done with it
        others = [r for r in range(1, world) if r not in scenario.get("silent", [])]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all((out_dir / f"rank{r}.json").exists() for r in others):
            time.sleep(0.05)
    os._exit(0)


class _ListLogger(logging.Logger):
    """A logger that keeps every message it is given in ``messages``."""

    def __init__(self, messages: list[str]) -> None:
        super().__init__("serialized_restore.test", logging.INFO)
        self.messages = messages

    def handle(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _misbehave(action: str, rank: int, out_dir: Path) -> None:
    # written whole and renamed: where two ranks fault at once, the file is one of them, never both interleaved
    staged = out_dir / f"fault.{rank}.tmp"
    staged.write_text(json.dumps({"rank": rank, "at": time.time(), "action": action}))
    staged.replace(out_dir / "fault.json")
    if action.startswith("raise"):
        time.sleep(float(action.partition(":")[2] or 0))
        raise ValueError(f"bad state in turn of rank {rank}")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if action.startswith("sleep:"):
        time.sleep(float(action.split(":")[1]))
    if action == "broadcast":
        dist.broadcast(torch.zeros(4), src=0)


def _run(tmp_path: Path, world: int, scenario: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Fork ``world`` ranks, wait at most ``timeout`` seconds, kill whatever is left; return every rank's outcome.

    The ranks listed in ``scenario["silent"]`` (killed, frozen or absent on purpose) are not waited for: they are
    killed once the others have ended.
    """
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_rank_main, args=(r, world, str(tmp_path), scenario)) for r in range(world)]
    started = time.time()
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    silent = scenario.get("silent", [])
    try:
        for rank, proc in enumerate(procs):
            if rank not in silent:
                proc.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, proc in enumerate(procs) if proc.is_alive() and r not in silent]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()  # SIGKILL also ends a SIGSTOPped process
                proc.join()
    ranks = {
        r: json.loads((tmp_path / f"rank{r}.json").read_text())
        for r in range(world)
        if (tmp_path / f"rank{r}.json").exists()
    }
    fault_file = tmp_path / "fault.json"
    fault: Optional[dict[str, Any]] = json.loads(fault_file.read_text()) if fault_file.exists() else None
    exitcodes = [p.exitcode for p in procs]
    return {"ranks": ranks, "hung": hung, "silent": silent, "fault": fault, "started": started, "exitcodes": exitcodes}


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda p: (p[0], p[1]))
    current = best = 0
    for _, delta in points:
        current += delta
        best = max(best, current)
    return best


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("world", "local_world_size", "k"), [(4, 4, 1), (4, 4, 2), (4, 2, 1)])
def test_turns_never_overlap_more_than_k_per_node(tmp_path, world, local_world_size, k):
    """At most k local ranks of a node are inside a turn at once, in local-rank order, and nodes run in parallel."""
    scenario = {"local_world_size": local_world_size, "k": k, "stages": 2, "body": 0.3}
    result = _run(tmp_path, world, scenario, timeout=40)
    assert not result["hung"]
    assert sorted(result["ranks"]) == list(range(world))
    for rank, outcome in result["ranks"].items():
        assert outcome.get("ok"), (rank, outcome)
        assert [e[0] for e in outcome["events"]] == list(STAGES)
    nodes = world // local_world_size
    for stage_index in range(2):
        for node in range(nodes):
            members = range(node * local_world_size, (node + 1) * local_world_size)
            intervals = [tuple(result["ranks"][r]["events"][stage_index][1:]) for r in members]
            assert _max_overlap(intervals) == k, intervals
            # local rank r starts once local rank r - k has ended
            assert all(intervals[i + k][0] >= intervals[i][1] for i in range(len(intervals) - k)), intervals
        if nodes > 1:
            # the first turns of the two nodes overlap: nodes do not wait for each other
            first_turns = [
                tuple(result["ranks"][n * local_world_size]["events"][stage_index][1:]) for n in range(nodes)
            ]
            assert _max_overlap(first_turns) == nodes
    # a stage starts only when every rank of the job has ended the previous one
    last_end_stage1 = max(o["events"][0][2] for o in result["ranks"].values())
    first_start_stage2 = min(o["events"][1][1] for o in result["ranks"].values())
    assert first_start_stage2 >= last_end_stage1


def _assert_every_rank_raised(result: dict[str, Any], world: int, failed: list[int]) -> None:
    assert not result["hung"], result
    assert sorted(result["ranks"]) == [r for r in range(world) if r not in result["silent"]], result
    for rank, outcome in result["ranks"].items():
        assert "unexpected" not in outcome, outcome["unexpected"]
        assert outcome.get("failed_ranks") == failed, (rank, outcome)
        assert CKPT in outcome["error"]
        assert outcome["pickled"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("failing", [0, 1, 3])
def test_an_exception_in_one_turn_is_raised_on_every_rank(tmp_path, failing):
    """An exception in one rank's turn (first, middle or last) ends every rank at once with the same error type."""
    result = _run(tmp_path, 4, {"actions": {str(failing): "raise"}, "body": 0.1}, timeout=40)
    _assert_every_rank_raised(result, 4, [failing])
    for rank, outcome in result["ranks"].items():
        error = outcome["error"]
        assert f"failed on rank(s) {failing} in stage 'restore modules and callbacks'" in error
        assert f"ValueError: bad state in turn of rank {failing}" in error
        assert f"Raised on rank {failing} in `_misbehave` (" in error and "`turn`" not in error
        # one traceback per rank: on the failing rank it runs down to where the body raised, whose exception is the
        # error's (unprinted) context
        assert outcome["printed"].count("Traceback") == 1 and outcome["cause"] == "None"
        assert ("in _misbehave\n" in outcome["printed"]) == (rank == failing)
        assert outcome["context"].startswith("ValueError") if rank == failing else outcome["context"] == "None"
        assert outcome["ended"] - result["fault"]["at"] < 3.0
    # the ranks after the failing one never started their turn
    assert all(not result["ranks"][r]["events"] for r in range(failing + 1, 4))


@pytest.mark.timeout(60)
def test_exceptions_in_concurrent_turns_are_all_reported(tmp_path):
    """Two ranks failing in the same round of turns are both named, on every rank."""
    # both raise 0.5 s into their turns, which start together
    scenario = {"k": 2, "actions": {"0": "raise:0.5", "1": "raise:0.5"}}
    result = _run(tmp_path, 3, scenario, timeout=40)
    _assert_every_rank_raised(result, 3, [0, 1])
    for outcome in result["ranks"].values():
        assert "bad state in turn of rank 0" in outcome["error"] and "bad state in turn of rank 1" in outcome["error"]


@pytest.mark.timeout(60)
def test_a_rank_blocked_in_its_turn_costs_the_others_the_grace_not_a_hang(tmp_path):
    """With every turn at once, rank 1 raises while rank 2 is still inside a long turn: ranks 0 and 1 raise after
    the one-second gather grace, not waiting for rank 2, which raises the same error once its turn ends."""
    result = _run(tmp_path, 3, {"k": 3, "actions": {"1": "raise:0.5", "2": "sleep:6"}}, timeout=40)
    _assert_every_rank_raised(result, 3, [1])
    started = min(o["events"][0][1] for o in result["ranks"].values())
    for rank in (0, 1):
        assert 1.4 < result["ranks"][rank]["ended"] - started < 4.0, rank
    assert result["ranks"][2]["ended"] - started > 6.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("killed", [1, 2])
def test_a_killed_rank_is_reported_at_once_by_its_node(tmp_path, killed):
    """A rank SIGKILLed in its turn is seen gone by the ranks on its machine long before the heartbeat timeout."""
    scenario = {"actions": {str(killed): "kill"}, "silent": [killed], "heartbeat_timeout": 60.0}
    result = _run(tmp_path, 3, scenario, timeout=40)
    _assert_every_rank_raised(result, 3, [killed])
    assert result["exitcodes"][killed] == -signal.SIGKILL
    for outcome in result["ranks"].values():
        error = outcome["error"]
        assert outcome["kinds"] == ["died"]
        assert "exited while inside its turn" in error and "killed" in error
        assert HEARTBEAT_TIMEOUT_SETTING in error
        assert outcome["ended"] - result["fault"]["at"] < 3.0


@pytest.mark.timeout(60)
def test_a_silent_rank_is_reported_after_the_heartbeat_timeout(tmp_path):
    """A rank alive but frozen (SIGSTOP, like an unreachable machine) is reported once its heartbeat is silent."""
    scenario = {"actions": {"1": "stop"}, "silent": [1], "heartbeat_timeout": 2.0}
    result = _run(tmp_path, 3, scenario, timeout=40)
    _assert_every_rank_raised(result, 3, [1])
    for outcome in result["ranks"].values():
        assert outcome["kinds"] == ["unresponsive"]
        assert "stopped responding while inside its turn" in outcome["error"]
        assert f"Set {HEARTBEAT_TIMEOUT_SETTING} (seconds, now 2)" in outcome["error"]
        # heartbeat timeout + one liveness interval + one heartbeat interval, plus scheduling slack
        assert 2.0 <= outcome["ended"] - result["fault"]["at"] < 6.0


@pytest.mark.timeout(60)
def test_a_slow_turn_times_out_and_names_the_setting(tmp_path):
    """A live turn longer than the turn timeout ends every rank with an error naming the slow rank and the setting."""
    scenario = {"actions": {"0": "sleep:6"}, "turn_timeout": 1.5}
    result = _run(tmp_path, 3, scenario, timeout=40)
    _assert_every_rank_raised(result, 3, [0])
    fault = result["fault"]["at"]
    for rank, outcome in result["ranks"].items():
        error = outcome["error"]
        assert outcome["kinds"] == ["timeout"]
        assert "still inside its turn" in error and f"{TURN_TIMEOUT_SETTING} (seconds, now 1.5)" in error
        assert "slow" in error and "_misbehave" in error
        # the waiting ranks give up after the timeout; the slow rank itself when its turn ends
        assert outcome["ended"] - fault < (8.0 if rank == 0 else 4.0)


@pytest.mark.timeout(60)
def test_a_collective_in_a_turn_ends_in_the_timeout_error(tmp_path):
    """A collective inside a turn cannot complete: the timeout error says so and names it, and nothing hangs."""
    scenario = {"gloo": True, "actions": {"0": "broadcast", "1": "broadcast", "2": "broadcast"}, "turn_timeout": 2.0}
    result = _run(tmp_path, 3, scenario, timeout=40)
    assert not result["hung"]
    for outcome in result["ranks"].values():
        error = outcome.get("error", "")
        assert 0 in outcome["failed_ranks"], outcome
        assert "blocked in the collective `torch.distributed.broadcast`" in error, error
        assert "`_misbehave`" in error and "must not run collectives" in error and TURN_TIMEOUT_SETTING in error
        assert outcome["ended"] - result["fault"]["at"] < 6.0
    # the stuck rank is freed once the others have left, and reports the collective's own error as well
    assert "exception" in result["ranks"][0]["kinds"]


@pytest.mark.timeout(60)
def test_losing_the_store_host_is_reported(tmp_path):
    """When rank 0, which hosts the store, is killed in its turn, the other ranks raise at once naming rank 0."""
    result = _run(tmp_path, 3, {"actions": {"0": "kill"}, "silent": [0]}, timeout=40)
    _assert_every_rank_raised(result, 3, [0])
    for outcome in result["ranks"].values():
        assert outcome["kinds"] == ["store lost"]
        assert "lost contact with the process group's store, which is hosted by global rank 0" in outcome["error"]
        assert outcome["ended"] - result["fault"]["at"] < 3.0


@pytest.mark.timeout(60)
def test_a_rank_that_never_arrives_times_out(tmp_path):
    """A rank that never reaches the restore is named once the others have waited for the turn timeout."""
    result = _run(tmp_path, 2, {"actions": {"1": "absent"}, "silent": [1], "turn_timeout": 1.5}, timeout=40)
    assert not result["hung"] and sorted(result["ranks"]) == [0]
    outcome = result["ranks"][0]
    assert outcome["failed_ranks"] == [1] and outcome["kinds"] == ["timeout"]
    assert "has not reached the restore" in outcome["error"] and TURN_TIMEOUT_SETTING in outcome["error"]
    assert outcome["elapsed"] < 5.0


def test_turn_order_forms_k_chains():
    """With 8 local ranks and k = 3, local rank r waits for r - 3 and hands over to r + 3: the first three wait for
    nobody and the last three hand over to nobody; a single rank has neither."""

    def schedule(local_world_size: int, k: int) -> TurnSchedule:
        placement = RankPlacement(0, local_world_size, 0, 0, local_world_size)
        return TurnSchedule(store=None, placement=placement, max_concurrent=k, checkpoint_path=CKPT,
                            turn_timeout=1.0, heartbeat_timeout=1.0)  # fmt: skip

    order = schedule(8, 3)
    assert [order.predecessor(r) for r in range(8)] == [None, None, None, 0, 1, 2, 3, 4]
    assert [order.successor(r) for r in range(8)] == [3, 4, 5, 6, 7, None, None, None]
    assert schedule(1, 1).predecessor(0) is None and schedule(1, 1).successor(0) is None


def test_a_bounded_wait_ends_at_its_bound_when_the_watch_is_gone():
    """A wait of the failure exchange ends at its bound even when the rank's watch no longer runs (here, never
    started): the rank sets the key itself, instead of waiting for the connection's one-hour backstop."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    schedule = TurnSchedule(store=server, placement=RankPlacement(0, 2, 0, 0, 2), max_concurrent=1,
                            checkpoint_path=CKPT, turn_timeout=30.0, heartbeat_timeout=30.0)  # fmt: skip
    store = schedule._open(StageKeys(STAGES[0]))
    watch = Watch(schedule, store)
    started = time.monotonic()
    assert schedule._await(store, watch, store.keys.all_acked, 0.2) == "deadline"
    assert 0.2 < time.monotonic() - started < 3.0


def test_a_single_process_raises_the_original_exception():
    """Without a store (one process) nothing is coordinated: the body's exception propagates unchanged, as upstream."""
    schedule = TurnSchedule(
        store=None,
        placement=RankPlacement(0, 1, 0, 0, 1),
        max_concurrent=1,
        checkpoint_path=CKPT,
        turn_timeout=1.0,
        heartbeat_timeout=1.0,
    )
    original = KeyError("state_dict")
    with pytest.raises(KeyError) as info:
        with schedule.turn(STAGES[0]):
            raise original
    assert info.value is original and not isinstance(info.value, CheckpointRestoreError)


def test_error_merges_duplicate_reports_and_survives_pickling():
    """Several ranks reporting the same dead rank give one entry; the error pickles with its failures and its type."""
    died = [RankFailure(2, 0, 2, STAGES[0], "died", "its process exited", reported_by=r) for r in (1, 0, 3)]
    own = RankFailure(
        1, 0, 1, STAGES[0], "exception", "OSError: disk", traceback="Traceback ...", error_types=("builtins:OSError",)
    )
    err = restore_error(CKPT, [*died, own], observed_on=0)
    assert isinstance(err, CheckpointRestoreError) and isinstance(err, OSError)
    assert err.failed_ranks == [1, 2]
    assert [f.reported_by for f in err.failures] == [None, 0]
    assert ", reported by rank 0: its process exited" in str(err)
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is type(err) and str(clone) == str(err) and clone.failures == err.failures
    assert RankFailure.from_json(own.to_json()) == own


@pytest.mark.timeout(60)
def test_a_failure_wakes_blocked_ranks_at_once_and_waiting_polls_nothing(tmp_path):
    """Ranks blocked for seconds in a wait (for their turn, for the stage's end) wake as soon as a rank raises, and
    spend only a few store operations while they wait: they block on a key, they do not poll."""
    scenario = {"actions": {"1": "raise:3"}, "count_store_operations": True}
    result = _run(tmp_path, 4, scenario, timeout=40)
    _assert_every_rank_raised(result, 4, [1])
    raised_at = result["fault"]["at"] + 3.0
    for rank, outcome in result["ranks"].items():
        # well within a second of the raise, for ranks that had waited 3 s (a generous bound on a loaded machine)
        assert outcome["ended"] - raised_at < 1.0, (rank, outcome["ended"] - raised_at)
        # the whole stage: arrival, turn, 3 s of waiting, the failure exchange. Polling every 20 ms, as an earlier
        # design did, is hundreds; the monitor's re-checks are one or two a second
        assert sum(outcome["store_operations"].values()) < 40, (rank, outcome["store_operations"])


@pytest.mark.timeout(90)
def test_a_lost_wake_up_never_hangs(tmp_path):
    """If every wake-up a rank sends its successor is lost, the successor's monitor sees the predecessor's end on its
    next re-check and starts the turn: the order holds, nothing hangs."""
    scenario = {"lose_wake_ups": True, "stages": 2, "body": 0.2}
    result = _run(tmp_path, 3, scenario, timeout=60)
    assert not result["hung"] and sorted(result["ranks"]) == [0, 1, 2], result
    for rank, outcome in result["ranks"].items():
        assert outcome.get("ok"), (rank, outcome)
    for stage_index in range(2):
        intervals = [result["ranks"][r]["events"][stage_index][1:] for r in range(3)]
        for before, after in zip(intervals, intervals[1:]):
            # in order, and caught by the re-check (1 s) rather than by any timeout (30 s here)
            assert before[1] <= after[0] < before[1] + 5.0, intervals


@pytest.mark.timeout(60)
def test_waiting_writes_nothing_to_stderr(tmp_path):
    """Seconds of waiting (many slices of the monitor's re-checks) write no c10d warning to stderr: no wait ends by
    its timeout."""
    scenario = {"actions": {"0": "sleep:4"}, "capture_stderr": True, "stages": 2}
    result = _run(tmp_path, 3, scenario, timeout=40)
    assert not result["hung"] and sorted(result["ranks"]) == [0, 1, 2], result
    for rank, outcome in result["ranks"].items():
        assert outcome.get("ok"), (rank, outcome)
        text = (tmp_path / f"stderr{rank}.txt").read_text()
        assert "c10d" not in text and "timed out" not in text and "timeout" not in text, (rank, text)


@pytest.mark.timeout(60)
def test_a_signal_reaches_a_rank_blocked_in_a_wait(tmp_path):
    """Ctrl-C (SIGINT) interrupts a rank blocked in a store wait at once, not when the store answers; the rank it
    leaves behind reports it gone."""
    scenario = {"actions": {"0": "sleep:8"}, "interrupt": {"1": 1.5}, "silent": [], "heartbeat_timeout": 30.0}
    result = _run(tmp_path, 2, scenario, timeout=40)
    assert not result["hung"] and sorted(result["ranks"]) == [0, 1], result
    interrupted = result["ranks"][1]
    assert "unexpected" not in interrupted, interrupted["unexpected"]
    assert "interrupted" in interrupted, interrupted
    # within a few seconds of the signal (its turn was 6.5 s away)
    assert interrupted["interrupted"] - interrupted["interrupt_sent"] < 2.0, interrupted
    assert not interrupted["events"]
    survivor = result["ranks"][0]
    assert survivor["failed_ranks"] == [1] and survivor["kinds"] == ["died"], survivor


@pytest.mark.timeout(60)
def test_each_node_takes_its_local_rank_zeros_decision(tmp_path):
    """``on_one_rank(..., per_node=True)`` (what "auto" plans with): every rank of a node gets the value its local rank
    0 computed."""
    result = _run(tmp_path, 4, {"local_world_size": 2, "decide": {}}, timeout=40)
    assert not result["hung"] and sorted(result["ranks"]) == [0, 1, 2, 3], result
    for rank, outcome in result["ranks"].items():
        assert outcome.get("ok"), (rank, outcome)
        assert outcome["decision"] == {"decided_by": rank - rank % 2}, rank


@pytest.mark.timeout(60)
def test_a_local_rank_zero_killed_before_its_decision_ends_every_wait(tmp_path):
    """Local rank 0 of node 1 dies while it decides: its node sees the process gone, the job hears of it, and every
    rank raises within seconds naming it, instead of waiting for a decision until the turn timeout (30 s here)."""
    scenario = {"local_world_size": 2, "decide": {"2": "kill"}, "silent": [2], "turn_timeout": 30.0}
    result = _run(tmp_path, 4, scenario, timeout=40)
    _assert_every_rank_raised(result, 4, [2])
    for rank, outcome in result["ranks"].items():
        assert outcome["kinds"] == ["died"], (rank, outcome["kinds"])
        assert "plan restore" in outcome["error"], rank
        assert outcome["ended"] - result["fault"]["at"] < 5.0, (rank, outcome["ended"] - result["fault"]["at"])


@pytest.mark.timeout(60)
def test_the_node_summary_says_what_was_mapped_and_copied_and_whose_memory(tmp_path):
    """Local rank 0's summary of a stage says how many ranks mapped the file and its size (shared pages, not
    summed), what was copied out of the mapping in all, and that the private memory is a rank's whole process's,
    with what its turn added; the other ranks log no summary."""
    result = _run(tmp_path, 3, {"mapped": 1024 * 1024}, timeout=40)
    summaries = {r: [m for m in o["log"] if "serialized restore: node" in m] for r, o in result["ranks"].items()}
    assert summaries[1] == summaries[2] == [], summaries
    (summary,) = summaries[0]
    assert "ran 3 turns of 'restore modules and callbacks' (at most 1 at once)" in summary, summary
    assert "3 rank(s) mapped the file (1.0 MiB, pages shared in the page cache)" in summary, summary
    assert "copied 6 B out of the mapping" in summary and "moving" not in summary, summary
    assert "a rank's process held at most " in summary and "of which its turn added at most " in summary, summary
