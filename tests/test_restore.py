"""End-to-end restores through real Lightning Trainers, real DDP process groups (gloo) and real checkpoint files."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.checks import (
    assert_same,
    assert_training_state_equal,
    ended_turns,
    max_concurrent,
    ran_at_once,
    run_ok,
    shared_job,
    turn_intervals,
)

pytestmark = pytest.mark.timeout(400)

ON = {"serialized": True}


EVALUATION = ("validate", "test", "predict")


@pytest.fixture(scope="module")
def resumed_then_evaluated(tmp_path_factory: pytest.TempPathFactory, reference: dict[str, Any]) -> dict[int, Any]:
    """Our Trainer with the option on and its default (memory-mapped) reader, one job per test session: it resumes
    the reference checkpoint to epoch 2, then runs validate, test and predict from it on the same Trainer; every
    rank's history, one result per call. The lr scheduler's `load_state_dict` sleeps 1 s (see
    `test_second_stage_runs_at_once_unless_it_reads_again`)."""
    calls = [[entry, reference["ckpt"]] for entry in ("fit", *EVALUATION)]
    config = {"trainer": "ours", **ON, "max_epochs": 2, "calls": calls, "scheduler_load_sleep": 1.0}
    return {rank: got["history"] for rank, got in shared_job(tmp_path_factory, "ours-resume", config).items()}


@pytest.fixture(scope="module")
def resumed_in_turns(resumed_then_evaluated: dict[int, Any]) -> dict[int, Any]:
    """The fit of that job: every rank's end state at epoch 2."""
    return {rank: history[0] for rank, history in resumed_then_evaluated.items()}


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(ON, id="True"),
        pytest.param({"serialized": 2, "hook_sleep": 1.0}, id="2"),
        pytest.param({"serialized": True, "flavour": "lightning"}, id="lightning-flavour"),
        pytest.param({"serialized": True, "strategy": "ddp_spawn"}, id="ddp-spawn"),
    ],
)
def test_fit_resume_is_bit_identical(
    tmp_path: Path,
    reference: dict[str, Any],
    upstream_resume: dict[int, Any],
    variant: dict[str, Any],
    request: pytest.FixtureRequest,
) -> None:
    """Resuming with the option on ends every rank exactly in upstream's resumed state: also with
    `serialized_restore.lightning.Trainer` (for `import lightning.pytorch`) and with `ddp_spawn` (spawned ranks).

    With `True` the memory-mapped first stage runs with the node's ranks at once (it allocates only what a rank
    keeps), and every rank logs so. With `serialized_checkpoint_loading=2` both ranks of the node are inside the first
    stage at once (its `on_load_checkpoint` sleeps 1 s), as with 1 they never are (tests/test_topology.py): the value
    reaches the turns. That no more than k ranks are ever inside, with more ranks than k, tests/test_turns.py asserts
    on the package's turn code, real processes and a real store, and tests/test_scale.py for long chains."""
    if variant is ON:
        ranks = request.getfixturevalue("resumed_in_turns")
    else:
        config = {"trainer": "ours", **variant, "out": str(tmp_path), "max_epochs": 2, "ckpt_path": reference["ckpt"]}
        ranks = run_ok(config).ranks
    assert_training_state_equal(ranks, upstream_resume)
    first = turn_intervals(ranks)["restore modules and callbacks"]
    if variant["serialized"] is True:
        assert ran_at_once(ranks, "restore modules and callbacks"), [got["turn_log"] for got in ranks.values()]
    else:
        assert max_concurrent(first) == variant["serialized"], sorted(first)
    for rank, got in ranks.items():
        # the second stage never sees model weights again, and runs on optimizer state copied out of the file
        view = got["stage2_view"]
        assert view["tensor_bytes"]["state_dict"] == 0, f"rank {rank}"
        assert view["tensor_bytes"]["optimizer_states"] > 0, f"rank {rank}"
        stages = turn_intervals({rank: got})
        assert set(stages) == {"restore modules and callbacks", "restore training state"}, f"rank {rank}"
        # each turn's record says how the file was read and what was copied out of the mapping
        (first,) = ended_turns(got, "restore modules and callbacks")
        (second,) = ended_turns(got, "restore training state")
        assert first["reader"] == "mmap" and second["bytes_copied"] > 0, (first, second)


@pytest.mark.parametrize("reader", ["mmap", "eager"])
def test_second_stage_runs_at_once_unless_it_reads_again(
    tmp_path: Path,
    reference: dict[str, Any],
    upstream_resume: dict[int, Any],
    reader: str,
    request: pytest.FixtureRequest,
) -> None:
    """Stage 2 of a fit restore runs on every rank at once when it copies out of the mapped file only what the
    optimizers keep (nothing transient), and in turns when each rank reads the optimizer state again (a transient
    of the file's size); either way the resume is exact. The lr scheduler's `load_state_dict` sleeps 1 s, so that
    turns run at once overlap and turns taken in order cannot. (mmap is the default reader: the shared run's log
    says the file was memory-mapped, `test_fit_resume_is_bit_identical[True]`.)"""
    if reader == "mmap":
        ranks = request.getfixturevalue("resumed_in_turns")
    else:
        config = {"trainer": "ours", **ON, "out": str(tmp_path), "max_epochs": 2, "ckpt_path": reference["ckpt"]}
        ranks = run_ok({**config, "scheduler_load_sleep": 1.0}, env={"SERIALIZED_RESTORE_READER": reader}).ranks
    assert_training_state_equal(ranks, upstream_resume)
    stages = turn_intervals(ranks)
    # the first stage: memory-mapped, with the node's ranks at once; read into memory, one at a time
    if reader == "mmap":
        assert ran_at_once(ranks, "restore modules and callbacks"), stages
    else:
        assert max_concurrent(stages["restore modules and callbacks"]) == 1, stages
    second = stages["restore training state"]
    assert sorted(r for _, _, r in second) == [0, 1], second
    assert max_concurrent(second) == (2 if reader == "mmap" else 1), sorted(second)
    turns = [t for t in ranks[1]["turns"] if t["stage"] == "restore training state"]
    if reader == "mmap":  # no start record: the rank did not wait
        assert [(t["event"], t["at_once"]) for t in turns] == [("ended", True)], turns
    else:
        assert [t["event"] for t in turns] == ["started", "ended"], turns


def test_hooks_see_what_upstream_hooks_see(resumed_in_turns: dict[int, Any], upstream_resume: dict[int, Any]) -> None:
    """`on_load_checkpoint` of module and callback and the callback's `load_state_dict` get upstream's content."""
    assert sorted(resumed_in_turns) == sorted(upstream_resume)
    for rank, got in resumed_in_turns.items():
        expected = upstream_resume[rank]
        assert len(got["module_records"]) == 1, f"rank {rank}: module hook not called exactly once"
        assert got["module_records"] == expected["module_records"], f"rank {rank}"
        assert [r["hook"] for r in got["callback_records"]] == [r["hook"] for r in expected["callback_records"]]
        assert got["callback_records"] == expected["callback_records"], f"rank {rank}"
        assert "optimizer_states" in got["module_records"][0]["keys"], f"rank {rank}"
        assert any(k.startswith("/state_dict/") for k in got["module_records"][0]["tensors"]), f"rank {rank}"


def test_default_off_behaves_as_upstream(
    tmp_path: Path, reference: dict[str, Any], upstream_resume: dict[int, Any]
) -> None:
    """`serialized_checkpoint_loading=False` restores exactly as the upstream Trainer, with no turns."""
    result = run_ok(
        {"trainer": "ours", "serialized": False, "out": str(tmp_path), "max_epochs": 2, "ckpt_path": reference["ckpt"]}
    )
    assert_training_state_equal(result.ranks, upstream_resume)
    for rank, got in result.ranks.items():
        assert got["module_records"] == upstream_resume[rank]["module_records"]
        assert got["callback_records"] == upstream_resume[rank]["callback_records"]
        assert got["stage2_view"] == upstream_resume[rank]["stage2_view"], f"rank {rank}"
        assert got["turn_log"] == [], f"rank {rank}"


def test_evaluation_entry_points(resumed_then_evaluated: dict[int, Any], reference: dict[str, Any]) -> None:
    """validate/test/predict(ckpt_path=...), one after another on one Trainer (after a fit, whose weights they
    replace), each load the weights and keep no optimizer or scheduler state."""
    checkpoint = torch.load(reference["ckpt"], weights_only=True)
    assert sorted(resumed_then_evaluated) == [0, 1]
    for rank, history in resumed_then_evaluated.items():
        assert len(history) == 1 + len(EVALUATION), f"rank {rank}"
        for entry, got in zip(EVALUATION, history[1:]):
            where = f"{entry}, rank {rank}"
            assert got["ckpt_path"] == reference["ckpt"], where
            assert_same(got["params"], checkpoint["state_dict"], f"{where}: params")
            assert got["module_records"][0]["keys"] == sorted(checkpoint), f"{where}: hook saw a partial dict"
            view = got["stage2_view"]
            assert "optimizer_states" not in view["keys"] and "lr_schedulers" not in view["keys"], where
            assert sum(view["tensor_bytes"].values()) == 0, f"{where}: tensors kept between stages: {view}"
            # the second stage moves nothing outside fit: its ranks run it at once, and it is not logged as turns
            assert set(turn_intervals({rank: got})) == {"restore modules and callbacks"}, where


def test_special_paths_best_last_hpc(tmp_path: Path, reference: dict[str, Any]) -> None:
    """`ckpt_path="best"`, `"last"` and `"hpc"` resolve as upstream and restore in turns (single process too)."""
    shutil.copy(reference["ckpt"], tmp_path / "hpc_ckpt_3.ckpt")
    result = run_ok(
        {
            "trainer": "ours",
            "serialized": True,
            "devices": 1,
            "strategy": "auto",
            "checkpointing": True,
            "out": str(tmp_path),
            "calls": [["fit", None], ["validate", "best"], ["test", "last"], ["predict", "hpc"]],
        }
    )
    history = result.ranks[0]["history"]
    assert [h["ckpt_path"] for h in history[1:]] == [
        str(tmp_path / "ckpts" / "epoch=0-step=8.ckpt"),
        str(tmp_path / "ckpts" / "last.ckpt"),
        str(tmp_path / "hpc_ckpt_3.ckpt"),
    ]
    for call in history[1:]:
        expected = torch.load(call["ckpt_path"], weights_only=True)["state_dict"]
        assert_same(call["params"], expected, call["ckpt_path"])
        assert len(call["module_records"]) == 1
        assert any("turn for 'restore modules and callbacks' ended" in m for _, m in call["turn_log"])
