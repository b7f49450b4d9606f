"""``_store``: the store view, its namespaces and the failure records of a stage, over a real ``TCPStore``."""

from __future__ import annotations

import datetime
import subprocess
import sys

import pytest
import torch.distributed as dist

from serialized_restore import RankFailure
from serialized_restore._store import StageKeys, StageStore, StoreLost, StoreTimeout, StoreView, open_namespace

STAGE = "restore modules and callbacks"


def _server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)


def _stage(server: dist.TCPStore, rank: int = 0, world: int = 2) -> StageStore:
    main, side = open_namespace(server, rank, 30.0)
    keys = StageKeys(STAGE)
    return StageStore(keys, main, side, [keys.wake(0, r) for r in range(world)])


def test_each_schedule_of_a_rank_gets_its_own_namespace_on_two_connections():
    """The n-th schedule of each rank meets the n-th of every other rank under ``serialized_restore/<n>/``; the main
    connection is a clone, not the job's store itself; a key set on one connection is read on the other."""
    server = _server()
    first, second = open_namespace(server, 0, 30.0), open_namespace(server, 0, 30.0)
    other_rank = open_namespace(server, 1, 30.0)
    first[0].set("k", "one")
    second[0].set("k", "two")
    assert other_rank[1].get("k") == "one" and first[1].get("k") == "one"
    assert second[1].get("k") == "two"
    assert first[0].raw is not first[1].raw


def test_get_if_set_never_blocks_and_a_backstop_timeout_is_not_a_lost_store():
    """``get_if_set`` answers ``None`` for an unset key at once; a blocking ``get`` that reaches the connection's
    timeout raises ``StoreTimeout``, a ``StoreLost`` that says the store itself may be fine."""
    server = _server()
    main, _ = open_namespace(server, 0, 0.2)
    assert main.get_if_set("nothing") is None
    with pytest.raises(StoreTimeout):
        main.get("nothing")


@pytest.mark.timeout(60)
def test_a_store_whose_host_is_gone_raises_store_lost():
    """Once the process hosting the store is killed, every operation on a connection to it raises ``StoreLost``."""
    host = subprocess.Popen(
        [sys.executable, "-c", "import datetime, sys, time, torch.distributed as d;"
         "s = d.TCPStore('127.0.0.1', 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False);"
         "print(s.port, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        view = StoreView(dist.TCPStore("127.0.0.1", port, 1, False, timeout=datetime.timedelta(seconds=5)))
        view.set("k", "v")
    finally:
        host.kill()
        host.wait()
    with pytest.raises(StoreLost):
        view.add("k2", 1)


def test_the_first_post_closes_the_stage_as_failed_and_wakes_everyone():
    """Posting a failure appends its record, closes the stage as ``failed`` and sets every rank's wake-up key; a
    second post adds its record to the same stage."""
    store = _stage(_server())
    first = RankFailure(1, 0, 1, STAGE, "exception", "ValueError: x")
    second = RankFailure(0, 0, 0, STAGE, "died", "gone", reported_by=1)
    store.post([first], store.side)
    assert store.main.get(store.keys.closed) == "failed"
    store.post([second], store.main)
    assert store.main.get(store.keys.closed) == "failed"
    assert store.reports(store.main) == [first, second]
    assert [store.main.get(k) for k in store.wake_keys] == ["failed", "failed"]
    # a rank gone is acknowledged (and counted as read) on its behalf, once however many ranks report it
    store.post([second], store.side)
    assert store.main.add(store.keys.acked, 0) == store.main.add(store.keys.reads, 0) == 1


def test_the_ranks_that_acknowledged_and_read_say_so_once_all_have():
    """The acknowledgement that completes the job's count sets ``all_acked`` to the reports, which the ranks read
    from it; ``all_read`` is set by the read that catches up with every acknowledgement: the whole job's, or those so
    far when the wait was set free at its bound."""
    store = _stage(_server())
    failure = RankFailure(1, 0, 1, STAGE, "exception", "ValueError: x")
    store.post([failure], store.side)
    assert store.acknowledge(store.main, 1)
    assert store.main.get_if_set(store.keys.all_acked) is None
    assert store.reports(store.main, "deadline") == [failure]  # set free at the bound: from the key
    store.read_done(store.main, "deadline")  # 1 read of 1 acknowledgement
    assert store.main.get_if_set(store.keys.all_read) == "1"
    other = _stage(_server())
    other.post([failure], other.side)
    assert other.acknowledge(other.main, 1) and other.acknowledge(other.side, 0)
    all_acked = other.main.get(other.keys.all_acked)
    other.main.set(other.keys.reports, "")  # what the ranks read is all_acked's copy
    assert other.reports(other.main, all_acked) == [failure]
    other.read_done(other.main, all_acked)  # 1 read of the whole job's 2
    assert other.main.get_if_set(other.keys.all_read) is None
    other.read_done(other.side, all_acked)
    assert other.main.get_if_set(other.keys.all_read) == "1"


def test_a_rank_reported_gone_that_comes_back_is_counted_once():
    """A rank acknowledged on its behalf (reported unresponsive) that comes back is not counted again: the job's
    count still waits for the rank that has not acknowledged."""
    store = _stage(_server(), world=3)
    store.post([RankFailure(1, 0, 1, STAGE, "unresponsive", "silent", reported_by=0)], store.side)
    assert not store.acknowledge(store.main, 1)  # it came back: acknowledged already, on its behalf
    assert store.acknowledge(store.main, 0)
    assert store.main.get_if_set(store.keys.all_acked) is None  # rank 2 has not acknowledged
    assert store.acknowledge(store.main, 2)
    assert store.main.get(store.keys.all_acked).startswith("reports\n")


def test_a_failure_after_the_stage_ended_changes_nothing():
    """A post after every rank ended the stage leaves it ``ended`` and wakes nobody."""
    store = _stage(_server())
    store.main.compare_set(store.keys.closed, "", "ended")
    store.post([RankFailure(1, 0, 1, STAGE, "died", "gone", reported_by=0)], store.side)
    assert store.main.get(store.keys.closed) == "ended"
    assert all(store.main.get_if_set(k) is None for k in store.wake_keys)


def test_records_that_are_not_ours_are_named_as_such_and_never_evaluated():
    """A line in the reports that is not a record this package wrote becomes a ``malformed report`` failure of no
    rank (-1), quoting the line, next to the sound records."""
    store = _stage(_server())
    good = RankFailure(1, 0, 1, STAGE, "exception", "ValueError: x")
    store.main.append(store.keys.reports, good.to_json() + "\n\n{not json\n")
    parsed = store.reports(store.side)
    assert parsed[0] == good
    assert parsed[1].kind == "malformed report" and parsed[1].global_rank == -1 and "{not json" in parsed[1].message
