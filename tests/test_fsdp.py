"""FSDP on CPU (gloo), through Lightning's own ``FSDPStrategy`` restore code, with and without the option.

Lightning's stock ``FSDPStrategy`` requires a GPU; ``CPUFSDPStrategy`` (``harness/models.py``) differs from it
only in wrapping the model with ``device_id=cpu``. Full checkpoints are written by the 2-rank DDP reference job
(torch 2.13's full-state FSDP save crashes on CPU); that is also how a DDP-trained model moves to FSDP. Every result
is compared bit for bit with upstream's FSDP restore of the same checkpoint on the same topology (FSDP's sharded
optimizer arithmetic differs from DDP's, so an uninterrupted DDP run is not the reference here).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.checks import assert_same, assert_training_state_equal, run_ok, shared_job
from tests.helpers.launch import run_job

pytestmark = pytest.mark.timeout(400)

MAPS_JOB = Path(__file__).with_name("helpers") / "maps_job.py"
FSDP = {"strategy": "fsdp_cpu"}
TOGETHER = "FSDP restores with collectives, so its ranks restore together"


def _assert_hooks_saw_the_same(got: dict[int, Any], expected: dict[int, Any]) -> None:
    for rank in expected:
        for key in ("module_records", "callback_records"):
            assert got[rank][key], f"rank {rank}: no {key}"
            assert_same(got[rank][key], expected[rank][key], f"rank {rank}: {key}")


@pytest.fixture(scope="module")
def fsdp_upstream_fit(tmp_path_factory: pytest.TempPathFactory, reference: dict[str, Any]) -> dict[int, Any]:
    config = {**FSDP, "trainer": "upstream", "max_epochs": 2, "ckpt_path": reference["ckpt"]}
    return shared_job(tmp_path_factory, "fsdp-upstream-fit", config)


@pytest.mark.parametrize("flavour", ["pytorch_lightning", "lightning"])
def test_full_checkpoint_fit_resume_equals_upstream_fsdp(
    tmp_path: Path, reference: dict[str, Any], fsdp_upstream_fit: dict[int, Any], flavour: str
) -> None:
    """Resuming with FSDP from the full checkpoint, with ``pytorch_lightning`` or ``lightning``, restores the ranks
    together, not in turns, and ends every rank at step 8 in upstream FSDP's training state; every rank's hooks see
    upstream's content, the optimizer state included. Once the restore is over no tensor of the checkpoint is held:
    the file is in no rank's ``/proc/self/maps`` (the optimizers' ``step`` counters are copied out of the mapping;
    ``tests/helpers/maps_job.py`` looks at ``on_train_start``)."""
    config = {**FSDP, "trainer": "ours", "flavour": flavour, "max_epochs": 2, "ckpt_path": reference["ckpt"]}
    result = run_ok({**config, "out": str(tmp_path)}, script=MAPS_JOB)
    for rank in (0, 1):
        mapped = json.loads((tmp_path / f"maps{rank}.json").read_text())
        assert mapped == [], f"rank {rank} still maps the checkpoint after the restore: {mapped}"
    assert TOGETHER in result.output
    assert_training_state_equal(result.ranks, fsdp_upstream_fit)
    _assert_hooks_saw_the_same(result.ranks, fsdp_upstream_fit)
    # the hooks saw the optimizer state on every rank, though only rank 0 handed it to FSDP
    for rank, ranked in result.ranks.items():
        (record,) = ranked["module_records"]
        assert any(name.startswith("/optimizer_states/0/state/") for name in record["tensors"]), rank
        assert not any("serialized restore: turn for" in line for _, line in ranked["turn_log"]), "FSDP took turns"
    assert {r["global_step"] for r in result.ranks.values()} == {8}


def test_full_checkpoint_validate_equals_upstream_fsdp(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, reference: dict[str, Any]
) -> None:
    """``validate`` with FSDP from the full checkpoint restores the ranks together and loads upstream FSDP's weights
    on every rank; the hooks see upstream's content."""
    config = {**FSDP, "entry": "validate", "ckpt_path": reference["ckpt"]}
    expected = shared_job(tmp_path_factory, "fsdp-upstream-validate", {**config, "trainer": "upstream"})
    result = run_ok({**config, "trainer": "ours", "out": str(tmp_path)})
    assert TOGETHER in result.output
    for rank in expected:
        assert_same(result.ranks[rank]["params"], expected[rank]["params"], f"rank {rank}: params")
    _assert_hooks_saw_the_same(result.ranks, expected)


def test_sharded_checkpoint_is_restored_by_fsdp_itself(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, reference: dict[str, Any]
) -> None:
    """A sharded FSDP checkpoint is left to FSDP, each rank reading only its own shards, without turns and without
    the full-checkpoint path; the resume ends every rank in upstream's training state."""
    sharded = {**FSDP, "fsdp_state_dict_type": "sharded"}
    ckpt = str(reference["root"] / "fsdp-sharded.ckpt")
    shared_job(tmp_path_factory, "fsdp-sharded-save", {**sharded, "trainer": "upstream", "save_ckpt": ckpt})
    assert (Path(ckpt) / "meta.pt").is_file(), "not a sharded checkpoint"
    resume = {**sharded, "max_epochs": 2, "ckpt_path": ckpt}
    expected = shared_job(tmp_path_factory, "fsdp-sharded-upstream", {**resume, "trainer": "upstream"})
    result = run_ok({**resume, "trainer": "ours", "out": str(tmp_path)})
    assert "each FSDP rank reads only its own shards of a sharded checkpoint; no turns are needed" in result.output
    assert TOGETHER not in result.output
    assert_training_state_equal(result.ranks, expected)


def test_rank_zero_failing_to_prepare_optimizer_state_fails_all(tmp_path: Path, reference: dict[str, Any]) -> None:
    """Only rank 0 reads the optimizer state for FSDP: its failure must reach the others before any broadcast."""
    checkpoint = torch.load(reference["ckpt"], weights_only=False)
    state = checkpoint["optimizer_states"][0]["state"]
    state[99] = state[0]  # a parameter index the model does not have
    bad = tmp_path / "bad.ckpt"
    torch.save(checkpoint, bad)
    digest = hashlib.sha256(bad.read_bytes()).hexdigest()
    result = run_job({**FSDP, "trainer": "ours", "out": str(tmp_path / "out"), "ckpt_path": str(bad)}, timeout=120)
    assert result.returncode != 0
    assert sorted(result.errors) == [0, 1], result.output[-4000:]
    for rank, error in result.errors.items():
        if rank == 0:  # it failed: its own exception, as upstream's
            assert error["type"] == "IndexError" and "list index out of range" in error["message"], error
            continue
        assert error["type"].startswith("CheckpointRestoreError["), (rank, error)
        assert "failed on rank(s) 0 in stage 'prepare optimizer state for FSDP'" in error["message"], error
        assert "IndexError: list index out of range" in error["message"]
    assert hashlib.sha256(bad.read_bytes()).hexdigest() == digest


def test_freed_memory_is_handed_back_where_the_allocator_can() -> None:
    """``malloc_trim`` is found under glibc (the FSDP path calls it after each unit) and is a no-op elsewhere."""
    import platform

    from serialized_restore._restore.fsdp import _malloc_trim, release_freed_memory

    release_freed_memory()
    if platform.libc_ver()[0] == "glibc":
        assert _malloc_trim() is not None
