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
import copy
import logging
import os

import fsspec
import pytest
import torch

from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from tests_pytorch.helpers.runif import RunIf


class AdamModel(BoringModel):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _mappings_of(path):
    """The lines of ``/proc/self/maps`` that map the file at ``path``."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        return [line for line in maps if line.rstrip().endswith(real)]


class _MappingProbe(Callback):
    """Records the mappings of the checkpoint while it is restored and once the loop runs, and what the job holds."""

    def __init__(self, path):
        self.path = path
        self.during = self.after = None
        self.weights = self.optimizer_state = None

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self.during = _mappings_of(self.path)

    def _after_restore(self, trainer, pl_module):
        if self.after is not None:
            return
        self.after = _mappings_of(self.path)
        self.weights = {name: tensor.clone() for name, tensor in pl_module.state_dict().items()}
        if trainer.optimizers:
            self.optimizer_state = copy.deepcopy(trainer.optimizers[0].state_dict()["state"])

    on_train_start = on_validation_start = on_test_start = on_predict_start = _after_restore


def _trainer(tmp_path, **kwargs):
    return Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        limit_train_batches=2,
        limit_val_batches=1,
        limit_test_batches=1,
        limit_predict_batches=1,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        **kwargs,
    )


@pytest.fixture
def checkpoint(tmp_path):
    """A checkpoint of an ``AdamModel`` after one epoch (it holds optimizer state), and its contents."""
    trainer = _trainer(tmp_path, max_epochs=1, enable_checkpointing=False)
    trainer.fit(AdamModel())
    path = tmp_path / "adam.ckpt"
    trainer.save_checkpoint(path)
    return path, torch.load(path, weights_only=False)


@RunIf(linux_only=True)
@pytest.mark.parametrize("fn", ["fit", "validate", "test", "predict"])
def test_mmap_restore_leaves_no_mapping(tmp_path, checkpoint, fn):
    """Every entry point restores a memory-mapped checkpoint, and no tensor is backed by the file once it ran."""
    path, saved = checkpoint
    probe = _MappingProbe(path)
    trainer = _trainer(tmp_path, max_epochs=2, callbacks=[probe], plugins=[TorchCheckpointIO(mmap=True)])
    getattr(trainer, fn)(AdamModel(), ckpt_path=path)

    assert probe.during, "the checkpoint was not memory-mapped while restored"
    assert probe.after == []
    for name, tensor in saved["state_dict"].items():
        torch.testing.assert_close(probe.weights[name], tensor)
    if fn == "fit":
        for index, state in saved["optimizer_states"][0]["state"].items():
            for key, tensor in state.items():
                torch.testing.assert_close(probe.optimizer_state[index][key], tensor)


@RunIf(linux_only=True)
def test_mmap_restore_through_a_wrapping_checkpoint_io(tmp_path, checkpoint):
    """A wrapped ``TorchCheckpointIO(mmap=True)`` (``AsyncCheckpointIO``) also leaves no tensor backed by the file."""
    path, _ = checkpoint
    probe = _MappingProbe(path)
    plugin = AsyncCheckpointIO(TorchCheckpointIO(mmap=True))
    _trainer(tmp_path, max_epochs=2, callbacks=[probe], plugins=[plugin]).fit(AdamModel(), ckpt_path=path)
    assert probe.during
    assert probe.after == []


def test_mmap_fit_resume_matches_reading_into_memory(tmp_path, checkpoint):
    """Resuming ``fit`` memory-mapped ends with the same weights and optimizer state as the default read."""
    path, _ = checkpoint
    results = []
    for checkpoint_io in (TorchCheckpointIO(), TorchCheckpointIO(mmap=True)):
        seed_everything(1)
        model = AdamModel()
        trainer = _trainer(tmp_path, max_epochs=2, plugins=[checkpoint_io], enable_checkpointing=False)
        trainer.fit(model, ckpt_path=path)
        results.append((model.state_dict(), trainer.optimizers[0].state_dict()))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


@RunIf(linux_only=True)
def test_mmap_reads_local_zip_files_and_falls_back_otherwise(tmp_path, checkpoint, caplog, monkeypatch):
    """A local zip checkpoint (also as a ``file://`` URL) is mapped; a legacy file or a remote one is read as
    before, with one log line saying why."""
    path, saved = checkpoint
    checkpoint_io = TorchCheckpointIO(mmap=True)
    for location in (path, f"file://{path}"):
        loaded = checkpoint_io.load_checkpoint(location)
        assert _mappings_of(path)
        torch.testing.assert_close(loaded["state_dict"], saved["state_dict"])
        del loaded
    assert _mappings_of(path) == []

    # Lightning's loggers do not propagate where the root logger had no handler when Lightning was imported
    monkeypatch.setattr(logging.getLogger("lightning.fabric"), "propagate", True)
    legacy = tmp_path / "legacy.ckpt"
    torch.save(saved, legacy, _use_new_zipfile_serialization=False)
    fs = fsspec.filesystem("memory")
    with fs.open("/remote.ckpt", "wb") as remote:
        torch.save(saved, remote)
    for location, reason in ((legacy, "not in the zip format"), ("memory://remote.ckpt", "not a local file system")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lightning.fabric.plugins.io.torch_io"):
            loaded = checkpoint_io.load_checkpoint(location, weights_only=False)
        torch.testing.assert_close(loaded["state_dict"], saved["state_dict"])
        (message,) = [record.getMessage() for record in caplog.records]
        assert message.startswith(f"Reading the checkpoint at {location} into memory: it cannot be memory-mapped (")
        assert reason in message
