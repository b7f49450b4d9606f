"""Prints what a process sees of Lightning's ``Trainer`` and ``Fabric``, started as it is or under the launcher.

It checks first that nothing of Lightning, torch or this project is imported before the program imports Lightning.
Under the launcher it also builds a ``Trainer`` subclass defined after the import and a ``Trainer`` given
``serialized_checkpoint_loading=False``, and prints what each resolved to.
"""

import inspect
import sys

roots = ("serialized_restore", "lightning", "lightning_fabric", "pytorch_lightning", "torch")
loaded = [name for name in sys.modules if name.split(".")[0] in roots]
assert not loaded, loaded

import lightning  # noqa: E402
import lightning.fabric  # noqa: E402
import lightning.pytorch  # noqa: E402
import lightning_fabric  # noqa: E402
import pytorch_lightning  # noqa: E402

import serialized_restore.fabric as standalone_fabric  # noqa: E402
import serialized_restore.lightning as unified  # noqa: E402
import serialized_restore.pytorch_lightning as standalone  # noqa: E402

names = [
    (lightning.Trainer, unified.Trainer),
    (lightning.pytorch.Trainer, unified.Trainer),
    (lightning.pytorch.trainer.Trainer, unified.Trainer),
    (lightning.pytorch.trainer.trainer.Trainer, unified.Trainer),
    (pytorch_lightning.Trainer, standalone.Trainer),
    (pytorch_lightning.trainer.Trainer, standalone.Trainer),
    (pytorch_lightning.trainer.trainer.Trainer, standalone.Trainer),
    (lightning.Fabric, unified.Fabric),
    (lightning.fabric.Fabric, unified.Fabric),
    (lightning.fabric.fabric.Fabric, unified.Fabric),
    (lightning_fabric.Fabric, standalone_fabric.Fabric),
    (lightning_fabric.fabric.Fabric, standalone_fabric.Fabric),
]
print("replaced:", all(got is ours for got, ours in names), "upstream:", not any(got is ours for got, ours in names))
if lightning.Trainer is not unified.Trainer:
    sys.exit()


class Framework(pytorch_lightning.Trainer):
    pass


print("default:", inspect.signature(unified.Trainer).parameters["serialized_checkpoint_loading"].default)
print("subclass:", Framework(accelerator="cpu", logger=False).serialized_checkpoint_loading)
explicit = lightning.pytorch.Trainer(accelerator="cpu", logger=False, serialized_checkpoint_loading=False)
print("explicit:", explicit.serialized_checkpoint_loading)
