"""The benchmark's quick mode and the memory-limit case run to completion and verify that every restore was exact.

Speed and memory are not asserted here: they are measured by the benchmark itself (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.processes import REPO, job_env


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    # the checkout first on the path, then the tests' start-up folder (tests/helpers/site), as for the tests' jobs
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.timeout(600)
def test_benchmark_quick_mode_completes_with_exact_restores(tmp_path: Path) -> None:
    """`restore_benchmark.py --quick`, at N = 1 and one entry point, exits 0 (it exits non-zero on any inexact
    restore) and writes its report."""
    out = tmp_path / "quick"
    args = ["--quick", "--devices", "1", "--entries", "fit", "--output-dir", str(out)]
    result = _run(["benchmarks/restore_benchmark.py", *args], timeout=540)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert (out / "report.md").exists() and (out / "results.json").exists()
    assert list(out.glob("*.png"))
    assert "upstream" in (out / "report.md").read_text() and "ours-true" in (out / "report.md").read_text()
    assert json.loads((out / "results.json").read_text())


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
