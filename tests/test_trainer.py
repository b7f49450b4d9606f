"""The add-on's `Trainer` around upstream's `_run` and entry points: a framework that replaces the checkpoint
connector gets upstream's behaviour, and a model of the other Lightning flavour gets an error naming the import."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.models import dataloader, lightning_module, make_model_class
from harness.trainers import quiet_cpu_trainer_kwargs

FLAVOURS = {"pytorch_lightning": "serialized_restore.pytorch_lightning", "lightning": "serialized_restore.lightning"}


def _trainers(flavour: str) -> tuple[type, type]:
    """(upstream's Trainer, ours) of one flavour."""
    return lightning_module(flavour).Trainer, importlib.import_module(FLAVOURS[flavour]).Trainer


def _stock_connector(flavour: str, trainer: Any) -> Any:
    """Lightning's own `_CheckpointConnector`, as NeMo and SageMaker HyperPod put on the Trainer."""
    module = importlib.import_module(f"{lightning_module(flavour).__name__}.trainer.connectors.checkpoint_connector")
    return module._CheckpointConnector(trainer)


def _failing_fit(trainer_cls: type, flavour: str, tmp_path: Path, **kwargs: Any) -> BaseException:
    class Failing(make_model_class(flavour)):  # type: ignore[misc]
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            raise ValueError("the user's own error")

    trainer = trainer_cls(**quiet_cpu_trainer_kwargs(str(tmp_path), 1, "auto", max_epochs=1), **kwargs)
    if kwargs:
        trainer._checkpoint_connector = _stock_connector(flavour, trainer)
    with pytest.raises(BaseException) as info:
        trainer.fit(Failing(), train_dataloaders=dataloader())
    return info.value


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_a_replaced_connector_lets_the_users_exception_through_unchanged(flavour: str, tmp_path: Path) -> None:
    """With the stock connector put back on the Trainer, an exception in `fit` surfaces as upstream's does: the same
    type and message, and no error of the package chained to it."""
    upstream_cls, ours_cls = _trainers(flavour)
    upstream = _failing_fit(upstream_cls, flavour, tmp_path / "upstream")
    ours = _failing_fit(ours_cls, flavour, tmp_path / "ours", serialized_checkpoint_loading=True)
    seen = [(type(e), str(e), type(e.__context__)) for e in (upstream, ours)]
    assert seen[0] == seen[1], seen
    assert type(ours) is ValueError and str(ours) == "the user's own error"


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_a_replaced_connector_resumes_as_upstream_and_says_turns_are_off(
    flavour: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With the stock connector, a resume restores what upstream's restores (no turns), and one INFO line says the
    option has no effect because the connector was replaced."""
    upstream_cls, ours_cls = _trainers(flavour)
    model_cls = make_model_class(flavour)
    torch.manual_seed(0)
    first = upstream_cls(**quiet_cpu_trainer_kwargs(str(tmp_path), 1, "auto", max_epochs=1))
    first.fit(model_cls(), train_dataloaders=dataloader())
    ckpt = str(tmp_path / "epoch1.ckpt")
    first.save_checkpoint(ckpt)

    def resume(trainer: Any) -> dict[str, torch.Tensor]:
        model = model_cls()
        trainer.fit(model, train_dataloaders=dataloader(), ckpt_path=ckpt)
        state = trainer.optimizers[0].state_dict()["state"]
        tensors = {**model.state_dict(), **{f"exp_avg.{k}": v["exp_avg"] for k, v in state.items()}}
        return {k: v.clone() for k, v in tensors.items()}

    kwargs = quiet_cpu_trainer_kwargs(str(tmp_path), 1, "auto", max_epochs=2, enable_checkpointing=False)
    expected = resume(upstream_cls(**kwargs))
    ours = ours_cls(**kwargs, serialized_checkpoint_loading=True)
    with caplog.at_level(logging.INFO):
        ours._checkpoint_connector = _stock_connector(flavour, ours)
        got = resume(ours)
        ours.validate(ours.lightning_module, dataloaders=dataloader(), ckpt_path=ckpt)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    assert ours.current_epoch == 2
    notes = [r.getMessage() for r in caplog.records if "connector was replaced" in r.getMessage()]
    assert notes == [
        "`Trainer(serialized_checkpoint_loading=True)` has no effect: the Trainer's checkpoint connector was replaced"
        " by _CheckpointConnector, which restores as upstream."
    ]
    assert "turn for" not in caplog.text


@pytest.mark.parametrize(("flavour", "other"), [("pytorch_lightning", "lightning"), ("lightning", "pytorch_lightning")])
def test_a_model_of_the_other_flavour_gets_upstreams_type_error(flavour: str, other: str, tmp_path: Path) -> None:
    """A `LightningModule` of the other flavour, or no `LightningModule` at all, raises upstream's `TypeError` with
    upstream's message, from every entry point."""
    upstream_cls, ours_cls = _trainers(flavour)
    kwargs = quiet_cpu_trainer_kwargs(str(tmp_path), 1, "auto", max_epochs=1)
    for entry_point, model in [("fit", make_model_class(other)()), ("validate", make_model_class(other)()),
                               ("fit", torch.nn.Linear(1, 1))]:  # fmt: skip
        with pytest.raises(TypeError) as upstream:
            getattr(upstream_cls(**kwargs), entry_point)(model, dataloader())
        with pytest.raises(TypeError) as ours:
            getattr(ours_cls(**kwargs), entry_point)(model, dataloader())
        assert str(ours.value) == str(upstream.value)
        assert "LightningModule" in str(ours.value)
