"""The serialized connector in a single process: strategy support, hook changes to optimizer state, readers."""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torchmetrics
from pytorch_lightning.strategies import SingleDeviceStrategy, Strategy

from harness.models import dataloader, make_model_class
from harness.trainers import quiet_cpu_trainer_kwargs
from serialized_restore import Trainer

Model = make_model_class("pytorch_lightning")


def _trainer(tmp_path: Path, **kwargs: Any) -> Trainer:
    defaults = quiet_cpu_trainer_kwargs(str(tmp_path), 1, "auto", max_epochs=1, enable_checkpointing=False)
    return Trainer(**{**defaults, **kwargs})


@pytest.fixture
def checkpoint(tmp_path: Path) -> str:
    torch.manual_seed(0)
    trainer = _trainer(tmp_path)
    trainer.fit(Model(), train_dataloaders=dataloader())
    path = str(tmp_path / "one.ckpt")
    trainer.save_checkpoint(path)
    return path


class _OverridingStrategy(SingleDeviceStrategy):
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)


def test_strategy_overriding_restore_warns_and_restores_as_upstream(
    tmp_path: Path, checkpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A strategy that overrides a restore method gets one warning naming it, and the upstream restore."""
    trainer = _trainer(
        tmp_path, strategy=_OverridingStrategy(device=torch.device("cpu")), serialized_checkpoint_loading=True
    )
    model = Model()
    with caplog.at_level(logging.INFO), pytest.warns(UserWarning) as warned:
        trainer.validate(model, dataloaders=dataloader(), ckpt_path=checkpoint)
    messages = [str(w.message) for w in warned if "serialized_checkpoint_loading" in str(w.message)]
    assert messages == [
        "`Trainer(serialized_checkpoint_loading=True)` has no effect with _OverridingStrategy: it overrides"
        " load_model_state_dict. The checkpoint is restored as upstream Lightning does."
    ]
    assert "turn for" not in caplog.text
    saved = torch.load(checkpoint, weights_only=True)["state_dict"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


class _UnknownStrategy(Strategy):
    """A strategy the package does not know (no DDP, single-device or FSDP base): one CPU process."""

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def is_global_zero(self) -> bool:
        return True

    global_rank = local_rank = node_rank = 0
    world_size = 1

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def barrier(self, name: Any = None) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
        return tensor


def test_unknown_strategy_warns_once_and_restores_as_upstream(
    tmp_path: Path, checkpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A strategy the package does not know may restore with collectives: one warning naming it, upstream's restore."""
    trainer = _trainer(tmp_path, strategy=_UnknownStrategy(), serialized_checkpoint_loading=2)
    model = Model()
    with caplog.at_level(logging.INFO), pytest.warns(UserWarning) as warned:
        trainer.validate(model, dataloaders=dataloader(), ckpt_path=checkpoint)
        trainer.test(model, dataloaders=dataloader(), ckpt_path=checkpoint)
    messages = [str(w.message) for w in warned if "serialized_checkpoint_loading" in str(w.message)]
    assert messages == [
        "`Trainer(serialized_checkpoint_loading=2)` has no effect with _UnknownStrategy: its restore may run"
        " collectives, which cannot run while ranks take turns. The checkpoint is restored as upstream Lightning"
        " does."
    ]
    assert "turn for" not in caplog.text
    saved = torch.load(checkpoint, weights_only=True)["state_dict"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


class _ZeroingModel(Model):  # type: ignore[misc,valid-type]
    """Changes the optimizer state in `on_load_checkpoint`, in place, as some users do."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        for state in checkpoint["optimizer_states"][0]["state"].values():
            state["exp_avg"].mul_(0)

    def on_train_start(self) -> None:
        self.exp_avg_at_start = [s["exp_avg"].clone() for s in self.trainer.optimizers[0].state.values()]


@pytest.mark.parametrize("reader", ["eager", "mmap"])
def test_hook_changes_to_optimizer_state_are_kept(
    tmp_path: Path, checkpoint: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, reader: str
) -> None:
    """An in-place change a hook makes to checkpoint['optimizer_states'] reaches the optimizer with both readers."""
    monkeypatch.setenv("SERIALIZED_RESTORE_READER", reader)
    trainer = _trainer(tmp_path, max_epochs=2, serialized_checkpoint_loading=True)
    model = _ZeroingModel()
    with caplog.at_level(logging.INFO):
        trainer.fit(model, train_dataloaders=dataloader(), ckpt_path=checkpoint)
    assert model.exp_avg_at_start and all(torch.count_nonzero(t) == 0 for t in model.exp_avg_at_start)
    assert "turn for 'restore training state' ended" in caplog.text
    if reader == "eager":
        assert "a hook changed checkpoint['optimizer_states']" in caplog.text


def test_eager_reader_reads_optimizer_state_again(
    tmp_path: Path, checkpoint: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With the eager reader, unchanged optimizer state is dropped after stage 1 and read again in stage 2."""
    monkeypatch.setenv("SERIALIZED_RESTORE_READER", "eager")
    torch.manual_seed(0)
    reference = _trainer(tmp_path, max_epochs=2)
    reference_model = Model()
    reference.fit(reference_model, train_dataloaders=dataloader(), ckpt_path=checkpoint)

    trainer = _trainer(tmp_path, max_epochs=2, serialized_checkpoint_loading=True)
    model = Model()
    with caplog.at_level(logging.INFO):
        trainer.fit(model, train_dataloaders=dataloader(), ckpt_path=checkpoint)
    assert "a hook changed" not in caplog.text
    stage2 = [r.getMessage() for r in caplog.records if "'restore training state' ended" in r.getMessage()]
    size = Path(checkpoint).stat().st_size
    assert stage2 and stage2[0].split(";")[0].endswith(f"read {size / 1024:.1f} KiB eagerly"), stage2
    for key, value in reference_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_upstream_trainer_is_untouched() -> None:
    """Importing the package changes nothing in the upstream Trainer."""
    import serialized_restore.lightning  # noqa: F401

    trainer = pl.Trainer(logger=False)
    assert type(trainer._checkpoint_connector).__module__.startswith("pytorch_lightning.")


@pytest.mark.parametrize("flavour", ["pytorch_lightning", "lightning"])
@pytest.mark.parametrize("reader", ["auto", "mmap"])
def test_a_missing_checkpoint_raises_upstreams_error_with_no_word_about_readers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, flavour: str, reader: str
) -> None:
    """A `ckpt_path` that does not exist raises upstream's own error, type and message, and no line before it speaks
    of reading eagerly instead of memory-mapped (a missing file is not a reader's concern)."""
    import importlib

    monkeypatch.setenv("SERIALIZED_RESTORE_READER", reader)
    upstream_cls = importlib.import_module("lightning.pytorch" if flavour == "lightning" else flavour).Trainer
    ours_cls = importlib.import_module(f"serialized_restore.{flavour}").Trainer
    model_cls = make_model_class(flavour)
    missing = str(tmp_path / "no-such.ckpt")
    kwargs = quiet_cpu_trainer_kwargs(str(tmp_path), 1, "auto", max_epochs=1, enable_checkpointing=False)
    errors = []
    for trainer in (upstream_cls(**kwargs), ours_cls(**kwargs, serialized_checkpoint_loading=True)):
        with caplog.at_level(logging.INFO), pytest.raises(Exception) as info:
            trainer.fit(model_cls(), train_dataloaders=dataloader(), ckpt_path=missing)
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1] and errors[0][0] is FileNotFoundError, errors
    assert "eagerly" not in caplog.text and "memory-mapped" not in caplog.text


class _WithPersistentMetric(Model):
    """Keeps a persistent torchmetrics state, which ``Metric._load_from_state_dict`` assigns instead of copying it;
    records, once the restore is over, the lines of ``/proc/self/maps`` that map the checkpoint and the state."""

    def __init__(self) -> None:
        super().__init__()
        self.metric = torchmetrics.SumMetric()
        self.metric.persistent(True)
        self.mapped: list[str] | None = None

    def on_train_batch_end(self, *args: Any) -> None:
        self.metric.update(torch.tensor(1.0))

    def _after_restore(self) -> None:
        if self.mapped is None and self.ckpt is not None:
            gc.collect()
            maps = Path("/proc/self/maps").read_text().splitlines()
            self.mapped = [line for line in maps if line.endswith(os.path.realpath(self.ckpt))]
            self.sum_at_start = self.metric.sum_value.clone()

    ckpt: str | None = None
    on_train_start = on_validation_start = _after_restore


@pytest.mark.parametrize("entry", ["fit", "validate"])
def test_what_a_module_keeps_of_the_weights_is_copied_out_of_the_mapping(
    tmp_path: Path, entry: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A persistent torchmetrics state, which the metric keeps instead of copying it from the memory-mapped checkpoint,
    is copied out of the mapping at the end of the first stage: once the restore is over the file is not mapped, and
    the state has its saved value."""
    trainer = _trainer(tmp_path)
    trainer.fit(_WithPersistentMetric(), train_dataloaders=dataloader())
    path = str(tmp_path / "metric.ckpt")
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["state_dict"]["metric.sum_value"]
    assert saved > 0

    model = _WithPersistentMetric()
    model.ckpt = path
    trainer = _trainer(tmp_path, max_epochs=2, serialized_checkpoint_loading=True)
    with caplog.at_level(logging.INFO):
        getattr(trainer, entry)(model, dataloader(), ckpt_path=path)
    assert any(getattr(record, "turn", {}).get("reader") == "mmap" for record in caplog.records)  # it was mapped
    assert model.mapped == []
    assert torch.equal(model.sum_at_start, saved)
