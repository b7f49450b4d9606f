"""One training or evaluation job, run as a real (multi-process) Lightning program by the tests.

Usage: ``python tests/helpers/job.py '<json config>'``. Lightning's ``ddp`` launcher re-runs this same command line
for every other local rank. Every rank writes what it ends with to ``<out>/rank<global_rank>.pt`` (or, when the run
raises, ``<out>/rank<global_rank>.error.json``), so that a test can assert on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.models import dataloader, lightning_module, make_callback_class, make_model_class  # noqa: E402


class _TurnLog(logging.Handler):
    """Keeps this rank's serialized-restore log lines with their timestamps."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.created, record.getMessage()))


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
        extra = {"serialized_checkpoint_loading": config.get("serialized", True)}
    callback = make_callback_class(flavour)()
    trainer = trainer_cls(
        accelerator="cpu",
        devices=config.get("devices", 2),
        strategy=config.get("strategy", "ddp"),
        max_epochs=config.get("max_epochs", 1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=config["out"],
        callbacks=[callback],
        **extra,
    )
    return trainer, callback


def main(config: dict[str, Any]) -> None:
    torch.manual_seed(0)
    flavour = config.get("flavour", "pytorch_lightning")
    turn_log = _TurnLog()
    root = "lightning.pytorch" if flavour == "lightning" else "pytorch_lightning"
    logging.getLogger(f"{root}.serialized_restore").addHandler(turn_log)
    logging.getLogger(f"{root}.serialized_restore").setLevel(logging.DEBUG)

    trainer, callback = build_trainer(config)
    model = make_model_class(flavour)()
    out = Path(config["out"])
    entry = config.get("entry", "fit")
    kwargs: dict[str, Any] = {}
    if config.get("ckpt_path"):
        kwargs["ckpt_path"] = config["ckpt_path"]
    if "weights_only" in config:
        kwargs["weights_only"] = config["weights_only"]
    started = time.time()
    try:
        if entry == "fit":
            trainer.fit(model, train_dataloaders=dataloader(), **kwargs)
        elif entry == "predict":
            trainer.predict(model, dataloaders=dataloader(), **kwargs)
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
    result = {
        "global_rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "node_rank": trainer.node_rank,
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizers": [opt.state_dict() for opt in trainer.optimizers] if entry == "fit" else [],
        "schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs] if entry == "fit" else [],
        "global_step": trainer.global_step,
        "fit_loop": trainer.fit_loop.state_dict(),
        "module_records": model.load_records,
        "callback_records": callback.records,
        "callback_batches_seen": callback.batches_seen,
        "turn_log": turn_log.lines,
        "loaded_checkpoint_after": dict(trainer._checkpoint_connector._loaded_checkpoint),
    }
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
