"""Which Lightning package an object comes from (``lightning`` or ``pytorch_lightning``/``lightning_fabric``), the
Lightning names the package uses, declared once with where each lives (:class:`LightningNames`), so that the logic,
written once, takes them from the flavour of the object it works on (``lightning_names(trainer).rank_zero_info``),
and who restores: the ``Trainer`` or ``Fabric`` (:class:`Owner`)."""

from __future__ import annotations

import enum
import functools
import importlib
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Callable


@dataclass(frozen=True)
class Flavour:
    pytorch: str  # "lightning.pytorch" or "pytorch_lightning"
    fabric: str  # "lightning.fabric" or "lightning_fabric"


UNIFIED = Flavour("lightning.pytorch", "lightning.fabric")
STANDALONE = Flavour("pytorch_lightning", "lightning_fabric")


def flavour_of(obj: Any) -> Flavour:
    """The flavour of a Lightning object (trainer, strategy, connector), judged by the classes it derives from."""
    for cls in type(obj).__mro__:
        module = cls.__module__
        if module.startswith("lightning.pytorch.") or module.startswith("lightning.fabric."):
            return UNIFIED
        if module.startswith("pytorch_lightning.") or module.startswith("lightning_fabric."):
            return STANDALONE
    raise TypeError(f"{type(obj).__qualname__} is not a Lightning object")


# where a name lives: its root ("pytorch" or "fabric"), module and name in that module
_P = "pytorch"
_F = "fabric"


class LightningNames:
    """Every Lightning name the package uses, of one flavour; each is imported when first used (a release may lack
    one that only some paths need) and kept. ``tests/test_private_names.py`` resolves every one, in both flavours, on
    every release CI tests."""

    # the Trainer's side
    TrainerFn: Annotated[Any, _P, "trainer.states", "TrainerFn"]
    Strategy: Annotated[Any, _P, "strategies", "Strategy"]
    DDPStrategy: Annotated[Any, _P, "strategies", "DDPStrategy"]
    SingleDeviceStrategy: Annotated[Any, _P, "strategies", "SingleDeviceStrategy"]
    FSDPStrategy: Annotated[Any, _P, "strategies", "FSDPStrategy"]
    Callback: Annotated[Any, _P, "callbacks", "Callback"]
    Checkpoint: Annotated[Any, _P, "callbacks", "Checkpoint"]
    ModelCheckpoint: Annotated[Any, _P, "callbacks", "ModelCheckpoint"]
    SubprocessScriptLauncher: Annotated[Any, _P, "strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"]
    pl_legacy_patch: Annotated[Callable[[], Any], _P, "utilities.migration", "pl_legacy_patch"]
    pl_migrate_checkpoint: Annotated[Callable[..., Any], _P, "utilities.migration.utils", "_pl_migrate_checkpoint"]
    rank_zero_info: Annotated[Callable[..., None], _P, "utilities.rank_zero", "rank_zero_info"]
    rank_zero_warn: Annotated[Callable[..., None], _P, "utilities.rank_zero", "rank_zero_warn"]
    # Fabric's side, which the Trainer's reads with too
    FabricStrategy: Annotated[Any, _F, "strategies", "Strategy"]
    FabricDDPStrategy: Annotated[Any, _F, "strategies", "DDPStrategy"]
    FabricSingleDeviceStrategy: Annotated[Any, _F, "strategies", "SingleDeviceStrategy"]
    FabricFSDPStrategy: Annotated[Any, _F, "strategies", "FSDPStrategy"]
    FabricSubprocessScriptLauncher: Annotated[
        Any, _F, "strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"
    ]
    TorchCheckpointIO: Annotated[Any, _F, "plugins.io.torch_io", "TorchCheckpointIO"]
    Stateful: Annotated[Any, _F, "utilities.types", "_Stateful"]
    load: Annotated[Callable[..., Any], _F, "utilities.cloud_io", "_load"]
    fabric_rank_zero_info: Annotated[Callable[..., None], _F, "utilities.rank_zero", "rank_zero_info"]
    fabric_rank_zero_warn: Annotated[Callable[..., None], _F, "utilities.rank_zero", "rank_zero_warn"]
    has_fsdp_modules: Annotated[Callable[[Any], bool], _F, "strategies.fsdp", "_has_fsdp_modules"]
    is_sharded_checkpoint: Annotated[Callable[[Any], bool], _F, "strategies.fsdp", "_is_sharded_checkpoint"]
    get_full_state_dict_context: Annotated[Callable[..., Any], _F, "strategies.fsdp", "_get_full_state_dict_context"]
    load_raw_module_state: Annotated[Callable[..., None], _F, "strategies.model_parallel", "_load_raw_module_state"]
    rekey_optimizer_state_if_needed: Annotated[
        Callable[..., Any], _F, "strategies.model_parallel", "_rekey_optimizer_state_if_needed"
    ]
    validate_keys_for_strict_loading: Annotated[
        Callable[..., None], _F, "strategies.strategy", "_validate_keys_for_strict_loading"
    ]
    move_state_into: Annotated[Callable[..., None], _F, "utilities.load", "_move_state_into"]

    def __init__(self, flavour: Flavour) -> None:
        self.flavour = flavour

    def __getattr__(self, attribute: str) -> Any:
        # only for what the instance does not hold yet: each declared name once
        where = declared_names().get(attribute)
        if where is None:
            raise AttributeError(f"{type(self).__name__} declares no {attribute!r}")
        root, module, name = where
        value = getattr(importlib.import_module(f"{getattr(self.flavour, root)}.{module}"), name)
        setattr(self, attribute, value)
        return value


@functools.cache
def declared_names() -> dict[str, tuple[str, str, str]]:
    """Each name :class:`LightningNames` declares: (root, module, name in the module)."""
    hints = typing.get_type_hints(LightningNames, include_extras=True)
    return {attribute: tuple(hint.__metadata__) for attribute, hint in hints.items() if hasattr(hint, "__metadata__")}


@functools.cache
def names_of_flavour(flavour: Flavour) -> LightningNames:
    return LightningNames(flavour)


def lightning_names(obj: Any) -> LightningNames:
    """The Lightning names of ``obj``'s flavour (:func:`flavour_of`)."""
    return names_of_flavour(flavour_of(obj))


class Owner(str, enum.Enum):
    """Who restores a checkpoint: the ``Trainer`` (``fit(ckpt_path=...)`` and the other entry points) or ``Fabric``
    (``fabric.load``, ``fabric.load_raw``). Its value is the class name messages quote."""

    TRAINER = "Trainer"
    FABRIC = "Fabric"
    __str__ = str.__str__  # the value, in messages

    @property
    def verb(self) -> str:
        """How messages say what it does with a checkpoint: ``"restore"`` or ``"load"``."""
        return "load" if self is Owner.FABRIC else "restore"

    @property
    def done(self) -> str:
        """:attr:`verb` once done: ``"restored"`` or ``"loaded"``."""
        return "loaded" if self is Owner.FABRIC else "restored"

    def info(self, obj: Any) -> Callable[..., None]:
        """The ``rank_zero_info`` of this owner's side of ``obj``'s flavour."""
        names = lightning_names(obj)
        return names.fabric_rank_zero_info if self is Owner.FABRIC else names.rank_zero_info

    def warn(self, obj: Any) -> Callable[..., None]:
        """The ``rank_zero_warn`` of this owner's side of ``obj``'s flavour."""
        names = lightning_names(obj)
        return names.fabric_rank_zero_warn if self is Owner.FABRIC else names.rank_zero_warn
