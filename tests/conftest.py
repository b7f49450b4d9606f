"""Shared fixtures, each run once per test session: a real checkpoint written by a real 2-rank DDP job and upstream's
resume from it, which every resume of it is compared with; a checkpoint written by upstream Fabric on 2 ranks, its
copy as a GPU job writes it, and what upstream Fabric's DDP loads of it give every rank, and ours."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from tests.helpers.checks import JOB_TIMEOUT, shared_cuda_tagged, shared_dir, shared_job
from tests.helpers.launch import run_job

# TCPStore resolves the name of every peer that connects; where the resolver is slow to answer (as in some sandboxes
# and CI containers) one lookup stalls the store for its default 5 s timeout, which the tests' prompt bounds would
# count as the restore's. Every process the tests start inherits this (as benchmarks/scale.py sets it too).
os.environ.setdefault("RES_OPTIONS", "attempts:1 timeout:1")
# every process the tests start collects cyclic garbage less often (tests/helpers/site/sitecustomize.py says why)
_SITE = os.path.join(os.path.dirname(__file__), "helpers", "site")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_SITE, os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 1-epoch checkpoint from upstream Lightning on 2 ranks."""
    root = shared_dir(tmp_path_factory)
    root.mkdir(parents=True, exist_ok=True)
    done = root / "done.json"
    with FileLock(str(root / "lock")):
        if not done.exists():
            first = run_job(
                {"trainer": "upstream", "out": str(root / "epoch1"), "save_ckpt": str(root / "epoch1.ckpt")},
                timeout=JOB_TIMEOUT,
            )
            assert first.returncode == 0, first.output[-4000:]
            done.write_text(json.dumps({"ok": True}))
    return {"ckpt": str(root / "epoch1.ckpt"), "root": root}


@pytest.fixture(scope="session")
def upstream_resume(tmp_path_factory: pytest.TempPathFactory, reference: dict[str, Any]) -> dict[int, Any]:
    """Upstream Lightning resuming the reference checkpoint to epoch 2 on 2 ranks: every rank's end state, which
    every resume of it in the tests must end in exactly."""
    config = {"trainer": "upstream", "max_epochs": 2, "ckpt_path": reference["ckpt"]}
    return shared_job(tmp_path_factory, "upstream-resume", config)


FABRIC_JOB = Path(__file__).with_name("helpers") / "fabric_job.py"


@pytest.fixture(scope="session")
def fabric_saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A checkpoint saved by upstream Fabric on 2 ranks (model, optimizer, scheduler, a stateful object, plain
    values), and the module's and the optimizer's plain state dicts."""
    root = shared_dir(tmp_path_factory) / "fabric-files"
    root.mkdir(parents=True, exist_ok=True)
    paths = {
        "ckpt": str(root / "fabric.ckpt"),
        "module": str(root / "module.pt"),
        "optimizer": str(root / "optimizer.pt"),
    }
    config = {
        "fabric": "upstream",
        "action": "save",
        "save_path": paths["ckpt"],
        "raw_module_path": paths["module"],
        "raw_optimizer_path": paths["optimizer"],
    }
    shared_job(tmp_path_factory, "fabric-save", config, script=FABRIC_JOB)
    return paths


def _fabric_loads(fabric: str, fabric_saved: dict[str, str]) -> dict[str, Any]:
    """A DDP Fabric job (Fabric's launcher, 2 ranks) of these loads, one after the other in the same processes, each
    into a fresh model and optimizer: ``load`` of the checkpoint into the whole state, then 2 more training steps;
    ``load_full``, the whole checkpoint; ``load_raw`` of the module's and the optimizer's state dict files."""
    return {
        "fabric": fabric,
        "action": ["load", "load_full", "load_raw"],
        "ckpt_path": fabric_saved["ckpt"],
        "raw_module_path": fabric_saved["module"],
        "raw_optimizer_path": fabric_saved["optimizer"],
    }


def _every_rank(tmp_path_factory: pytest.TempPathFactory, name: str, config: dict[str, Any]) -> dict[int, Any]:
    ranks = shared_job(tmp_path_factory, name, config, script=FABRIC_JOB)
    assert sorted(ranks) == [0, 1], f"{name}: results of ranks {sorted(ranks)}"
    return ranks


@pytest.fixture(scope="session")
def fabric_upstream_loads(tmp_path_factory: pytest.TempPathFactory, fabric_saved: dict[str, str]) -> dict[int, Any]:
    """Upstream Fabric's DDP loads of that checkpoint and of the state dict files (``_fabric_loads``): every rank's
    result of each, by action."""
    return _every_rank(tmp_path_factory, "fabric-upstream-loads", _fabric_loads("upstream", fabric_saved))


@pytest.fixture(scope="session")
def fabric_upstream_load(fabric_upstream_loads: dict[int, Any]) -> dict[int, Any]:
    """Upstream Fabric's DDP ``load`` of that checkpoint into the whole state, then 2 more training steps (every
    rank's end state; the first load of its job)."""
    return {rank: got["load"] for rank, got in fabric_upstream_loads.items()}


@pytest.fixture(scope="session")
def fabric_gpu_checkpoint(tmp_path_factory: pytest.TempPathFactory, fabric_saved: dict[str, str]) -> str:
    """The checkpoint upstream Fabric saved on 2 ranks, as a GPU job writes it (``shared_cuda_tagged``)."""
    return shared_cuda_tagged(tmp_path_factory, fabric_saved["ckpt"], "fabric-cuda.ckpt")


@pytest.fixture(scope="session")
def fabric_ours_loads(
    tmp_path_factory: pytest.TempPathFactory, fabric_saved: dict[str, str], fabric_gpu_checkpoint: str
) -> dict[int, Any]:
    """Our Fabric's DDP loads, in turns with the default settings (``lightning_fabric``): upstream's
    (``_fabric_loads``), then ``load_gpu``, ``load`` of the GPU job's copy of the checkpoint (every rank's result of
    each, by name)."""
    config = _fabric_loads("ours", fabric_saved)
    load_gpu = {"action": "load", "name": "load_gpu", "ckpt_path": fabric_gpu_checkpoint}
    config.update(flavour="lightning_fabric", action=[*config["action"], load_gpu])
    return _every_rank(tmp_path_factory, "fabric-ours-loads", config)
