"""Sharded optimizer state: torch's ``ZeroRedundancyOptimizer`` under ``ddp``, and fairscale's ``OSS`` with
``ShardedDataParallel`` (Lightning 1.x's ``ddp_sharded``, the setup of the original report, as a Lightning 2.6 strategy
in ``harness/models.py``). A checkpoint holds the consolidated state; every rank loads it and keeps only its shard.
Real 2-rank DDP jobs over gloo, real checkpoint files.

The checkpoint is the session's 2-rank reference (plain Adam under ``ddp``): a sharded optimizer's consolidated state
is Adam's state dict, the same keys, parameter groups, indexes, shapes and dtypes as plain Adam's (compared when this
was set up, for a checkpoint saved under each setup), so a save under each setup would only re-run upstream's save."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.checks import (
    assert_training_state_equal,
    ended_turns,
    max_concurrent,
    ran_at_once,
    run_ok,
    turn_intervals,
)

pytestmark = pytest.mark.timeout(400)


_SETUPS = {
    "zero-redundancy-optimizer": {"optimizer": "zero"},
    "fairscale-oss": {"strategy": "fairscale_sharded"},
}


@pytest.mark.parametrize("setup", sorted(_SETUPS))
def test_sharded_optimizer_resumes_exactly_and_each_rank_copies_only_its_shard(
    tmp_path: Path, reference: dict[str, Any], setup: str
) -> None:
    """A fit resume with a sharded optimizer ends every rank (weights, its optimizer shard, step) exactly as
    upstream's resume does: the memory-mapped first stage with the ranks at once, the second in turns one at a time
    (a sharded optimizer's `load_state_dict` is not torch's own: it copies what it is given); in its stage-2 turn each
    rank copies out of the mapped file only the state of its own shard, about half of the checkpoint's optimizer
    state with 2 ranks."""
    ckpt = reference["ckpt"]
    resume = {"max_epochs": 2, "ckpt_path": ckpt, **_SETUPS[setup]}
    upstream = run_ok({"trainer": "upstream", "out": str(tmp_path / "upstream"), **resume})
    ours = run_ok({"trainer": "ours", "serialized": True, "out": str(tmp_path / "ours"), **resume})
    assert_training_state_equal(ours.ranks, upstream.ranks)
    intervals = turn_intervals(ours.ranks)
    assert sorted(intervals) == ["restore modules and callbacks", "restore training state"]
    assert ran_at_once(ours.ranks, "restore modules and callbacks"), intervals
    second = intervals["restore training state"]
    assert max_concurrent(second) == 1 and len(second) == 2, intervals

    saved = torch.load(ckpt, weights_only=True)["optimizer_states"][0]["state"]
    full = sum(t.nbytes for state in saved.values() for t in state.values() if isinstance(t, torch.Tensor))
    for rank, result in ours.ranks.items():
        (turn,) = ended_turns(result, "restore training state")
        shard = result["optimizer_state_bytes"]
        assert shard < 0.75 * full, f"rank {rank}: its shard {shard} of {full} bytes"
        # what the rank copied out of the mapped file is its shard
        assert turn["bytes_copied"] == shard, f"rank {rank}: copied {turn['bytes_copied']}, keeps {shard}"
