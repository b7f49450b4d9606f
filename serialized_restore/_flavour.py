"""Which Lightning package an object comes from (``lightning`` or ``pytorch_lightning``/``lightning_fabric``), so
that the logic, written once, imports the Lightning names it needs from the flavour of the object it works on."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Flavour:
    pytorch: str  # "lightning.pytorch" or "pytorch_lightning"
    fabric: str  # "lightning.fabric" or "lightning_fabric"

    def import_(self, module: str, name: str, fabric: bool = False) -> Any:
        root = self.fabric if fabric else self.pytorch
        return getattr(importlib.import_module(f"{root}.{module}"), name)


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
