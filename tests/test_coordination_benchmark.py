"""The coordination benchmark's quick mode runs to completion and produces sane, non-empty results, and the host
that runs its simulated ranks' watches on one thread per process (``benchmarks/_watch_host.py``) keeps its contract.

Nothing here is timed and no goal is asserted: the figures depend on the machine and are reported by the benchmark
itself (docs/benchmarks.md, "Coordination at scale").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks import coordination_benchmark as bench
from benchmarks._watch_host import SharedThread
from tests.helpers.watches import Ticking

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


def test_the_shared_host_runs_every_watch_on_one_thread_at_its_own_tick():
    """The simulator's ``SharedThread`` steps the watches of many ranks on one thread, each at its own rate; one
    whose step asks to stop is no longer run; a stopped one is not stepped again, and stopping waits for a step in
    progress."""
    host = SharedThread()
    fast, slow, once = Ticking(0.01), Ticking(0.1), Ticking(0.01, steps_before_stop=1)
    for watch in (fast, slow, once):
        host.start(watch)
    deadline = time.monotonic() + 10.0  # a loaded machine may hold the thread back; the rates are what counts
    while not (slow.steps >= 3 and fast.steps > 2 * slow.steps) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slow.steps >= 3 and fast.steps > 2 * slow.steps, (fast.steps, slow.steps)
    assert once.steps == 1 and not host.runs(once)
    assert len(fast.threads | slow.threads) == 1 and threading.get_ident() not in fast.threads
    long = Ticking(0.01, step_seconds=0.3)
    host.start(long)
    deadline = time.monotonic() + 2.0
    while not long.running and time.monotonic() < deadline:
        time.sleep(0.001)
    host.stop(long, timeout=2.0)
    assert not long.running and long.steps == 1  # stopping waited for the step in progress to end
    for watch in (fast, slow):
        host.stop(watch)
    counts = (fast.steps, slow.steps, long.steps)
    time.sleep(0.2)
    assert (fast.steps, slow.steps, long.steps) == counts


def test_a_shared_host_stuck_in_one_step_counts_as_not_running():
    """A step that does not end (a store operation that never answers) makes every watch of the shared thread count
    as not running once ``stuck_after`` has passed, so that their waits end at the backstop; it runs again after."""
    host = SharedThread()
    host.stuck_after = 0.5
    stuck, other = Ticking(0.01, step_seconds=2.0), Ticking(0.01)
    host.start(stuck)
    host.start(other)
    deadline = time.monotonic() + 5.0
    while not stuck.running and time.monotonic() < deadline:
        time.sleep(0.001)
    assert stuck.running and host.runs(other)
    time.sleep(0.8)
    assert stuck.running and not host.runs(other) and not host.runs(stuck)
    host.stop(stuck, timeout=2.0)
    deadline = time.monotonic() + 5.0
    while not host.runs(other) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert host.runs(other)
    host.stop(other)
