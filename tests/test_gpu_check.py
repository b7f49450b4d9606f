"""The GPU check (``benchmarks/gpu_check.py``): its CPU branch runs every job of a device run and passes its checks;
without CUDA ``--require-gpu`` fails with the reason; a failed preflight, a job timeout and the whole-run bound each
end the run non-zero, leaving the results of the jobs that finished; and its checks fail on what they guard."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import gpu_check
from harness.processes import REPO, job_env

# S = 138 MiB: large enough that 0.1 x S is well above the few MiB a job's memory varies by, small enough for 2 cores
PARAMS = "12000000"


def _run(args: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # the checkout first on the path, then the tests' start-up folder (tests/helpers/site), as for the tests' jobs
    return subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", *args],
        cwd=REPO,
        env=job_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _no_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")


@pytest.mark.timeout(60)
def test_require_gpu_fails_with_the_reason_without_cuda() -> None:
    """``gpu_check.sh --require-gpu`` exits 2 and names the interpreter and why where no CUDA device is visible."""
    _no_cuda()
    env = job_env({"PYTHON": sys.executable})
    result = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--require-gpu"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert result.returncode == gpu_check.EXIT_NO_GPU, result.stdout + result.stderr
    assert "--require-gpu, but no CUDA device is visible to " + sys.executable in result.stderr, result.stderr


@pytest.mark.timeout(60)
def test_without_require_gpu_it_skips_with_one_line() -> None:
    """Without ``--require-gpu`` and without CUDA it prints one line and exits 0 (a skip, never a measurement)."""
    _no_cuda()
    env = job_env({"PYTHON": sys.executable})
    result = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=50, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == ["gpu_check: skipped: no CUDA device is visible"], result.stdout


@pytest.mark.timeout(420)
def test_cpu_branch_runs_every_job_and_passes_its_checks(tmp_path: Path) -> None:
    """``--accelerator cpu`` runs the device run's jobs (Trainer fit and Fabric, DDP and FSDP on 2 ranks; `validate`
    and the eager reader are the device run's only) with gloo, every restore exact, ours within 0.1 x S, upstream at
    least 0.5 x S, turns in order."""
    result = _run(["--accelerator", "cpu", "--params", PARAMS, "--out", str(tmp_path)], timeout=400)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    results = json.loads((tmp_path / "results.json").read_text())
    jobs = {job["name"]: job for job in results["jobs"]}
    assert list(jobs) == [job.name for job in gpu_check.plan("cpu", 2)]
    assert {job["status"] for job in jobs.values()} == {"passed"}
    modes = {(job["mode"], job["entry"], job["devices"]) for job in jobs.values()}
    assert {("ours-true", "fit", 1), ("upstream", "fit", 1)} <= modes
    assert {("fabric-ours", "fit", 1), ("fabric-upstream", "fit", 1)} <= modes
    assert {("ours-true", "fit", 2), ("fsdp-ours", "fit", 2), ("fsdp-upstream", "fit", 2)} <= modes

    def checks(name: str) -> dict[str, Any]:
        return {check["name"]: check for check in jobs[name]["checks"]}

    for name in ("n1-fit-ours-true", "n1-load-fabric-ours"):
        assert checks(name)["memory"]["ok"] and "<= 0.1 x S" in checks(name)["memory"]["detail"], name
        assert checks(name)["log: read memory-mapped"]["ok"], name
    for name in ("n1-fit-upstream", "n1-load-fabric-upstream"):
        assert checks(name)["memory"]["ok"] and ">= 0.5 x S" in checks(name)["memory"]["detail"], name
    assert checks("n2-fit-ours-true")["turns"]["ok"] and checks("n2-fit-ours-true")["log: read memory-mapped"]["ok"]
    assert checks("n2-fit-fsdp-ours")["log: memory-mapped"]["ok"]
    assert all(checks(name)["exact"]["ok"] for name, job in jobs.items() if job["checks"])
    assert (tmp_path / "runs" / "n2-fit-fsdp-ours" / "job.log").is_file()
    assert "GPU check (cpu): **passed**" in (tmp_path / "report.md").read_text()


@pytest.mark.timeout(60)
def test_failed_preflight_is_an_environment_failure(tmp_path: Path) -> None:
    """A process group that cannot start (gloo on a network interface that does not exist) ends the run with exit 3,
    as the environment's failure, before any job runs."""
    result = _run(
        ["--accelerator", "cpu", "--params", "100000", "--out", str(tmp_path)],
        timeout=50,
        env={"GLOO_SOCKET_IFNAME": "no-such-interface0"},
    )
    assert result.returncode == gpu_check.EXIT_ENVIRONMENT, result.stdout + result.stderr
    assert "environment failure (not the project's)" in result.stderr
    jobs = json.loads((tmp_path / "results.json").read_text())["jobs"]
    assert {job["status"] for job in jobs} == {"not run"}


@pytest.mark.timeout(60)
def test_a_job_past_its_timeout_is_killed_and_reported(tmp_path: Path) -> None:
    """A job past ``--job-timeout`` is killed and reported as an error; the jobs that need it do not run; exit 1."""
    result = _run(["--accelerator", "cpu", "--params", "100000", "--out", str(tmp_path), "--job-timeout", "1"], 50)
    assert result.returncode == gpu_check.EXIT_FAILED, result.stdout + result.stderr
    jobs = json.loads((tmp_path / "results.json").read_text())["jobs"]
    assert jobs[0]["name"] == "checkpoint" and jobs[0]["status"] == "error", jobs[0]
    assert "timed out after 1s" in jobs[0]["detail"]
    assert {job["status"] for job in jobs[1:]} == {"not run"}


@pytest.mark.timeout(120)
def test_the_whole_run_bound_keeps_the_jobs_that_finished(tmp_path: Path) -> None:
    """With ``--budget`` too short for the run, the jobs that finished keep their results and the rest are reported
    as not run (whole-run bound); exit 1.

    The budget counts from before the preflight, and no job starts with less than ``MIN_JOB_SECONDS`` left: 30 s
    lets the first job start after a preflight of up to 15 s (a busy host's), and cuts the run wherever it is, as
    no more than 15 s of starts fit in it and the plan's 10 jobs take at least 3 s each."""
    budget = gpu_check.MIN_JOB_SECONDS + 15
    args = ["--accelerator", "cpu", "--params", "100000", "--out", str(tmp_path), "--budget", f"{budget:g}"]
    result = _run(args, 100)
    assert result.returncode == gpu_check.EXIT_FAILED, result.stdout + result.stderr
    jobs = json.loads((tmp_path / "results.json").read_text())["jobs"]
    finished = [job for job in jobs if job["status"] == "passed"]
    bounded = [job for job in jobs if job["status"] == "not run"]
    assert finished and finished[0]["name"] == "checkpoint", jobs
    assert bounded and all("whole-run bound" in job["detail"] for job in bounded), bounded
    # every job ran to its verdict (at this tiny size a memory check may fail: the checks are not what this pins),
    # was not run, or was in flight when the budget ran out and says so
    ran = [job for job in jobs if job["status"] in ("passed", "failed")]
    cut = [job for job in jobs if job["status"] == "error" and "whole-run bound" in job["detail"]]
    assert len(ran) + len(bounded) + len(cut) == len(jobs), [(job["name"], job["status"]) for job in jobs]
    assert all(job["cell"] is not None for job in ran[1:])


def test_checks_fail_on_what_they_guard(tmp_path: Path) -> None:
    """The memory, log and turn checks fail when ours copies the checkpoint, upstream's copy is not seen, the log
    says eager where memory-mapped was due, or rank 1's turn starts before rank 0's ends."""
    size = 100 * 2**20

    def job(mode: str, entry: str, peak: int) -> gpu_check.Job:
        cell = {
            "entry": entry,
            "anon_peak": peak,
            "anon_end": peak,
            "pss_peak": peak,
            "smaps_anon_peak": peak,
            "optimizer_state_bytes": 0,
            "optimizer_state_mapped_bytes": 0,
            "run_dir": str(tmp_path),
        }
        return gpu_check.Job(f"n1-{entry}-{mode}", "restore", mode, entry, cell=cell)

    base = 500 * 2**20
    jobs = [job("baseline", "validate", base), job("ours-true", "validate", base + size * 2 // 5)]
    jobs.append(job("upstream", "validate", base + size * 2 // 5))
    assert not gpu_check.memory_check(jobs[1], jobs, size)["ok"]
    assert not gpu_check.memory_check(jobs[2], jobs, size)["ok"]
    jobs[1].cell["anon_peak"] = jobs[2].cell["anon_peak"] = base + size // 20  # type: ignore[index]
    assert gpu_check.memory_check(jobs[1], jobs, size)["ok"]
    assert not gpu_check.memory_check(jobs[2], [jobs[2]], size)["ok"], "no baseline must fail, not pass"

    eager = "[rank 0] serialized restore: turn for 'restore modules and callbacks' ended in 0.10s, read 1.0 MiB eagerly"
    assert not gpu_check._log_check(eager, gpu_check.STAGE_1, "memory-mapped", 1)["ok"]
    assert gpu_check._log_check(eager, gpu_check.STAGE_1, "eagerly", 1)["ok"]
    assert not gpu_check._log_check(eager, gpu_check.STAGE_1, "eagerly", 2)["ok"]

    def line(rank: int, what: str) -> str:
        return f"[rank {rank}] serialized restore: turn for '{gpu_check.STAGE_1}' {what}"

    # the first rank starts at once and logs its end only; the next one waits and logs its start too
    in_order = "\n".join([line(0, "ended"), line(1, "started"), line(1, "ended")])
    overlapping = "\n".join([line(1, "started"), line(0, "ended"), line(1, "ended")])
    assert gpu_check.turns_check(in_order, 2)["ok"]
    assert not gpu_check.turns_check(overlapping, 2)["ok"]
    assert not gpu_check.turns_check("\n".join([line(0, "ended")]), 2)["ok"]
    assert not gpu_check.turns_check("\n".join([line(0, "ended"), line(1, "ended")]), 2)["ok"]
