"""How checkpoint bytes are read (``docs/design.md``, *Readers*); the turn schedule (``_turns.py``) decides when.
``mmap`` (a local zip file, stock ``TorchCheckpointIO``) or ``eager`` (the strategy's own load), both with the
``weights_only`` the installed Lightning reads with (``_compat.py``)."""

from __future__ import annotations

import logging
import os
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import fsspec
import torch

from serialized_restore._compat import read_weights_only, weights_only_kwargs
from serialized_restore._flavour import flavour_of, lightning_names

log = logging.getLogger(__name__)

_ZIP_MAGIC = b"PK\x03\x04"


@dataclass
class LoadedCheckpoint:
    """A checkpoint dict and how it was read."""

    checkpoint: dict[str, Any]
    reader: str
    bytes_read: int


def local_path(path: Any) -> str | None:
    """The local path (fsspec's protocol ``file``, as for Lightning), or ``None`` for a URL or a file object."""
    if not isinstance(path, (str, os.PathLike)) or fsspec.utils.get_protocol(os.fspath(path)) != "file":
        return None
    return os.fspath(path).removeprefix("file://")


def path_unmappable_reason(path: Any) -> str | None:
    """Why ``path`` cannot be memory-mapped, or ``None`` if it can: it must be a local file in torch's zip format.
    ``""`` where no checkpoint is there (nothing, a file neither zip nor pickle, or a zip archive without its end, as
    a cut-short save leaves it): upstream's own error says why, raised by the first reader in its turn, and the
    package's error names it on every other rank."""
    local = local_path(path)
    if local is None:
        return f"{path!r} is not a local path"
    if not os.path.isfile(local):
        return f"{path!r} is not a file" if os.path.lexists(local) else ""
    try:
        with open(local, "rb") as f:
            head = f.read(4)
    except OSError as err:
        return f"{path!r} cannot be read ({err.strerror})"
    if head == _ZIP_MAGIC:
        # a few KiB read from the file's end: whether the archive's end record is there
        return None if zipfile.is_zipfile(local) else ""
    legacy = f"{path!r} is not in torch's zip format (saved with `_use_new_zipfile_serialization=False`?)"
    return legacy if head.startswith(b"\x80") else ""


def load_mmap(path: Any, map_location: Any, weights_only: bool | None) -> Any:
    """``torch.load`` of a local zip checkpoint, memory-mapped; ``map_location`` and ``weights_only`` as given."""
    local = local_path(path)
    assert local is not None
    return torch.load(local, map_location=map_location, weights_only=weights_only, mmap=True)


def choose_reader(strategy: Any, path: Any, requested: str) -> tuple[str, str | None]:
    """How a rank reads ``path``: ``("mmap", None)`` where ``requested`` allows it and the file can be mapped, else
    ``("eager", why)``; ``why`` is ``None`` when eager was requested or there is no checkpoint to read."""
    reason = path_unmappable_reason(path)
    if requested == "eager" or reason == "":
        return "eager", None
    if not stock_checkpoint_io(strategy):
        return "eager", f"the strategy's CheckpointIO is {type(strategy.checkpoint_io).__name__}, not TorchCheckpointIO"
    return ("mmap", None) if reason is None else ("eager", reason)


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
    fabric: bool = False,
) -> LoadedCheckpoint:
    """(one rank, inside its turn) Read the whole checkpoint with ``reader``, logging ``reason`` for an eager read;
    eager calls ``read_eagerly`` (default: the strategy's ``load_checkpoint``), with ``weights_only`` where the release
    passes it. Private memory grows by the unpickled containers only (mmap), or by the file (eager)."""
    flavour = flavour_of(strategy)
    if reader == "mmap":
        # as TorchCheckpointIO: keep the device each tensor was saved from
        checkpoint = load_mmap(path, lambda storage, loc: storage, read_weights_only(flavour, weights_only))
    else:
        if reason is not None:
            logger.info(f"Reading {path!r} eagerly instead of memory-mapped: {reason}.")
        kwargs = weights_only_kwargs(flavour, weights_only, fabric=fabric)
        checkpoint = (read_eagerly or strategy.load_checkpoint)(path, **kwargs)
    local = local_path(path)
    size = os.path.getsize(local) if local is not None and os.path.isfile(local) else 0
    return LoadedCheckpoint(checkpoint, reader, size)


def wait_for_device_copies() -> None:
    """(one rank) Before the host memory or mapping is dropped: a queued host-to-device copy may still read it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


def _strided_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every strided (not sparse) tensor in a nested structure of dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        if obj.layout is torch.strided:
            yield obj
    elif isinstance(obj, (dict, list, tuple)):
        for item in obj.values() if isinstance(obj, dict) else obj:
            yield from _strided_tensors(item)


def storages_of(obj: Any) -> set[int]:
    """The storages (by data pointer) of every strided tensor in a nested structure of dicts, lists and tuples."""
    return {tensor.untyped_storage().data_ptr() for tensor in _strided_tensors(obj)}


def copy_kept_out_of_mapping(optimizers: list[Any], mapped: set[int]) -> int:
    """Copy into private memory what the optimizers kept of the storages ``mapped``; the bytes copied."""
    return copy_out_of_mapping(optimizer_containers(optimizers), mapped)


def optimizer_containers(optimizers: list[Any]) -> list[Any]:
    """Each optimizer's ``state`` and ``param_groups``, and those of optimizers it wraps (ZeRO's, OSS's ``optim``)."""
    containers: list[Any] = []
    seen: set[int] = set()

    def collect(optimizer: Any) -> None:
        if id(optimizer) in seen:
            return
        seen.add(id(optimizer))
        containers.append(optimizer.state)
        containers.append(optimizer.param_groups)
        for value in vars(optimizer).values():
            for inner in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(inner, torch.optim.Optimizer):
                    collect(inner)

    for optimizer in optimizers:
        collect(optimizer)
    return containers


def copy_out_of_mapping(containers: list[Any], mapped: set[int]) -> int:
    """Replace, in place, every tensor in ``containers`` whose storage is one of ``mapped`` by a private copy; the
    bytes copied. A tensor reachable twice is copied once; views of one storage stay views of one copy."""
    by_storage: dict[int, dict[int, torch.Tensor]] = {}
    for container in containers:
        for tensor in _strided_tensors(container):
            if (storage_ptr := tensor.untyped_storage().data_ptr()) in mapped:
                by_storage.setdefault(storage_ptr, {})[id(tensor)] = tensor
    copies: dict[int, torch.Tensor] = {}
    copied = 0
    for group in by_storage.values():
        tensors = list(group.values())
        if len(tensors) == 1:
            copies[id(tensors[0])] = tensors[0].clone()
            copied += tensors[0].nbytes
            continue
        storage = tensors[0].untyped_storage()
        private = storage.clone()
        copied += storage.nbytes()
        for tensor in tensors:
            view = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
            copies[id(tensor)] = view.set_(private, tensor.storage_offset(), tensor.size(), tensor.stride())

    def replace(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return copies.get(id(value), value)
        if isinstance(value, dict):
            for key in list(value):
                value[key] = replace(value[key])
        elif isinstance(value, list):
            for i, item in enumerate(value):
                value[i] = replace(item)
        elif isinstance(value, tuple):
            items = [replace(item) for item in value]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        return value

    if copies:
        for container in containers:
            replace(container)
    return copied
