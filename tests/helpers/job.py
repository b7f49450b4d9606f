"""One training or evaluation job, run as a real (multi-process) Lightning program by the tests.

Usage: ``python tests/helpers/job.py '<json config>'``. Lightning's ``ddp`` launcher re-runs this same command line
for every other local rank. Every rank writes what it ends with to ``<out>/rank<global_rank>.pt`` (or, when the run
raises, ``<out>/rank<global_rank>.error.json``), so that a test can assert on every rank.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

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
from harness.processes import end_finished_rank  # noqa: E402
from harness.trainers import quiet_cpu_trainer_kwargs  # noqa: E402


def build_trainer(config: dict[str, Any]) -> Any:
    flavour = config.get("flavour", "pytorch_lightning")
    if config["trainer"] == "upstream":
        trainer_cls = lightning_module(flavour).Trainer
        extra: dict[str, Any] = {}
    else:
        if flavour == "lightning":
            from serialized_restore.lightning import Trainer as trainer_cls
        else:
            from serialized_restore import Trainer as trainer_cls
        value = config.get("serialized", True)
        if isinstance(value, dict):
            from serialized_restore import SerializedLoading

            value = SerializedLoading(**value)
        extra = {"serialized_checkpoint_loading": value}
    callback = make_callback_class(flavour)()
    writer = make_writer_class(flavour)(config, callback)
    pl = lightning_module(flavour)
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
            plugins=precision,
            **extra,
        )
    )
    return trainer, callback


def main(config: dict[str, Any]) -> None:
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


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    end_finished_rank()
