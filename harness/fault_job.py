"""The job ``scripts/fault_campaign.py`` starts: a Lightning ``Trainer`` or ``Fabric`` DDP job on CPU that saves a
checkpoint, or resumes from one, with upstream's classes or the project's, and says where it is as it goes.

Usage: ``python harness/fault_job.py '<json config>'``, directly (Lightning's launcher: rank 0 is this process and
starts the other local ranks by re-running the same command line) or under ``torchrun --nproc-per-node R``.

Config keys:

* ``api``: ``"trainer"`` or ``"fabric"``; ``impl``: ``"upstream"`` (``lightning.pytorch.Trainer`` /
  ``lightning.fabric.Fabric``) or ``"ours"`` (``serialized_restore.lightning``'s, with
  ``serialized_checkpoint_loading=True``); ``devices``: the number of ranks; ``out``: where the job writes;
* ``role``: ``"save"`` (train from scratch and write a checkpoint into ``save_dir``, and ``save_dir/meta.json`` with
  the checkpoint's file name and step) or ``"resume"`` (restore ``ckpt_path`` with ``entry``: ``"fit"``,
  ``"validate"`` or ``"load"`` (Fabric), then train ``extra_steps`` more steps where the entry trains);
* ``hook_sleep``: seconds the restore's hook sleeps inside the rank's turn (``LightningModule.on_load_checkpoint``;
  for Fabric a stateful object's ``load_state_dict``), so that the restore lasts long enough to be hit from outside;
* ``fault``: ``null`` or ``{"kind": "raise" | "exit", "rank": r, "text": ...}``: that hook, on global rank ``r``,
  raises ``RuntimeError(text)`` or ``SystemExit(text)`` (the faults a signal carries are sent from outside).

What the campaign reads (nothing else of the job's internals):

* ``<out>/events.jsonl``: one JSON line per event and rank, ``{"event", "rank", "pid", "t"}`` (wall-clock ``t``):
  ``begin`` (right before the restore starts: the Trainer's ``setup`` hook, or the line before ``fabric.load``),
  ``turn`` (the hook inside the rank's turn is entered), ``fault`` (the injected exception is raised now),
  ``hook_end`` (the hook returns), ``restored`` (the restore is over: ``on_train_start`` / ``on_validation_start``,
  or ``fabric.load`` returned) and ``done`` (the rank's results are written);
* ``<out>/rank<r>.pt``: each rank's state right after the restore (``restored``) and at the end (``final``), read
  back with ``read_results`` and compared with ``differences``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.models import dataloader, fabric_training, make_callback_class, make_model_class  # noqa: E402
from harness.processes import end_process_group  # noqa: E402
from harness.trainers import quiet_cpu_trainer_kwargs  # noqa: E402

WIDTH = 32
"""Width of both jobs' MLPs (the Trainer's is ``harness.models``' ``RecordingModel``)."""


class Events:
    """Appends this process's events to ``<out>/events.jsonl``: one ``write`` per line on an ``O_APPEND`` file, so
    the ranks' lines never interleave."""

    def __init__(self, out: Path) -> None:
        self.path = out / "events.jsonl"
        self.rank: Optional[int] = None

    def emit(self, event: str, rank: Optional[int] = None, **extra: Any) -> None:
        self.rank = self.rank if rank is None else rank
        line = json.dumps({"event": event, "rank": self.rank, "pid": os.getpid(), "t": time.time(), **extra}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def in_turn_hook(config: dict[str, Any], events: Events, rank: int) -> None:
    """What the hook inside a rank's turn does: say so, misbehave if this run's fault asks for it here, sleep."""
    events.emit("turn", rank)
    fault = config.get("fault")
    if fault and fault["rank"] == rank:
        events.emit("fault", rank, kind=fault["kind"])
        if fault["kind"] == "raise":
            raise RuntimeError(fault["text"])
        if fault["kind"] == "exit":
            raise SystemExit(fault["text"])
        raise ValueError(f"unknown in-job fault {fault['kind']!r}")
    time.sleep(float(config.get("hook_sleep", 0.0)))
    events.emit("hook_end", rank)


def tensors_cloned(obj: Any) -> Any:
    """``obj`` with every tensor detached and cloned (the state as it is now, not a view of what changes later)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: tensors_cloned(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tensors_cloned(v) for v in obj)
    return obj


def save_result(out: Path, rank: int, result: dict[str, Any], events: Events) -> None:
    path = out / f"rank{rank}.pt"
    torch.save(result, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
    events.emit("done", rank)


# ---------------------------------------------------------------------------------------------------------- Trainer


def trainer_class(impl: str) -> Any:
    if impl == "ours":
        from serialized_restore.lightning import Trainer
    else:
        from lightning.pytorch import Trainer  # type: ignore[assignment]
    return Trainer


_Model = make_model_class("lightning")
_Recorder = make_callback_class("lightning")


class FaultModel(_Model):  # type: ignore[misc, valid-type]
    """``harness.models``' recording MLP; its ``on_load_checkpoint`` (in the rank's turn) runs ``in_turn_hook``."""

    def __init__(self, config: dict[str, Any], events: Events) -> None:
        super().__init__(width=WIDTH)
        self.config = config
        self.events = events

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        in_turn_hook(self.config, self.events, self.trainer.global_rank)


def _trainer_state(trainer: Any, module: Any, recorder: Any) -> dict[str, Any]:
    """What a rank's Trainer holds: weights, optimizer and scheduler states, step, epoch, loops, callback, metrics."""
    fitting = trainer.state.fn == "fit"
    return tensors_cloned(
        {
            "params": module.state_dict(),
            "optimizers": [opt.state_dict() for opt in trainer.optimizers] if fitting else [],
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs] if fitting else [],
            "global_step": trainer.global_step,
            "current_epoch": trainer.current_epoch,
            "fit_loop": trainer.fit_loop.state_dict() if fitting else {},
            "callback_batches_seen": recorder.batches_seen,
            "metrics": dict(trainer.callback_metrics),
        }
    )


def _probe_class() -> type:
    from lightning.pytorch import Callback

    class Probe(Callback):
        """Emits ``begin`` / ``restored`` / ``done``; keeps the rank's state right after the restore and at the end."""

        def __init__(self, config: dict[str, Any], events: Events, recorder: Any) -> None:
            self.config, self.events, self.recorder = config, events, recorder
            self.restored: dict[str, Any] = {}

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.events.emit("begin", trainer.global_rank)  # Lightning's `_run` restores right after this hook

        def _restored(self, trainer: Any, pl_module: Any) -> None:
            self.restored = _trainer_state(trainer, pl_module, self.recorder)
            self.events.emit("restored", trainer.global_rank)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self._restored(trainer, pl_module)

        def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
            if trainer.state.fn == "validate":
                self._restored(trainer, pl_module)

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if self.config["role"] != "resume" or not self.restored:
                return
            final = _trainer_state(trainer, pl_module, self.recorder)
            save_result(Path(self.config["out"]), trainer.global_rank, {"restored": self.restored, "final": final},
                        self.events)  # fmt: skip

    return Probe


def run_trainer(config: dict[str, Any], events: Events) -> None:
    torch.manual_seed(0)
    impl, role = config["impl"], config["role"]
    recorder = _Recorder()
    callbacks: list[Any] = [recorder, _probe_class()(config, events, recorder)]
    extra: dict[str, Any] = {"enable_checkpointing": False}
    if role == "save":
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=config["save_dir"], save_last=True, save_top_k=1))
        extra = {"max_epochs": 1}
    elif config["entry"] == "fit":
        extra["max_steps"] = int(config["saved_step"]) + int(config.get("extra_steps", 2))
    if impl == "ours":
        extra["serialized_checkpoint_loading"] = config.get("k", True)
    kwargs = quiet_cpu_trainer_kwargs(config["out"], int(config["devices"]), "ddp", callbacks=callbacks, **extra)
    trainer = trainer_class(impl)(**kwargs)
    model = FaultModel(config, events)
    if role == "save":
        trainer.fit(model, train_dataloaders=dataloader())
        if trainer.global_rank == 0:
            meta = {"file": "last.ckpt", "global_step": trainer.global_step}
            (Path(config["save_dir"]) / "meta.json").write_text(json.dumps(meta))
    elif config["entry"] == "fit":
        trainer.fit(model, train_dataloaders=dataloader(), ckpt_path=config["ckpt_path"])
    elif config["entry"] == "validate":
        trainer.validate(model, dataloaders=dataloader(), ckpt_path=config["ckpt_path"], verbose=False)
    else:
        raise ValueError(f"unknown Trainer entry {config['entry']!r}")


# ----------------------------------------------------------------------------------------------------------- Fabric


def fabric_class(impl: str) -> Any:
    if impl == "ours":
        from serialized_restore.lightning import Fabric
    else:
        from lightning.fabric import Fabric  # type: ignore[assignment]
    return Fabric


class Counter:
    """A stateful object that is neither a module nor an optimizer; its ``load_state_dict`` runs in the rank's turn
    (inside ``fabric.load``) and calls ``in_turn_hook`` first."""

    def __init__(self, config: dict[str, Any], events: Events, rank: int) -> None:
        self.seen = torch.zeros(4)
        self.config, self.events, self.rank = config, events, rank

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        in_turn_hook(self.config, self.events, self.rank)
        self.seen = state["seen"]


def run_fabric(config: dict[str, Any], events: Events) -> None:
    impl, role = config["impl"], config["role"]
    kwargs: dict[str, Any] = {"accelerator": "cpu", "devices": int(config["devices"]), "strategy": "ddp"}
    if impl == "ours":
        kwargs["serialized_checkpoint_loading"] = config.get("k", True)
    fabric = fabric_class(impl)(**kwargs)
    fabric.launch()
    rank = fabric.global_rank
    counter = Counter(config, events, rank)
    model, optimizer, scheduler, train = fabric_training(fabric, counter, WIDTH)

    def state_now(step: int) -> dict[str, Any]:
        return tensors_cloned(
            {
                "params": model.state_dict(),
                "optimizers": [optimizer.optimizer.state_dict()],
                "schedulers": [scheduler.state_dict()],
                "counter": counter.seen,
                "global_step": step,
            }
        )

    if role == "save":
        steps = 3
        train(steps, 0)
        path = Path(config["save_dir"]) / "state.ckpt"
        fabric.save(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "counter": counter,
                           "step": steps})  # fmt: skip
        if rank == 0:
            (Path(config["save_dir"]) / "meta.json").write_text(json.dumps({"file": path.name, "global_step": steps}))
        fabric.barrier()
        return
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "counter": counter,
                             "step": 0}  # fmt: skip
    events.emit("begin", rank)
    remainder = fabric.load(config["ckpt_path"], state)
    step = int(state["step"])
    restored = {**state_now(step), "remainder": tensors_cloned(remainder)}
    events.emit("restored", rank)
    train(int(config.get("extra_steps", 2)), step)
    final = state_now(step + int(config.get("extra_steps", 2)))
    save_result(Path(config["out"]), rank, {"restored": restored, "final": final}, events)


def main(config: dict[str, Any]) -> None:
    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    events = Events(out)
    if config["api"] == "trainer":
        run_trainer(config, events)
    elif config["api"] == "fabric":
        run_fabric(config, events)
    else:
        raise ValueError(f"unknown api {config['api']!r}")
    end_process_group()


# ------------------------------------------------------------------------------------- the results, for the campaign


def read_results(out: Path) -> dict[int, Any]:
    """Every rank's ``rank<r>.pt`` in ``out``: global rank -> ``{"restored": ..., "final": ...}``."""
    return {int(p.stem[4:]): torch.load(p, weights_only=False) for p in out.glob("rank*.pt")}


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ: tensors bit for bit (dtype, shape, values), containers by keys and items."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
        return [] if same and a.shape == b.shape and torch.equal(a, b) else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where} keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}/{i}")]
    return [] if type(a) is type(b) and a == b else [f"{where}: {a!r} != {b!r}"[:200]]


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
