"""A restore's keys in the job's store belong to that restore: a restarted attempt of the job, on a store that outlived
the first attempt's processes (as torchrun's agent store does), never reads what the failed attempt left there."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness.processes import job_env, kill_job, start_job
from tests.helpers.checks import JOB_TIMEOUT, assert_training_state_equal

RESTART_JOB = Path(__file__).with_name("helpers") / "restart_job.py"
WORLD = 2


def _attempt(out: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Start one process per rank, as torchrun's agent starts an attempt; wait for both (killing both on timeout);
    every rank's result and error."""
    out.mkdir(parents=True)
    procs = []
    for rank in range(WORLD):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(WORLD)}
        procs.append(start_job(RESTART_JOB, config, cwd=out, env=job_env(env), stdout=subprocess.PIPE, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=JOB_TIMEOUT)[0])
    finally:
        for proc in procs:
            kill_job(proc)
    return {
        "returncodes": [proc.returncode for proc in procs],
        "output": "\n".join(outputs),
        "ranks": {
            r: torch.load(out / f"rank{r}.pt", weights_only=False)
            for r in range(WORLD)
            if (out / f"rank{r}.pt").exists()
        },  # fmt: skip
        "errors": {
            r: json.loads((out / f"rank{r}.error.json").read_text())
            for r in range(WORLD)
            if (out / f"rank{r}.error.json").exists()
        },  # fmt: skip
    }


@pytest.mark.timeout(2 * JOB_TIMEOUT + 60)
def test_a_restart_after_a_failed_restore_restores_exactly(
    tmp_path: Path, reference: dict[str, Any], upstream_resume: dict[int, Any]
) -> None:
    """Attempt 1: rank 1 raises in ``on_load_checkpoint``, every rank fails naming it. Attempt 2, fresh processes on the
    same store, no fault: it restores exactly as upstream resumes, with nothing of attempt 1's failure."""
    server = dist.TCPStore("127.0.0.1", 0, WORLD, True, wait_for_workers=False)
    config = {"trainer": "ours", "max_epochs": 2, "ckpt_path": reference["ckpt"], "store_port": server.port}

    first = _attempt(
        tmp_path / "attempt0", {**config, "out": str(tmp_path / "attempt0"), "attempt": 0, "fault_rank": 1}
    )
    assert all(code != 0 for code in first["returncodes"]), first["output"][-4000:]
    assert first["errors"][1]["message"] == "injected failure in attempt 0 on rank 1", first["errors"][1]
    assert "failed on rank(s) 1" in first["errors"][0]["message"], first["errors"][0]

    second = _attempt(tmp_path / "attempt1", {**config, "out": str(tmp_path / "attempt1"), "attempt": 1})
    assert second["returncodes"] == [0, 0] and not second["errors"], (second["errors"], second["output"][-4000:])
    assert "injected failure" not in second["output"]
    assert_training_state_equal(second["ranks"], upstream_resume)
