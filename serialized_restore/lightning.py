"""``serialized_restore`` for users of the unified package: ``import lightning.pytorch`` and ``lightning.fabric``."""

from serialized_restore._lightning.versions import missing_lightning

try:
    from lightning.fabric import Fabric as _Fabric
    from lightning.pytorch import Trainer as _Trainer
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
except ModuleNotFoundError as err:
    raise missing_lightning(err, "lightning", "lightning") from None

from serialized_restore._lightning.connector import SerializedCheckpointConnectorMixin
from serialized_restore._lightning.fabric import SerializedFabricMixin
from serialized_restore._lightning.trainer import SerializedRestoreTrainerMixin


class _SerializedCheckpointConnector(SerializedCheckpointConnectorMixin, _CheckpointConnector):
    pass


class Trainer(SerializedRestoreTrainerMixin, _Trainer):
    __doc__ = SerializedRestoreTrainerMixin.__doc__
    _connector_class = _SerializedCheckpointConnector


class Fabric(SerializedFabricMixin, _Fabric):
    __doc__ = SerializedFabricMixin.__doc__


__all__ = ["Fabric", "Trainer"]
