"""A ``LightningCLI`` script as recipes ship them: ``python launched_cli.py fit --ckpt_path CKPT --trainer.devices=2``.

Each rank writes its state right after the restore to ``resumed_rank<global_rank>.pt`` in the working directory. It
never imports ``serialized_restore``: the launcher's tests start it unmodified.
"""

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI
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


def main() -> None:
    defaults = {"callbacks": [SaveResumed()], "logger": False, "enable_progress_bar": False}
    LightningCLI(Net, trainer_defaults={**defaults, "enable_model_summary": False, "enable_checkpointing": False})


if __name__ == "__main__":
    main()
