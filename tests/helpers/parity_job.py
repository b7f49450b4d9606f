"""Everything a user's code can observe of a restore, recorded per call, for side-by-side comparison with upstream.

Usage: ``python tests/helpers/parity_job.py '<json config>'``, through ``tests.helpers.launch.run_job``. Config keys:

* ``out``, ``devices`` (1: a single device; 2: ``ddp``), ``trainer`` (``"upstream"``: ``pytorch_lightning.Trainer``,
  ``"ours"``: ``serialized_restore.Trainer``), ``serialized`` (its ``serialized_checkpoint_loading``);
* ``cases``: run one after another in the same processes, each with a fresh Trainer and model: ``name``, ``calls``
  (``[[entry, ckpt_path, extra kwargs], ...]`` on that one Trainer, stopping at the first that raises),
  ``max_epochs``, ``checkpointing`` (a ``ModelCheckpoint(save_last=True)`` in the case's directory), ``fault``
  (``{"rank": r or "all"}``: ``on_load_checkpoint`` raises :class:`ParityError` there).

After every call each rank writes ``<out>/<case>/call<i>.rank<r>.json``: the exception (its type's MRO, message,
cause), every warning emitted during the call (category and text, even repeated ones), every record of Lightning's
loggers (logger, level, text), and the trainer's state after the call (``state``, ``ckpt_path``, step and epoch,
a digest of the weights, the checkpoint callback's state, the logger's hyperparameters). Paths under ``out`` are
written as ``<out>/...`` so that two jobs compare equal.
"""

from __future__ import annotations

import gc
import json
import logging
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytorch_lightning as pl  # noqa: E402
from pytorch_lightning.loggers import CSVLogger  # noqa: E402

from harness.models import dataloader, make_model_class  # noqa: E402
from harness.processes import end_process_group  # noqa: E402
from harness.trainers import quiet_cpu_trainer_kwargs  # noqa: E402

_BaseModel = make_model_class("pytorch_lightning")


class ParityError(Exception):
    """A user's own exception class, raised in ``on_load_checkpoint``."""


class ParityModel(_BaseModel):  # type: ignore[misc, valid-type]
    def __init__(self, lr: float = 0.01, fault: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters("lr")
        self.fault = fault

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if self.fault is not None and self.fault["rank"] in ("all", rank):
            raise ParityError(f"the user's hook refused the checkpoint on rank {rank}")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.levelname, record.getMessage()))


def _normalize(value: Any, out: str) -> Any:
    if isinstance(value, str):
        return value.replace(out, "<out>")
    if isinstance(value, dict):
        return {str(k): _normalize(v, out) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalize(v, out) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return repr(value)


def _state(trainer: Any, model: Any) -> dict[str, Any]:
    callback = trainer.checkpoint_callback
    return {
        "fn": str(trainer.state.fn),
        "status": str(trainer.state.status),
        "stage": str(trainer.state.stage),
        "ckpt_path": trainer.ckpt_path,
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "params": {name: p.detach().double().sum().item() for name, p in model.named_parameters()},
        "checkpoint_callback": callback.state_dict() if callback is not None else None,
        "best_model_path": getattr(callback, "best_model_path", None),
        "logger_hparams": _logged_hparams(trainer),
        "model_hparams": dict(model.hparams),
        "callbacks": [type(cb).__name__ for cb in trainer.callbacks],
    }


def _logged_hparams(trainer: Any) -> Any:
    """The hyperparameters the logger wrote (``hparams.yaml`` of the CSV logger, on global rank 0)."""
    path = Path(trainer.logger.log_dir) / "hparams.yaml"
    return path.read_text() if trainer.global_rank == 0 and path.exists() else None


def _trainer(config: dict[str, Any], case: dict[str, Any], directory: Path) -> Any:
    if config["trainer"] == "upstream":
        trainer_cls, extra = pl.Trainer, {}
    else:
        from serialized_restore import Trainer as trainer_cls

        extra = {"serialized_checkpoint_loading": config.get("serialized", True)}
    devices = config.get("devices", 2)
    checkpointing = [pl.callbacks.ModelCheckpoint(dirpath=str(directory / "ckpts"), save_last=True)]
    return trainer_cls(
        **quiet_cpu_trainer_kwargs(
            str(directory),
            devices,
            "ddp" if devices > 1 else "auto",
            max_epochs=case.get("max_epochs", 2),
            logger=CSVLogger(str(directory), name="logs"),
            enable_checkpointing=bool(case.get("checkpointing")),
            callbacks=checkpointing if case.get("checkpointing") else [],
            **extra,
        )
    )


def run_case(config: dict[str, Any], case: dict[str, Any], handler: _Records) -> None:
    out = config["out"]
    directory = Path(out) / case["name"]
    directory.mkdir(parents=True, exist_ok=True)
    trainer = _trainer(config, case, directory)
    model = ParityModel(fault=case.get("fault"))
    for index, (entry, ckpt_path, extra) in enumerate(case["calls"]):
        handler.records.clear()
        error: Any = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                kwargs = {"ckpt_path": ckpt_path, **extra}
                if entry == "fit":
                    trainer.fit(model, train_dataloaders=dataloader(), **kwargs)
                else:
                    getattr(trainer, entry)(model, dataloaders=dataloader(), **kwargs)
            except Exception as err:
                error = {
                    "mro": [f"{c.__module__}:{c.__qualname__}" for c in type(err).__mro__],
                    "message": str(err),
                    # the original exception chained to the error (its unprinted __context__ where it was raised)
                    "cause": type(chained).__name__ if (chained := err.__cause__ or err.__context__) else None,
                    "traceback": traceback.format_exc(),
                }
        record = {
            "error": error,
            "warnings": [[w.category.__name__, str(w.message)] for w in caught],
            "logs": [list(r) for r in handler.records],
            "state": _state(trainer, model),
        }
        rank = trainer.global_rank
        (directory / f"call{index}.rank{rank}.json").write_text(json.dumps(_normalize(record, out)))
        if error is not None:
            return


def main(config: dict[str, Any]) -> None:
    torch.manual_seed(0)
    handler = _Records()
    for name in ("pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.DEBUG)
    for case in config["cases"]:
        run_case(config, case, handler)
        gc.collect()  # the case's Trainer and DDP model go now, not in the interpreter's teardown
    end_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
