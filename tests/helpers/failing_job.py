"""A Lightning job whose serialized restore fails on purpose, run as a real multi-process program by the tests.

Usage: ``python tests/helpers/failing_job.py '<json config>'``, typically through ``tests.helpers.launch.run_job``.
Lightning's ``ddp`` launcher re-runs this same command line for every other local rank; ``ddp_spawn`` runs the
Trainer's work in spawned workers. Config keys:

* ``out``, ``strategy`` (``"ddp"`` or ``"ddp_spawn"``), ``devices``, ``serialized`` (as in ``job.py``);
* ``cases``: restores to attempt one after another in the same processes, each with a fresh Trainer and model:
  ``name``, ``ckpt_path``, ``entry`` (``"fit"``, ``"validate"``, ...), optional ``weights_only``, ``strict``
  (``LightningModule.strict_loading``), ``checkpoint_dir`` (adds ``ModelCheckpoint(save_last=True,
  save_on_exception=True, every_n_train_steps=1)``, without ``save_on_exception`` in a release that lacks it, and
  ``OnExceptionCheckpoint`` writing there) and ``fault``:
  ``{"rank": r or "all", "in": what, "seconds": s}`` where ``what`` is ``"module_hook"`` (an exception in
  ``LightningModule.on_load_checkpoint``), ``"callback_load_state_dict"``, ``"strict_mismatch"`` (the hook drops a
  weight, so that ``load_state_dict`` fails on that rank), ``"optimizer_state"`` (the hook breaks the optimizer
  state, so that the second stage fails), ``"kill"`` (SIGKILL), ``"sleep"`` or ``"collective"`` (a ``broadcast``);
* ``continue_after_failure``: go on with the next case after a failed one (else the error ends the process).

Every rank writes ``<out>/<case>/rank<global_rank>.json`` the moment ``Trainer._run`` returns or raises, with the
outcome and the wall-clock time (``ended_at``), and the rank that injects a fault first writes ``fault.json`` with the
time it did so.
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytorch_lightning as pl  # noqa: E402
from pytorch_lightning.callbacks import ModelCheckpoint, OnExceptionCheckpoint  # noqa: E402

from harness.models import dataloader, make_callback_class, make_model_class  # noqa: E402
from harness.processes import end_process_group  # noqa: E402
from harness.trainers import quiet_cpu_trainer_kwargs  # noqa: E402
from serialized_restore import CheckpointRestoreError  # noqa: E402
from serialized_restore.pytorch_lightning import Trainer as SerializedTrainer  # noqa: E402

# module-level classes, so that ddp_spawn can pickle them by reference
_BaseModel = make_model_class("pytorch_lightning")
_BaseCallback = make_callback_class("pytorch_lightning")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _inject(case: dict[str, Any], site: str, checkpoint: Optional[dict[str, Any]] = None) -> Optional[str]:
    """Misbehave here if the case asks for it at ``site`` on this rank; return what is left to the caller to do."""
    fault = case.get("fault")
    rank = _rank()
    if not fault or fault["in"] not in _SITES[site] or fault["rank"] not in ("all", rank):
        return None
    if fault["rank"] != "all" or rank == 0:
        record = {"rank": rank, "in": fault["in"], "at": time.time()}
        (Path(case["dir"]) / "fault.json").write_text(json.dumps(record))
    what = fault["in"]
    if what in ("module_hook", "callback_load_state_dict"):
        raise RuntimeError(f"injected failure in {what} on rank {rank}")
    if what == "strict_mismatch":
        assert checkpoint is not None
        checkpoint["state_dict"].pop(next(iter(checkpoint["state_dict"])))
    elif what == "optimizer_state":
        assert checkpoint is not None
        groups = checkpoint["optimizer_states"][0]["param_groups"]
        groups.append(dict(groups[0], params=[]))
    elif what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif what == "stop":
        # let go of the job's output pipe first, so that the test sees the job end when its main process does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.kill(os.getpid(), signal.SIGSTOP)
    elif what == "sleep":
        time.sleep(fault["seconds"])
    return what


_SITES = {
    "module_hook": ("module_hook", "strict_mismatch", "optimizer_state", "kill", "stop", "sleep", "collective"),
    "callback_load_state_dict": ("callback_load_state_dict",),
}


class FailingModel(_BaseModel):  # type: ignore[misc, valid-type]
    """The tests' recording model, with a fault injected in ``on_load_checkpoint``."""

    def __init__(self, case: dict[str, Any]) -> None:
        super().__init__()
        self.case = case
        self.strict_loading = case.get("strict", True)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if _inject(self.case, "module_hook", checkpoint) == "collective":
            # as a user would write it: every rank agrees on a value from rank 0
            dist.broadcast(torch.zeros(1), src=0)


class FailingCallback(_BaseCallback):  # type: ignore[misc, valid-type]
    """The tests' recording callback, with a fault injected in ``load_state_dict``."""

    def __init__(self, case: dict[str, Any]) -> None:
        super().__init__()
        self.case = case

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _inject(self.case, "callback_load_state_dict")
        super().load_state_dict(state_dict)


class RecordingTrainer(SerializedTrainer):
    """Writes each rank's outcome from inside ``_run``, which runs on every rank with both launchers."""

    case: dict[str, Any] = {}

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        started = time.time()
        try:
            result = super()._run(*args, **kwargs)
        except BaseException as err:
            _write_outcome(self, started, err)
            raise
        _write_outcome(self, started, None)
        return result


def _write_outcome(trainer: RecordingTrainer, started: float, err: Optional[BaseException]) -> None:
    ended = time.time()
    outcome: dict[str, Any] = {"rank": trainer.global_rank, "started_at": started, "ended_at": ended, "ok": err is None}
    if err is not None:
        outcome.update(
            type=type(err).__name__,
            message=str(err),
            cause=repr(err.__cause__),
            cause_type=type(err.__cause__).__name__ if err.__cause__ is not None else None,
            context_type=type(err.__context__).__name__ if err.__context__ is not None else None,
            traceback="".join(traceback.format_exception(type(err), err, err.__traceback__)),
            failed_ranks=err.failed_ranks if isinstance(err, CheckpointRestoreError) else None,
            kinds=[f.kind for f in err.failures] if isinstance(err, CheckpointRestoreError) else None,
        )
    path = Path(trainer.case["dir"]) / f"rank{trainer.global_rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(outcome))
    path.with_suffix(".tmp").rename(path)


def build_trainer(config: dict[str, Any], case: dict[str, Any]) -> RecordingTrainer:
    callbacks: list[pl.Callback] = [FailingCallback(case)]
    if case.get("checkpoint_dir"):
        directory = case["checkpoint_dir"]
        # a release without `save_on_exception` (2.4) has OnExceptionCheckpoint only
        saves_on_exception = "save_on_exception" in inspect.signature(ModelCheckpoint.__init__).parameters
        callbacks += [
            ModelCheckpoint(
                dirpath=directory,
                save_last=True,
                every_n_train_steps=1,
                save_top_k=-1,
                **({"save_on_exception": True} if saves_on_exception else {}),
            ),
            OnExceptionCheckpoint(dirpath=directory),
        ]
    trainer = RecordingTrainer(
        **quiet_cpu_trainer_kwargs(
            config["out"],
            config.get("devices", 2),
            config.get("strategy", "ddp"),
            max_epochs=case.get("max_epochs", 2),
            enable_checkpointing=bool(case.get("checkpoint_dir")),
            callbacks=callbacks,
            serialized_checkpoint_loading=config.get("serialized", True),
        )
    )
    trainer.case = case
    return trainer


def run_case(config: dict[str, Any], case: dict[str, Any]) -> None:
    case = dict(case, dir=str(Path(config["out"]) / case["name"]))
    Path(case["dir"]).mkdir(parents=True, exist_ok=True)
    trainer = build_trainer(config, case)
    model = FailingModel(case)
    kwargs: dict[str, Any] = {"ckpt_path": case["ckpt_path"]}
    if "weights_only" in case:
        kwargs["weights_only"] = case["weights_only"]
    entry = case.get("entry", "fit")
    if entry == "fit":
        trainer.fit(model, train_dataloaders=dataloader(), **kwargs)
    else:
        getattr(trainer, entry)(model, dataloaders=dataloader(), **kwargs)


def main(config: dict[str, Any]) -> None:
    torch.manual_seed(0)
    for case in config["cases"]:
        try:
            run_case(config, case)
        except Exception:
            if not config.get("continue_after_failure"):
                raise
        finally:
            gc.collect()  # the case's Trainer and DDP model go now, not in the interpreter's teardown
    end_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
