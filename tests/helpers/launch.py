"""Runs ``tests/helpers/job.py`` as a real process tree with a hard timeout, and reads what every rank wrote."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from harness.processes import job_env, kill_job, start_job

JOB = Path(__file__).with_name("job.py")


@dataclass
class JobResult:
    returncode: int
    elapsed: float
    output: str
    ranks: dict[int, dict[str, Any]]
    errors: dict[int, dict[str, Any]]


def run_job(
    config: dict[str, Any], timeout: float = 120.0, env: Optional[dict[str, str]] = None, script: Path = JOB
) -> JobResult:
    """Run one job script (all its ranks) and return every rank's result; kill the whole process group on timeout."""
    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    proc = start_job(script, config, cwd=out, env=job_env(env), stdout=subprocess.PIPE, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc)
        output, _ = proc.communicate()
        raise AssertionError(f"job did not finish within {timeout}s:\n{output[-6000:]}") from None
    finally:
        # children of Lightning's launcher live in the same session: never leave one behind
        kill_job(proc)
    ranks = {}
    errors = {}
    for path in out.glob("rank*.pt"):
        ranks[int(path.stem[4:])] = torch.load(path, weights_only=False)
    for path in out.glob("rank*.error.json"):
        errors[int(path.name[4:].split(".")[0])] = json.loads(path.read_text())
    return JobResult(proc.returncode, time.monotonic() - started, output, ranks, errors)
