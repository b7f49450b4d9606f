"""A small deterministic model and data used by the tests, in either Lightning flavour."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset


def lightning_module(flavour: str) -> Any:
    """``lightning.pytorch`` or ``pytorch_lightning``."""
    return importlib.import_module("lightning.pytorch" if flavour == "lightning" else "pytorch_lightning")


def make_model_class(flavour: str) -> type:
    pl = lightning_module(flavour)

    class RecordingModel(pl.LightningModule):
        """An MLP trained with Adam and a step lr scheduler that records what ``on_load_checkpoint`` receives."""

        def __init__(self, width: int = 32, depth: int = 2) -> None:
            super().__init__()
            layers: list[torch.nn.Module] = []
            for _ in range(depth):
                layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
            self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
            self.load_records: list[dict[str, Any]] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

        def test_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("test_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(batch[0])

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            self.load_records.append(describe_checkpoint("module", checkpoint))

    return RecordingModel


def make_callback_class(flavour: str) -> type:
    pl = lightning_module(flavour)

    class RecordingCallback(pl.Callback):
        """Records what the callback hooks receive; its state is a counter restored from the checkpoint."""

        def __init__(self) -> None:
            self.records: list[dict[str, Any]] = []
            self.batches_seen = 0

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            self.batches_seen += 1

        def state_dict(self) -> dict[str, Any]:
            return {"batches_seen": self.batches_seen}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.records.append({"hook": "callback.load_state_dict", "state": dict(state_dict)})
            self.batches_seen = state_dict["batches_seen"]

        def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
            self.records.append(describe_checkpoint("callback", checkpoint))

    return RecordingCallback


def describe_checkpoint(hook: str, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A comparable summary of a checkpoint dict as a hook sees it: keys, and a digest of every tensor."""
    digests: dict[str, Any] = {}

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            digests[prefix] = (tuple(value.shape), str(value.dtype), value.double().sum().item())
        elif isinstance(value, dict):
            for key, item in value.items():
                visit(f"{prefix}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(f"{prefix}/{i}", item)

    visit("", checkpoint)
    return {"hook": hook, "keys": sorted(checkpoint.keys()), "tensors": digests}


def make_data(n: int = 64, width: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, 1, generator=g))


def dataloader(batch_size: int = 8) -> DataLoader:
    return DataLoader(make_data(), batch_size=batch_size, shuffle=False)
