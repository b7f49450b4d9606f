"""The coordination benchmark's quick mode runs to completion and produces sane, non-empty results.

Nothing here is timed and no goal is asserted: the figures depend on the machine and are reported by the benchmark
itself (docs/benchmarks.md, "Coordination at scale").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import coordination_benchmark as bench

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(420)
def test_quick_mode_completes_with_sane_results(tmp_path: Path) -> None:
    """``--quick`` exits 0 with no broken run and writes results, plot and report; every (R, k) run completes on
    every rank with consistent store, hand-off and timing figures, and the exception run ends every rank blaming the
    failing rank."""
    out = tmp_path / "quick"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "benchmarks/coordination_benchmark.py", "--quick", "--output-dir", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=360, check=False,
    )  # fmt: skip
    output = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, output
    results = json.loads((out / "results.json").read_text())
    assert not results["broken"], results["broken"]
    assert (out / "coordination.png").stat().st_size > 0
    report = (out / "report.md").read_text()
    assert report.startswith(bench.SECTION) and "### Goals" in report

    for plain in results["plain"]:
        assert plain["ops"] > 0 and plain["server_cpu_s"] >= 0

    runs = [r for r in results["runs"] if not r.get("skipped")]
    normal = [r for r in runs if not r["failure"]]
    assert {(r["R"], r["k"]) for r in normal} == {(n, k) for n in bench.QUICK_SIZES for k in bench.CONCURRENCY}
    for run in normal:
        assert run["finished"], run
        assert run["ranks_completed"] == run["R"] and run["ranks_raised"] == 0
        # every turn ran, so the run took at least its turns' bodies; the schedule talked to the store
        assert run["wall_s"] >= run["ideal_s"] * 0.95
        assert run["ops_total"] > 0 and run["ops_per_s_per_rank"] > 0
        assert all(v is not None and v > 0 for v in run["waiting_ops_per_s"].values())
        nodes = run["R"] // run["local_ranks"]
        assert run["handoffs"] == len(run["stages"]) * nodes * (run["local_ranks"] - run["k"])
        assert 0 <= run["handoff_p50_s"] <= run["handoff_p99_s"]
        assert run["body_mean_s"] >= run["body_s"] * 0.95

    failed = [r for r in runs if r["failure"]]
    assert [(r["failure"], r["R"]) for r in failed] == [
        (kind, n) for kind, sizes in bench.QUICK_FAILURES.items() for n in sizes
    ]
    for run in failed:
        assert run["finished"], run
        # every rank raised, and its error names the rank whose turn failed
        assert run["ranks_raised"] == run["ranks_expected"] == run["R"]
        assert run["verdicts_right_kind"] == run["R"] and run["blamed_others_count"] == 0
        assert 0 <= run["first_error_s"] <= run["last_error_s"]

    goals = bench.check_goals(results)
    assert goals and all(g["met"] in (True, False, None) and g["measured"] for g in goals)


def test_the_docs_section_is_replaced_and_the_rest_kept_byte_for_byte(tmp_path: Path) -> None:
    """``write_section`` appends the section to a page without it and replaces it (up to the next level-2 heading,
    or the end) on later writes; every other byte of the page, before or after the section, stays as it was."""
    page = tmp_path / "benchmarks.md"
    before = "# Benchmark\n\nintro\n\n## Results\n\n| a |\n|---|\n\n## Sampling\n\ntext  \n"
    page.write_text(before)
    bench.write_section(page, bench.SECTION + "\n\nfirst\n")
    assert page.read_text() == before + "\n" + bench.SECTION + "\n\nfirst\n"
    bench.write_section(page, bench.SECTION + "\n\nsecond\n\n### sub\n\nmore\n")
    assert page.read_text() == before + "\n" + bench.SECTION + "\n\nsecond\n\n### sub\n\nmore\n"
    # a section that is not the last one: what follows it stays too
    page.write_text(bench.SECTION + "\n\nold\n\n## After\n\nkept\n")
    bench.write_section(page, bench.SECTION + "\n\nnew\n")
    assert page.read_text() == bench.SECTION + "\n\nnew\n\n## After\n\nkept\n"
