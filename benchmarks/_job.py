"""The program every rank of a measured job runs: train and save a checkpoint; restore one and stop; restore one as a
whole process; or copy what a rank keeps (the floor).

Usage: ``python benchmarks/_job.py '<json config>'`` (``_measure.job_config``). Lightning's launcher re-runs this
command line for local ranks 1..N-1, so the job's process tree is this process and its children.

A restore job marks its window in ``markers.jsonl`` of the run directory (one JSON line per rank and event,
``time.time()`` stamps; local rank 0 first writes ``wake``, in ``prepare_data``, which sets the parent's sampler to
full rate): ``start`` at the end of ``LightningModule.setup`` (the process group exists, no restore stage has run);
``end`` at ``on_train_start`` (fit) or ``on_validation_start`` (validate), after ``resume_end``. At ``end`` every rank
also records the bytes of optimizer state it holds (kept for training, so not restore overhead) and how many of them
still lie in a memory-mapped file (``mmap-plugin``: ``Optimizer.load_state_dict`` keeps the loaded tensors, so the
state stays in the checkpoint's copy-on-write mapping until the first step writes it). After a barrier it compares
what it restored with the checkpoint, bit for bit, writes ``rank<global rank>.json`` and, after one more barrier,
leaves with ``os._exit(0)``: nothing after the window is measured. The restore path itself is untouched. The
``start`` and ``end`` markers also carry the rank's page faults and storage reads so far (``_io``).
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


class MmapTorchCheckpointIO(pl.plugins.io.TorchCheckpointIO):
    """``mmap-plugin``: upstream's restore reading with ``torch.load(..., mmap=True)`` (what upstream's PR 01 adds to
    ``TorchCheckpointIO``)."""

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
        return torch.load(path, map_location=lambda storage, loc: storage, weights_only=weights_only, mmap=True)


class Proposal2021Connector(_CheckpointConnector):
    """The 2021 proposal (Lightning issue #8043): local ranks read one at a time and drop only ``state_dict``: for each
    local rank in order, it runs upstream's first restore stage and deletes ``checkpoint['state_dict']``, and every
    rank meets the others at a barrier after each turn. The rest, the optimizer state kept until ``resume_end``
    included, is upstream's."""

    def _restore_modules_and_callbacks(self, checkpoint_path: Any = None, weights_only: Optional[bool] = None) -> None:
        if not checkpoint_path:
            super()._restore_modules_and_callbacks(checkpoint_path, weights_only)
            return
        strategy = self.trainer.strategy
        strategy.barrier("proposal-2021 before turns")
        for turn in range(int(getattr(strategy, "num_processes", 1))):
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

    def prepare_data(self) -> None:
        # (local rank 0, after the process group is up, right before `setup`) wakes the parent's sampler
        if self.run:
            _mark(Path(self.run["out"]), self.global_rank, "wake")

    def setup(self, stage: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.run:
            _mark(Path(self.run["out"]), self.global_rank, "start", **_io())
            _profile_window(start=True)

    def on_train_start(self) -> None:
        self._end_window()

    def on_validation_start(self) -> None:
        self._end_window()

    def _end_window(self) -> None:
        if not self.run:
            return
        on_gpu = self.device.type == "cuda"
        gpu = (torch.cuda.memory_allocated(self.device), torch.cuda.max_memory_allocated(self.device)) if on_gpu else ()
        strategy, fitting = self.trainer.strategy, self.trainer.state.fn == "fit"
        optimizers = self.trainer.optimizers if fitting else []

        def compare(reference: dict[str, Any]) -> list[str]:
            mismatches = []
            if fitting and self.trainer.global_step != reference["global_step"]:
                mismatches.append(f"global_step {self.trainer.global_step} != {reference['global_step']}")
            if self.run.get("strategy") in ("fsdp_cpu", "fsdp"):
                assert strategy.model is not None
                return mismatches + _fsdp_mismatches(
                    strategy.model, self, reference["state_dict"], optimizers, reference["optimizer_states"]
                )
            restored = [local_state(optimizer, self) for optimizer in optimizers]
            saved = [
                _owned(ref["state"], mine, o)
                for ref, mine, o in zip(reference["optimizer_states"], restored, optimizers)
            ]
            return mismatches + _mismatches(self.state_dict(), reference["state_dict"], restored, saved)

        _finish(self.run, self.global_rank, self.trainer.optimizers, strategy.barrier, compare, gpu)


def _finish(
    run: dict[str, Any],
    rank: int,
    optimizers: list[Any],
    barrier: Callable[..., Any],
    compare: Callable[[dict[str, Any]], list[str]],
    gpu: tuple[int, ...] = (),
    linger: float = 0.0,
) -> None:
    """The end of a restore window: mark it with the optimizer state held, wait for every rank to leave the window,
    compare what was restored with the checkpoint (loaded memory-mapped), write ``rank<rank>.json`` and, once every
    rank has, leave at once: teardown and interpreter shutdown would cost seconds per job, and are not measured."""
    out = Path(run["out"])
    _profile_window(start=False, path=out / f"rank{rank}.prof")
    held, mapped = _host_optimizer_state_bytes(optimizers)
    _mark(out, rank, "end", optimizer_state_bytes=held, optimizer_state_mapped_bytes=mapped, **_io())
    barrier()  # nobody starts checking (which maps the file) before every rank has left the window
    checked = bool(run.get("ckpt_path"))
    reference = torch.load(run["ckpt_path"], mmap=True, weights_only=False, map_location="cpu") if checked else None
    mismatches = compare(reference) if reference is not None else []
    result = {
        "global_rank": rank,
        "pid": os.getpid(),
        "optimizer_state_bytes": held,
        "optimizer_state_mapped_bytes": mapped,
        "checked": checked,
        "exact": not mismatches,
        "mismatches": mismatches[:20],
        "gpu_bytes": gpu[0] if gpu else None,
        "gpu_peak_bytes": gpu[1] if gpu else None,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    barrier()
    time.sleep(linger)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _mismatches(
    ours: dict[str, Any], saved: dict[str, Any], restored: list[dict], saved_states: list[dict]
) -> list[str]:
    """What differs, bit for bit, between the weights ``ours`` and ``saved`` and between each optimizer's restored
    and saved state (``{parameter: {key: value}}``); empty when the restore is exact."""
    mismatches = [f"state_dict keys: {sorted(set(ours) ^ set(saved))}"] if sorted(ours) != sorted(saved) else []
    mismatches += [f"state_dict[{k!r}]" for k in saved if k in ours and not _equal(ours[k], saved[k])]
    if len(restored) != len(saved_states):
        mismatches.append(f"{len(restored)} optimizers, checkpoint has {len(saved_states)}")
    for i, (mine, ref) in enumerate(zip(restored, saved_states)):
        if sorted(mine, key=str) != sorted(ref, key=str):
            mismatches.append(f"optimizer {i}: state of parameters {sorted(mine, key=str)}")
        for pid, state in ref.items():
            mismatches += [
                f"optimizer {i} state[{pid!r}][{key!r}]"
                for key, value in state.items()
                if not _equal(mine.get(pid, {}).get(key), value)
            ]
    return mismatches


def _fsdp_mismatches(
    model: Any, module: torch.nn.Module, saved: dict[str, Any], optimizers: list[Any], saved_states: list[dict]
) -> list[str]:
    """(all ranks) ``_mismatches`` for FSDP: the weights and optimizer state are gathered to rank 0 (every rank's
    shard included) and compared there; the other ranks report none."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    checking = torch.distributed.get_rank() == 0
    with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
        ours = {name: tensor.clone() for name, tensor in module.state_dict().items()} if checking else {}
    # a checkpoint saved by DDP keys the state by parameter index, in the order of `module.parameters()`; one saved by
    # FSDP keys it by parameter name
    names = [name.replace("_fsdp_wrapped_module.", "") for name, _ in module.named_parameters()]
    # offload_to_cpu=False: with FSDP on CPU (torch 2.13), offloading returns the gathered state tensors of one
    # parameter aliased to each other (exp_avg reads as exp_avg_sq)
    full = (FullStateDictConfig(rank0_only=True), FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True))
    restored = []
    for optimizer in optimizers:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, *full):
            restored.append(FSDP.optim_state_dict(model, optimizer).get("state", {}))
    saved_by_name = [
        {names[k] if isinstance(k, int) else str(k): v for k, v in s["state"].items()} for s in saved_states
    ]
    return _mismatches(ours, saved, restored, saved_by_name[: len(restored)]) if checking else []


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


_profiler: Any = None


def _profile_window(start: bool, path: Optional[Path] = None) -> None:
    """With ``BENCH_PROFILE_WINDOW=1`` in the environment, each rank profiles its restore window with ``cProfile``
    and writes the stats to ``rank<global rank>.prof`` in the run directory (``python -m pstats``); otherwise
    nothing. For finding where a restore's own time goes, not for the measured runs: profiling slows Python code."""
    global _profiler
    if os.environ.get("BENCH_PROFILE_WINDOW") != "1":
        return
    import cProfile

    if start:
        _profiler = cProfile.Profile()
        _profiler.enable()
    elif _profiler is not None:
        _profiler.disable()
        _profiler.dump_stats(str(path))
        _profiler = None


def _io() -> dict[str, int]:
    """This process's page faults (major: the page had to be read from storage) and bytes it caused to be read from
    storage, so far."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    found = {"major_faults": usage.ru_majflt, "minor_faults": usage.ru_minflt, "read_bytes": 0}
    try:
        with open("/proc/self/io") as f:
            found["read_bytes"] = next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration):
        pass
    return found


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


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach().cpu(), b.detach().cpu())
    return a == b


def local_state(optimizer: Any, module: torch.nn.Module) -> dict[Any, Any]:
    """The optimizer's state, keyed as the checkpoint is (by the parameter's index in the module): for a sharded
    optimizer, the state of the parameters this rank owns."""
    local = local_optimizer(optimizer)
    if local is optimizer:
        return optimizer.state_dict()["state"]
    index = {id(p): i for i, p in enumerate(module.parameters())}
    return {index[id(p)]: dict(state) for p, state in local.state.items()}


def _owned(saved: dict[Any, Any], restored: dict[Any, Any], optimizer: Any) -> dict[Any, Any]:
    """The checkpoint's optimizer state, cut to the parameters of ``restored`` where that is a rank's shard."""
    return saved if local_optimizer(optimizer) is optimizer else {i: saved[i] for i in restored if i in saved}


def _data(width: int, n: int, batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    dataset = TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, width, generator=g))
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


def _trainer(config: dict[str, Any], **kwargs: Any) -> pl.Trainer:
    strategy: Any = config.get("strategy", "ddp")
    if strategy == "fsdp_cpu":  # Lightning's FSDPStrategy wrapping with device_id=cpu (its stock one needs a GPU)
        strategy = make_cpu_fsdp_class("pytorch_lightning")(auto_wrap_policy={torch.nn.Linear}, state_dict_type="full")
    elif strategy == "fsdp":  # Lightning's stock FSDPStrategy (GPU only); one FSDP unit per layer in both
        strategy = pl.strategies.FSDPStrategy(auto_wrap_policy={torch.nn.Linear}, state_dict_type="full")
    elif strategy == "fairscale_sharded":
        strategy = make_fairscale_sharded_class("pytorch_lightning")()
    if config.get("accelerator", "cpu") != "cpu":
        kwargs["accelerator"] = config["accelerator"]
    common = quiet_cpu_trainer_kwargs(config["out"], config["devices"], strategy, enable_checkpointing=False, **kwargs)
    restorer = config.get("restorer", "upstream")
    if restorer == "ours":
        from serialized_restore import Trainer

        return Trainer(serialized_checkpoint_loading=config["k"], **common)
    if restorer == "mmap-plugin":
        return pl.Trainer(plugins=[MmapTorchCheckpointIO()], **common)
    trainer = pl.Trainer(**common)
    if restorer == "proposal-2021":
        trainer._checkpoint_connector = Proposal2021Connector(trainer)
    return trainer


def train(config: dict[str, Any]) -> None:
    """Train ``steps`` Adam steps and save the checkpoint with ``trainer.save_checkpoint``."""
    torch.manual_seed(0)
    model = BenchMLP(config["width"], config["depth"])
    trainer = _trainer(config, max_steps=config["steps"])
    trainer.fit(model, train_dataloaders=_data(config["width"], 4 * config["steps"] * config["devices"], 4))
    trainer.save_checkpoint(config["ckpt_path"])
    if trainer.global_rank == 0:
        meta = {"params": sum(p.numel() for p in model.parameters()), "global_step": trainer.global_step}
        meta.update(width=config["width"], depth=config["depth"], size_bytes=os.path.getsize(config["ckpt_path"]))
        Path(config["meta_path"]).write_text(json.dumps(meta, indent=1))


def restore(config: dict[str, Any]) -> None:
    """Restore through ``trainer.fit`` or ``trainer.validate`` (or, without a checkpoint, run the same baseline)."""
    torch.manual_seed(0)
    model = BenchMLP(config["width"], config["depth"], run=config, zero_init=True)
    data = _data(config["width"], 8 * config["devices"], 4)
    if config["entry"] == "fit":
        trainer = _trainer(config, max_steps=config["global_step"] + 1)
        trainer.fit(model, train_dataloaders=data, ckpt_path=config.get("ckpt_path"))
    else:
        trainer = _trainer(config, limit_val_batches=1)
        trainer.validate(model, dataloaders=data, ckpt_path=config.get("ckpt_path"), verbose=False)


class PhaseMarks(pl.Callback):
    """The whole-process job's phases: ``setup`` (the process group exists, no restore stage has run), ``fit_start``
    (after the first stage and DDP's setup) and ``fit_end`` (after the second stage, the skipped loop, teardown)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _mark(self.out, trainer.global_rank, "setup", **_io())

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _mark(self.out, trainer.global_rank, "fit_start")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _mark(self.out, trainer.global_rank, "fit_end", **_io())


def resume_whole(config: dict[str, Any]) -> None:
    """Restore only, as a whole process: ``trainer.fit(ckpt_path=...)`` with ``max_steps`` equal to the checkpoint's
    step, so that Lightning restores, skips the fit loop, tears down and returns; then the interpreter exits as any
    script does (no ``os._exit``). Nothing is checked or sampled: the parent times the process tree from its start
    to the exit of its last process. Each rank marks its phases (``PhaseMarks``; ``imported`` at the end of this
    script's imports; ``exit``, with its CPU time, at interpreter exit, from ``atexit``)."""
    import atexit
    import resource

    out = Path(config["out"])
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))

    def at_exit() -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        _mark(out, rank, "exit", cpu=usage.ru_utime + usage.ru_stime)

    atexit.register(at_exit)  # registered first, so it runs last of the handlers registered in this process
    _mark(out, rank, "imported")
    torch.manual_seed(0)
    model = BenchMLP(config["width"], config["depth"], zero_init=True)
    trainer = _trainer(config, max_steps=config["global_step"], callbacks=[PhaseMarks(out)])
    trainer.fit(
        model, train_dataloaders=_data(config["width"], 8 * config["devices"], 4), ckpt_path=config["ckpt_path"]
    )
    _mark(out, trainer.global_rank, "returned")


def _fabric(config: dict[str, Any]) -> Any:
    """The job's Fabric, launched: upstream's or the package's, DDP or FSDP (on CPU, Fabric's FSDPStrategy wrapping
    with device_id=cpu), one FSDP unit per layer."""
    from lightning_fabric import Fabric

    from serialized_restore.fabric import Fabric as SerializedFabric

    strategy: Any = config.get("strategy", "ddp")
    if strategy == "fsdp_cpu":
        strategy = make_fabric_cpu_fsdp_class("lightning_fabric")(
            auto_wrap_policy={torch.nn.Linear}, state_dict_type="full"
        )
    kwargs = {"accelerator": config.get("accelerator", "cpu"), "devices": config["devices"], "strategy": strategy}
    ours = config.get("restorer") == "ours"
    fabric = SerializedFabric(serialized_checkpoint_loading=config["k"], **kwargs) if ours else Fabric(**kwargs)
    fabric.launch()
    return fabric


def fabric_restore(config: dict[str, Any]) -> None:
    """``fabric.load(path, {"model", "optimizer", "step"})`` (or, without a checkpoint, the same program up to that
    call), its window marked around the call; then the same checks and report as ``restore``."""
    fabric = _fabric(config)
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

    def compare(reference: dict[str, Any]) -> list[str]:
        if config.get("strategy") == "fsdp_cpu":
            return _fsdp_mismatches(
                model._forward_module, net, reference["model"], [optimizer.optimizer], [reference["optimizer"]]
            )
        restored = [optimizer.optimizer.state_dict()["state"]]
        return _mismatches(net.state_dict(), reference["model"], restored, [reference["optimizer"]["state"]])

    # the window of a job without fabric.load lasts about a millisecond, with no memory sample inside it: the sampler
    # then takes the samples on either side, and lingering keeps the ranks (and their memory) alive for the one after
    _finish(config, rank, [optimizer.optimizer], fabric.barrier, compare, linger=0.1)


def copy_floor(config: dict[str, Any]) -> None:
    """(every rank, launched as a Fabric DDP job) The floor's copy, each phase with all ranks at once after a barrier,
    and marked, ``config["repeats"]`` times (one ``copied`` marker per rank and repeat). First, from a fresh mapping
    of the checkpoint (``torch.load(mmap=True)``: no page of it mapped in this process yet), what a rank keeps copied
    into freshly allocated tensors (``torch.empty_like`` then ``copy_``: each new page's first touch included, as a
    restore's copy of the optimizer state pays it; freed again after the phase): the weights (``params_fresh``), then
    the optimizer state (``optimizer_fresh``). Then, from another fresh mapping, the same into tensors allocated and
    written beforehand (the model's own weights are such memory): ``params``, ``optimizer``."""
    fabric = _fabric({**config, "strategy": "ddp"})
    for repeat in range(config.get("repeats", 1)):
        _copy_once(config, fabric, repeat)
    fabric.barrier()
    os._exit(0)


def _copy_once(config: dict[str, Any], fabric: Any, repeat: int) -> None:
    """One repeat of ``copy_floor``'s phases."""

    def kept() -> dict[str, list[torch.Tensor]]:
        checkpoint = torch.load(config["ckpt_path"], mmap=True, weights_only=False, map_location="cpu")
        states = [state for optimizer in checkpoint["optimizer_states"] for state in optimizer["state"].values()]
        return {
            "params": list(checkpoint["state_dict"].values()),
            "optimizer": [value for state in states for value in state.values() if isinstance(value, torch.Tensor)],
        }

    times: dict[str, Any] = {}
    sources = kept()
    for phase, tensors in sources.items():
        fabric.barrier()
        started = time.time()
        fresh = [torch.empty_like(t) for t in tensors]
        for target, source in zip(fresh, tensors):
            target.copy_(source)
        times[f"{phase}_fresh"] = (started, time.time())
        del fresh
    del sources
    sources = kept()
    private = {phase: [torch.zeros_like(t) for t in tensors] for phase, tensors in sources.items()}
    for phase, tensors in sources.items():
        fabric.barrier()
        started = time.time()
        for target, source in zip(private[phase], tensors):
            target.copy_(source)
        times.update({phase: (started, time.time()), f"{phase}_bytes": sum(t.nbytes for t in tensors)})
    _mark(Path(config["out"]), fabric.global_rank, "copied", repeat=repeat, **times)


def main(config: dict[str, Any]) -> None:
    actions = {"train": train, "restore": restore, "fabric": fabric_restore, "whole": resume_whole, "copy": copy_floor}
    try:
        actions[config["action"]](config)
    except BaseException:
        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
        (Path(config["out"]) / f"rank{rank}.error.txt").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
