"""Checks and job runners shared by the test modules: exact state comparison, turn intervals from the ranks' logs,
and jobs that must succeed (once per session where the result is shared)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from filelock import FileLock

from harness.processes import job_env
from tests.helpers.launch import JOB, JobResult, run_job

JOB_TIMEOUT = 180.0


def run_ok(config: dict[str, Any], timeout: float = JOB_TIMEOUT, env: Any = None, script: Path = JOB) -> JobResult:
    """Run a job that must succeed on every rank."""
    result = run_job(config, timeout=timeout, env=env, script=script)
    assert result.returncode == 0, result.output[-6000:]
    assert not result.errors, result.errors
    return result


def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory per test session, shared by its xdist workers, so that reference jobs run once per session."""
    session_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        session_dir = session_dir.parent  # <session>/popen-gw<n>
    return session_dir / "shared-reference-jobs"


def rank_files(out: Path) -> dict[int, Path]:
    return {int(p.stem[4:]): p for p in out.glob("rank*.pt")}


def once_per_session(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """``<shared dir>/<name>``, made by ``make(directory)`` once per test session (whichever xdist worker asks
    first; the others wait for it)."""
    root = shared_dir(tmp_path_factory)
    root.mkdir(parents=True, exist_ok=True)
    out = root / name
    with FileLock(str(root / f"lock-{name}")):
        if not (out / "done").exists():
            out.mkdir(exist_ok=True)
            make(out)
            (out / "done").write_text("")
    return out


def shared_cuda_tagged(tmp_path_factory: pytest.TempPathFactory, source: str, name: str) -> str:
    """``source`` rewritten as a GPU job saves it (``tests/helpers/cuda_tagged.py``), once per test session: checked
    to record its storages on ``cuda:0``, which a machine without CUDA cannot load without a ``map_location``."""

    def make(directory: Path) -> None:
        target = directory / name
        script = [sys.executable, str(Path(__file__).with_name("cuda_tagged.py")), source, str(target)]
        subprocess.run(script, env=job_env(), check=True, timeout=120)
        with zipfile.ZipFile(target) as archive:
            pickled = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
        assert b"cuda:0" in pickled
        if not torch.cuda.is_available():
            with pytest.raises(RuntimeError, match="CUDA"):
                torch.load(target, weights_only=False)

    return str(once_per_session(tmp_path_factory, name, make) / name)


def shared_job(
    tmp_path_factory: pytest.TempPathFactory, name: str, config: dict[str, Any], script: Path = JOB
) -> dict[int, Any]:
    """Run a job that must succeed once per test session; every rank's result.

    ``config["out"]`` is set to ``<shared dir>/<name>``; other paths in ``config`` may refer to the shared dir.
    """

    def run(out: Path) -> None:
        result = run_job({**config, "out": str(out)}, timeout=JOB_TIMEOUT, script=script)
        assert result.returncode == 0, result.output[-4000:]
        assert not result.errors, result.errors

    out = once_per_session(tmp_path_factory, name, run)
    return {r: torch.load(p, weights_only=False) for r, p in rank_files(out).items()}


def assert_same(a: Any, b: Any, where: str) -> None:
    """Exact (bitwise) equality of nested states."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_training_state_equal(got: dict[int, Any], expected: dict[int, Any]) -> None:
    """``got``, a resumed run, ends every rank in exactly ``expected``'s training state.

    A run that silently ignored the checkpoint and trained from the start may end in that state too (with two ranks
    an uninterrupted run does, bit for bit), so every rank of ``got`` must also have restored a checkpoint: its
    ``on_load_checkpoint`` ran.
    """
    assert sorted(got) == sorted(expected), "not every rank reported"
    for rank in got:
        assert got[rank]["ckpt_path"], f"rank {rank} did not resume from a checkpoint"
        assert got[rank]["module_records"], f"rank {rank}: on_load_checkpoint never ran"
    for rank in expected:
        for key in ("params", "optimizers", "schedulers", "global_step", "fit_loop", "callback_batches_seen"):
            assert_same(got[rank][key], expected[rank][key], f"rank {rank}: {key}")


def turn_intervals(rank_results: dict[int, Any]) -> dict[str, list[tuple[float, float, int]]]:
    """Per stage, the (start, end, rank) of every turn, from the records each rank's turn lines carry."""
    opened: dict[tuple[str, int], float] = {}
    out: dict[str, list[tuple[float, float, int]]] = {}
    for result in rank_results.values():
        for turn in result["turns"]:
            key = (turn["stage"], turn["rank"])
            if turn["event"] == "started":
                opened[key] = turn["created"]
            else:  # a rank that started at once logs no start: its end record says how long the turn took
                start = opened.pop(key, turn["created"] - turn["duration"])
                out.setdefault(turn["stage"], []).append((start, turn["created"], turn["rank"]))
    assert not opened, f"turns that never ended: {opened}"
    return out


def ended_turns(result: dict[str, Any], stage: str) -> list[dict[str, Any]]:
    """The records of a rank's ended turns of ``stage``."""
    return [turn for turn in result["turns"] if turn["stage"] == stage and turn["event"] == "ended"]


def ran_at_once(ranks: dict[int, Any], stage: str) -> bool:
    """Every rank ran its one turn of ``stage`` with its node's other ranks at once (no rank waited for it)."""
    turns = [[t for t in got["turns"] if t["stage"] == stage] for got in ranks.values()]
    return all(len(own) == 1 and own[0]["event"] == "ended" and own[0]["at_once"] for own in turns)


def max_concurrent(intervals: Sequence[tuple[float, ...]]) -> int:
    """The most intervals (start, end, ...) open at once; one that ends as another starts does not overlap it."""
    events = sorted([(i[0], 1) for i in intervals] + [(i[1], -1) for i in intervals], key=lambda x: (x[0], x[1]))
    inside = peak = 0
    for _, delta in events:
        inside += delta
        peak = max(peak, inside)
    return peak
