"""``serialized_restore`` for users of the unified package: ``import lightning.pytorch``."""

from lightning.pytorch import Trainer as _Trainer

from serialized_restore._trainer import SerializedRestoreTrainerMixin


class Trainer(SerializedRestoreTrainerMixin, _Trainer):
    __doc__ = SerializedRestoreTrainerMixin.__doc__


__all__ = ["Trainer"]
