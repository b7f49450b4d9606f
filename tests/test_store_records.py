"""Records in the job's store that serialized_restore did not write: real processes, a real ``TCPStore``, no Lightning.

Any process that can reach the job's ``TCPStore`` can write to it (torch does not authenticate its clients). Here three
ranks take turns with ``TurnSchedule`` while a fourth process, a plain store client that is no rank, decides the stage
with a record of its own and wakes every rank, as a rank that failed would. Every rank must
raise one clear ``CheckpointRestoreError`` saying that a record could not be read, none may hang or crash, and the
record must never be unpickled or evaluated.

This file relies only on ``TurnSchedule``'s public API and on the layout of the store keys the schedule uses
(``RestoreKeys``: its implementation is free to change otherwise): a restore's keys live under
``serialized_restore/<namespace>/`` (``0`` here), a stage's keys under ``<stage with '_' for ' '>/``,
and a failure is decided by ``compare_set(verdict, "", "failed\n" + record)``, copied to ``closed`` and announced by
setting every rank's ``wake/<node>/<local rank>`` key to ``failed``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

from serialized_restore import CheckpointRestoreError
from serialized_restore._coordination.store import RestoreKeys
from tests.helpers.store import connect, one_node_schedule

CKPT = "/checkpoints/epoch=3.ckpt"
STAGE = "restore modules and callbacks"
KEYS = RestoreKeys("0").stage(STAGE)
WORLD = 3


class _Payload:
    """Unpickling this creates ``marker``: the proof that a record was unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.mkdir, (self.marker,))


def _rank_main(rank: int, out: str) -> None:
    """(one forked rank) take its turn of the stage (1 s long) and write the outcome; never returns."""
    out_dir = Path(out)
    outcome: dict[str, Any] = {}
    try:
        store = connect(rank, WORLD, out_dir)
        schedule = one_node_schedule(store, rank, WORLD, CKPT)
        with schedule.turn(STAGE):
            time.sleep(1.0)
        outcome["ok"] = True
    except CheckpointRestoreError as err:
        outcome.update(
            type=type(err).__name__,
            error=str(err),
            kinds=[f.kind for f in err.failures],
            failed_ranks=err.failed_ranks,
        )
    except BaseException as err:
        outcome["unexpected"] = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    outcome["ended"] = time.time()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(outcome))
    if rank == 0:
        # the store lives in this process: stay until the others are done with it
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all((out_dir / f"rank{r}.json").exists() for r in range(WORLD)):
            time.sleep(0.05)
    os._exit(0)


def _intruder_main(out: str, record: bytes) -> None:
    """(a store client that is no rank) during rank 0's turn (1 s), post ``record`` as a failure."""
    out_dir = Path(out)
    try:
        store = connect(1, WORLD, out_dir)  # a client, like any rank but 0
        time.sleep(0.5)
        # as a rank posting a failure: the verdict decided, copied to the key ranks wait on, every waiter woken
        verdict = store.compare_set(KEYS.verdict, "", b"failed\n" + record)
        store.set(KEYS.closed, verdict)
        wake = [KEYS.wake(0, local) for local in range(WORLD + 1)]
        store.multi_set(wake, ["failed"] * len(wake))
        (out_dir / "fault.json").write_text(json.dumps({"at": time.time()}))
    except BaseException:
        (out_dir / "fault.json").write_text(json.dumps({"unexpected": traceback.format_exc()}))
    os._exit(0)


def _run(tmp_path: Path, record: bytes, timeout: float = 40.0) -> dict[str, Any]:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_rank_main, args=(r, str(tmp_path))) for r in range(WORLD)]
    procs.append(ctx.Process(target=_intruder_main, args=(str(tmp_path), record)))
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, proc in enumerate(procs) if proc.is_alive()]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    ranks = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)}
    return {"ranks": ranks, "hung": hung, "fault": json.loads((tmp_path / "fault.json").read_text())}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["pickle", "wrong fields", "not utf-8"])
def test_a_malformed_failure_record_gives_one_clear_error_on_every_rank(tmp_path: Path, kind: str) -> None:
    """A record that is not one of ours ends the stage on every rank with one error that says so; a pickle in it is
    never loaded."""
    marker = tmp_path / "unpickled"
    record = {
        "pickle": pickle.dumps(_Payload(str(marker))),
        "wrong fields": json.dumps({"global_rank": "0", "stage": 1, "kind": "exception"}).encode() + b"\n",
        "not utf-8": b"\xff\xfe\x00 not a record\n",
    }[kind]
    result = _run(tmp_path, record)
    assert not result["hung"], result
    assert "unexpected" not in result["fault"], result["fault"]["unexpected"]
    for rank, outcome in result["ranks"].items():
        assert "unexpected" not in outcome, outcome["unexpected"]
        assert outcome.get("type", "").startswith("CheckpointRestoreError"), (rank, outcome)
        assert outcome["kinds"] == ["malformed report"], (rank, outcome)
        assert outcome["failed_ranks"] == [], (rank, outcome)
        error = outcome["error"]
        assert f"Serialized restore of checkpoint {CKPT!r} failed" in error and repr(STAGE) in error, error
        assert "a failure record in the job's store could not be read" in error, error
        assert "any process that can reach the job's TCPStore can write to it" in error, error
        assert outcome["ended"] - result["fault"]["at"] < 5.0, (rank, outcome)
    assert not marker.exists()
