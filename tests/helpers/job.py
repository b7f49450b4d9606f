"""One training or evaluation job, run as a real (multi-process) Lightning program by the tests.

Usage: ``python tests/helpers/job.py '<json config>'``. Lightning's ``ddp`` launcher re-runs this same command line
for every other local rank. Every rank writes what it ends with to ``<out>/rank<global_rank>.pt`` (or, when the run
raises, ``<out>/rank<global_rank>.error.json``), so that a test can assert on every rank.

With ``SERIALIZED_RESTORE_TRAINER=patched-upstream``, ``"trainer": "ours"`` is ``lightning.pytorch.Trainer`` of a
Lightning tree patched with a ``serialized_checkpoint_loading`` argument, and ``serialized_restore`` cannot be
imported. CI no longer sets it (``.ci/upstream_check.sh`` runs the series' own tests on Lightning master); the hook
stays while ``tests/conftest.py``, ``tests/test_restore.py`` and ``tests/test_strategies.py`` read it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TRAINER_ENV = "SERIALIZED_RESTORE_TRAINER"
PATCHED_UPSTREAM = os.environ.get(TRAINER_ENV, "") == "patched-upstream"
if PATCHED_UPSTREAM:
    # what runs must be the patched upstream Trainer, never the add-on next to these tests
    sys.modules["serialized_restore"] = None  # type: ignore[assignment]

from harness.models import (  # noqa: E402
    dataloader,
    lightning_module,
    make_callback_class,
    make_cpu_fsdp_class,
    make_fairscale_sharded_class,
    make_model_class,
    make_precision_class,
    make_writer_class,
)
from harness.trainers import quiet_cpu_trainer_kwargs  # noqa: E402


def build_trainer(config: dict[str, Any]) -> Any:
    flavour = config.get("flavour", "pytorch_lightning")
    if config["trainer"] == "upstream":
        trainer_cls = lightning_module(flavour).Trainer
        extra: dict[str, Any] = {}
    else:
        if PATCHED_UPSTREAM:
            trainer_cls = patched_upstream_trainer(flavour)
        elif flavour == "lightning":
            from serialized_restore.lightning import Trainer as trainer_cls
        else:
            from serialized_restore import Trainer as trainer_cls
        value = config.get("serialized", True)
        if isinstance(value, dict):
            # the fields of a SerializedLoading, of the package or of the patched Lightning tree
            if PATCHED_UPSTREAM:
                from lightning.pytorch.trainer.connectors.serialized_restore import SerializedLoading
            else:
                from serialized_restore import SerializedLoading
            value = SerializedLoading(**value)
        extra = {"serialized_checkpoint_loading": value}
    callback = make_callback_class(flavour)()
    writer = make_writer_class(flavour)(config, callback)
    pl = lightning_module(flavour)
    checkpoint_io = []
    if config.get("plugin") == "mmap":
        from serialized_restore import lightning as unified
        from serialized_restore import pytorch_lightning as standalone

        checkpoint_io = [(unified if flavour == "lightning" else standalone).MmapCheckpointIO()]
    checkpointing = (
        [pl.callbacks.ModelCheckpoint(dirpath=str(Path(config["out"]) / "ckpts"), save_last=True)]
        if config.get("checkpointing")
        else []
    )
    strategy: Any = config.get("strategy", "ddp")
    precision = [make_precision_class(flavour)()]
    if strategy == "fsdp_cpu":
        # FSDP wraps each Linear layer; it brings its own precision plugin
        strategy = make_cpu_fsdp_class(flavour)(
            auto_wrap_policy={torch.nn.Linear}, state_dict_type=config.get("fsdp_state_dict_type", "full")
        )
        precision = []
    elif strategy == "fairscale_sharded":
        strategy = make_fairscale_sharded_class(flavour)()
    trainer = trainer_cls(
        **quiet_cpu_trainer_kwargs(
            config["out"],
            config.get("devices", 2),
            strategy,
            num_nodes=config.get("num_nodes", 1),
            max_epochs=config.get("max_epochs", 1),
            enable_checkpointing=bool(config.get("checkpointing")),
            callbacks=[callback, writer, *checkpointing],
            plugins=[*precision, *checkpoint_io],
            **extra,
        )
    )
    return trainer, callback


def reads_memory_mapped() -> bool:
    """Whether ``"trainer": "ours"`` can read a checkpoint memory-mapped: the package's always; a patched Lightning
    tree from the series' memory-mapped reading step on (its ``SerializedLoading`` then has a ``reader``)."""
    if not PATCHED_UPSTREAM:
        return True
    from lightning.pytorch.trainer.connectors.serialized_restore import SerializedLoading

    return "reader" in {field.name for field in dataclasses.fields(SerializedLoading)}


def patched_upstream_trainer(flavour: str) -> Any:
    """``lightning.pytorch.Trainer``, checked to be a patched one."""
    if flavour != "lightning":
        raise ValueError(f"{TRAINER_ENV}=patched-upstream runs the `lightning` flavour only, not {flavour!r}")
    from lightning.pytorch import Trainer

    if "serialized_checkpoint_loading" not in inspect.signature(Trainer.__init__).parameters:
        raise RuntimeError(
            f"{TRAINER_ENV}=patched-upstream, but lightning.pytorch.Trainer ({inspect.getfile(Trainer)}) has no"
            " `serialized_checkpoint_loading`: install a Lightning tree patched with upstream/series/*.patch."
        )
    return Trainer


def main(config: dict[str, Any]) -> None:
    if PATCHED_UPSTREAM and config["trainer"] == "ours":
        config = {**config, "flavour": "lightning"}
    torch.manual_seed(0)
    flavour = config.get("flavour", "pytorch_lightning")
    trainer, callback = build_trainer(config)
    model = make_model_class(flavour)()
    model.hook_sleep = config.get("hook_sleep", 0.0)
    model.scheduler_load_sleep = config.get("scheduler_load_sleep", 0.0)
    model.optimizer_kind = config.get("optimizer", "adam")
    out = Path(config["out"])
    calls = config.get("calls") or [[config.get("entry", "fit"), config.get("ckpt_path")]]
    started = time.time()
    try:
        for entry, ckpt_path in calls:
            kwargs: dict[str, Any] = {"ckpt_path": ckpt_path} if ckpt_path else {}
            if "weights_only" in config:
                kwargs["weights_only"] = config["weights_only"]
            if entry == "fit":
                trainer.fit_loop.max_epochs = config.get("max_epochs", 1)
                trainer.fit(model, train_dataloaders=dataloader(), **kwargs)
            else:
                getattr(trainer, entry)(model, dataloaders=dataloader(), **kwargs)
    except BaseException as err:
        rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", trainer.global_rank)))
        (out / f"rank{rank}.error.json").write_text(
            json.dumps(
                {
                    "type": type(err).__name__,
                    "message": str(err),
                    "cause": repr(err.__cause__),
                    "traceback": traceback.format_exc(),
                    "elapsed": time.time() - started,
                }
            )
        )
        raise
    if config.get("save_ckpt"):
        trainer.save_checkpoint(config["save_ckpt"])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # as a training script ends (and as Lightning's own tests do between tests): the process group's threads
        # stop here, not in the interpreter's teardown, where gloo and the store may meet already-destroyed objects
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
