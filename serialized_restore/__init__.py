"""Serialized checkpoint restore for the Lightning Trainer.

``from serialized_restore import Trainer`` gives the ``pytorch_lightning`` flavour and
``from serialized_restore.lightning import Trainer`` the ``lightning.pytorch`` one: upstream's ``Trainer`` plus
``serialized_checkpoint_loading`` (``True``, a positive int or a :class:`SerializedLoading`).
"""

from typing import Any

from serialized_restore._coordination.failures import CheckpointRestoreError, RankFailure
from serialized_restore._lightning.versions import UnsupportedLightningError
from serialized_restore.settings import SerializedLoading

__version__ = "0.1.0"

__all__ = [
    "CheckpointRestoreError",
    "RankFailure",
    "SerializedLoading",
    "Trainer",
    "UnsupportedLightningError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # imported on first use, so that users of `lightning.pytorch` never import `pytorch_lightning` as well
    if name == "Trainer":
        from serialized_restore import pytorch_lightning

        return getattr(pytorch_lightning, name)
    raise AttributeError(f"module 'serialized_restore' has no attribute {name!r}")
