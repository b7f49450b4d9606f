"""One attempt of a 2-rank job, its ranks started by the test as torchrun's agent starts them, on a store the test
holds across attempts (``tests.helpers.store.AttemptStore``); otherwise ``job.py``'s job.

Usage: ``python tests/helpers/restart_job.py '<json config>'`` with ``RANK``, ``LOCAL_RANK``, ``NODE_RANK`` and
``WORLD_SIZE`` set; config: ``job.py``'s, plus ``store_port``, ``attempt`` and ``fault_rank`` (that rank raises in
``LightningModule.on_load_checkpoint``).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.models import make_model_class  # noqa: E402
from harness.processes import end_finished_rank  # noqa: E402
from tests.helpers import job  # noqa: E402
from tests.helpers.store import AttemptStore  # noqa: E402

_STORE: AttemptStore | None = None


def main(config: dict[str, Any]) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=60)
    outliving = dist.TCPStore("127.0.0.1", config["store_port"], world, False, timeout=timeout)
    # Lightning finds the group initialised and uses it as it is; the Python object must outlive the group
    global _STORE
    _STORE = AttemptStore(outliving, config["attempt"])
    dist.init_process_group("gloo", store=_STORE, rank=rank, world_size=world)
    if config.get("fault_rank") == rank:
        model_class = make_model_class(config.get("flavour", "pytorch_lightning"))
        recorded = model_class.on_load_checkpoint

        def on_load_checkpoint(self: Any, checkpoint: dict[str, Any]) -> None:
            recorded(self, checkpoint)
            raise RuntimeError(f"injected failure in attempt {config['attempt']} on rank {rank}")

        model_class.on_load_checkpoint = on_load_checkpoint
    job.main(config)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    end_finished_rank()
