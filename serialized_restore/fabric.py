"""``serialized_restore`` for users of Lightning Fabric from the standalone package: ``import lightning_fabric``.

``from serialized_restore.fabric import Fabric`` is upstream's ``Fabric`` plus ``serialized_checkpoint_loading``;
users of the unified package (``import lightning.fabric``) take ``from serialized_restore.lightning import Fabric``.
"""

from serialized_restore._lightning.versions import missing_lightning

try:
    from lightning_fabric import Fabric as _Fabric
except ModuleNotFoundError as err:
    raise missing_lightning(err, "lightning_fabric", "pytorch-lightning") from None

from serialized_restore._lightning.fabric import SerializedFabricMixin


class Fabric(SerializedFabricMixin, _Fabric):
    __doc__ = SerializedFabricMixin.__doc__


__all__ = ["Fabric"]
