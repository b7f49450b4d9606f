"""What differs between the Lightning releases the package supports, each difference decided once, here.

Supported: Lightning 2.4, 2.5 and 2.6 (``SUPPORTED``), in both flavours, and Lightning's ``master`` while it reports a
version in that range. Each decision is made per flavour (``lightning`` and ``pytorch_lightning``/``lightning_fabric``
may be different releases in one environment) from what the installed release offers: the parameters of its methods,
the defaults it reads with. The one behaviour no signature shows (which callbacks stage 1 restores) is decided by the
flavour's version.

The differences:

- ``weights_only``: 2.6 added it to ``Trainer.fit``/``validate``/..., ``resume_start``, ``strategy.load_checkpoint``,
  ``CheckpointIO.load_checkpoint`` and ``Fabric.load``/``load_raw``. Where the release lacks it, nothing passes it
  (:func:`passes_weights_only`), and a file is read as the release reads it: with ``weights_only=False``
  (:func:`read_weights_only`).
- Stage 1 of a restore restores callbacks only when fitting before 2.5, always since
  (:func:`restores_callbacks_only_when_fitting`).
"""

from __future__ import annotations

import functools
import importlib
import inspect

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from serialized_restore._flavour import Flavour

SUPPORTED_RANGE = ">=2.4,<2.7"
"""The Lightning releases the package supports (as ``setup.py`` requires): each is tested (2.4.0, 2.5.6, 2.6.6 and
Lightning's master)."""
SUPPORTED = SpecifierSet(SUPPORTED_RANGE)


class UnsupportedLightningError(RuntimeError):
    """The installed Lightning is a release the package does not support (:data:`SUPPORTED`)."""


def installed_version(flavour: Flavour, fabric: bool = False) -> str:
    """The version the flavour's package reports: ``lightning.pytorch.__version__``, ``pytorch_lightning``'s or
    (``fabric``) ``lightning.fabric``'s / ``lightning_fabric``'s."""
    return str(importlib.import_module(flavour.fabric if fabric else flavour.pytorch).__version__)


def check_supported(flavour: Flavour, owner: str) -> None:
    """(each process, in ``Trainer(...)``/``Fabric(...)``, ``owner``) Refuse a Lightning outside :data:`SUPPORTED`
    before anything else runs, rather than fail deep inside a restore."""
    module = flavour.fabric if owner == "Fabric" else flavour.pytorch
    version = installed_version(flavour, fabric=owner == "Fabric")
    try:
        supported = Version(version) in SUPPORTED
    except InvalidVersion:
        supported = False
    if supported:
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
    """Whether the release passes ``weights_only`` on when it reads a checkpoint: its ``Strategy.load_checkpoint`` (the
    Trainer's, or ``fabric``'s) takes it (2.6 on)."""
    strategy = importlib.import_module(f"{flavour.fabric if fabric else flavour.pytorch}.strategies").Strategy
    return "weights_only" in inspect.signature(strategy.load_checkpoint).parameters


def weights_only_kwargs(flavour: Flavour, weights_only: bool | None, fabric: bool = False) -> dict[str, bool | None]:
    """The keyword arguments with which to call the release's ``load_checkpoint`` (strategy or ``CheckpointIO``):
    ``weights_only`` as given where the release passes it, else none (as the release calls it)."""
    return {"weights_only": weights_only} if passes_weights_only(flavour, fabric) else {}


@functools.cache
def _default_weights_only(flavour: Flavour) -> bool | None:
    """The ``weights_only`` the release's ``TorchCheckpointIO`` reads with when none is given: the default of its
    ``_load`` (``False`` before 2.6; ``None``, torch's own default, since)."""
    load = importlib.import_module(f"{flavour.fabric}.utilities.cloud_io")._load
    default = inspect.signature(load).parameters["weights_only"].default
    return None if default is inspect.Parameter.empty else default


def read_weights_only(flavour: Flavour, weights_only: bool | None) -> bool | None:
    """The ``weights_only`` a memory-mapped read of a local file passes to ``torch.load``: the one the release's
    ``TorchCheckpointIO`` would read the same file with (the user's where the release passes it on)."""
    if passes_weights_only(flavour, fabric=True) and weights_only is not None:
        return weights_only
    return _default_weights_only(flavour)


def restores_callbacks_only_when_fitting(flavour: Flavour) -> bool:
    """Whether the release's stage 1 (``_restore_modules_and_callbacks``) restores callbacks only when fitting: before
    2.5. No signature shows it, so the flavour's version decides."""
    return Version(installed_version(flavour)).release < (2, 5)
