"""``tests/helpers/job.py``'s Trainer job, which also records whether the checkpoint file is still mapped into the rank
once the restore is over: ``python tests/helpers/maps_job.py '<json config>'``.

At ``on_train_start`` (after ``resume_end``: the restore dropped its checkpoint dict) every rank collects garbage and
writes to ``<out>/maps<global rank>.json`` the lines of ``/proc/self/maps`` that map the checkpoint file (none when
no tensor of it is held any more, by the model, the optimizers, the callbacks or anything else).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.processes import end_finished_rank  # noqa: E402
from tests.helpers import job  # noqa: E402


def _mapped_lines(path: str) -> list[str]:
    target = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if line.rstrip().endswith(target)]


def main(config: dict[str, Any]) -> None:
    flavour = config.get("flavour", "pytorch_lightning")
    pl = job.lightning_module(flavour)

    class MapsAfterRestore(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            gc.collect()
            lines = _mapped_lines(config["ckpt_path"])
            (Path(config["out"]) / f"maps{trainer.global_rank}.json").write_text(json.dumps(lines))

    build = job.build_trainer

    def build_with_maps(config: dict[str, Any]) -> Any:
        trainer, callback = build(config)
        trainer.callbacks.append(MapsAfterRestore())
        return trainer, callback

    job.build_trainer = build_with_maps
    job.main(config)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    end_finished_rank()
