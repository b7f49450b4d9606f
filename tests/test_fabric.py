"""Lightning Fabric: ``fabric.load`` / ``fabric.load_raw`` with ``serialized_checkpoint_loading`` against upstream's.

Real Fabric jobs (CPU, gloo), launched by Fabric's own launcher or by ``torchrun``; every rank's end state, the
returned remainder and the errors are compared with upstream ``Fabric`` loading the same checkpoint.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.processes import job_env, kill_job, start_job
from tests.helpers.checks import (
    JOB_TIMEOUT,
    assert_same,
    max_concurrent,
    ran_at_once,
    shared_job,
    turn_intervals,
)
from tests.helpers.launch import JobResult, run_job

JOB = Path(__file__).with_name("helpers") / "fabric_job.py"
STAGE = "load checkpoint"
COPY_STAGE = "copy what is kept"


def _run(config: dict[str, Any], launcher: str = "fabric") -> JobResult:
    if launcher == "fabric":
        return run_job(config, timeout=JOB_TIMEOUT, script=JOB)
    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}"]
    proc = start_job(JOB, config, cwd=out, env=job_env(), stdout=subprocess.PIPE, text=True, argv=argv)
    try:
        output, _ = proc.communicate(timeout=JOB_TIMEOUT)
    finally:
        kill_job(proc)
    ranks = {int(p.stem[4:]): torch.load(p, weights_only=False) for p in out.glob("rank*.pt")}
    return JobResult(proc.returncode, 0.0, output, ranks, {})


def _ok(config: dict[str, Any], launcher: str = "fabric") -> dict[int, Any]:
    result = _run(config, launcher)
    assert result.returncode == 0 and not result.errors, (result.output[-6000:], result.errors)
    assert sorted(result.ranks) == list(range(config.get("devices", 2))), result.output[-3000:]
    return result.ranks


@pytest.fixture(scope="module")
def upstream_fsdp_load(tmp_path_factory: pytest.TempPathFactory, fabric_saved: dict[str, str]) -> dict[int, Any]:
    """Upstream Fabric's FSDP ``load`` of the DDP job's full checkpoint, then 2 more training steps."""
    config = {"fabric": "upstream", "action": "load", "ckpt_path": fabric_saved["ckpt"], "strategy": "fsdp"}
    return shared_job(tmp_path_factory, "fabric-upstream-fsdp-load", config, script=JOB)


def _assert_same_end_state(ours: dict[int, Any], upstream: dict[int, Any], keys: tuple[str, ...]) -> None:
    assert sorted(ours) == sorted(upstream)
    for rank in upstream:
        for key in keys:
            assert_same(ours[rank][key], upstream[rank][key], f"rank {rank}: {key}")


def _assert_took_turns(ranks: dict[int, Any], one_at_a_time: bool = False) -> None:
    """Every rank loaded (``one_at_a_time``: in its turn, in local rank order; else, memory-mapped, with the node's
    ranks at once), then copied what it keeps (all at once)."""
    intervals = turn_intervals(ranks)
    assert sorted(intervals) == [COPY_STAGE, STAGE], intervals
    for stage in (STAGE, COPY_STAGE):
        assert sorted(r for _, _, r in intervals[stage]) == sorted(ranks), intervals
    if one_at_a_time:
        assert max_concurrent(intervals[STAGE]) == 1, sorted(intervals[STAGE])
        assert [r for _, _, r in sorted(intervals[STAGE])] == sorted(ranks), "not in local rank order"
    else:
        assert ran_at_once(ranks, STAGE), [got["turns"] for got in ranks.values()]
    last_load = max(end for _, end, _ in intervals[STAGE])
    # a copy's start is its end record's time less the duration the record carries
    copies = intervals[COPY_STAGE]
    assert all(start >= last_load for start, _, _ in copies), (last_load, copies)


@pytest.mark.parametrize(("launcher", "flavour"), [("fabric", "lightning_fabric"), ("torchrun", "lightning")])
def test_load_equals_upstream_and_keeps_nothing_backed_by_the_file(
    tmp_path: Path,
    fabric_saved: dict[str, str],
    fabric_upstream_load: dict[int, Any],
    request: pytest.FixtureRequest,
    launcher: str,
    flavour: str,
) -> None:
    """`fabric.load(path, state)` ends every rank exactly as upstream's load does (weights, optimizer, scheduler, a
    stateful object, plain values put into `state`, the returned remainder, and 2 more training steps): with `True`
    the memory-mapped load with the node's ranks at once, with `k = 1` one at a time; nothing they keep lies in the
    file's pages. (Upstream's end state, the same under either launcher, comes from one upstream job per test session;
    ours under Fabric's launcher is the first load of the session's job of our DDP loads.)"""
    if launcher == "fabric":  # that job's loads are `lightning_fabric`'s, with `True`
        ours = {rank: got["load"] for rank, got in request.getfixturevalue("fabric_ours_loads").items()}
    else:
        config = {"action": "load", "ckpt_path": fabric_saved["ckpt"], "flavour": flavour, "fabric": "ours"}
        ours = _ok({**config, "serialized": 1, "out": str(tmp_path / "ours")}, launcher)
    upstream = fabric_upstream_load
    keys = ("params", "optimizer", "scheduler", "counter", "plain_state", "remainder")
    _assert_same_end_state(ours, upstream, keys)
    assert set(ours[0]["remainder"]) == {"note"} and ours[0]["plain_state"]["step"] == 3
    _assert_took_turns(ours, one_at_a_time=launcher == "torchrun")
    for rank, got in ours.items():
        assert got["file_backed"] == [], f"rank {rank}: tensors still in the file's pages: {got['file_backed']}"
        ended = [t for t in got["turns"] if t["event"] == "ended"]
        assert [(t["stage"], t["reader"]) for t in ended] == [(STAGE, "mmap"), (COPY_STAGE, "")], ended
        assert ended[0]["bytes_read"] > 0 and ended[1]["bytes_copied"] > 0, ended


def test_load_of_the_whole_checkpoint_and_load_raw_equal_upstream(
    fabric_upstream_loads: dict[int, Any], fabric_ours_loads: dict[int, Any]
) -> None:
    """`fabric.load(path)` returns upstream's whole checkpoint, in private memory; `fabric.load_raw` of a module's
    and an optimizer's state dict files restores them as upstream's does; both in turns (each side's loads come from
    the session's job of that side's DDP loads, which runs them one after the other, after its `load`)."""
    upstream, ours = fabric_upstream_loads, fabric_ours_loads
    for action in ("load_full", "load_raw"):
        keys = ("params", "optimizer", "scheduler") + (("remainder",) if action == "load_full" else ())
        _assert_same_end_state(
            {r: got[action] for r, got in ours.items()}, {r: got[action] for r, got in upstream.items()}, keys
        )
        for rank, got in ours.items():
            assert got[action]["file_backed"] == [], f"{action}, rank {rank}: {got[action]['file_backed']}"
            lines = got[action]["turn_log"]
            assert any("turn for 'load checkpoint' ended" in m for _, m in lines), (action, rank)


_FAILING_LOADS = [
    ("missing file", {"ckpt_path": "does-not-exist.ckpt"}),
    ("key not in the checkpoint, strict", {"missing_keys": ["absent"]}),
]


def test_failures_raise_upstreams_exception_type_on_every_rank(tmp_path: Path, fabric_saved: dict[str, str]) -> None:
    """A load that fails raises on every rank an exception of upstream's type: one rank at a time (k = 1), rank 0,
    which failed, its own; the other rank a CheckpointRestoreError naming rank 0; the job ends non-zero, and the
    checkpoint file is left as it was.
    (The failing loads run one after the other in one job per side, each on a state of its own, the job raising once
    the last has failed.)"""
    before = Path(fabric_saved["ckpt"]).read_bytes()
    loads = [{"action": "load", **config} for _, config in _FAILING_LOADS]
    common = {"action": loads, "keep_going": True, "ckpt_path": fabric_saved["ckpt"]}
    upstream = _run({**common, "fabric": "upstream", "out": str(tmp_path / "upstream")})
    ours = _run({**common, "fabric": "ours", "serialized": 1, "out": str(tmp_path / "ours")})
    assert upstream.returncode != 0 and ours.returncode != 0
    assert sorted(upstream.errors) == sorted(ours.errors) == [0, 1], (upstream.errors, ours.errors)
    for rank in (0, 1):
        assert len(upstream.errors[rank]["cases"]) == len(ours.errors[rank]["cases"]) == len(_FAILING_LOADS), rank
        for (case, _), theirs, mine in zip(_FAILING_LOADS, upstream.errors[rank]["cases"], ours.errors[rank]["cases"]):
            assert theirs is not None and mine is not None, (case, rank, theirs, mine)
            assert theirs["type"] in mine["mro"], f"{case}, rank {rank}: {mine['mro']} lacks {theirs['type']}"
            if rank == 0:
                assert mine["type"] == theirs["type"] and "CheckpointRestoreError" not in mine["mro"], (case, mine)
            else:
                assert "CheckpointRestoreError" in mine["mro"] and "rank 0" in mine["message"], (case, mine)
    assert Path(fabric_saved["ckpt"]).read_bytes() == before


def test_strategy_overriding_load_warns_once_and_loads_as_upstream(
    tmp_path: Path, fabric_saved: dict[str, str], fabric_upstream_load: dict[int, Any]
) -> None:
    """A DDP strategy that overrides `load_checkpoint` gets one warning and upstream's load, with no turns."""
    config = {"action": "load", "ckpt_path": fabric_saved["ckpt"], "strategy": "ddp_overriding_load", "fabric": "ours"}
    result = _run({**config, "out": str(tmp_path / "ours")})
    assert result.returncode == 0 and not result.errors, result.output[-4000:]
    # the strategy's override only calls upstream's method: its load is upstream's DDP load
    _assert_same_end_state(
        result.ranks, fabric_upstream_load, ("params", "optimizer", "scheduler", "counter", "remainder")
    )
    assert result.output.count("has no effect with DDPOverridingLoad: it overrides load_checkpoint") == 1
    assert not turn_intervals(result.ranks)


@pytest.mark.parametrize(("launcher", "flavour"), [("fabric", "lightning_fabric"), ("torchrun", "lightning")])
def test_fsdp_full_checkpoint_loads_together_memory_mapped_and_equals_upstream(
    tmp_path: Path, fabric_saved: dict[str, str], upstream_fsdp_load: dict[int, Any], launcher: str, flavour: str
) -> None:
    """Under Fabric's FSDP, `fabric.load` of a full checkpoint (here the DDP job's: a model moving to FSDP) runs on
    every rank together, memory-mapped, and ends every rank exactly as upstream's FSDP load does: each rank's
    shards of the weights and of the optimizer state, the scheduler, a stateful object, plain values, the remainder,
    and 2 more training steps; nothing a rank keeps lies in the file's pages."""
    config = {"action": "load", "ckpt_path": fabric_saved["ckpt"], "strategy": "fsdp", "flavour": flavour}
    result = _run({**config, "fabric": "ours", "out": str(tmp_path / "ours")}, launcher)
    upstream = upstream_fsdp_load
    assert result.returncode == 0 and not result.errors, (result.output[-6000:], result.errors)
    ours = result.ranks
    _assert_same_end_state(ours, upstream, ("params", "optimizer", "scheduler", "counter", "plain_state", "remainder"))
    assert set(ours[0]["remainder"]) == {"note"} and ours[0]["plain_state"]["step"] == 3
    # each rank holds a shard: fewer moments than the model (fabric_job's 32-32-1 MLP) has parameters
    parameters = 32 * 32 + 32 + 32 + 1
    for rank, got in ours.items():
        moments = sum(s["exp_avg"].numel() for s in got["optimizer"]["state"].values())
        assert 0 < moments < parameters, (rank, moments)
    assert result.output.count("FSDP loads with collectives, so its ranks load together") == 1, result.output[-3000:]
    intervals = turn_intervals(ours)
    assert STAGE not in intervals, intervals
    assert sorted(r for _, _, r in intervals[COPY_STAGE]) == [0, 1], intervals
    for rank, got in ours.items():
        assert got["file_backed"] == [], f"rank {rank}: tensors still in the file's pages: {got['file_backed']}"


def test_fsdp_strict_key_error_is_upstreams_on_every_rank(tmp_path: Path, fabric_saved: dict[str, str]) -> None:
    """Under FSDP a key of `state` missing from the checkpoint raises upstream's exception, with upstream's message,
    on every rank (they load together: no rank waits on another), and leaves the file as it was."""
    before = Path(fabric_saved["ckpt"]).read_bytes()
    common = {"action": "load", "ckpt_path": fabric_saved["ckpt"], "strategy": "fsdp", "missing_keys": ["absent"]}
    upstream = _run({**common, "fabric": "upstream", "out": str(tmp_path / "upstream")})
    ours = _run({**common, "fabric": "ours", "serialized": 1, "out": str(tmp_path / "ours")})
    assert upstream.returncode != 0 and ours.returncode != 0
    assert sorted(upstream.errors) == sorted(ours.errors) == [0, 1], (upstream.errors, ours.errors)
    for rank in (0, 1):
        theirs, mine = upstream.errors[rank], ours.errors[rank]
        assert (mine["type"], mine["message"]) == (theirs["type"], theirs["message"]), rank
        assert "absent" in mine["message"], mine["message"]
    assert Path(fabric_saved["ckpt"]).read_bytes() == before


def test_single_process_raises_the_original_exception_and_bad_values_are_refused(tmp_path: Path) -> None:
    """One process: the original exception, unchanged; a bad option value: a ValueError naming Fabric."""
    from lightning_fabric import Fabric as UpstreamFabric

    from serialized_restore.fabric import Fabric

    with pytest.raises(ValueError, match=r"`Fabric\(serialized_checkpoint_loading=0\)` is not supported"):
        Fabric(accelerator="cpu", devices=1, serialized_checkpoint_loading=0)
    missing = str(tmp_path / "missing.ckpt")
    errors = []
    for fabric in (
        UpstreamFabric(accelerator="cpu", devices=1),
        Fabric(accelerator="cpu", devices=1, serialized_checkpoint_loading=True),
    ):
        with pytest.raises(FileNotFoundError) as info:
            fabric.load(missing, {"model": torch.nn.Linear(2, 2)})
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]


def test_fabric_load_copies_out_what_a_module_keeps_of_the_weights(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``fabric.load`` into a module with a persistent torchmetrics state (which the metric keeps instead of copying it
    from the memory-mapped checkpoint): afterwards the file is not mapped, and the state has its saved value."""
    import torchmetrics

    from serialized_restore.fabric import Fabric

    def module() -> torch.nn.Module:
        metric = torchmetrics.SumMetric()
        metric.persistent(True)
        return torch.nn.ModuleDict({"layer": torch.nn.Linear(4, 4), "metric": metric})

    fabric = Fabric(accelerator="cpu", devices=1, serialized_checkpoint_loading=True)
    saved = module()
    saved["metric"].update(torch.tensor(3.0))
    path = tmp_path / "metric.ckpt"
    fabric.save(path, {"model": saved})

    loaded = module()
    with caplog.at_level(logging.INFO):
        fabric.load(path, {"model": loaded})
    assert any(getattr(record, "turn", {}).get("reader") == "mmap" for record in caplog.records)  # it was mapped
    gc.collect()
    maps = Path("/proc/self/maps").read_text().splitlines()
    assert [line for line in maps if line.endswith(os.path.realpath(path))] == []
    assert torch.equal(loaded["metric"].sum_value, torch.tensor(3.0))
