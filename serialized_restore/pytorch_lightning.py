"""``serialized_restore`` for users of the standalone package: ``import pytorch_lightning``."""

from pytorch_lightning import Trainer as _Trainer

from serialized_restore._trainer import SerializedRestoreTrainerMixin


class Trainer(SerializedRestoreTrainerMixin, _Trainer):
    __doc__ = SerializedRestoreTrainerMixin.__doc__


__all__ = ["Trainer"]
