"""The benchmark's quick mode and the memory-limit case run to completion and verify that every restore was exact; the
default run's plan is the table it says; the report is made again from `results.json` alone.

Speed and memory are not asserted here: they are measured by the benchmark itself (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report as benchmark_report
from benchmarks import restore_benchmark
from benchmarks.modes import BASELINES, MODES, baseline_of
from harness.processes import REPO, job_env

pytestmark = pytest.mark.tooling  # a tool of the project's, not the package's behaviour


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    # the checkout first on the path, then the tests' start-up folder (tests/helpers/site), as for the tests' jobs
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.timeout(600)
def test_benchmark_quick_mode_completes_with_exact_restores(tmp_path: Path) -> None:
    """`restore_benchmark.py --quick`, at N = 1 and one entry point, exits 0 (it exits non-zero on any inexact
    restore) and writes its report, its plots and a record per mode and entry point with the window and the floor;
    `report.py` makes the same page again from the run's `results.json`."""
    out = tmp_path / "quick"
    args = ["--quick", "--devices", "1", "--entries", "fit", "--output-dir", str(out)]
    result = _run(["benchmarks/restore_benchmark.py", *args], timeout=540)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    report = (out / "report.md").read_text()
    assert list(out.glob("*.png")) and json.loads((out / "results.json").read_text())
    assert "upstream" in report and "ours-true" in report and "## Against the floor" in report
    assert "x floor" in result.stdout and "Worst case: `upstream`" in result.stdout
    records = json.loads((out / "benchmark_results.json").read_text())
    cells = {(r["mode"], r["entry"], r["devices"]) for r in records}
    assert {("upstream", "fit", 1), ("ours-true", "fit", 1), ("ours-true", "whole", 1)} <= cells, cells
    for record in records:
        assert record["checkpoint_bytes"] > 0 and record["floor_s"] > 0 and record["window_s"] > 0, record
    assert all(r["exact"] for r in records if r["mode"] in ("upstream", "ours-true") and r["entry"] == "fit")
    again = tmp_path / "again"
    again.mkdir()
    # in this process: the tests' jobs run without the plotting libraries (tests/helpers/site/sitecustomize.py)
    written = benchmark_report.write(json.loads((out / "results.json").read_text()), again, docs=False)
    assert (again / "report.md").read_text() == report and again / "restore_memory.png" in written


def test_default_plan_measures_every_n_of_k_1_also_with_k_n() -> None:
    """The default run measures `ours-1` (k = 1) beside `ours-true` (`True`) wherever it measures the latter, each
    after its baseline; `--whole-only` runs only the whole-process jobs, alternating ABBA."""
    args = restore_benchmark.parse_args([])
    for params in args.params:
        jobs = restore_benchmark.plan(args, params)
        where = {mode: {(n, entry) for n, entry, m, _ in jobs if m == mode} for mode in MODES}
        assert where["ours-1"] == {(n, e) for n, e in where["ours-true"] if n > 1} != set(), params
        for i, (n, entry, mode, repeat) in enumerate(jobs):
            assert mode in BASELINES or (n, entry, baseline_of(mode), repeat) in jobs[:i], (params, n, entry, mode)
    assert not restore_benchmark.whole_plan(args, max(args.params))
    whole = restore_benchmark.parse_args(["--whole-only"])
    assert not restore_benchmark.plan(whole, max(whole.params))
    jobs = restore_benchmark.whole_plan(whole, max(whole.params))
    assert [mode for n, mode, _ in jobs if n == 4][:4] == ["upstream", "ours-true", "ours-true", "upstream"]


@pytest.mark.timeout(600)
def test_resume_under_a_memory_limit(tmp_path: Path) -> None:
    """Under a cgroup memory limit with room for one more checkpoint copy than the job needs without one, the
    serialized resume finishes, exact (`memory_limit.py` exits non-zero otherwise); skipped, with its own reason,
    where no memory cgroup can be made. Upstream's resume, which the limit kills, is the benchmark's, not run here."""
    args = ["--ours-only", "--params", "20000000", "--devices", "2", "--output-dir", str(tmp_path)]
    result = _run(["benchmarks/memory_limit.py", *args], timeout=540)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    if result.stdout.startswith("memory_limit: skipped:"):
        pytest.skip(result.stdout.strip())
    ours = next(line for line in result.stdout.splitlines() if "serialized_checkpoint_loading=True" in line)
    assert "**finished**" in ours and ours.rstrip().endswith("| yes |"), ours
