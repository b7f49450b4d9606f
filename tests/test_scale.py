"""Smoke test of ``benchmarks/scale.py``: a few nodes of simulated ranks through the real turn code and a real store.

Only that the benchmark runs and its outcome is right (no hang, no error, every rank's error names the failed rank);
its timings are measured by the benchmark itself, under whatever load the machine has, and not asserted tightly here.
"""

from __future__ import annotations

import pytest

from benchmarks.scale import Config, run

pytestmark = pytest.mark.tooling  # a tool of the project's, not the package's behaviour


@pytest.mark.timeout(120)
def test_scale_stage_completes_on_every_rank() -> None:
    """32 ranks in 4 nodes of 8, 2 turns at a time: every rank ends the stage, within a few store operations."""
    result = run(Config(ranks=32, ranks_per_node=8, k=2, turn_s=0.05, procs=2, deadline_s=45.0))
    assert result["hung"] == 0 and result["errors"]["count"] == 0, result
    assert result["ideal_s"] == pytest.approx(0.2)
    # no turn ran late enough for a timer (60 s) to name anyone: half of it is a loaded machine's margin
    assert result["ideal_s"] <= result["wall_s"] < 30, result
    assert 1 <= result["ops_per_rank"]["max"] <= 8, result


@pytest.mark.timeout(120)
def test_scale_failure_reaches_every_rank() -> None:
    """Rank 13 raises in its turn: the 31 others raise a CheckpointRestoreError naming rank 13."""
    result = run(Config(ranks=32, ranks_per_node=8, k=1, turn_s=0.05, fail_rank=13, procs=2, deadline_s=45.0))
    assert result["hung"] == 0 and result["errors"]["count"] == 0, result
    assert result["others_raised"] == 31 and result["all_name_fail_rank"], result
    # woken by the failure, not by a timer (60 s)
    assert result["all_raised_s"] is not None and result["all_raised_s"] < 30, result
