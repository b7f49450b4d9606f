"""What differs between the Lightning releases supported (``SUPPORTED``), each difference decided once, here.

Decided per flavour (``lightning`` and ``pytorch_lightning``/``lightning_fabric`` may be different releases in one
environment) from what the installed release offers: its methods' parameters, the defaults it reads with.

- ``weights_only``: 2.6 added it to ``Trainer.fit``/..., ``resume_start``, ``strategy.load_checkpoint``,
  ``CheckpointIO.load_checkpoint`` and ``Fabric.load``/``load_raw``. Where the release lacks it, nothing passes it
  (:func:`passes_weights_only`) and a file is read with ``weights_only=False``, as the release reads it.
- Stage 1 restores callbacks only when fitting before 2.5, always since: no signature shows it, the version decides.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from serialized_restore._flavour import SUPPORTED_RANGE, Flavour, names_of_flavour

SUPPORTED = SpecifierSet(SUPPORTED_RANGE)


class UnsupportedLightningError(RuntimeError):
    """The installed Lightning is a release the package does not support (:data:`SUPPORTED`)."""


def installed_version(flavour: Flavour, fabric: bool = False) -> str:
    """The ``__version__`` of the flavour's pytorch package, or (``fabric``) of its fabric package."""
    return str(importlib.import_module(flavour.fabric if fabric else flavour.pytorch).__version__)


def check_supported(flavour: Flavour, owner: str) -> None:
    """(each process, in ``Trainer(...)``/``Fabric(...)``) Refuse a Lightning outside :data:`SUPPORTED` up front."""
    module = flavour.fabric if owner == "Fabric" else flavour.pytorch
    version = installed_version(flavour, fabric=owner == "Fabric")
    with contextlib.suppress(InvalidVersion):
        if Version(version) in SUPPORTED:
            return
    distribution = module.replace("_", "-") if "." not in module else "lightning"
    raise UnsupportedLightningError(
        f"`serialized_restore`'s `{owner}` supports Lightning {SUPPORTED_RANGE} (tested: 2.4, 2.5, 2.6), and"
        f" `{module}` is {version}. Install a supported release, for example"
        f" `pip install '{distribution}{SUPPORTED_RANGE}'`, or use upstream's `{module}.{owner}`, which restores"
        " without `serialized_checkpoint_loading`."
    )


@functools.cache
def passes_weights_only(flavour: Flavour, fabric: bool = False) -> bool:
    """Whether the release's ``Strategy.load_checkpoint`` (the Trainer's, or ``fabric``'s) takes ``weights_only``."""
    names = names_of_flavour(flavour)
    strategy = names.FabricStrategy if fabric else names.Strategy
    return "weights_only" in inspect.signature(strategy.load_checkpoint).parameters


def weights_only_kwargs(flavour: Flavour, weights_only: bool | None, fabric: bool = False) -> dict[str, bool | None]:
    """The keyword arguments for the release's ``load_checkpoint``: ``weights_only`` where it passes it, else none."""
    return {"weights_only": weights_only} if passes_weights_only(flavour, fabric) else {}


@functools.cache
def _default_weights_only(flavour: Flavour) -> bool | None:
    """The default ``weights_only`` of the release's ``_load``: ``False`` before 2.6, ``None`` (torch's) since."""
    default = inspect.signature(names_of_flavour(flavour).load).parameters["weights_only"].default
    return None if default is inspect.Parameter.empty else default


def read_weights_only(flavour: Flavour, weights_only: bool | None) -> bool | None:
    """The ``weights_only`` for ``torch.load``: the one the release's ``TorchCheckpointIO`` would read the file with."""
    if passes_weights_only(flavour, fabric=True) and weights_only is not None:
        return weights_only
    return _default_weights_only(flavour)


def weights_only_for(path: Any, weights_only: bool | None) -> bool | None:
    """``weights_only`` as the release's ``_load`` applies it to ``path``: an ``http(s)`` URL read with ``None`` is read
    with ``False`` (every release supported: 2.6 and later say so for URLs, earlier ones for everything)."""
    if weights_only is None and isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith("http"):
        return False
    return weights_only


def restores_callbacks_only_when_fitting(flavour: Flavour) -> bool:
    """Whether the release's ``_restore_modules_and_callbacks`` restores callbacks only when fitting (before 2.5)."""
    return Version(installed_version(flavour)).release < (2, 5)
