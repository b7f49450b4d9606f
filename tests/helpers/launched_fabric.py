"""A Lightning Fabric training script as third parties write them: ``Fabric`` built in its own ``main``.

Usage: ``python launched_fabric.py``: on 2 CPU ranks (Fabric's launcher starts the second by re-running this
command), train two steps, ``fabric.save`` the model and optimizer to ``state.ckpt``, then build a fresh model and
optimizer and resume them with ``fabric.load("state.ckpt", state)``; each rank writes what it resumed to
``resumed_rank<global_rank>.pt``. It never imports ``serialized_restore``: the launcher's tests start it unmodified.
"""

import torch
from lightning.fabric import Fabric


def build(fabric: Fabric) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(32, 2)
    return fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))


def main() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(0)
    data = torch.randn(16, 32, generator=torch.Generator().manual_seed(fabric.global_rank))
    model, optimizer = build(fabric)
    for batch in data.split(8):
        fabric.backward(model(batch).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    fabric.save("state.ckpt", {"model": model, "optimizer": optimizer, "step": 2})

    model, optimizer = build(fabric)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load("state.ckpt", state)
    resumed = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": state["step"]}
    torch.save({**resumed, "remainder": remainder}, f"resumed_rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    main()
