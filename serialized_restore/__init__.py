"""Serialized checkpoint restore for the Lightning Trainer.

``from serialized_restore import Trainer`` gives the ``pytorch_lightning`` flavour;
``from serialized_restore.lightning import Trainer`` gives the ``lightning.pytorch`` one. Both are the upstream
``Trainer`` plus one argument, ``serialized_checkpoint_loading``.
"""

from typing import Any

from serialized_restore._errors import CheckpointRestoreError, RankFailure

__version__ = "0.1.0"

__all__ = ["CheckpointRestoreError", "RankFailure", "Trainer", "__version__"]


def __getattr__(name: str) -> Any:
    # imported on first use, so that users of `lightning.pytorch` never import `pytorch_lightning` as well
    if name == "Trainer":
        from serialized_restore.pytorch_lightning import Trainer

        return Trainer
    raise AttributeError(f"module 'serialized_restore' has no attribute {name!r}")
