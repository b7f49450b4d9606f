"""A user's resume script, nothing caught: ``python tests/helpers/uncaught_job.py '<json config>'``.

``trainer.fit(model, ckpt_path=config["ckpt_path"])`` with ``config.get("devices", 2)`` CPU ranks under ``ddp``; the
add-on's ``Trainer`` with ``serialized_checkpoint_loading=True`` when ``config["serialized"]``, else upstream's. With
``config["raise_on_rank"]``, that rank's ``on_load_checkpoint`` raises. Whatever the restore raises reaches Python's
top level on every rank, so that a test reads exactly what a user's log would show.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.models import dataloader, make_model_class  # noqa: E402
from harness.trainers import quiet_cpu_trainer_kwargs  # noqa: E402

config = json.loads(sys.argv[1])
if config["serialized"]:
    from serialized_restore import Trainer

    extra = {"serialized_checkpoint_loading": True}
else:
    from pytorch_lightning import Trainer

    extra = {}


class Model(make_model_class("pytorch_lightning")):  # type: ignore[misc]
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.global_rank == config.get("raise_on_rank"):
            raise RuntimeError(f"rank {self.global_rank} cannot use this checkpoint")


trainer = Trainer(**quiet_cpu_trainer_kwargs(config["out"], config.get("devices", 2), "ddp", max_epochs=1), **extra)
trainer.fit(Model(), dataloader(), ckpt_path=config["ckpt_path"])
