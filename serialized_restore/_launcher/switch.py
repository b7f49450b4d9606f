"""What ``SERIALIZED_RESTORE`` does in a process once a Lightning package has been imported (the start-up hook,
``_bootstrap/sitecustomize.py``, calls :func:`switch_on`): the package's ``Trainer`` and ``Fabric`` are replaced by
the project's, whose ``serialized_checkpoint_loading`` defaults to the variable's value (``docs/launcher.md``)."""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from typing import Any, Callable

from serialized_restore._launcher.hook import OURS, VARIABLE
from serialized_restore._lightning.names import Owner
from serialized_restore.settings import PARAMETER

# the names each class of the project's module for a Lightning package takes once that module has run (the modules
# that define the classes too: a program may import them from there)
_REPLACED: dict[str, dict[str, tuple[str, ...]]] = {
    "serialized_restore.lightning": {
        "Trainer": ("lightning", "lightning.pytorch", "lightning.pytorch.trainer", "lightning.pytorch.trainer.trainer"),
        "Fabric": ("lightning", "lightning.fabric", "lightning.fabric.fabric"),
    },
    "serialized_restore.pytorch_lightning": {
        "Trainer": ("pytorch_lightning", "pytorch_lightning.trainer", "pytorch_lightning.trainer.trainer")
    },
    "serialized_restore.fabric": {"Fabric": ("lightning_fabric", "lightning_fabric.fabric")},
}
_announced = False  # one line per process: the first Trainer or Fabric built says what was switched on


def parse(raw: str) -> bool | int:
    """The ``serialized_checkpoint_loading`` value ``SERIALIZED_RESTORE=raw`` stands for, else ``ValueError``."""
    text = raw.strip()
    if text.isascii() and text.isdigit():
        k = int(text)
        return False if k == 0 else True if k == 1 else k
    raise ValueError(
        f"`{VARIABLE}={raw!r}` is not supported. Accepted values: `1` (the local ranks of a node restore one at a"
        " time), a positive int k (at most k at once) or `0` (off, as unset)."
    )


def switch_on(imported: str, raw: str, launched: bool, announce: bool = True) -> None:
    """(each process) After a Lightning package ran, import our module for it; after that module ran, give its classes
    the package's names, defaulting to the value ``SERIALIZED_RESTORE=raw`` stands for; the first built says so at
    INFO (rank 0) unless not ``announce``."""
    value = parse(raw)
    if value is False:
        return
    if imported in OURS:
        # while the module itself imports the package, this returns it unfinished: the hook calls again when it is done
        importlib.import_module(OURS[imported])
        return
    by = f"by `serialized-restore run` ({VARIABLE}={raw})" if launched else f"by {VARIABLE}={raw}"
    for name, modules in _REPLACED[imported].items():
        cls = getattr(sys.modules[imported], name)
        _default_to(cls, value, by, Owner(name), announce=announce)
        for module in modules:
            setattr(sys.modules[module], name, cls)


def _default_to(cls: type, value: object, by: str, owner: Owner, announce: bool) -> None:
    """Make ``value`` the default of ``cls(serialized_checkpoint_loading=...)``, in its signature too (LightningCLI)."""
    init: Callable[..., None] = cls.__init__  # type: ignore[misc]  # the class's own, as built by its module
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        global _announced
        given = kwargs.setdefault(PARAMETER, value)
        init(self, *args, **kwargs)
        if _announced or not announce:
            return
        _announced = True
        built = type(self).__name__
        if given == value:
            message = f"serialized restore: {built}(serialized_checkpoint_loading={value!r}) switched on {by}"
        else:
            message = (
                f"serialized restore: the program builds {built}(serialized_checkpoint_loading={given!r}) itself,"
                f" which wins over {value!r} set {by}"
            )
        owner.info(self)(message)

    parameters = [p.replace(default=value) if p.name == PARAMETER else p for p in signature.parameters.values()]
    __init__.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    del __init__.__wrapped__  # type: ignore[attr-defined]  # the signature is the one set above
    cls.__init__ = __init__  # type: ignore[misc]
