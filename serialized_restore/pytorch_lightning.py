"""``serialized_restore`` for users of the standalone package: ``import pytorch_lightning``."""

from serialized_restore._lightning.versions import missing_lightning

try:
    from pytorch_lightning import Trainer as _Trainer
    from pytorch_lightning.trainer.connectors.checkpoint_connector import _CheckpointConnector
except ModuleNotFoundError as err:
    raise missing_lightning(err, "pytorch_lightning", "pytorch-lightning") from None

from serialized_restore._lightning.connector import SerializedCheckpointConnectorMixin
from serialized_restore._lightning.trainer import SerializedRestoreTrainerMixin


class _SerializedCheckpointConnector(SerializedCheckpointConnectorMixin, _CheckpointConnector):
    pass


class Trainer(SerializedRestoreTrainerMixin, _Trainer):
    __doc__ = SerializedRestoreTrainerMixin.__doc__
    _connector_class = _SerializedCheckpointConnector


__all__ = ["Trainer"]
