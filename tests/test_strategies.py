"""The rows of the strategy table not covered elsewhere: fork-started DDP, `ddp_find_unused_parameters_true`, a single
device against upstream, and a user's `DDPStrategy` subclass that leaves the restore methods alone.

`ddp_find_unused_parameters_true` is Lightning's registry name for `DDPStrategy(find_unused_parameters=True)`: the
user's subclass is registered with that setting, so its job covers both rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.checks import JOB_TIMEOUT, assert_training_state_equal, max_concurrent, run_ok, turn_intervals
from tests.helpers.launch import run_job

pytestmark = pytest.mark.timeout(400)

STAGES = {"restore modules and callbacks", "restore training state"}
HOOK_SLEEP = 0.3
"""Seconds `on_load_checkpoint` sleeps, so that stage-1 turns that overlapped would be seen to."""
NO_EFFECT = "has no effect with"
"""Part of the warning a strategy the option does not apply to gets (serialized_restore/_restore/plan.py)."""


def assert_ranks_took_turns(ranks: dict[int, Any]) -> None:
    """Every rank took one turn per stage; in the first stage one rank at a time, local rank 0 first (k = 1 given,
    one node). The second stage, which copies out of the mapped file only what the optimizers keep, runs at once
    unless k is given: then in turns too."""
    stages = turn_intervals(ranks)
    assert set(stages) == STAGES, sorted(stages)
    for stage, intervals in stages.items():
        assert sorted(r for _, _, r in intervals) == sorted(ranks), f"{stage}: {intervals}"
        if stage == "restore training state":
            continue
        assert max_concurrent(intervals) == 1, f"{stage}: turns overlapped: {sorted(intervals)}"
        by_start = sorted(intervals)
        assert [r for _, _, r in by_start] == sorted(ranks), f"{stage}: not in local rank order: {by_start}"
        for (_, ended, _), (started, _, _) in zip(by_start, by_start[1:]):
            assert started >= ended, f"{stage}: a turn started before the previous one ended: {by_start}"


def assert_every_rank_wrote_its_result(out: Path, ranks: dict[int, Any], world_size: int) -> None:
    """One result file per rank, written by the process that ran that rank's restore."""
    assert sorted(p.name for p in out.glob("rank*.pt")) == [f"rank{r}.pt" for r in range(world_size)]
    assert not list(out.glob("rank*.error.json"))
    for rank, got in ranks.items():
        assert (got["global_rank"], got["local_rank"], got["node_rank"]) == (rank, rank, 0), f"rank {rank}"
        # the turn log is kept by the process that restored: a file written elsewhere (the launching process of a
        # fork launcher) would hold no turn of this rank
        assert any(f"[rank {rank}] serialized restore: turn for" in m for _, m in got["turn_log"]), f"rank {rank}"


# `ddp_notebook` is registered as `ddp_fork` (the same DDPStrategy, start method "fork")
@pytest.mark.parametrize("strategy", ["ddp_fork"])
def test_ddp_family_resume_is_bit_identical_in_turns(
    tmp_path: Path, reference: dict[str, Any], upstream_resume: dict[int, Any], strategy: str
) -> None:
    """Resuming with the option on ends every rank in upstream's resumed state, and the ranks restore in turns.

    With `ddp_fork` the ranks are processes forked by the launching one, and the result-writing
    callback runs in them."""
    result = run_ok(
        {
            "trainer": "ours",
            "strategy": strategy,
            "serialized": 1,  # one at a time: the order is asserted
            "out": str(tmp_path),
            "max_epochs": 2,
            "ckpt_path": reference["ckpt"],
            "hook_sleep": HOOK_SLEEP,
        }
    )
    assert_every_rank_wrote_its_result(tmp_path, result.ranks, world_size=2)
    assert_training_state_equal(result.ranks, upstream_resume)
    assert_ranks_took_turns(result.ranks)
    for rank, got in result.ranks.items():
        assert got["stage2_view"]["tensor_bytes"]["state_dict"] == 0, f"rank {rank}: weights kept after stage 1"
    assert NO_EFFECT not in result.output


def test_single_device_fit_resume_matches_upstream(tmp_path: Path, reference: dict[str, Any]) -> None:
    """One process (`devices=1`, strategy auto): with the default reader, resuming with the option on ends in the
    same training state, bit for bit, as the upstream Trainer resuming from the same checkpoint.

    (tests/test_connector.py compares the model weights only, with the eager reader, against our Trainer with the
    option off; this compares optimizer, scheduler, loop and callback state too, against upstream's class.)"""
    config = {"devices": 1, "strategy": "auto", "max_epochs": 2, "ckpt_path": reference["ckpt"]}
    upstream = run_ok({**config, "trainer": "upstream", "out": str(tmp_path / "upstream")})
    ours = run_ok({**config, "trainer": "ours", "serialized": True, "out": str(tmp_path / "ours")})
    assert sorted(upstream.ranks) == [0]
    assert_training_state_equal(ours.ranks, upstream.ranks)
    assert_every_rank_wrote_its_result(tmp_path / "ours", ours.ranks, world_size=1)
    # the serialized path did run: a turn per stage (a single process logs only their ends), and stage 2 saw the
    # dict without its weights
    ended = [m for _, m in ours.ranks[0]["turn_log"] if "serialized restore: turn for" in m and " ended in " in m]
    assert [m.split("'")[1] for m in ended] == ["restore modules and callbacks", "restore training state"], ended
    assert ours.ranks[0]["stage2_view"]["tensor_bytes"]["state_dict"] == 0
    assert upstream.ranks[0]["stage2_view"]["tensor_bytes"]["state_dict"] > 0
    assert NO_EFFECT not in ours.output


_SUBCLASS_JOB = '''\
"""tests/helpers/job.py with two DDPStrategy subclasses: `strategy="plain_ddp_subclass"` overrides an unrelated
method and none of the restore methods (registered with `find_unused_parameters=True`, as Lightning registers
`ddp_find_unused_parameters_true`), `strategy="overriding_ddp_subclass"` overrides `load_checkpoint`."""

import json
import sys

from tests.helpers import job
from harness.models import lightning_module

config = json.loads(sys.argv[1])
pl = lightning_module(config.get("flavour", "pytorch_lightning"))


class PlainDDPSubclass(pl.strategies.DDPStrategy):
    def setup(self, trainer):
        super().setup(trainer)
        unused = self.model.find_unused_parameters  # torch's DistributedDataParallel, wrapped for fit
        print(f"PlainDDPSubclass in use on rank {self.global_rank}, find_unused_parameters={unused}", flush=True)


class OverridingDDPSubclass(pl.strategies.DDPStrategy):
    def load_checkpoint(self, checkpoint_path, weights_only=None):
        print(f"OverridingDDPSubclass.load_checkpoint on rank {self.global_rank}", flush=True)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)


pl.strategies.StrategyRegistry.register("plain_ddp_subclass", PlainDDPSubclass, find_unused_parameters=True)
pl.strategies.StrategyRegistry.register("overriding_ddp_subclass", OverridingDDPSubclass)
job.main(config)
'''


def _run_subclass_job(tmp_path: Path, reference: dict[str, Any], strategy: str, **config: Any) -> Any:
    """Resume the reference checkpoint to epoch 2 with our Trainer and a strategy registered by `_SUBCLASS_JOB`
    (written into `tmp_path`); every rank must succeed. Results go to `tmp_path / "out"`."""
    script = tmp_path / "subclass_job.py"
    script.write_text(_SUBCLASS_JOB)
    job = {
        "trainer": "ours",
        "strategy": strategy,
        "serialized": 1,  # one at a time: the order is asserted
        "out": str(tmp_path / "out"),
        "max_epochs": 2,
        "ckpt_path": reference["ckpt"],
        **config,
    }
    result = run_job(job, timeout=JOB_TIMEOUT, script=script)
    assert result.returncode == 0, result.output[-6000:]
    assert not result.errors, result.errors
    return result


def test_ddp_subclass_without_restore_overrides_is_treated_as_ddp(
    tmp_path: Path, reference: dict[str, Any], upstream_resume: dict[int, Any]
) -> None:
    """A user's `DDPStrategy` subclass that does not override `load_checkpoint`, `load_model_state_dict` or
    `load_optimizer_state_dict` restores in turns like DDP, bit-identically, with no warning; here with
    `find_unused_parameters=True`, what `ddp_find_unused_parameters_true` sets.

    tests/helpers/job.py takes a strategy by name only, so this runs it through a small script that registers the
    subclass under a name in Lightning's strategy registry (in every rank: the `ddp` launcher re-runs the script) and
    then runs `job.main` unchanged."""
    out = tmp_path / "out"
    result = _run_subclass_job(tmp_path, reference, "plain_ddp_subclass", hook_sleep=HOOK_SLEEP)
    for rank in (0, 1):
        assert f"PlainDDPSubclass in use on rank {rank}, find_unused_parameters=True" in result.output
    assert NO_EFFECT not in result.output, result.output[-4000:]
    assert_every_rank_wrote_its_result(out, result.ranks, world_size=2)
    assert_training_state_equal(result.ranks, upstream_resume)
    assert_ranks_took_turns(result.ranks)


def test_ddp_subclass_overriding_a_restore_method_warns_and_restores_as_upstream(
    tmp_path: Path, reference: dict[str, Any], upstream_resume: dict[int, Any]
) -> None:
    """A `DDPStrategy` subclass that overrides `load_checkpoint` may run collectives there: on 2 real ranks, one
    warning on rank zero naming it, no turns, and upstream's restore, bit-identical."""
    out = tmp_path / "out"
    result = _run_subclass_job(tmp_path, reference, "overriding_ddp_subclass", serialized=True)
    for rank in (0, 1):
        assert f"OverridingDDPSubclass.load_checkpoint on rank {rank}" in result.output
    warning = (
        "`Trainer(serialized_checkpoint_loading=True)` has no effect with OverridingDDPSubclass: it overrides"
        " load_checkpoint. The checkpoint is restored as upstream Lightning does."
    )
    assert result.output.count(warning) == 1, result.output[-4000:]
    assert sorted(p.name for p in out.glob("rank*.pt")) == ["rank0.pt", "rank1.pt"]
    assert_training_state_equal(result.ranks, upstream_resume)
    for rank, ranked in result.ranks.items():
        assert not [m for _, m in ranked["turn_log"] if "serialized restore: turn for" in m], f"rank {rank} took turns"
        assert ranked["stage2_view"]["tensor_bytes"]["state_dict"] > 0, "the cached dict was released as ours does"
