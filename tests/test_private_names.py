"""Every private Lightning (and torch) name the package imports, calls, overrides or patches still exists, in both
flavours: a rename upstream fails here, not in a user's restore."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch.distributed as dist

from serialized_restore._lightning.names import Flavour, LightningNames, declared_names

# (class, method, the parameters the package passes or relies on): what it overrides or calls
CONNECTOR_METHODS = [
    ("_restore_modules_and_callbacks", ["checkpoint_path"]),
    ("restore_model", []),
    ("restore_datamodule", []),
    ("restore_callbacks", []),
    ("restore_training_state", []),
    ("resume_end", []),
]
FLAVOURS = {
    "unified": ("lightning.pytorch", "lightning.fabric"),
    "standalone": ("pytorch_lightning", "lightning_fabric"),
}


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_every_imported_lightning_name_resolves(flavour: str) -> None:
    """Each Lightning name the package takes (``LightningNames``, the one place they are declared) is there, in this
    flavour."""
    names = LightningNames(Flavour(*FLAVOURS[flavour]))
    declared = declared_names()
    assert len(declared) >= 30, sorted(declared)
    missing = []
    for attribute, (root, module, name) in declared.items():
        try:
            getattr(names, attribute)
        except (ImportError, AttributeError):
            missing.append(f"{FLAVOURS[flavour][root == 'fabric']}.{module}.{name}")
    assert not missing, missing


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_every_overridden_or_patched_member_exists_with_the_parameters_used(flavour: str) -> None:
    """The connector's methods the package overrides or calls, the Trainer's connector attribute, Fabric's
    ``_strategy``, ``load`` and ``load_raw``, and the strategy members it reads or patches."""
    pytorch, fabric = (importlib.import_module(root) for root in FLAVOURS[flavour])
    connector_cls = importlib.import_module(f"{pytorch.__name__}.trainer.connectors.checkpoint_connector")
    for method, parameters in CONNECTOR_METHODS:
        function = getattr(connector_cls._CheckpointConnector, method)
        assert list(inspect.signature(function).parameters)[1 : 1 + len(parameters)] == parameters, method
    trainer = pytorch.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    connector = trainer._checkpoint_connector
    assert isinstance(connector, connector_cls._CheckpointConnector)
    assert hasattr(connector, "_loaded_checkpoint") and hasattr(connector, "_ckpt_path")
    # an instance attribute Lightning's Trainer sets, and frameworks replace: the package's Trainer makes it a property
    assert "_checkpoint_connector" in vars(trainer)
    strategy = trainer.strategy
    for member in ("load_checkpoint", "load_model_state_dict", "load_optimizer_state_dict", "checkpoint_io"):
        assert hasattr(strategy, member), member
    assert hasattr(type(strategy), "restore_checkpoint_after_setup")
    assert hasattr(pytorch.strategies.DDPStrategy, "num_processes")
    # the launched processes of Lightning's own launcher, which the package kills when they are named stuck
    launcher = importlib.import_module(f"{pytorch.__name__}.strategies.launchers.subprocess_script")
    ddp = pytorch.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False).strategy
    assert isinstance(ddp.launcher, launcher._SubprocessScriptLauncher) and ddp.launcher.procs == []
    instance = fabric.Fabric(accelerator="cpu", devices=1)
    assert hasattr(instance, "_strategy") and instance._strategy is instance.strategy
    for method, parameters in (("load", ["path", "state", "strict"]), ("load_raw", ["path", "obj", "strict"])):
        assert list(inspect.signature(getattr(fabric.Fabric, method)).parameters)[1:4] == parameters, method
    for member in ("load_checkpoint", "load_module_state_dict", "checkpoint_io", "broadcast"):
        assert hasattr(instance._strategy, member), member


def test_the_torch_private_name_resolves() -> None:
    """The job's default store, which the turns run on."""
    assert callable(dist.distributed_c10d._get_default_store)
