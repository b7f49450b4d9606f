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

from serialized_restore._lightning.names import Flavour, Owner, names_of_flavour

SUPPORTED_RANGE = ">=2.4,<2.7"
"""The releases supported (as ``setup.py`` requires), each tested: 2.4.0, 2.5.6, 2.6.6 and Lightning's master."""
SUPPORTED = SpecifierSet(SUPPORTED_RANGE)


class UnsupportedLightningError(RuntimeError):
    """The installed Lightning is a release the package does not support (:data:`SUPPORTED`)."""


UnsupportedLightningError.__module__ = "serialized_restore"  # where it is imported from: what tracebacks name


def installed_version(flavour: Flavour, owner: Owner = Owner.TRAINER) -> str:
    """The ``__version__`` of the flavour's package of ``owner``: its pytorch package, or its fabric package."""
    return str(importlib.import_module(_package(flavour, owner)).__version__)


def _package(flavour: Flavour, owner: Owner) -> str:
    return flavour.fabric if owner is Owner.FABRIC else flavour.pytorch


def check_supported(flavour: Flavour, owner: Owner) -> None:
    """(each process, in ``Trainer(...)``/``Fabric(...)``) Refuse a Lightning outside :data:`SUPPORTED` up front."""
    module = _package(flavour, owner)
    version = installed_version(flavour, owner)
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
def passes_weights_only(flavour: Flavour, owner: Owner = Owner.TRAINER) -> bool:
    """Whether the release's ``Strategy.load_checkpoint`` (the Trainer's, or Fabric's) takes ``weights_only``."""
    names = names_of_flavour(flavour)
    strategy = names.FabricStrategy if owner is Owner.FABRIC else names.Strategy
    return "weights_only" in inspect.signature(strategy.load_checkpoint).parameters


def weights_only_kwargs(flavour: Flavour, weights_only: bool | None, owner: Owner) -> dict[str, bool | None]:
    """The keyword arguments for the release's ``load_checkpoint``: ``weights_only`` where it passes it, else none."""
    return {"weights_only": weights_only} if passes_weights_only(flavour, owner) else {}


@functools.cache
def _default_weights_only(flavour: Flavour) -> bool | None:
    """The default ``weights_only`` of the release's ``_load``: ``False`` before 2.6, ``None`` (torch's) since."""
    default = inspect.signature(names_of_flavour(flavour).load).parameters["weights_only"].default
    return None if default is inspect.Parameter.empty else default


def read_weights_only(flavour: Flavour, weights_only: bool | None) -> bool | None:
    """The ``weights_only`` for ``torch.load``: the one the release's ``TorchCheckpointIO`` would read the file with."""
    if passes_weights_only(flavour, Owner.FABRIC) and weights_only is not None:
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


def missing_lightning(err: ModuleNotFoundError, package: str, extra: str) -> ModuleNotFoundError:
    """The error to raise when importing Lightning's ``package`` failed with ``err``: where the package itself is
    missing, one that names the extra that installs it; anything else (a module it imports) as it is."""
    if err.name != package:
        return err
    return ModuleNotFoundError(
        f"`{package}` is not installed, and this module of serialized_restore extends it. Install it with"
        f" `pip install 'serialized_restore[{extra}]'` (Lightning {SUPPORTED_RANGE}), or use the module for the"
        " Lightning package you have: `serialized_restore.lightning` for `lightning`, `serialized_restore` and"
        " `serialized_restore.fabric` for `pytorch_lightning` and `lightning_fabric`.",
        name=package,
    )
