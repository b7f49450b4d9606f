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
import shutil

import pytest
import torch

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector


class TwoParamGroupsModel(BoringModel):
    """Its optimizer state does not fit a ``BoringModel`` checkpoint: restoring one fails after the weights loaded."""

    def configure_optimizers(self):
        return torch.optim.SGD([{"params": [self.layer.weight]}, {"params": [self.layer.bias]}], lr=0.1)


class UserError(Exception):
    pass


class FailingOptimizerModel(BoringModel):
    """Raises the user's own exception where its optimizer state is restored, after the weights and the loops."""

    raised = None

    def configure_optimizers(self):
        model = self

        class FailingSGD(torch.optim.SGD):
            def load_state_dict(self, state_dict):
                model.raised = UserError("optimizer state")
                raise model.raised

        return FailingSGD(self.parameters(), lr=0.1)


class FailingCallback(Callback):
    """Raises the user's own exception in ``on_train_start`` or ``on_train_batch_start``, after the restore."""

    def __init__(self, hook):
        self.hook = hook
        self.raised = None

    def _fail_in(self, hook):
        if hook == self.hook:
            self.raised = UserError(hook)
            raise self.raised

    def on_train_start(self, *_):
        self._fail_in("on_train_start")

    def on_train_batch_start(self, *_):
        self._fail_in("on_train_batch_start")


def _trainer(tmp_path, callbacks, max_epochs=1):
    return Trainer(
        default_root_dir=tmp_path,
        max_epochs=max_epochs,
        limit_train_batches=2,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=callbacks,
    )


@pytest.fixture
def good_checkpoint(tmp_path):
    """The checkpoint ``ModelCheckpoint`` writes after one epoch: ``epoch=0-step=2.ckpt``."""
    _trainer(tmp_path, [ModelCheckpoint(dirpath=tmp_path)]).fit(BoringModel())
    (path,) = tmp_path.glob("*.ckpt")
    return path


@pytest.mark.parametrize("on_exception_callback", ["ModelCheckpoint", "OnExceptionCheckpoint"])
def test_no_checkpoint_on_exception_of_a_partly_restored_model(tmp_path, good_checkpoint, on_exception_callback):
    """A restore that fails after the weights loaded saves no checkpoint on exception, so none overwrites the one
    it resumed from (``ModelCheckpoint`` would write the same ``epoch=0-step=2.ckpt``)."""
    if on_exception_callback == "ModelCheckpoint":
        callback = ModelCheckpoint(dirpath=tmp_path, save_on_exception=True, save_last=True)
        resumed = good_checkpoint
    else:
        callback = OnExceptionCheckpoint(dirpath=tmp_path)
        resumed = shutil.copy(good_checkpoint, callback.ckpt_path)
    files = {path: path.read_bytes() for path in tmp_path.glob("*.ckpt")}

    trainer = _trainer(tmp_path, [callback], max_epochs=2)
    with pytest.raises(ValueError, match="different number of parameter groups"):
        trainer.fit(TwoParamGroupsModel(), ckpt_path=resumed)
    assert {path: path.read_bytes() for path in tmp_path.glob("*.ckpt")} == files


def test_checkpoint_on_exception_once_the_restore_completed(tmp_path, good_checkpoint):
    """An exception after the restore completed (here in ``on_train_start``) still saves a checkpoint on exception."""
    failing = FailingCallback("on_train_start")
    trainer = _trainer(tmp_path, [ModelCheckpoint(dirpath=tmp_path, save_on_exception=True), failing], max_epochs=2)
    good_checkpoint.rename(tmp_path / "resumed.ckpt")
    with pytest.raises(UserError):
        trainer.fit(BoringModel(), ckpt_path=tmp_path / "resumed.ckpt")
    assert (tmp_path / "epoch=1-step=2.ckpt").exists()


@pytest.mark.parametrize("hook", ["restore", "on_train_start", "on_train_batch_start"])
def test_user_exception_unchanged_with_a_stock_checkpoint_connector(tmp_path, good_checkpoint, hook):
    """With a stock ``_CheckpointConnector`` swapped in (as frameworks built on Lightning do), ``fit`` raises the
    user's own exception, during the restore or after it, and a partly restored model is still not saved."""
    model = FailingOptimizerModel() if hook == "restore" else BoringModel()
    failing = FailingCallback(hook)
    trainer = _trainer(tmp_path, [ModelCheckpoint(dirpath=tmp_path, save_on_exception=True), failing], max_epochs=2)
    trainer._checkpoint_connector = _CheckpointConnector(trainer)
    files = {path: path.read_bytes() for path in tmp_path.glob("*.ckpt")}

    with pytest.raises(UserError) as raised:
        trainer.fit(model, ckpt_path=good_checkpoint)
    assert raised.value is (model.raised if hook == "restore" else failing.raised)
    saved = {path: path.read_bytes() for path in tmp_path.glob("*.ckpt")}
    if hook == "restore":
        assert saved == files
    else:
        assert saved.keys() == files.keys() | {tmp_path / "epoch=1-step=2.ckpt"}
