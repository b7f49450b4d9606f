"""``serialized_restore`` for users of the unified package: ``import lightning.pytorch`` and ``lightning.fabric``."""

from serialized_restore._flavour import missing_lightning

try:
    from lightning.fabric import Fabric as _Fabric
    from lightning.pytorch import Trainer as _Trainer
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
except ModuleNotFoundError as err:
    raise missing_lightning(err, "lightning", "lightning") from None

from serialized_restore._connector import _SerializedCheckpointConnectorMixin
from serialized_restore._fabric import SerializedFabricMixin
from serialized_restore._trainer import SerializedRestoreTrainerMixin


class _SerializedCheckpointConnector(_SerializedCheckpointConnectorMixin, _CheckpointConnector):
    pass


class Trainer(SerializedRestoreTrainerMixin, _Trainer):
    __doc__ = SerializedRestoreTrainerMixin.__doc__
    _connector_class = _SerializedCheckpointConnector


class Fabric(SerializedFabricMixin, _Fabric):
    __doc__ = SerializedFabricMixin.__doc__


__all__ = ["Fabric", "Trainer"]
