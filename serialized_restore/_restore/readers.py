"""How checkpoint bytes are read (``docs/design.md``, *Readers*); the turns (``_coordination/turns.py``) decide when.
``mmap`` (a local zip file, stock ``TorchCheckpointIO``) or ``eager`` (the strategy's own load), both with the
``weights_only`` the installed Lightning reads with (``_lightning/versions.py``)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from serialized_restore._files import local_path, unmappable_reason
from serialized_restore._lightning.names import Owner, flavour_of, lightning_names
from serialized_restore._lightning.versions import read_weights_only, weights_only_kwargs

log = logging.getLogger(__name__)

MMAP, EAGER = "mmap", "eager"  # how a rank reads: memory-mapped, or into memory as upstream reads


@dataclass
class LoadedCheckpoint:
    """A checkpoint dict and how it was read."""

    checkpoint: dict[str, Any]
    reader: str
    bytes_read: int


def load_mmap(path: Any, map_location: Any, weights_only: bool | None) -> Any:
    """``torch.load`` of a local zip checkpoint, memory-mapped; ``map_location`` and ``weights_only`` as given."""
    local = local_path(path)
    assert local is not None
    return torch.load(local, map_location=map_location, weights_only=weights_only, mmap=True)


def choose_reader(strategy: Any, path: Any, requested: str) -> tuple[str, str | None]:
    """How a rank reads ``path``: ``("mmap", None)`` where ``requested`` allows it and the file can be mapped, else
    ``("eager", why)``; ``why`` is ``None`` when eager was requested, ``""`` when there is no checkpoint to read (the
    eager read raises upstream's own error, and nothing is said about how it reads)."""
    reason = unmappable_reason(path)
    if reason == "":
        return EAGER, ""
    if requested == EAGER:
        return EAGER, None
    if not stock_checkpoint_io(strategy):
        return EAGER, f"the strategy's CheckpointIO is {type(strategy.checkpoint_io).__name__}, not TorchCheckpointIO"
    return (MMAP, None) if reason is None else (EAGER, reason)


def stock_checkpoint_io(strategy: Any) -> bool:
    """Whether the strategy reads with Lightning's own ``TorchCheckpointIO`` (not a subclass, not a user's own)."""
    return type(strategy.checkpoint_io) is lightning_names(strategy).TorchCheckpointIO


def read_checkpoint(
    strategy: Any,
    path: Any,
    weights_only: bool | None,
    reader: str,
    reason: str | None = None,
    logger: logging.Logger = log,
    read_eagerly: Callable[..., Any] | None = None,
    owner: Owner = Owner.TRAINER,
) -> LoadedCheckpoint:
    """(one rank, inside its turn) Read the whole checkpoint with ``reader``, logging ``reason`` for an eager read;
    eager calls ``read_eagerly`` (default: the strategy's ``load_checkpoint``), with ``weights_only`` where the release
    passes it to ``owner``'s strategy. Private memory grows by the unpickled containers only (mmap), or by the file
    (eager)."""
    flavour = flavour_of(strategy)
    if reader == MMAP:
        # as TorchCheckpointIO: keep the device each tensor was saved from
        checkpoint = load_mmap(path, lambda storage, loc: storage, read_weights_only(flavour, weights_only))
    else:
        if reason:
            logger.info(f"Reading {path!r} eagerly instead of memory-mapped: {reason}.")
        kwargs = weights_only_kwargs(flavour, weights_only, owner)
        checkpoint = (read_eagerly or strategy.load_checkpoint)(path, **kwargs)
    local = local_path(path)
    size = os.path.getsize(local) if local is not None and os.path.isfile(local) else 0
    return LoadedCheckpoint(checkpoint, reader, size)
