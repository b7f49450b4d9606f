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
import glob
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from torch.utils.data import DataLoader

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import FSDPStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.connectors.serialized_restore import CheckpointRestoreError, SerializedLoading


class _AdamModel(BoringModel):
    """Adam (which has optimizer state) and fixed data, so that runs can be compared exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.seen_by_hook: list[str] = []
        self.state_dict_tensors_seen = 0

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.randn(32, 32, generator=torch.Generator().manual_seed(0)), batch_size=8)

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.seen_by_hook = sorted(checkpoint)
        self.state_dict_tensors_seen = len(checkpoint["state_dict"])


class _RecordingPrecision(Precision):
    """Records the cached checkpoint as the second restore stage sees it."""

    keys: list[str] = []
    state_dict_tensors = -1

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.keys = sorted(checkpoint)
        self.state_dict_tensors = len(checkpoint["state_dict"])


def _trainer(tmp_path, **kwargs: Any) -> Trainer:
    return Trainer(**{**_trainer_defaults(tmp_path), **kwargs})


def _trainer_defaults(tmp_path) -> dict[str, Any]:
    return {
        "default_root_dir": tmp_path,
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }


def _first_epoch_checkpoint(tmp_path) -> str:
    torch.manual_seed(0)
    trainer = _trainer(tmp_path)
    trainer.fit(_AdamModel())
    path = str(tmp_path / "epoch1.ckpt")
    trainer.save_checkpoint(path)
    return path


def _assert_equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal(x, y)
    else:
        assert a == b


# series: auto
@pytest.mark.parametrize("value", [False, True, 1, 3, "auto", SerializedLoading(max_concurrent=2)])
def test_serialized_checkpoint_loading_accepted_values(value):
    """The Trainer accepts `False`, `True`, a positive int, "auto" and the settings object, and reports the value
    back."""
    # series: before auto
    # @pytest.mark.parametrize("value", [False, True, 1, 3, SerializedLoading(max_concurrent=2)])
    # def test_serialized_checkpoint_loading_accepted_values(value):
    #     """The Trainer accepts `False`, `True`, a positive int and the settings object, and reports the value back."""
    # series: end
    trainer = Trainer(serialized_checkpoint_loading=value, logger=False)
    assert trainer.serialized_checkpoint_loading == value


# series: auto
@pytest.mark.parametrize("value", [0, -2, 1.5, "yes", None])
# series: before auto
# @pytest.mark.parametrize("value", [0, -2, 1.5, "yes", "auto", None])
# series: end
def test_serialized_checkpoint_loading_rejected_values(value):
    """Any other value raises a `ValueError` at construction that quotes it."""
    with pytest.raises(ValueError, match=re.escape(f"serialized_checkpoint_loading={value!r}")):
        Trainer(serialized_checkpoint_loading=value, logger=False)


@pytest.mark.parametrize("serialized", [True, 2])
def test_serialized_resume_equals_uninterrupted_training(tmp_path, serialized):
    """Resuming with the option on ends with exactly the weights and optimizer state of an uninterrupted run."""
    ckpt_path = _first_epoch_checkpoint(tmp_path)
    torch.manual_seed(0)
    uninterrupted_model = _AdamModel()
    uninterrupted = _trainer(tmp_path, max_epochs=2)
    uninterrupted.fit(uninterrupted_model)

    model = _AdamModel()
    precision = _RecordingPrecision()
    trainer = _trainer(tmp_path, max_epochs=2, plugins=[precision], serialized_checkpoint_loading=serialized)
    trainer.fit(model, ckpt_path=ckpt_path)

    _assert_equal(model.state_dict(), uninterrupted_model.state_dict())
    _assert_equal(trainer.optimizers[0].state_dict(), uninterrupted.optimizers[0].state_dict())
    assert trainer.global_step == uninterrupted.global_step
    # hooks see the complete checkpoint; the second stage no longer holds the weights
    assert "optimizer_states" in model.seen_by_hook
    assert model.state_dict_tensors_seen > 0
    assert "optimizer_states" in precision.keys
    assert precision.state_dict_tensors == 0


def test_serialized_checkpoint_loading_off_restores_as_before(tmp_path):
    """With the default (`False`) the second stage sees the whole checkpoint, as it always did."""
    ckpt_path = _first_epoch_checkpoint(tmp_path)
    precision = _RecordingPrecision()
    trainer = _trainer(tmp_path, max_epochs=2, plugins=[precision])
    assert trainer.serialized_checkpoint_loading is False
    trainer.fit(_AdamModel(), ckpt_path=ckpt_path)
    assert precision.state_dict_tensors > 0


@pytest.mark.parametrize("entry", ["validate", "test", "predict"])
def test_serialized_evaluation_keeps_no_optimizer_state(tmp_path, entry):
    """validate/test/predict load the weights and drop optimizer and scheduler states after the first stage."""
    ckpt_path = _first_epoch_checkpoint(tmp_path)
    model = _AdamModel()
    precision = _RecordingPrecision()
    limits = {"limit_val_batches": 2, "limit_test_batches": 2, "limit_predict_batches": 2}
    trainer = _trainer(tmp_path, plugins=[precision], serialized_checkpoint_loading=True, **limits)
    getattr(trainer, entry)(model, ckpt_path=ckpt_path)

    _assert_equal(model.state_dict(), torch.load(ckpt_path, weights_only=True)["state_dict"])
    assert "optimizer_states" in model.seen_by_hook
    assert "optimizer_states" not in precision.keys
    assert "lr_schedulers" not in precision.keys


def test_serialized_checkpoint_loading_unsupported_strategy_warns(tmp_path):
    """A strategy that overrides how it loads a checkpoint gets a warning and the usual restore."""

    class _OwnLoading(SingleDeviceStrategy):
        def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            return super().load_checkpoint(*args, **kwargs)

    ckpt_path = _first_epoch_checkpoint(tmp_path)
    precision = _RecordingPrecision()
    trainer = _trainer(
        tmp_path, strategy=_OwnLoading(torch.device("cpu")), plugins=[precision], serialized_checkpoint_loading=True
    )
    with pytest.warns(UserWarning, match="has no effect with _OwnLoading: it overrides load_checkpoint"):
        trainer.validate(_AdamModel(), ckpt_path=ckpt_path)
    assert precision.state_dict_tensors > 0


# series: auto
def test_serialized_checkpoint_loading_auto_refuses_when_no_turn_fits(tmp_path):
    """With "auto", every rank raises a `MemoryError` before reading when not even one rank can restore."""
    ckpt_path = _first_epoch_checkpoint(tmp_path)
    settings = SerializedLoading(max_concurrent="auto", reader="eager", available_memory=1)
    trainer = _trainer(tmp_path, serialized_checkpoint_loading=settings)
    with pytest.raises(MemoryError, match="not even one rank of node 0"):
        trainer.validate(_AdamModel(), ckpt_path=ckpt_path)


# series: end


def test_serialized_checkpoint_loading_single_process_raises_the_default_restores_error(tmp_path):
    """In one process a failed restore raises exactly what the default restore raises: same type, same message."""
    ckpt_path = _first_epoch_checkpoint(tmp_path)
    with open(ckpt_path, "r+b") as f:
        f.truncate(100)
    raised = []
    for serialized in (False, True):
        trainer = _trainer(tmp_path, serialized_checkpoint_loading=serialized)
        with pytest.raises(RuntimeError, match="failed finding central directory") as info:
            trainer.validate(_AdamModel(), ckpt_path=ckpt_path)
        raised.append((type(info.value), str(info.value)))
    assert raised[0] == raised[1]
    assert not issubclass(raised[1][0], CheckpointRestoreError)


# series: mmap
def _mapped(path: str) -> bool:
    """Whether this process maps ``path`` (Linux's ``/proc/self/maps``)."""
    with open("/proc/self/maps") as maps:
        return any(line.rstrip("\n").endswith(" " + os.path.realpath(path)) for line in maps)


class _MappingModel(_AdamModel):
    """Records whether the checkpoint file is mapped while the hooks see it, and once the restore has ended."""

    def __init__(self, ckpt_path: str) -> None:
        super().__init__()
        self.ckpt_path = ckpt_path
        self.mapped_in_hook: bool | None = None
        self.mapped_after_restore: bool | None = None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.mapped_in_hook = _mapped(self.ckpt_path)

    def on_train_start(self) -> None:
        self.mapped_after_restore = _mapped(self.ckpt_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("reader", ["auto", "mmap", "eager"])
def test_serialized_resume_reads_memory_mapped_and_keeps_nothing_of_the_file(tmp_path, reader):
    """A local checkpoint is read memory-mapped unless `reader="eager"`; once the restore has ended nothing the
    model or the optimizers keep lies in the file's pages, and the run equals the default restore's."""
    ckpt_path = _first_epoch_checkpoint(tmp_path)
    results = []
    for serialized in (False, SerializedLoading(reader=reader)):
        torch.manual_seed(1)
        model = _MappingModel(ckpt_path)
        trainer = _trainer(tmp_path, max_epochs=2, serialized_checkpoint_loading=serialized)
        trainer.fit(model, ckpt_path=ckpt_path)
        results.append((model, trainer))
        assert model.mapped_in_hook is (serialized is not False and reader != "eager")
        assert model.mapped_after_restore is False
    (default_model, default), (model, trainer) = results
    _assert_equal(model.state_dict(), default_model.state_dict())
    _assert_equal(trainer.optimizers[0].state_dict(), default.optimizers[0].state_dict())


def test_serialized_resume_of_a_legacy_file_reads_it_eagerly_and_says_why(tmp_path, caplog):
    """A checkpoint that cannot be memory-mapped (not in torch's zip format) is read as the default restore reads it,
    with one INFO line saying why."""
    ckpt_path = _first_epoch_checkpoint(tmp_path)
    legacy = str(tmp_path / "legacy.ckpt")
    torch.save(torch.load(ckpt_path, weights_only=False), legacy, _use_new_zipfile_serialization=False)
    trainer = _trainer(tmp_path, max_epochs=2, serialized_checkpoint_loading=True)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.serialized_restore"):
        trainer.fit(_AdamModel(), ckpt_path=legacy)
    messages = [r.getMessage() for r in caplog.records]
    assert any("eagerly instead of memory-mapped" in m and "zip format" in m for m in messages), messages
    assert trainer.global_step == 8


# series: end
# series: remote
def test_serialized_resume_from_a_remote_checkpoint_reads_a_private_local_copy(tmp_path, caplog):
    """A remote (fsspec) checkpoint is downloaded once into a new private directory under `tmpdir`, read from there
    and removed when the restore ends; `trainer.ckpt_path` stays the URL, and the run equals the default restore's."""
    fsspec = pytest.importorskip("fsspec")
    ckpt_path = _first_epoch_checkpoint(tmp_path)
    url = f"memory://serialized-checkpoint-loading/{tmp_path.name}/epoch1.ckpt"
    with fsspec.open(url, "wb") as f:
        f.write(Path(ckpt_path).read_bytes())
    copies = tmp_path / "copies"
    copies.mkdir(mode=0o700)
    results = []
    for serialized in (False, SerializedLoading(tmpdir=str(copies))):
        torch.manual_seed(1)
        model = _AdamModel()
        trainer = _trainer(tmp_path, max_epochs=2, serialized_checkpoint_loading=serialized)
        with caplog.at_level(logging.INFO, logger="lightning.pytorch.serialized_restore"):
            trainer.fit(model, ckpt_path=url)
        results.append((model, trainer))
        assert trainer.ckpt_path == url
    assert sum("serialized restore: fetched" in r.getMessage() for r in caplog.records) == 1
    assert list(copies.iterdir()) == []
    (default_model, default), (model, trainer) = results
    _assert_equal(model.state_dict(), default_model.state_dict())
    _assert_equal(trainer.optimizers[0].state_dict(), default.optimizers[0].state_dict())


# series: end
# series: fsdp
class _CPUFSDPStrategy(FSDPStrategy):
    """FSDP on CPU: torch's FSDP runs there with gloo when wrapped with `device_id=cpu` (only `_setup_model`
    differs, so the restore is `FSDPStrategy`'s)."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            model = FullyShardedDataParallel(module=model, device_id=torch.device("cpu"), **self.kwargs)
        return model


class _FSDPAdamModel(_AdamModel):
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # FSDP's `load_checkpoint` takes the weights out of the dict before the hooks run
        self.seen_by_hook = sorted(checkpoint)


@pytest.fixture
def _in_process_group():
    """FSDP in one process initializes a process group in it and sets ``MASTER_PORT`` and the like: both are undone
    afterwards (as Lightning's conftest does between tests), so that later tests' processes do not find the port
    taken."""
    environ = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


# FSDP's own full-state restore, which both runs use, calls the `state_dict_type` API torch deprecates
@pytest.mark.filterwarnings("ignore:FSDP.state_dict_type:FutureWarning")
@pytest.mark.usefixtures("_in_process_group")
def test_serialized_resume_under_fsdp_reads_a_full_checkpoint_memory_mapped(tmp_path, caplog):
    """Under `FSDPStrategy` a full checkpoint (here from a single-device run: a model moving to FSDP) is restored by
    every rank together, memory-mapped, and equals FSDP's own restore."""
    ckpt_path = _first_epoch_checkpoint(tmp_path)
    results = []
    for serialized in (False, True):
        torch.manual_seed(1)
        model = _FSDPAdamModel()
        strategy = _CPUFSDPStrategy()
        trainer = _trainer(tmp_path, max_epochs=2, strategy=strategy, serialized_checkpoint_loading=serialized)
        with caplog.at_level(logging.INFO):
            trainer.fit(model, ckpt_path=ckpt_path)
        results.append((model, trainer))
    assert any("FSDP restores with collectives" in r.getMessage() for r in caplog.records)
    (default_model, default), (model, trainer) = results
    assert model.seen_by_hook == default_model.seen_by_hook
    _assert_equal(model.state_dict(), default_model.state_dict())
    _assert_equal(trainer.optimizers[0].state_dict(), default.optimizers[0].state_dict())
    assert trainer.global_step == default.global_step == 8


# series: end
class _TwoGroupsModel(_AdamModel):
    """Two parameter groups: the optimizer state of a one-group checkpoint fails to load in the second stage."""

    def configure_optimizers(self) -> Any:
        weight, bias = self.layer.weight, self.layer.bias
        return torch.optim.Adam([{"params": [weight]}, {"params": [bias]}], lr=0.01)


@pytest.mark.parametrize("serialized", [False, True])
def test_serialized_restore_failing_half_way_saves_no_checkpoint_of_the_partly_restored_model(tmp_path, serialized):
    """A restore that fails after the weights are restored (the optimizer state does not fit): the default restore
    lets `ModelCheckpoint(save_on_exception=True)` save the partly restored model; a serialized restore does not."""
    ckpt_path = _first_epoch_checkpoint(tmp_path)
    dirpath = tmp_path / "on-exception"
    callback = ModelCheckpoint(dirpath=dirpath, save_on_exception=True)
    options = {"callbacks": [callback], "enable_checkpointing": True, "serialized_checkpoint_loading": serialized}
    trainer = _trainer(tmp_path, max_epochs=2, **options)
    with pytest.raises(ValueError, match="different number of parameter groups"):
        if serialized:
            with pytest.warns(UserWarning, match="will not save a checkpoint of the partly restored model"):
                trainer.fit(_TwoGroupsModel(), ckpt_path=ckpt_path)
        else:
            trainer.fit(_TwoGroupsModel(), ckpt_path=ckpt_path)
    saved = sorted(p.name for p in dirpath.glob("*.ckpt")) if dirpath.exists() else []
    assert bool(saved) is not serialized, saved


@pytest.mark.skipif(sys.platform == "win32", reason="gloo process groups on CPU")
def test_serialized_resume_ddp_spawn_equals_default_restore(tmp_path):
    """With two processes taking turns, the resumed run ends exactly where the default restore ends, and the second
    process starts its restore only after the first ended its own (the hook runs inside each process's turn)."""
    ckpt_path = _first_epoch_checkpoint(tmp_path)
    results = []
    for serialized in (False, True):
        model = _TimedHookModel(tmp_path)
        trainer = _trainer(
            tmp_path, devices=2, strategy="ddp_spawn", max_epochs=2, serialized_checkpoint_loading=serialized
        )
        trainer.fit(model, ckpt_path=ckpt_path)
        results.append((model.state_dict(), trainer.global_step))
    _assert_equal(results[1], results[0])
    (_, end0), (start1, _) = (json.loads((tmp_path / f"turn{rank}.json").read_text()) for rank in (0, 1))
    assert end0 <= start1, "rank 1 started its restore before rank 0 ended its own"


class _TimedHookModel(_AdamModel):
    """Records when each rank's ``on_load_checkpoint`` ran (inside the rank's turn); can fail on one rank."""

    def __init__(self, out, fail_on_rank: int = -1, exit_on_rank: int = -1) -> None:
        super().__init__()
        self.out = out
        self.fail_on_rank = fail_on_rank
        self.exit_on_rank = exit_on_rank

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        started = time.time()
        if self.global_rank == self.fail_on_rank:
            raise RuntimeError(f"hook failed on rank {self.global_rank}")
        if self.global_rank == self.exit_on_rank:
            # the process vanishes in its turn; exit code 0, so that the spawn launcher keeps the other process running
            # (as the launcher of another machine would: it does not see a process of this one die)
            os._exit(0)
        time.sleep(0.5)
        (self.out / f"turn{self.global_rank}.json").write_text(json.dumps([started, time.time()]))


class _RecordingTrainer(Trainer):
    """Writes what each rank raised from inside ``_run`` (which runs in every spawned worker), then waits until every
    rank has (at most 60 s): the launcher terminates the other workers once one has exited."""

    expected_records: Optional[int] = None
    """How many ranks will record (default: all)."""

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._run(*args, **kwargs)
        except BaseException as err:
            out = self.default_root_dir
            record = {"mro": [c.__name__ for c in type(err).__mro__], "message": str(err)}
            with open(os.path.join(out, f"error{self.global_rank}.json"), "w") as f:
                json.dump(record, f)
            deadline = time.time() + 60
            expected = self.expected_records or self.world_size
            while time.time() < deadline and len(glob.glob(os.path.join(out, "error*.json"))) < expected:
                time.sleep(0.05)
            raise


@pytest.mark.skipif(sys.platform == "win32", reason="gloo process groups on CPU")
def test_serialized_failure_on_one_rank_ends_the_restore_on_every_rank(tmp_path):
    """A hook that raises on rank 1 in its turn: every rank raises a `CheckpointRestoreError` naming rank 1 and the
    stage, also an instance of the hook's exception type, instead of waiting for a turn that never ends."""
    ckpt_path = _first_epoch_checkpoint(tmp_path)
    out = tmp_path / "spawned"
    out.mkdir()
    options = {"devices": 2, "strategy": "ddp_spawn", "max_epochs": 2, "serialized_checkpoint_loading": True}
    trainer = _RecordingTrainer(**{**_trainer_defaults(out), **options})
    with pytest.raises(Exception, match="hook failed on rank 1"):
        trainer.fit(_TimedHookModel(tmp_path, fail_on_rank=1), ckpt_path=ckpt_path)
    for rank in (0, 1):
        error = json.loads((out / f"error{rank}.json").read_text())
        assert "CheckpointRestoreError" in error["mro"], error
        assert "RuntimeError" in error["mro"], error
        assert "rank 1" in error["message"], error
        assert "restore modules and callbacks" in error["message"], error


class _OneRecordTrainer(_RecordingTrainer):
    expected_records = 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a vanished process is seen through /proc at once")
def test_serialized_restore_ends_on_every_rank_when_a_rank_vanishes_in_its_turn(tmp_path):
    """A process that disappears inside its turn (killed, or on a machine whose launcher does not tell this one) is
    found gone: the other process raises a `CheckpointRestoreError` naming it and the stage at once, instead of
    waiting for the turn timeout (30 minutes by default)."""
    ckpt_path = _first_epoch_checkpoint(tmp_path)
    out = tmp_path / "spawned"
    out.mkdir()
    settings = SerializedLoading(turn_timeout=120)
    options = {"devices": 2, "strategy": "ddp_spawn", "max_epochs": 2, "serialized_checkpoint_loading": settings}
    trainer = _OneRecordTrainer(**{**_trainer_defaults(out), **options})
    started = time.time()
    with pytest.raises(Exception, match="rank 1"):
        trainer.fit(_TimedHookModel(tmp_path, exit_on_rank=1), ckpt_path=ckpt_path)
    assert time.time() - started < 60
    assert not (out / "error1.json").exists()
    error = json.loads((out / "error0.json").read_text())
    assert "CheckpointRestoreError" in error["mro"], error
    assert "rank 1 (node 0, local rank 1)" in error["message"], error
    assert "exited while inside its turn" in error["message"], error
    assert "restore modules and callbacks" in error["message"], error
