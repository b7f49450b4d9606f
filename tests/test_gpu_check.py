"""The GPU check (``benchmarks/gpu_check.py``): its CPU branch runs every job of a device run and passes its checks;
without CUDA ``--require-gpu`` fails with the reason; a failed preflight, a job timeout and the whole-run bound each
end the run non-zero, leaving the results of the jobs that finished (the bound, the run loop's bookkeeping, checked in
this process); and its checks fail on what they guard."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks import gpu_check
from harness.processes import REPO, job_env

pytestmark = pytest.mark.tooling  # a tool of the project's, not the package's behaviour

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
def test_failed_preflight_is_an_environment_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A process group that cannot start (gloo on a network interface that does not exist) ends the run with exit 3,
    as the environment's failure, before any job runs. The run's loop runs in this process; the preflight is its
    real child process."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-interface0")
    args = ["--accelerator", "cpu", "--params", "100000", "--out", str(tmp_path)]
    assert gpu_check.main(args) == gpu_check.EXIT_ENVIRONMENT
    assert "environment failure (not the project's)" in capsys.readouterr().err
    jobs = json.loads((tmp_path / "results.json").read_text())["jobs"]
    assert {job["status"] for job in jobs} == {"not run"}


@pytest.mark.timeout(60)
def test_a_job_past_its_timeout_is_killed_and_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job past ``--job-timeout`` is killed and reported as an error; the jobs that need it do not run; exit 1.
    The run's loop runs in this process, with the preflight passed; the job is its real child process tree."""
    monkeypatch.setattr(gpu_check, "preflight", lambda accelerator: (True, "gloo: not run here"))
    args = ["--accelerator", "cpu", "--params", "100000", "--out", str(tmp_path), "--job-timeout", "1"]
    assert gpu_check.main(args) == gpu_check.EXIT_FAILED
    jobs = json.loads((tmp_path / "results.json").read_text())["jobs"]
    assert jobs[0]["name"] == "checkpoint" and jobs[0]["status"] == "error", jobs[0]
    assert "timed out after 1s" in jobs[0]["detail"]
    assert {job["status"] for job in jobs[1:]} == {"not run"}


def test_the_whole_run_bound_keeps_the_jobs_that_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``--budget`` too short for the run, the jobs that finished keep their results, the job in flight is given
    only what is left (and, cut there, says so), the rest are reported as not run (whole-run bound); exit 1.

    The bound is the run loop's own bookkeeping, checked here in this process: each job is simulated as taking 10 s
    of the budget, and the preflight as passing. That a job is killed at the timeout it is given, and reported, is
    the real processes' test above (``--job-timeout``)."""
    given: dict[str, float] = {}

    def simulated_job(run: gpu_check.Run, job: gpu_check.Job, timeout: float) -> None:
        given[job.name] = timeout
        run.deadline -= 10.0  # the job took 10 s
        if timeout < run.args.job_timeout:  # cut by the budget: what `_measure` raises when it kills a job
            job.status, job.detail = "error", f"job timed out after {timeout:.0f}s"
        elif job.kind == "checkpoint":
            run.checkpoints[job.name] = SimpleNamespace(size_bytes=2**20)
            job.status = "passed"
        else:
            job.status = "passed"  # no measurement: the report shows none

    monkeypatch.setattr(gpu_check.Run, "_run_job", simulated_job)
    monkeypatch.setattr(gpu_check, "preflight", lambda accelerator: (True, "gloo: simulated"))
    # 48 s: three 10 s jobs leave 18 s, so the fourth starts and is given those 18 s, less than its 20 s
    # --job-timeout, and is cut; the 8 s then left are under MIN_JOB_SECONDS, and nothing else starts
    assert gpu_check.MIN_JOB_SECONDS == 15.0
    args = ["--accelerator", "cpu", "--out", str(tmp_path), "--budget", "48", "--job-timeout", "20"]
    assert gpu_check.main(args) == gpu_check.EXIT_FAILED
    jobs = json.loads((tmp_path / "results.json").read_text())["jobs"]
    assert [job["name"] for job in jobs] == [job.name for job in gpu_check.plan("cpu", 2)]
    assert [job["status"] for job in jobs[:3]] == ["passed"] * 3, jobs[:3]
    assert [round(given[job["name"]]) for job in jobs[:4]] == [20, 20, 20, 18], given
    cut = jobs[3]
    assert cut["status"] == "error" and cut["detail"].startswith("whole-run bound: stopped after the 18s"), cut
    assert all(job["status"] == "not run" and "whole-run bound" in job["detail"] for job in jobs[4:]), jobs[4:]
    assert set(given) == {job["name"] for job in jobs[:4]}
    assert "GPU check (cpu): **failed**" in (tmp_path / "report.md").read_text()


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
