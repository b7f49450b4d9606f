"""What a restore does differently on GPU nodes, tested on CPU with real jobs: a checkpoint a GPU job wrote, the second
stage in turns where loading converts dtypes, the note for one rank per node, and the wait for device copies before
the checkpoint is dropped. (That an FSDP restore leaves nothing of the file mapped, tests/test_fsdp.py checks on its
fit resumes.)

A GPU job's checkpoint is made the way ``torch.save`` makes one on a GPU (``tests/helpers/cuda_tagged.py``, run by
``tests.helpers.checks.shared_cuda_tagged``): every storage a GPU job holds on its GPU is recorded with the location
``cuda:0``, its bytes as they are; loading it without a ``map_location`` on a machine without CUDA fails as it would
for a file copied from a GPU node.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.processes import job_env
from tests.helpers.checks import (
    JOB_TIMEOUT,
    assert_same,
    assert_training_state_equal,
    ended_turns,
    max_concurrent,
    run_ok,
    shared_cuda_tagged,
    turn_intervals,
)

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def gpu_checkpoint(reference: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> str:
    """The 2-rank reference checkpoint as a GPU job writes it (once per test session)."""
    return shared_cuda_tagged(tmp_path_factory, reference["ckpt"], "epoch1-cuda.ckpt")


def _readers(ranks: dict[int, Any], stage: str) -> list[str]:
    """How each rank's turn of ``stage`` read the file, from the records its turn lines carry."""
    return [turn["reader"] for got in ranks.values() for turn in ended_turns(got, stage)]


# the eager reader is upstream's own `strategy.load_checkpoint`, called in the turn: the memory-mapped one is ours
@pytest.mark.parametrize("reader", ["mmap"])
def test_trainer_restores_a_gpu_checkpoint_on_cpu(
    tmp_path: Path, gpu_checkpoint: str, upstream_resume: dict[int, Any], reader: str
) -> None:
    """A checkpoint saved on ``cuda:0`` resumes on CPU memory-mapped, every rank ending in exactly the state
    upstream reaches from the same checkpoint saved on the host."""
    config = {"trainer": "ours", "out": str(tmp_path), "max_epochs": 2, "ckpt_path": gpu_checkpoint}
    result = run_ok(config, env={"SERIALIZED_RESTORE_READER": reader})
    assert_training_state_equal(result.ranks, upstream_resume)
    assert _readers(result.ranks, "restore modules and callbacks") == [reader, reader]


def test_fabric_loads_a_gpu_checkpoint_on_cpu(
    fabric_ours_loads: dict[int, Any], fabric_upstream_load: dict[int, Any]
) -> None:
    """``fabric.load`` of a checkpoint saved on ``cuda:0`` (conftest's ``fabric_gpu_checkpoint``) gives,
    memory-mapped (the default reader; the eager one is upstream's `checkpoint_io.load_checkpoint`), exactly what
    upstream Fabric gives from the same checkpoint saved on the host, with nothing kept backed by the file. (Ours is
    the ``load_gpu`` load of the session's job of our DDP Fabric loads.)"""
    ours = {rank: got["load_gpu"] for rank, got in fabric_ours_loads.items()}
    upstream = fabric_upstream_load
    assert sorted(ours) == sorted(upstream) == [0, 1]
    for rank in upstream:
        for key in ("params", "optimizer", "scheduler", "remainder", "plain_state", "counter"):
            assert_same(ours[rank][key], upstream[rank][key], f"rank {rank}: {key}")
        assert ours[rank]["file_backed"] == [], rank
    assert _readers(ours, "load checkpoint") == ["mmap", "mmap"]


def test_second_stage_takes_turns_when_loading_converts_dtypes(
    tmp_path: Path, reference: dict[str, Any], upstream_resume: dict[int, Any]
) -> None:
    """With saved optimizer state in another dtype than its parameters (float64 into a float32 model), torch's
    ``load_state_dict`` converts each tensor through a temporary, so the ranks of a node run stage 2 in turns (not at
    once, as they do when nothing is converted); the resume is still exact. The lr scheduler's ``load_state_dict``
    sleeps 1 s, so that turns run at once would overlap."""
    checkpoint = torch.load(reference["ckpt"], weights_only=False)
    for state in checkpoint["optimizer_states"][0]["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = state[key].double()
    wide = tmp_path / "float64-state.ckpt"
    torch.save(checkpoint, wide)
    config = {"trainer": "ours", "out": str(tmp_path / "out"), "max_epochs": 2, "scheduler_load_sleep": 1.0}
    result = run_ok({**config, "ckpt_path": str(wide)})
    assert_training_state_equal(result.ranks, upstream_resume)
    second = turn_intervals(result.ranks)["restore training state"]
    assert sorted(r for _, _, r in second) == [0, 1] and max_concurrent(second) == 1, sorted(second)
    started = [m for _, m in result.ranks[1]["turn_log"] if "turn for 'restore training state' started" in m]
    assert len(started) == 1 and "after waiting" in started[0], started


def test_one_rank_per_node_resumes_exactly(
    tmp_path: Path, reference: dict[str, Any], upstream_resume: dict[int, Any]
) -> None:
    """Two nodes of one rank each (as with one GPU per container), started by torchrun: every rank takes its turn at
    once, and the resume is exact."""
    import socket

    from harness.processes import kill_job, start_job
    from tests.helpers.launch import JOB

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = {"trainer": "ours", "out": str(tmp_path), "max_epochs": 2, "ckpt_path": reference["ckpt"]}
    config.update(devices=1, num_nodes=2)
    torchrun = ["-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--master-addr=127.0.0.1"]
    procs = [
        start_job(
            JOB,
            config,
            cwd=tmp_path,
            env=job_env(),
            stdout=subprocess.PIPE,
            text=True,
            argv=[*torchrun, f"--master-port={port}", f"--node-rank={node}"],
        )
        for node in (0, 1)
    ]
    try:
        outputs = [proc.communicate(timeout=JOB_TIMEOUT)[0] for proc in procs]
    finally:
        for proc in procs:
            kill_job(proc)
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    ranks = {int(p.stem[4:]): torch.load(p, weights_only=False) for p in tmp_path.glob("rank*.pt")}
    for rank in ranks.values():  # each first on its node: no wait, so an end line only
        turns = [t["event"] for t in rank["turns"] if t["stage"] == "restore modules and callbacks"]
        assert turns == ["ended"], rank["turns"]
    assert_training_state_equal(ranks, upstream_resume)


class _RecordingCuda:
    """Stands in for ``torch.cuda`` inside ``serialized_restore._restore.mapping`` only: CUDA initialised, and every
    wait on the current stream recorded with whether the checkpoint file was still mapped into the process at that
    moment."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.waits: list[bool] = []

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def current_stream(self) -> Any:
        from harness.processes import file_mappings

        recorder = self

        class Stream:
            def synchronize(self) -> None:
                recorder.waits.append(bool(file_mappings(recorder.path)))

        return Stream()


def test_device_copies_are_waited_for_before_the_checkpoint_is_dropped(
    tmp_path: Path, reference: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where CUDA is initialised, a fit restore (one process, memory-mapped) waits on the current CUDA stream at the
    end of each stage while the file is still mapped, and only then lets go of it: once the restore is over, nothing
    of the file is mapped."""
    import gc
    import types

    import pytorch_lightning as pl

    from harness.models import dataloader, make_model_class
    from harness.processes import file_mappings
    from harness.trainers import quiet_cpu_trainer_kwargs
    from serialized_restore import Trainer
    from serialized_restore._restore import mapping

    ckpt = tmp_path / "epoch1.ckpt"
    ckpt.write_bytes(Path(reference["ckpt"]).read_bytes())
    cuda = _RecordingCuda(str(ckpt))
    torch_with_cuda = types.ModuleType("torch")
    torch_with_cuda.__getattr__ = lambda name: getattr(torch, name)  # type: ignore[method-assign]
    torch_with_cuda.cuda = cuda  # type: ignore[attr-defined]
    monkeypatch.setattr(mapping, "torch", torch_with_cuda)
    mapped_after: list[bool] = []

    class MappedAfterRestore(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            gc.collect()
            mapped_after.append(bool(file_mappings(str(ckpt))))

    kwargs = quiet_cpu_trainer_kwargs(str(tmp_path), 1, "auto", max_epochs=2, callbacks=[MappedAfterRestore()])
    trainer = Trainer(serialized_checkpoint_loading=True, enable_checkpointing=False, **kwargs)
    trainer.fit(make_model_class("pytorch_lightning")(), train_dataloaders=dataloader(), ckpt_path=str(ckpt))
    assert len(cuda.waits) >= 2 and all(cuda.waits), cuda.waits
    assert mapped_after == [False]
