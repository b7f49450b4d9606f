"""A training recipe as frameworks ship them: its own ``Trainer`` subclass, defined at import, built in ``main``.

Usage: ``python launched_trainer.py CKPT``: resume ``fit`` from ``CKPT`` on 2 CPU ranks (Lightning's launcher starts
the second by re-running this command) and write each rank's state right after the restore to
``resumed_rank<global_rank>.pt`` in the working directory. It never imports ``serialized_restore``: the launcher's
tests start it unmodified.
"""

import sys

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        data = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(data), batch_size=8)


class SaveResumed(Callback):
    """Writes what the restore left on this rank, before the first step trains on."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        state = {
            "model": pl_module.state_dict(),
            "optimizer": trainer.optimizers[0].state_dict(),
            "global_step": trainer.global_step,
        }
        torch.save(state, f"resumed_rank{trainer.global_rank}.pt")


class RecipeTrainer(Trainer):
    """The framework's Trainer: its own defaults on top of whichever ``Trainer`` it found at import."""

    def __init__(self, **kwargs: object) -> None:
        defaults = {"accelerator": "cpu", "logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
        super().__init__(**{**defaults, "enable_model_summary": False, **kwargs})


def main() -> None:
    trainer = RecipeTrainer(devices=2, strategy="ddp", max_steps=3, callbacks=[SaveResumed()])
    trainer.fit(Net(), ckpt_path=sys.argv[1])


if __name__ == "__main__":
    main()
