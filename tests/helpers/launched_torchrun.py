"""A ``pytorch_lightning`` training script started by ``torchrun``: ``torchrun --nproc-per-node 2 launched_torchrun.py
CKPT`` resumes ``fit`` from ``CKPT`` with the stock ``pl.Trainer`` and writes each rank's state right after the
restore to ``resumed_rank<global_rank>.pt``. It never imports ``serialized_restore``.
"""

import sys

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Net(pl.LightningModule):
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


class SaveResumed(pl.Callback):
    """Writes what the restore left on this rank, before the first step trains on."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = {
            "model": pl_module.state_dict(),
            "optimizer": trainer.optimizers[0].state_dict(),
            "global_step": trainer.global_step,
        }
        torch.save(state, f"resumed_rank{trainer.global_rank}.pt")


def main() -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SaveResumed()],
    )
    trainer.fit(Net(), ckpt_path=sys.argv[1])


if __name__ == "__main__":
    main()
