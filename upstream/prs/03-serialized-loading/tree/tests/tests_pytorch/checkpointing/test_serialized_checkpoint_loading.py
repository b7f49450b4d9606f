# Copyright The Lightning AI team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from tests_pytorch.helpers.runif import RunIf


class _RestoreError(Exception):
    pass


def _seen(checkpoint: dict[str, Any]) -> dict[str, Any]:
    return {"keys": sorted(checkpoint), "state_dict": checkpoint["state_dict"], "loops": checkpoint["loops"]}


def _assert_same_seen(path: Path, expected_path: Path) -> None:
    seen, expected = torch.load(path), torch.load(expected_path)
    assert seen["keys"] == expected["keys"]
    torch.testing.assert_close(seen["state_dict"], expected["state_dict"])
    torch.testing.assert_close(seen["loops"], expected["loops"])


class _RecordingModel(BoringModel):
    """Records what its hooks see during a restore into files under ``log_dir``, one per rank."""

    def __init__(self, log_dir: Path, fail_on_rank: int = -1) -> None:
        super().__init__()
        self.log_dir = log_dir
        self.fail_on_rank = fail_on_rank

    def _log(self, line: str) -> None:
        # one shared file, appended to by every rank: the order of its lines is the order of the turns
        with open(self.log_dir / "order.txt", "a") as f:
            f.write(f"{line} {self.global_rank}\n")

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._log("start")
        torch.save(_seen(checkpoint), self.log_dir / f"module_saw_{self.global_rank}.pt")
        if self.global_rank == self.fail_on_rank:
            raise _RestoreError(f"rank {self.global_rank} cannot restore")

    def on_train_start(self) -> None:
        optimizer_state = self.trainer.optimizers[0].state_dict()
        state = {"model": self.state_dict(), "optimizer": optimizer_state, "step": self.trainer.global_step}
        torch.save(state, self.log_dir / f"resumed_{self.global_rank}.pt")

    def on_validation_end(self) -> None:
        torch.save(self.state_dict(), self.log_dir / f"validated_{self.global_rank}.pt")


class _RecordingCallback(Callback):
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        assert isinstance(pl_module, _RecordingModel)
        pl_module._log("end")
        torch.save(_seen(checkpoint), pl_module.log_dir / f"callback_saw_{trainer.global_rank}.pt")


def _checkpoint(tmp_path: Path) -> Path:
    trainer = Trainer(default_root_dir=tmp_path, max_steps=2, logger=False, enable_progress_bar=False)
    trainer.fit(BoringModel())
    path = tmp_path / "start.ckpt"
    trainer.save_checkpoint(path)
    return path


def _trainer(tmp_path: Path, **kwargs: Any) -> Trainer:
    return Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        limit_val_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_RecordingCallback()],
        **kwargs,
    )


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", None])
def test_serialized_checkpoint_loading_invalid_value(value):
    """An argument that is neither a bool nor a positive int is rejected, quoting the value."""
    with pytest.raises(ValueError, match=rf"serialized_checkpoint_loading={value!r}\)` is not supported"):
        Trainer(serialized_checkpoint_loading=value)


def test_serialized_checkpoint_loading_strategy_restoring_after_setup():
    """A strategy that restores the checkpoint after setup (with collectives) cannot restore in turns."""

    class _RestoresAfterSetup(DDPStrategy):
        @property
        def restore_checkpoint_after_setup(self) -> bool:
            return True

    with pytest.raises(MisconfigurationException, match="not supported with `_RestoresAfterSetup`"):
        Trainer(accelerator="cpu", devices=1, strategy=_RestoresAfterSetup(), serialized_checkpoint_loading=True)


@pytest.mark.parametrize("fn", ["fit", "validate", "test", "predict"])
def test_serialized_checkpoint_loading_entry_points(tmp_path, fn):
    """Every entry point restores the same weights and shows the hooks the same checkpoint as the default restore."""
    ckpt_path = _checkpoint(tmp_path)
    weights = {}
    for turns in (False, True):
        log_dir = tmp_path / str(turns)
        log_dir.mkdir()
        model = _RecordingModel(log_dir)
        trainer = _trainer(log_dir, serialized_checkpoint_loading=turns)
        getattr(trainer, fn)(model, ckpt_path=ckpt_path)
        assert trainer._checkpoint_connector._loaded_checkpoint == {}
        assert (log_dir / "order.txt").read_text() == "start 0\nend 0\n"
        # after `fit` the model has trained on: compare what it resumed from
        weights[turns] = torch.load(log_dir / "resumed_0.pt")["model"] if fn == "fit" else model.state_dict()
    for name in ("module_saw_0.pt", "callback_saw_0.pt"):
        _assert_same_seen(tmp_path / "True" / name, tmp_path / "False" / name)
    assert weights[True].keys() == weights[False].keys()
    for key, value in weights[True].items():
        torch.testing.assert_close(value, weights[False][key])


@pytest.mark.parametrize("fail_in_turn", [True, False])
def test_serialized_checkpoint_loading_stock_connector_swapped_in(tmp_path, fail_in_turn):
    """With the connector replaced by a new ``_CheckpointConnector`` (as frameworks do), ``fit`` raises the user's own
    exception unchanged, whether it comes from the restore or from training."""
    ckpt_path = _checkpoint(tmp_path)

    class _FailingModel(_RecordingModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            raise _RestoreError("training failed")

    model = _RecordingModel(tmp_path, fail_on_rank=0) if fail_in_turn else _FailingModel(tmp_path)
    trainer = _trainer(tmp_path, serialized_checkpoint_loading=True)
    trainer._checkpoint_connector = _CheckpointConnector(trainer)
    message = "rank 0 cannot restore" if fail_in_turn else "training failed"
    with pytest.raises(_RestoreError, match=f"^{message}$") as excinfo:
        trainer.fit(model, ckpt_path=ckpt_path)
    assert excinfo.type is _RestoreError


def _ddp_trainer(tmp_path: Path) -> Trainer:
    # a short process group timeout bounds how long a rank could wait on a collective if this feature regressed
    strategy = DDPStrategy(start_method="spawn", timeout=timedelta(seconds=60))
    return _trainer(tmp_path, accelerator="cpu", devices=2, strategy=strategy, serialized_checkpoint_loading=True)


@RunIf(skip_windows=True)
@pytest.mark.timeout(120)
def test_serialized_checkpoint_loading_ddp_equals_default_restore(tmp_path):
    """With two ranks, rank 0 restores before rank 1 starts, and both resume to the state of the default restore."""
    ckpt_path = _checkpoint(tmp_path)
    (tmp_path / "default").mkdir()
    default = _RecordingModel(tmp_path / "default")
    _trainer(tmp_path / "default").fit(default, ckpt_path=ckpt_path)
    expected = torch.load(tmp_path / "default" / "resumed_0.pt")

    _ddp_trainer(tmp_path).fit(_RecordingModel(tmp_path), ckpt_path=ckpt_path)
    assert (tmp_path / "order.txt").read_text() == "start 0\nend 0\nstart 1\nend 1\n"
    for rank in (0, 1):
        resumed = torch.load(tmp_path / f"resumed_{rank}.pt")
        assert resumed["step"] == expected["step"] == 2
        torch.testing.assert_close(resumed["model"], expected["model"])
        torch.testing.assert_close(resumed["optimizer"], expected["optimizer"])
        for name in ("module_saw", "callback_saw"):
            _assert_same_seen(tmp_path / f"{name}_{rank}.pt", tmp_path / "default" / f"{name}_0.pt")

    # `validate(ckpt_path=...)` was the entry point the 2021 attempt broke
    (tmp_path / "order.txt").unlink()
    _ddp_trainer(tmp_path).validate(_RecordingModel(tmp_path), ckpt_path=ckpt_path)
    assert (tmp_path / "order.txt").read_text() == "start 0\nend 0\nstart 1\nend 1\n"
    checkpoint = torch.load(ckpt_path)
    for rank in (0, 1):
        torch.testing.assert_close(torch.load(tmp_path / f"validated_{rank}.pt"), checkpoint["state_dict"])


def _fit_on_rank(local_rank: int, port: int, log_dir: Path, ckpt_path: Path) -> None:
    # the processes are created here, as a cluster's launcher would: `fit` raises in each of them, not in a launcher
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
    os.environ.update(LOCAL_RANK=str(local_rank), RANK=str(local_rank))
    trainer = _trainer(
        log_dir,
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(timeout=timedelta(seconds=60)),
        serialized_checkpoint_loading=True,
    )
    try:
        trainer.fit(_RecordingModel(log_dir, fail_on_rank=0), ckpt_path=ckpt_path)
    except Exception as ex:
        (log_dir / f"error_{local_rank}.txt").write_text(f"{type(ex).__name__}: {ex}")


@RunIf(skip_windows=True)
@pytest.mark.timeout(120)
def test_serialized_checkpoint_loading_ddp_failure_in_turn(tmp_path):
    """A rank that fails in its turn raises its own error, and the rank waiting for that turn a clear one."""
    ckpt_path = _checkpoint(tmp_path)
    torch.multiprocessing.spawn(_fit_on_rank, args=(find_free_network_port(), tmp_path, ckpt_path), nprocs=2)
    assert (tmp_path / "error_0.txt").read_text() == "_RestoreError: rank 0 cannot restore"
    assert (tmp_path / "error_1.txt").read_text() == (
        f"RuntimeError: Restoring the checkpoint {str(ckpt_path)!r} failed on another rank in turn 0 of"
        " `Trainer(serialized_checkpoint_loading=1)` (local ranks 0 to 0 of its node). That rank raised the original"
        " error."
    )
    # rank 1 never had its turn
    assert (tmp_path / "order.txt").read_text() == "start 0\n"
