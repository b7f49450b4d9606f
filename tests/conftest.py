"""Shared fixtures, each run once per test session: a real checkpoint written by a real 2-rank DDP job, the
uninterrupted run to compare with, upstream's resume from it; a checkpoint written by upstream Fabric on 2 ranks, and
what upstream Fabric's load of it gives every rank."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock

from tests.helpers.checks import JOB_TIMEOUT, rank_files, shared_dir, shared_job
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
    """A 1-epoch checkpoint from upstream Lightning on 2 ranks, and an uninterrupted 2-epoch run (every rank)."""
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
            full = run_job({"trainer": "upstream", "out": str(root / "epoch2"), "max_epochs": 2}, timeout=JOB_TIMEOUT)
            assert full.returncode == 0, full.output[-4000:]
            done.write_text(json.dumps({"ok": True}))
    ranks = {r: torch.load(p, weights_only=False) for r, p in rank_files(root / "epoch2").items()}
    return {"ckpt": str(root / "epoch1.ckpt"), "uninterrupted": ranks, "root": root}


@pytest.fixture(scope="session")
def upstream_resume(tmp_path_factory: pytest.TempPathFactory, reference: dict[str, Any]) -> dict[int, Any]:
    """Upstream Lightning resuming the reference checkpoint to epoch 2 on 2 ranks."""
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


@pytest.fixture(scope="session")
def fabric_upstream_load(tmp_path_factory: pytest.TempPathFactory, fabric_saved: dict[str, str]) -> dict[int, Any]:
    """Upstream Fabric's DDP ``load`` of that checkpoint into the whole state, then 2 more training steps (every
    rank's end state)."""
    config = {"fabric": "upstream", "action": "load", "ckpt_path": fabric_saved["ckpt"]}
    return shared_job(tmp_path_factory, "fabric-upstream-load", config, script=FABRIC_JOB)
