"""The turn schedule on its own: real processes, a real ``TCPStore`` (gloo where a collective is needed), no Lightning.

Every test forks one process per rank, gives each rank a ``TurnSchedule`` over the same store and lets each rank write
what it ended with (its turns' timestamps, or the error it raised) to ``rank<r>.json``. A rank that misbehaves on
purpose first writes ``fault.json`` with the time it did so.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from serialized_restore import CheckpointRestoreError
from serialized_restore._coordination.placement import RankPlacement
from serialized_restore._coordination.store import RestoreKeys
from serialized_restore._coordination.turns import TurnSchedule, predecessor
from serialized_restore.settings import TURN_TIMEOUT_SETTING
from tests.helpers.checks import max_concurrent
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


def _rank_main(rank: int, world: int, out: str, scenario: dict[str, Any]) -> None:
    """(one forked rank) take part in the stages of ``scenario`` and write the outcome; never returns."""
    out_dir = Path(out)
    outcome: dict[str, Any] = {"events": []}
    started = time.time()
    # what a new Python process starts with: the fork inherits whatever an earlier test in this pytest process left
    # (Lightning's `_destroy_dist_connection` leaves SIGINT at SIG_DFL, or SIG_IGN if destroying the group raised)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if scenario.get("capture_stderr") or rank in scenario.get("silent", []):
        # the file descriptor itself: c10d writes its warnings from C++, past Python's sys.stderr
        fd = os.open(str(out_dir / f"stderr{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 2)
        sys.stderr = os.fdopen(2, "w", buffering=1)  # where faulthandler writes a stuck rank's stack
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
                (out_dir / f"interrupt{rank}.txt").write_text(str(time.time()))
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
            checkpoint_path=CKPT,
            turn_timeout=scenario.get("turn_timeout", 30.0),
            logger=_ListLogger(outcome.setdefault("log", [])),
        )
        action = scenario.get("actions", {}).get(str(rank))
        if action == "absent":
            time.sleep(60)
        decide = scenario.get("decide")
        if decide is not None:
            # as a remote checkpoint is fetched: local rank 0 of each node decides, its node's ranks take its value
            def _decision() -> str:
                if str(rank) in decide:
                    _misbehave(decide[str(rank)], rank, out_dir)
                return json.dumps({"decided_by": rank})

            value = schedule.on_one_rank(
                "plan restore", _decision, central=rank % lws == 0, per_node=True, doing=scenario.get("doing")
            )
            outcome["decision"] = json.loads(value or "null")
        for stage in STAGES[: scenario.get("stages", 1)]:
            with schedule.turn(stage, k=scenario.get("k", 1)) as record:
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
            types=[c.__name__ for c in type(err).__mro__],
            cause=repr(err.__cause__),
            context=repr(err.__context__),
            printed="".join(traceback.format_exception(type(err), err, err.__traceback__)),
            pickled=str(pickle.loads(pickle.dumps(err))) == str(err),
        )
    except ValueError as err:  # a rank's own exception, raised as it is
        outcome["own"] = f"{type(err).__name__}: {err}"
    except BaseException as err:
        outcome["unexpected"] = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    outcome["ended"] = time.time()
    outcome["threads"] = [t.name for t in threading.enumerate() if t.name.startswith("serialized-restore")]
    outcome["elapsed"] = outcome["ended"] - started
    outcome["store_operations"] = counts
    (out_dir / f"rank{rank}.json").write_text(json.dumps(outcome))
    if rank == 0:
        # the store lives in this process: stay until the others are done with it
        others = [r for r in range(1, world) if r not in scenario.get("silent", [])]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all((out_dir / f"rank{r}.json").exists() for r in others):
            time.sleep(0.05)
        if scenario.get("count_reads"):
            # how many ranks said they read the first stage's verdict
            reads = store.add(RestoreKeys("").stage(STAGES[0]).reads, 0)
            (out_dir / "reads.txt").write_text(str(reads))
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
            assert max_concurrent(intervals) == k, intervals
            # local rank r starts once local rank r - k has ended
            assert all(intervals[i + k][0] >= intervals[i][1] for i in range(len(intervals) - k)), intervals
        if nodes > 1:
            # the first turns of the two nodes overlap: nodes do not wait for each other
            first_turns = [
                tuple(result["ranks"][n * local_world_size]["events"][stage_index][1:]) for n in range(nodes)
            ]
            assert max_concurrent(first_turns) == nodes
    # a stage starts only when every rank of the job has ended the previous one
    last_end_stage1 = max(o["events"][0][2] for o in result["ranks"].values())
    first_start_stage2 = min(o["events"][1][1] for o in result["ranks"].values())
    assert first_start_stage2 >= last_end_stage1


def _assert_every_rank_raised(result: dict[str, Any], world: int, failed: list[int], own: tuple[int, ...] = ()) -> None:
    """Every rank but the silent ones ended; ``own`` ranks raised their own ``ValueError``, every other rank a
    ``CheckpointRestoreError`` naming ``failed``."""
    assert not result["hung"], result
    assert sorted(result["ranks"]) == [r for r in range(world) if r not in result["silent"]], result
    for rank, outcome in result["ranks"].items():
        assert "unexpected" not in outcome, outcome["unexpected"]
        if rank in own:
            assert outcome["own"] == f"ValueError: bad state in turn of rank {rank}", (rank, outcome)
            continue
        assert outcome.get("failed_ranks") == failed, (rank, outcome)
        assert CKPT in outcome["error"] and STAGES[0] in outcome["error"], (rank, outcome["error"])
        assert outcome["pickled"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("failing", [0, 1, 3])
def test_an_exception_in_one_turn_is_raised_on_every_rank(tmp_path, failing):
    """The failing rank raises its own exception unchanged; every other rank, waiting for its turn or for the stage's
    end, raises at once naming the failing rank, the stage and the error text, as an instance of its type: woken by
    the failure, long before any turn timeout (30 s) would have named anyone."""
    scenario = {"actions": {str(failing): "raise"}, "body": 0.2, "turn_timeout": 30.0}
    result = _run(tmp_path, 4, scenario, timeout=40)
    _assert_every_rank_raised(result, 4, [failing], own=(failing,))
    for rank, outcome in result["ranks"].items():
        if rank != failing:
            assert f"ValueError: bad state in turn of rank {failing}" in outcome["error"], outcome["error"]
            assert outcome["kinds"] == ["exception"] and "ValueError" in outcome["types"], outcome
            # at once: no wait timed out (the first would end at 30 s); the margin is a loaded machine's
            assert outcome["ended"] - result["fault"]["at"] < 10.0, (rank, outcome["ended"] - result["fault"]["at"])


@pytest.mark.timeout(60)
def test_exceptions_in_concurrent_turns_each_raise_their_own(tmp_path):
    """Two ranks failing at once (k = 2): each raises its own exception; the others name the one that failed first."""
    scenario = {"k": 2, "actions": {"0": "raise:0.3", "1": "raise:0.3"}}
    result = _run(tmp_path, 4, scenario, timeout=40)
    named = {tuple(o["failed_ranks"]) for r, o in result["ranks"].items() if r > 1}
    assert len(named) == 1 and named <= {(0,), (1,)}, result["ranks"]
    _assert_every_rank_raised(result, 4, list(named.pop()), own=(0, 1))


def _assert_timed_out(result: dict[str, Any], world: int, stuck: int, timeout: float) -> None:
    _assert_every_rank_raised(result, world, [stuck])
    for rank, outcome in result["ranks"].items():
        error = outcome["error"]
        assert outcome["kinds"] == ["timeout"], (rank, outcome["kinds"])
        assert f"rank(s) {stuck} " in error and TURN_TIMEOUT_SETTING in error, error
        assert "slow file system" in error and "on_load_checkpoint" in error and "load_state_dict" in error, error
        late = outcome["ended"] - result["fault"]["at"]
        # named by the rank timing it, at the turn timeout (its timer starts when the stuck turn could start, before the
        # stuck rank wrote fault.json: seconds before, on a loaded machine); a backstop would end at twice the timeout
        assert timeout - 2.0 < late < 2 * timeout - 0.5, (rank, late)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("stuck", "action"), [(1, "stop"), (3, "stop"), (2, "kill")])
def test_a_rank_that_stops_in_its_turn_is_named_at_the_turn_timeout(tmp_path, stuck, action):
    """A rank stopped (SIGSTOP) or killed inside its turn, in the middle of the chain or as its last turn (timed by its
    predecessor): every other rank raises at the turn timeout, naming it, the stage and the two likely causes."""
    scenario = {"actions": {str(stuck): action}, "silent": [stuck], "turn_timeout": 5.0}
    result = _run(tmp_path, 4, scenario, timeout=40)
    _assert_timed_out(result, 4, stuck, 5.0)


@pytest.mark.timeout(60)
def test_a_slow_rank_named_as_timed_out_is_counted_as_having_read_the_verdict_once(tmp_path):
    """A rank whose turn outlasts the turn timeout (and then ends) is counted once among the ranks that read the
    verdict, by the rank that named it: a second count would let rank 0, the store's host, stop waiting for the
    readers before every one has read it."""
    scenario = {"actions": {"1": "sleep:4"}, "turn_timeout": 2.0, "count_reads": True}
    result = _run(tmp_path, 3, scenario, timeout=40)
    _assert_every_rank_raised(result, 3, [1])
    assert (tmp_path / "reads.txt").read_text() == "2"  # ranks 1 and 2; rank 0 hosts the store and waits


@pytest.mark.timeout(60)
def test_a_collective_in_a_turn_is_named_and_the_stuck_rank_prints_its_stack(tmp_path):
    """A turn that calls a collective cannot complete while the others wait for their turns: they raise at the turn
    timeout naming the rank and the causes, and the stuck rank prints its stack, with the collective, at that time."""
    scenario = {"gloo": True, "actions": {"1": "broadcast"}, "silent": [1], "turn_timeout": 5.0}
    result = _run(tmp_path, 3, scenario, timeout=40)
    _assert_timed_out(result, 3, 1, 5.0)
    stack = (tmp_path / "stderr1.txt").read_text()
    assert "turn still running after 5s (turn timeout)" in stack, stack
    assert "in broadcast" in stack and "_misbehave" in stack, stack


@pytest.mark.timeout(60)
def test_a_rank_that_never_arrives_times_out(tmp_path):
    """A first rank of a chain that never reaches the restore: its successor names it at the turn timeout."""
    scenario = {"actions": {"0": "absent"}, "silent": [0], "turn_timeout": 2.0}
    result = _run(tmp_path, 3, scenario, timeout=40)
    assert not result["hung"], result
    for rank in (1, 2):
        outcome = result["ranks"][rank]
        assert outcome["failed_ranks"] == [0] and outcome["kinds"] == ["timeout"], outcome
        assert 1.5 < outcome["elapsed"] < 8, outcome["elapsed"]


@pytest.mark.timeout(60)
def test_losing_the_store_host_is_reported_at_once(tmp_path):
    """Rank 0, which hosts the store, killed in its turn: every rank raises at once, naming rank 0 as the store's
    host, instead of waiting for the turn timeout (30 s here)."""
    scenario = {"actions": {"0": "kill"}, "silent": [0], "body": 0.2}
    result = _run(tmp_path, 3, scenario, timeout=40)
    _assert_every_rank_raised(result, 3, [0])
    for rank, outcome in result["ranks"].items():
        assert outcome["kinds"] == ["store lost"] and "hosted by global rank 0" in outcome["error"], outcome
        # at once: the store's loss is seen when a call fails, not at a timeout (30 s)
        assert outcome["ended"] - result["fault"]["at"] < 10.0, (rank, outcome["ended"] - result["fault"]["at"])


def test_turn_order_forms_k_chains():
    """Local rank r waits for r - k (the rank whose end the protocol waits for); with k >= the local ranks, nobody
    waits."""
    for lws, k, waits in [(4, 1, [None, 0, 1, 2]), (5, 2, [None, None, 0, 1, 2]), (3, 5, [None, None, None])]:
        assert [predecessor(r, k) for r in range(lws)] == waits


def test_a_single_process_raises_the_original_exception():
    """Without a store (one process), a turn is the body itself: its exception is raised as it is."""
    schedule = TurnSchedule(store=None, placement=RankPlacement(0, 1, 0, 0, 1), checkpoint_path=CKPT, turn_timeout=1.0)
    with pytest.raises(KeyError, match="missing"), schedule.turn(STAGES[0]):
        raise KeyError("missing")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("world", "local_world_size", "k"), [(4, 4, 1), (8, 4, 1), (8, 4, 2)])
def test_store_operations_per_rank_are_at_most_six_and_nobody_polls(tmp_path, world, local_world_size, k):
    """In a stage without failure, no rank makes more than 6 store operations, whatever it waits for and however
    long; every wait is one blocking get."""
    scenario = {"count_store_operations": True, "local_world_size": local_world_size, "k": k, "body": 0.3}
    result = _run(tmp_path, world, scenario, timeout=40)
    assert not result["hung"] and sorted(result["ranks"]) == list(range(world)), result
    for rank, outcome in result["ranks"].items():
        assert outcome.get("ok"), (rank, outcome)
        counts = outcome["store_operations"]
        assert sum(counts.values()) <= 6, (rank, counts)
        assert set(counts) <= {"get", "add", "set", "compare_set"}, (rank, counts)


@pytest.mark.timeout(60)
def test_a_failure_costs_each_waiting_rank_a_few_operations(tmp_path):
    """A failure wakes every waiting rank of the job in one multi_set by the failing rank; each waiting rank then
    reads the verdict and says it read it: no rank reads every rank's keys."""
    scenario = {"count_store_operations": True, "local_world_size": 2, "actions": {"1": "raise"}}
    result = _run(tmp_path, 6, scenario, timeout=40)
    _assert_every_rank_raised(result, 6, [1], own=(1,))
    for rank, outcome in result["ranks"].items():
        counts = outcome["store_operations"]
        assert sum(counts.values()) <= 6 and "check" not in counts and "multi_get" not in counts, (rank, counts)
    assert result["ranks"][1]["store_operations"].get("multi_set") == 1


@pytest.mark.timeout(60)
def test_waiting_writes_nothing_to_stderr(tmp_path):
    """Seconds of waiting for a turn and for the stage's end write no c10d warning to stderr: no wait times out."""
    scenario = {"actions": {"0": "sleep:3"}, "capture_stderr": True, "stages": 2}
    result = _run(tmp_path, 3, scenario, timeout=40)
    assert not result["hung"] and sorted(result["ranks"]) == [0, 1, 2], result
    for rank, outcome in result["ranks"].items():
        assert outcome.get("ok"), (rank, outcome)
        text = (tmp_path / f"stderr{rank}.txt").read_text()
        assert "c10d" not in text and "timeout" not in text.lower(), (rank, text)


@pytest.mark.timeout(60)
def test_ctrl_c_ends_a_waiting_rank_at_once(tmp_path):
    """SIGINT to a rank blocked waiting for its turn raises ``KeyboardInterrupt`` there at once (its turn was seconds
    away), not when its wait returns, through the process's own SIGINT handler; the rank posts it, so that the others
    name it at once too, and leaves no call to the store running behind it."""
    scenario = {"actions": {"0": "sleep:12"}, "interrupt": {"1": 1.0}, "turn_timeout": 30.0}
    result = _run(tmp_path, 3, scenario, timeout=40)
    sent = float((tmp_path / "interrupt1.txt").read_text())
    interrupted = result["ranks"][1]
    assert "KeyboardInterrupt" in interrupted["unexpected"], interrupted
    # at once: its wait would have returned 11 s after the signal; the margin is a loaded machine's
    assert interrupted["ended"] - sent < 6.0, interrupted["ended"] - sent
    assert interrupted["threads"] == [], interrupted["threads"]
    for rank in (0, 2):
        outcome = result["ranks"][rank]
        assert outcome["failed_ranks"] == [1] and outcome["kinds"] == ["exception"], (rank, outcome)
        assert "KeyboardInterrupt" in outcome["error"], outcome["error"]
    assert result["ranks"][2]["ended"] - sent < 6.0, result["ranks"][2]["ended"] - sent


@pytest.mark.timeout(60)
def test_each_node_takes_its_local_rank_zeros_decision(tmp_path):
    """``on_one_rank(..., per_node=True)`` (how a remote checkpoint's per-node fetch is decided): every rank of a node
    gets the value its local rank 0 computed."""
    result = _run(tmp_path, 4, {"local_world_size": 2, "decide": {}}, timeout=40)
    assert not result["hung"] and sorted(result["ranks"]) == [0, 1, 2, 3], result
    for rank, outcome in result["ranks"].items():
        assert outcome.get("ok"), (rank, outcome)
        assert outcome["decision"] == {"decided_by": rank - rank % 2}, rank


@pytest.mark.timeout(60)
def test_a_rank_killed_in_a_stage_of_all_at_once_ends_every_wait_at_the_turn_timeout(tmp_path):
    """Local rank 0 of node 1 dies while it decides, in a stage all ranks run at once (no turn follows it): every
    other rank raises at the turn timeout, not later, naming it: its node's other rank finds it never said it ended."""
    scenario = {"local_world_size": 2, "decide": {"2": "kill"}, "silent": [2], "turn_timeout": 4.0}
    result = _run(tmp_path, 4, scenario, timeout=40)
    assert not result["hung"], result
    for rank, outcome in result["ranks"].items():
        assert outcome["kinds"] == ["timeout"] and "plan restore" in outcome["error"], (rank, outcome)
        assert outcome["failed_ranks"] == [2] and "did not end its turn" in outcome["error"], outcome["error"]
        # at the turn timeout; a second wait (another timeout) would end at twice it
        assert 2.0 < outcome["ended"] - result["fault"]["at"] < 8.0, (rank, outcome["ended"] - result["fault"]["at"])


@pytest.mark.timeout(60)
def test_a_stage_slow_at_what_it_does_is_named_by_it(tmp_path):
    """A stage that says what it does (as the remote checkpoint's download does): local rank 0 is still at it when the
    turn timeout passes; both ranks raise naming it, with what it did not finish."""
    scenario = {"local_world_size": 2, "decide": {"0": "sleep:5"}, "turn_timeout": 2.0, "doing": "downloading it"}
    result = _run(tmp_path, 2, scenario, timeout=40)
    assert not result["hung"] and sorted(result["ranks"]) == [0, 1], result
    for rank, outcome in result["ranks"].items():
        assert outcome["kinds"] == ["timeout"] and outcome["failed_ranks"] == [0], (rank, outcome)
        assert "did not finish downloading it within the turn timeout" in outcome["error"], outcome["error"]


@pytest.mark.timeout(60)
def test_a_turn_logs_what_it_mapped_and_copied_and_its_memory(tmp_path):
    """Each rank's end line says what its turn read through the mapping and copied out of it, and its process's
    private memory; nobody logs for another rank."""
    result = _run(tmp_path, 3, {"mapped": 1024 * 1024}, timeout=40)
    for rank, outcome in result["ranks"].items():
        (end,) = [m for m in outcome["log"] if "ended in" in m]
        assert end.startswith(f"[rank {rank}] serialized restore: turn for 'restore modules and callbacks'"), end
        assert f"read 1.0 MiB memory-mapped, copied {rank + 1} B out of the mapped file" in end, end
        assert "of private memory" in end and "more than before its turn" in end, end
