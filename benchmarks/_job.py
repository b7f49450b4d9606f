"""The program every rank of a measured job runs: train and save a checkpoint, or restore one and stop.

Usage: ``python benchmarks/_job.py '<json config>'`` (started by ``_measure.run_job``). Lightning's ``ddp`` launcher
re-runs this command line for local ranks 1..N-1, so the job's process tree is this process and its children.

A restore job marks its restore window in ``markers.jsonl`` of the run directory (one JSON line per rank and event,
``time.time()`` stamps; local rank 0 first writes ``wake`` in ``prepare_data``, which switches the parent's sampler
to full rate):

* ``start``: end of ``LightningModule.setup``, after the process group exists and before Lightning's first restore
  stage (``_restore_modules_and_callbacks``);
* ``end``: ``on_train_start`` (fit) or ``on_validation_start`` (validate), after ``resume_end``.

At ``end`` every rank also records how many bytes of optimizer state it holds (kept for training, so not restore
overhead) and how many of them still lie in a memory-mapped file (``mmap-plugin``: ``Optimizer.load_state_dict``
keeps the loaded tensors when dtype and device match, so the state stays in the checkpoint's copy-on-write mapping
until the first step writes it). Then, after a barrier so that no rank is still inside the window, it compares its
weights (and, for fit, its optimizer state and step) exactly with the checkpoint and writes ``rank<global rank>.json``.
After one more barrier every rank leaves with ``os._exit(0)``: nothing after the window is measured, and Lightning's
teardown and interpreter shutdown would cost seconds per run. The restore path itself is untouched.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

# BENCH_JOB_PROFILE=<directory>: every rank (or those in BENCH_JOB_PROFILE_RANKS, comma-separated local ranks)
# profiles itself with cProfile, in CPU time (a rank waiting for another costs nothing; other load on the machine
# barely shows), from here, before the heavy imports, to its exit: <directory>/rank<local rank>.prof
_PROFILE_DIR = os.environ.get("BENCH_JOB_PROFILE")
_PROFILE_RANKS = os.environ.get("BENCH_JOB_PROFILE_RANKS", "")
if _PROFILE_DIR and (not _PROFILE_RANKS or os.environ.get("LOCAL_RANK", "0") in _PROFILE_RANKS.split(",")):
    import atexit
    import cProfile

    _PROFILER = cProfile.Profile(time.process_time)

    def _dump_profile() -> None:
        _PROFILER.disable()
        _PROFILER.dump_stats(os.path.join(_PROFILE_DIR, f"rank{os.environ.get('LOCAL_RANK', '0')}.prof"))

    atexit.register(_dump_profile)
    _PROFILER.enable()

_SCRIPT_STARTED = time.time()

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytorch_lightning as pl  # noqa: E402
from pytorch_lightning.trainer.connectors.checkpoint_connector import _CheckpointConnector  # noqa: E402

from harness.models import (  # noqa: E402
    RegressionSteps,
    local_optimizer,
    make_cpu_fsdp_class,
    make_fabric_cpu_fsdp_class,
    make_fairscale_sharded_class,
)
from harness.processes import file_mappings, in_mappings  # noqa: E402
from harness.trainers import quiet_cpu_trainer_kwargs  # noqa: E402

warnings.filterwarnings("ignore")

# mode -> how the Trainer is built; the environment of a mode is set by the parent (see `_measure.MODES`)
TRAINER_OF_MODE: dict[str, tuple[str, Any]] = {
    "upstream": ("upstream", None),
    "baseline": ("upstream", None),
    "proposal-2021": ("proposal-2021", None),
    "ours-off": ("ours", False),
    "ours-true": ("ours", True),
    "ours-2": ("ours", 2),
    "ours-true-eager": ("ours", True),
    "mmap-plugin": ("mmap-plugin", None),
    "fsdp-baseline": ("upstream", None),
    "fsdp-upstream": ("upstream", None),
    "fsdp-ours": ("ours", True),
    "zero-upstream": ("upstream", None),
    "zero-ours": ("ours", True),
    "oss-baseline": ("upstream", None),
    "oss-upstream": ("upstream", None),
    "oss-ours": ("ours", True),
}


class MmapTorchCheckpointIO(pl.plugins.io.TorchCheckpointIO):
    """``mmap-plugin``: upstream's restore reading with ``torch.load(..., mmap=True)`` (what upstream's PR 01 adds to
    ``TorchCheckpointIO``)."""

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
        return torch.load(path, map_location=lambda storage, loc: storage, weights_only=weights_only, mmap=True)


class Proposal2021Connector(_CheckpointConnector):
    """The 2021 proposal (Lightning issue #8043): local ranks read one at a time and drop only ``state_dict``.

    (all ranks) for each local rank ``r`` in order: rank ``r`` runs upstream's first restore stage, then deletes
    ``checkpoint['state_dict']``; every rank meets the others at a barrier after each turn. Everything else, the
    optimizer state kept until ``resume_end`` included, is upstream's.
    """

    def _restore_modules_and_callbacks(self, checkpoint_path: Any = None, weights_only: Optional[bool] = None) -> None:
        if not checkpoint_path:
            super()._restore_modules_and_callbacks(checkpoint_path, weights_only)
            return
        strategy = self.trainer.strategy
        local_world_size = int(getattr(strategy, "num_processes", 1))
        strategy.barrier("proposal-2021 before turns")
        for turn in range(local_world_size):
            if self.trainer.local_rank == turn:
                super()._restore_modules_and_callbacks(checkpoint_path, weights_only)
                self._loaded_checkpoint.pop("state_dict", None)
            strategy.barrier(f"proposal-2021 turn {turn}")


class BenchMLP(RegressionSteps, pl.LightningModule):
    """``depth`` square linear layers of ``width`` features (``depth * (width**2 + width)`` parameters), Adam."""

    def __init__(self, width: int, depth: int, run: Optional[dict[str, Any]] = None, zero_init: bool = False) -> None:
        super().__init__()
        self.net = _mlp(width, depth, zero_init)
        self.run = run or {}

    def configure_optimizers(self) -> Any:
        if self.run.get("optimizer") == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    # ------------------------------------------------------------ restore window

    def prepare_data(self) -> None:
        # (local rank 0, after the process group is up, right before `setup`) wakes the parent's sampler
        self._mark("wake")

    def setup(self, stage: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._mark("start")

    def on_train_start(self) -> None:
        self._end_window()

    def on_validation_start(self) -> None:
        self._end_window()

    def _mark(self, event: str, **extra: Any) -> None:
        if self.run:
            _mark(Path(self.run["out"]), self.global_rank, event, **extra)

    def _end_window(self) -> None:
        if not self.run:
            return
        ended = time.time()
        optimizer_bytes, mapped_bytes = _host_optimizer_state_bytes(self.trainer.optimizers)
        on_gpu = self.device.type == "cuda"
        gpu = {
            "gpu_bytes": torch.cuda.memory_allocated(self.device) if on_gpu else None,
            "gpu_peak_bytes": torch.cuda.max_memory_allocated(self.device) if on_gpu else None,
        }
        self._mark("end", optimizer_state_bytes=optimizer_bytes, optimizer_state_mapped_bytes=mapped_bytes)
        # nobody starts checking (which maps the file) before every rank has left the window
        self.trainer.strategy.barrier("restore window end")
        mismatches = self._compare_with_checkpoint() if self.run.get("ckpt_path") else []
        result = {
            "global_rank": self.global_rank,
            "local_rank": self.local_rank,
            "pid": os.getpid(),
            "end": ended,
            "optimizer_state_bytes": optimizer_bytes,
            "optimizer_state_mapped_bytes": mapped_bytes,
            "checked": bool(self.run.get("ckpt_path")),
            "exact": not mismatches,
            "mismatches": mismatches[:20],
            "global_step": self.trainer.global_step,
            **gpu,
        }
        _report_and_exit(
            Path(self.run["out"]), result, lambda: self.trainer.strategy.barrier("restore reports written")
        )

    def _compare_with_checkpoint(self) -> list[str]:
        """Names of everything restored that differs from the checkpoint (bit for bit); empty when exact."""
        reference = torch.load(self.run["ckpt_path"], mmap=True, weights_only=False, map_location="cpu")
        if self.run.get("strategy") in ("fsdp_cpu", "fsdp"):
            return self._compare_fsdp_with_checkpoint(reference)
        mismatches = []
        ours = self.state_dict()
        theirs = reference["state_dict"]
        if sorted(ours) != sorted(theirs):
            mismatches.append(f"state_dict keys: {sorted(set(ours) ^ set(theirs))}")
        mismatches += [f"state_dict[{k!r}]" for k in theirs if k in ours and not _equal(ours[k], theirs[k])]
        if self.trainer.state.fn == "fit":
            if self.trainer.global_step != reference["global_step"]:
                mismatches.append(f"global_step {self.trainer.global_step} != {reference['global_step']}")
            restored = [_local_state_dict(optimizer, self) for optimizer in self.trainer.optimizers]
            saved = [_owned(ref, mine) for ref, mine in zip(reference["optimizer_states"], restored)]
            if len(restored) != len(saved):
                mismatches.append(f"{len(restored)} optimizers, checkpoint has {len(saved)}")
            for i, (mine, ref) in enumerate(zip(restored, saved)):
                if sorted(mine["state"]) != sorted(ref["state"]):
                    mismatches.append(f"optimizer {i}: state of parameters {sorted(mine['state'])}")
                for pid, state in ref["state"].items():
                    for key, value in state.items():
                        if not _equal(mine["state"].get(pid, {}).get(key), value):
                            mismatches.append(f"optimizer {i} state[{pid}][{key!r}]")
        return mismatches

    def _compare_fsdp_with_checkpoint(self, reference: dict[str, Any]) -> list[str]:
        """(all ranks) As ``_compare_with_checkpoint``, for FSDP (:func:`_fsdp_mismatches`)."""
        model = self.trainer.strategy.model
        assert model is not None
        fitting = self.trainer.state.fn == "fit"
        mismatches = _fsdp_mismatches(
            model,
            self,
            reference["state_dict"],
            self.trainer.optimizers if fitting else [],
            reference["optimizer_states"],
            checking=self.global_rank == 0,
        )
        if fitting and self.trainer.global_step != reference["global_step"]:
            mismatches.append(f"global_step {self.trainer.global_step} != {reference['global_step']}")
        return mismatches


def _fsdp_mismatches(
    model: Any,
    module: torch.nn.Module,
    saved_weights: dict[str, Any],
    optimizers: list[Any],
    saved_optimizers: list[dict[str, Any]],
    checking: bool,
) -> list[str]:
    """(all ranks) What differs between the FSDP ``model`` (its inner ``module``) and the full checkpoint's weights
    and optimizer states: the weights and optimizer state are gathered to rank 0 (complete, every rank's shard
    included) and compared there (``checking``); the other ranks report no mismatch."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
        ours = {name: tensor.clone() for name, tensor in module.state_dict().items()} if checking else {}
    mismatches = [f"state_dict[{k!r}]" for k in saved_weights if not _equal(ours.get(k), saved_weights[k])]
    if not checking:
        mismatches = []
    elif sorted(ours) != sorted(saved_weights):
        mismatches.append(f"state_dict keys: {sorted(set(ours) ^ set(saved_weights))}")
    # a checkpoint saved by DDP keys the state by parameter index, in the order of `module.parameters()`; one saved by
    # FSDP keys it by parameter name
    names = [name.replace("_fsdp_wrapped_module.", "") for name, _ in module.named_parameters()]

    def name_of(key: Any) -> str:
        return names[key] if isinstance(key, int) else str(key)

    # offload_to_cpu=False: with FSDP on CPU (torch 2.13), offloading returns the gathered state tensors of one
    # parameter aliased to each other (exp_avg reads as exp_avg_sq)
    full = (FullStateDictConfig(rank0_only=True), FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True))
    for i, (optimizer, saved) in enumerate(zip(optimizers, saved_optimizers)):
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, *full):
            restored = FSDP.optim_state_dict(model, optimizer).get("state", {})
        if not checking:
            continue
        if sorted(restored) != sorted(name_of(pid) for pid in saved["state"]):
            mismatches.append(f"optimizer {i}: state of parameters {sorted(restored)}")
        for pid, state in saved["state"].items():
            for key, value in state.items():
                if not _equal(restored.get(name_of(pid), {}).get(key), value):
                    mismatches.append(f"optimizer {i} state[{name_of(pid)!r}][{key!r}]")
    return mismatches


def _mlp(width: int, depth: int, zero_init: bool) -> torch.nn.Sequential:
    """``depth`` square linear layers; ``zero_init``: every page of the weights written (resident) as after a random
    init, at a tenth of the cost."""
    device = "meta" if zero_init else None
    net = torch.nn.Sequential(*[torch.nn.Linear(width, width, device=device) for _ in range(depth)])
    if zero_init:
        net.to_empty(device="cpu")
        with torch.no_grad():
            for parameter in net.parameters():
                parameter.zero_()
    return net


def _mark(out: Path, rank: int, event: str, **extra: Any) -> None:
    """Append one marker line (``time.time()`` stamp) to ``<out>/markers.jsonl``."""
    line = json.dumps({"rank": rank, "event": event, "t": time.time(), "pid": os.getpid(), **extra})
    with open(out / "markers.jsonl", "a") as f:
        f.write(line + "\n")


def _host_optimizer_state_bytes(optimizers: list[Any]) -> tuple[int, int]:
    """Bytes of the optimizers' state in host memory (a GPU's is counted by ``gpu_bytes``), and the part of it that
    still lies in memory-mapped file pages."""
    tensors = [
        value
        for optimizer in optimizers
        for state in local_optimizer(optimizer).state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.device.type == "cpu"
    ]
    mappings = file_mappings()
    return sum(t.nbytes for t in tensors), sum(t.nbytes for t in tensors if in_mappings(t.data_ptr(), mappings))


def _report_and_exit(out: Path, result: dict[str, Any], barrier: Callable[[], None], linger: float = 0.0) -> None:
    """Write this rank's ``rank<global rank>.json``, wait for every rank to have written its own, and leave at once:
    nothing after the window is measured, and teardown and interpreter shutdown would cost seconds per job."""
    (out / f"rank{result['global_rank']}.json").write_text(json.dumps(result))
    barrier()
    time.sleep(linger)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach().cpu(), b.detach().cpu())
    return a == b


def _local_state_dict(optimizer: Any, module: torch.nn.Module) -> dict[str, Any]:
    """The optimizer's ``state_dict``, keyed as the checkpoint is (by the parameter's index in the module): for a
    sharded optimizer, the state of the parameters this rank owns."""
    local = local_optimizer(optimizer)
    if local is optimizer:
        return optimizer.state_dict()
    index = {id(p): i for i, p in enumerate(module.parameters())}
    return {"state": {index[id(p)]: dict(state) for p, state in local.state.items()}}


def _owned(saved: dict[str, Any], restored: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's optimizer state, cut to the parameters of ``restored`` where that is a rank's shard."""
    if "param_groups" in restored:
        return saved
    return {"state": {i: saved["state"][i] for i in restored["state"] if i in saved["state"]}}


def _data(width: int, n: int, batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    dataset = TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, width, generator=g))
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


def _trainer(config: dict[str, Any], **kwargs: Any) -> pl.Trainer:
    kind, serialized = TRAINER_OF_MODE[config.get("mode", "upstream")]
    strategy: Any = config.get("strategy", "ddp")
    if strategy == "fsdp_cpu":
        # Lightning's FSDPStrategy, wrapping with device_id=cpu (its stock version requires a GPU); one FSDP unit per
        # layer
        strategy = make_cpu_fsdp_class("pytorch_lightning")(auto_wrap_policy={torch.nn.Linear}, state_dict_type="full")
    elif strategy == "fsdp":
        # Lightning's stock FSDPStrategy (GPU only), one FSDP unit per layer
        strategy = pl.strategies.FSDPStrategy(auto_wrap_policy={torch.nn.Linear}, state_dict_type="full")
    elif strategy == "fairscale_sharded":
        strategy = make_fairscale_sharded_class("pytorch_lightning")()
    if config.get("accelerator", "cpu") != "cpu":
        kwargs["accelerator"] = config["accelerator"]
    common = quiet_cpu_trainer_kwargs(config["out"], config["devices"], strategy, enable_checkpointing=False, **kwargs)
    if kind == "ours":
        from serialized_restore import Trainer

        return Trainer(serialized_checkpoint_loading=serialized, **common)
    if kind == "mmap-plugin":
        return pl.Trainer(plugins=[MmapTorchCheckpointIO()], **common)
    trainer = pl.Trainer(**common)
    if kind == "proposal-2021":
        trainer._checkpoint_connector = Proposal2021Connector(trainer)
    return trainer


def train(config: dict[str, Any]) -> None:
    """Train ``steps`` Adam steps and save the checkpoint with ``trainer.save_checkpoint``."""
    torch.manual_seed(0)
    model = BenchMLP(config["width"], config["depth"])
    steps = config["steps"]
    trainer = _trainer(config, max_steps=steps)
    trainer.fit(model, train_dataloaders=_data(config["width"], 4 * steps * config["devices"], 4))
    trainer.save_checkpoint(config["ckpt_path"])
    if trainer.global_rank == 0:
        meta = {
            "params": sum(p.numel() for p in model.parameters()),
            "width": config["width"],
            "depth": config["depth"],
            "global_step": trainer.global_step,
            "size_bytes": os.path.getsize(config["ckpt_path"]),
        }
        Path(config["meta_path"]).write_text(json.dumps(meta, indent=1))


def restore(config: dict[str, Any]) -> None:
    """Restore through ``trainer.fit`` or ``trainer.validate`` (or, without a checkpoint, run the same baseline)."""
    torch.manual_seed(0)
    model = BenchMLP(config["width"], config["depth"], run=config, zero_init=True)
    ckpt_path = config.get("ckpt_path")
    data = _data(config["width"], 8 * config["devices"], 4)
    if config["entry"] == "fit":
        trainer = _trainer(config, max_steps=config["global_step"] + 1)
        trainer.fit(model, train_dataloaders=data, ckpt_path=ckpt_path)
    else:
        trainer = _trainer(config, limit_val_batches=1)
        trainer.validate(model, dataloaders=data, ckpt_path=ckpt_path, verbose=False)


class PhaseMarks(pl.Callback):
    """The whole-process job's phases: each rank appends ``(event, time.time())`` lines to ``markers.jsonl``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # after the process group exists, before the first restore stage
        _mark(self.out, trainer.global_rank, "setup", cpu=time.process_time())

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after the first restore stage and DDP's setup, before the second stage
        _mark(self.out, trainer.global_rank, "fit_start", cpu=time.process_time())

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after the second stage, the (skipped) fit loop and the Trainer's teardown
        _mark(self.out, trainer.global_rank, "fit_end", cpu=time.process_time())


def resume_whole(config: dict[str, Any]) -> None:
    """Restore only, as a whole process: ``trainer.fit(ckpt_path=...)`` with ``max_steps`` equal to the checkpoint's
    step, so that Lightning restores, skips the fit loop, tears down and returns; then the interpreter exits as any
    script does (no ``os._exit``). Nothing is checked or sampled: the parent times the process tree from its start
    to the exit of its last process. Each rank marks its phases (``PhaseMarks``, plus ``imported`` at the end of
    this script's imports and ``exit`` with its CPU time and page faults at interpreter exit, from ``atexit``)."""
    import atexit
    import resource

    out = Path(config["out"])
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))

    def at_exit() -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        _mark(
            out, rank, "exit", cpu=usage.ru_utime + usage.ru_stime, cpu_user=usage.ru_utime, cpu_sys=usage.ru_stime,
            minflt=usage.ru_minflt, majflt=usage.ru_majflt, maxrss_kib=usage.ru_maxrss, script_started=_SCRIPT_STARTED,
            modules=len(sys.modules), lightning_imported="lightning" in sys.modules,
            jsonargparse_imported="jsonargparse" in sys.modules,
        )  # fmt: skip

    # registered first, so it runs last of the handlers registered in this process
    atexit.register(at_exit)
    _mark(out, rank, "imported", script_started=_SCRIPT_STARTED, cpu=time.process_time())
    torch.manual_seed(0)
    model = BenchMLP(config["width"], config["depth"], zero_init=True)
    trainer = _trainer(config, max_steps=config["global_step"], callbacks=[PhaseMarks(out)])
    data = _data(config["width"], 8 * config["devices"], 4)
    trainer.fit(model, train_dataloaders=data, ckpt_path=config["ckpt_path"])
    _mark(out, trainer.global_rank, "returned", cpu=time.process_time())


def fabric_restore(config: dict[str, Any]) -> None:
    """``fabric.load(path, {"model", "optimizer", "step"})`` under Fabric's DDP (or, without a checkpoint, the same
    program up to that call), its window marked around the call; then the same checks and report as ``restore``."""
    from lightning_fabric import Fabric

    from serialized_restore.fabric import Fabric as SerializedFabric

    fsdp = config.get("strategy") == "fsdp_cpu"
    # Fabric's FSDPStrategy wrapping with device_id=cpu (its stock version requires a GPU); one FSDP unit per layer
    strategy = (
        make_fabric_cpu_fsdp_class("lightning_fabric")(auto_wrap_policy={torch.nn.Linear}, state_dict_type="full")
        if fsdp
        else "ddp"
    )
    kwargs = {"accelerator": config.get("accelerator", "cpu"), "devices": config["devices"], "strategy": strategy}
    ours = "-ours" in config["mode"]
    fabric = SerializedFabric(serialized_checkpoint_loading=True, **kwargs) if ours else Fabric(**kwargs)
    fabric.launch()
    torch.manual_seed(0)
    net = _mlp(config["width"], config["depth"], zero_init=True)
    model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
    out, rank = Path(config["out"]), fabric.global_rank
    if fabric.local_rank == 0:
        _mark(out, rank, "wake")
    fabric.barrier()
    _mark(out, rank, "start")
    if config.get("ckpt_path"):
        fabric.load(config["ckpt_path"], {"model": model, "optimizer": optimizer, "step": 0})
    ended = time.time()
    optimizer_bytes, mapped_bytes = _host_optimizer_state_bytes([optimizer.optimizer])
    _mark(out, rank, "end", optimizer_state_bytes=optimizer_bytes, optimizer_state_mapped_bytes=mapped_bytes)
    fabric.barrier()
    mismatches: list[str] = []
    if config.get("ckpt_path") and fsdp:
        reference = torch.load(config["ckpt_path"], mmap=True, weights_only=False, map_location="cpu")
        inner = model._forward_module
        checking = fabric.global_rank == 0
        mismatches += _fsdp_mismatches(
            inner, net, reference["model"], [optimizer.optimizer], [reference["optimizer"]], checking
        )
    elif config.get("ckpt_path"):
        reference = torch.load(config["ckpt_path"], mmap=True, weights_only=False, map_location="cpu")
        ours_state = net.state_dict()
        mismatches += [f"model[{k!r}]" for k, v in reference["model"].items() if not _equal(ours_state.get(k), v)]
        restored = optimizer.optimizer.state_dict()["state"]
        for pid, state in reference["optimizer"]["state"].items():
            mismatches += [f"optimizer[{pid}][{k!r}]" for k, v in state.items() if not _equal(restored[pid][k], v)]
    result = {
        "global_rank": fabric.global_rank,
        "local_rank": fabric.local_rank,
        "pid": os.getpid(),
        "end": ended,
        "optimizer_state_bytes": optimizer_bytes,
        "optimizer_state_mapped_bytes": mapped_bytes,
        "checked": bool(config.get("ckpt_path")),
        "exact": not mismatches,
        "mismatches": mismatches[:20],
        "global_step": 0,
        "gpu_bytes": None,
        "gpu_peak_bytes": None,
    }
    # the window of a job without fabric.load lasts about a millisecond, with no memory sample inside it: the sampler
    # then takes the samples on either side, and lingering keeps the ranks (and their memory) alive for the one after
    _report_and_exit(out, result, fabric.barrier, linger=0.1)


def main(config: dict[str, Any]) -> None:
    try:
        {"train": train, "restore": restore, "fabric": fabric_restore, "whole": resume_whole}[config["action"]](config)
    except BaseException:
        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
        (Path(config["out"]) / f"rank{rank}.error.txt").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
