"""``_exchange``: how a failed stage ends on every rank. Real forked processes, a real ``TCPStore``, no Lightning.

Each rank opens the stage's store and its watch as a turn would, and calls ``Exchange.abort`` directly: rank 1 with
its own failure, the others once they see the stage closed as failed (rank 2, in one case, never does: a rank
blocked inside its turn).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

from serialized_restore import RankFailure
from serialized_restore._exchange import Exchange
from serialized_restore._liveness import Watch
from serialized_restore._store import StageKeys, StageStore, open_namespace
from tests.helpers.store import connect, one_node_schedule

CKPT = "/checkpoints/epoch=3.ckpt"
STAGE = "restore modules and callbacks"
WORLD = 3


def _rank_main(rank: int, out: str, absent: list[int]) -> None:
    """(one forked rank) abort the stage as its scenario says and write the outcome; never returns."""
    out_dir = Path(out)
    outcome: dict[str, Any] = {}
    try:
        store = connect(rank, WORLD, out_dir)
        schedule = one_node_schedule(store, rank, WORLD, CKPT)
        main, side = open_namespace(store, rank, 30.0)
        keys = StageKeys(STAGE)
        stage = StageStore(keys, main, side, [keys.wake(0, r) for r in range(WORLD)])
        watch = Watch(schedule, stage)
        schedule.host.start(watch)
        if rank in absent:
            time.sleep(30)  # blocked in its turn: never acknowledges
        if rank == 1:
            time.sleep(0.5)
            outcome["failed_at"] = time.time()
            own = RankFailure(1, 0, 1, STAGE, "exception", "ValueError: bad", error_types=("builtins:ValueError",))
            err = Exchange(schedule, stage, watch).abort([own])
        else:
            assert main.get(keys.wake(0, rank)) == "failed"  # woken by the post
            err = Exchange(schedule, stage, watch).abort([])
        schedule.host.stop(watch)
        outcome.update(
            type=type(err).__name__, failed_ranks=err.failed_ranks, error=str(err), value=isinstance(err, ValueError)
        )
    except BaseException:
        outcome["unexpected"] = traceback.format_exc()
    outcome["ended"] = time.time()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(outcome))
    if rank == 0:
        deadline = time.monotonic() + 20  # the store lives here: stay until the others are done with it
        others = [r for r in range(1, WORLD) if r not in absent]
        while time.monotonic() < deadline and not all((out_dir / f"rank{r}.json").exists() for r in others):
            time.sleep(0.05)
    os._exit(0)


def _run(tmp_path: Path, absent: list[int]) -> dict[int, dict[str, Any]]:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_rank_main, args=(r, str(tmp_path), absent)) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 40
    try:
        for rank, proc in enumerate(procs):
            if rank not in absent:
                proc.join(max(0.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD) if r not in absent}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("absent", [[], [2]], ids=["every rank acknowledges", "a rank blocked in its turn"])
def test_every_rank_raises_the_posted_failure_within_the_grace(tmp_path: Path, absent: list[int]) -> None:
    """Every rank that takes part ends with one error naming the failing rank, of its type, soon after the failure:
    at once when every rank acknowledges, after the one-second gather grace when a rank never does."""
    ranks = _run(tmp_path, absent)
    failed_at = ranks[1]["failed_at"]
    bound = 1.0 if not absent else 1.0 + 2.5
    for rank, outcome in ranks.items():
        assert "unexpected" not in outcome, outcome["unexpected"]
        assert outcome["failed_ranks"] == [1] and outcome["value"], (rank, outcome)
        assert (
            "rank 1 (node 0, local rank 1), stage 'restore modules and callbacks': ValueError: bad" in outcome["error"]
        )
        assert outcome["ended"] - failed_at < bound, (rank, outcome["ended"] - failed_at)
    if absent:
        assert max(o["ended"] for o in ranks.values()) - failed_at > 0.9  # the grace was waited for
