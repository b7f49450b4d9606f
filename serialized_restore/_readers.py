"""How checkpoint bytes are read: memory-mapped where possible, else through the strategy's ``CheckpointIO``.

The turn schedule (``_turns.py``) decides *when* a rank reads; this module decides *how*.

* ``mmap``: ``torch.load(path, mmap=True, weights_only=...)``. Tensors are views of the file's pages in the page
  cache: clean, shared by every process on the node that maps the same file, and dropped by the kernel under
  pressure. Nothing of the checkpoint is copied into a rank's private (anonymous) memory until the rank copies it
  into its model or optimizer. Used only for a local, zip-format file read by Lightning's stock
  ``TorchCheckpointIO``, since a custom ``CheckpointIO`` may do anything.
* ``eager``: ``strategy.load_checkpoint(path, weights_only=...)``, exactly what upstream Lightning does: the whole
  file is unpickled into the rank's private memory.

Both pass ``weights_only`` through unchanged, so its meaning is upstream's.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch

from serialized_restore._flavour import flavour_of

log = logging.getLogger(__name__)

_ZIP_MAGIC = b"PK\x03\x04"


@dataclass
class LoadedCheckpoint:
    """A checkpoint dict and how it was read."""

    checkpoint: dict[str, Any]
    reader: str
    bytes_read: int


def local_path(path: Any) -> str | None:
    """The checkpoint's path on the local file system, or ``None`` for a URL or a file-like object."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        return None
    if path.startswith("file://"):
        return path[len("file://") :]
    if "://" in path:
        return None
    return path


def _not_a_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a local path with nothing there, or a file that is neither a zip archive nor a pickle (not a
    checkpoint of any format): reading it raises upstream's own error, which needs no word about readers before it."""
    local = local_path(path)
    if local is None or not os.path.lexists(local):
        return local is not None
    try:
        with open(local, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return os.path.isfile(local) and not head.startswith(_ZIP_MAGIC) and not head.startswith(b"\x80")


def _file_size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path is not None else 0
    except OSError:
        return 0


def path_unmappable_reason(path: Any) -> str | None:
    """Why ``path`` cannot be memory-mapped, or ``None`` if it can: it must be a local file in torch's zip format."""
    local = local_path(path)
    if local is None:
        return f"{path!r} is not a local path"
    if not os.path.isfile(local):
        return f"{path!r} is not a file"
    with open(local, "rb") as f:
        if f.read(4) != _ZIP_MAGIC:
            return f"{path!r} is not in torch's zip format (saved with `_use_new_zipfile_serialization=False`?)"
    return None


def mmap_unsupported_reason(strategy: Any, path: Any) -> str | None:
    """Why ``path`` cannot be memory-mapped for ``strategy``, or ``None`` if it can."""
    checkpoint_io = strategy.checkpoint_io
    stock = flavour_of(strategy).import_("plugins.io.torch_io", "TorchCheckpointIO", fabric=True)
    if type(checkpoint_io) is not stock and not isinstance(checkpoint_io, MmapCheckpointIOMixin):
        return f"the strategy's CheckpointIO is {type(checkpoint_io).__name__}, not TorchCheckpointIO"
    return path_unmappable_reason(path)


def load_mmap(path: Any, map_location: Any, weights_only: bool | None) -> Any:
    """``torch.load`` of a local zip checkpoint, memory-mapped; ``map_location`` and ``weights_only`` as given."""
    local = local_path(path)
    assert local is not None
    return torch.load(local, map_location=map_location, weights_only=weights_only, mmap=True)


class MmapCheckpointIOMixin:
    """Loads local zip-format checkpoints memory-mapped; mixed into Lightning's ``TorchCheckpointIO``.

    Every process that maps the same file shares its clean pages in the page cache instead of holding a private
    copy, so N ranks on a node cost about 1 x S of (reclaimable) page cache rather than N x S of private memory.
    Legacy (non-zip) files, non-local paths and file-like objects are read as ``TorchCheckpointIO`` reads them,
    with one INFO line saying why. ``weights_only`` is passed to ``torch.load`` unchanged.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _accept_in_every_imported_flavour(type(self))

    def load_checkpoint(
        self,
        path: Any,
        map_location: Any = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        # on global rank zero, through Lightning's logger: shown where Lightning's own INFO lines are
        info = flavour_of(self).import_("utilities.rank_zero", "rank_zero_info", fabric=True)
        if not isinstance(path, (str, os.PathLike)):
            info("MmapCheckpointIO: reading a file-like object eagerly: only paths can be memory-mapped.")
            return torch.load(path, map_location=map_location, weights_only=weights_only)
        reason = path_unmappable_reason(path)
        if reason is None:
            return load_mmap(path, map_location, weights_only)
        if not _not_a_checkpoint(path):
            info(f"MmapCheckpointIO: reading {path!r} eagerly instead of memory-mapped: {reason}.")
        return super().load_checkpoint(  # type: ignore[misc]
            path, map_location=map_location, weights_only=weights_only
        )


def _accept_in_every_imported_flavour(cls: type) -> None:
    """Make ``cls`` a ``CheckpointIO`` of each Lightning flavour imported so far, not only of its own.

    The plugin of the ``pytorch_lightning`` flavour derives from that distribution's ``TorchCheckpointIO``; given to
    ``lightning.pytorch.Trainer(plugins=[...])`` it would be refused ("Found invalid type for plugin"), since the two
    distributions ship separate classes. Both flavours' ``CheckpointIO`` are abstract base classes and the plugin's
    code is the same in both, so it is registered as a virtual subclass of the other flavour's ``CheckpointIO`` (only
    of a flavour the program has imported: a user passing it to a Trainer has imported that Trainer's flavour).
    """
    for fabric in ("lightning.fabric.plugins.io.checkpoint_io", "lightning_fabric.plugins.io.checkpoint_io"):
        module = sys.modules.get(fabric)
        base = getattr(module, "CheckpointIO", None)
        if base is not None and not issubclass(cls, base):
            base.register(cls)


def choose_reader(strategy: Any, path: Any, requested: str) -> tuple[str, str | None]:
    """The one rule for how a rank reads ``path``: ``("mmap", None)`` where ``requested`` (``"auto"``, ``"mmap"``
    or ``"eager"``) allows it and the file can be memory-mapped for ``strategy``, else ``("eager", why)``, ``why``
    being ``None`` when eager reading was requested or when there is no checkpoint to read (the eager read raises
    upstream's error). ``"auto"``'s memory estimate uses it before anything is read."""
    if requested == "eager" or _not_a_checkpoint(path):
        return "eager", None
    reason = mmap_unsupported_reason(strategy, path)
    return ("mmap", None) if reason is None else ("eager", reason)


def read_checkpoint(
    strategy: Any,
    path: Any,
    weights_only: bool | None,
    reader: str,
    logger: logging.Logger = log,
    read_eagerly: Callable[..., Any] | None = None,
) -> LoadedCheckpoint:
    """(one rank, inside its turn) Read the whole checkpoint with the reader ``choose_reader`` picks.

    ``reader`` is ``"auto"`` or ``"mmap"`` (memory-mapped when possible, else eager, saying why at INFO on
    ``logger``: the connector passes Lightning's ``serialized_restore`` logger) or ``"eager"``.
    Eager reading calls ``read_eagerly(path, weights_only=...)``: by default the Trainer strategy's
    ``load_checkpoint``; Fabric passes its strategy's ``checkpoint_io.load_checkpoint``.

    Memory: memory-mapped, the rank's private memory grows by nothing but the unpickled containers (the tensors are
    views of the file's pages in the page cache); eager, by the whole checkpoint (about the file's size).
    """
    chosen, reason = choose_reader(strategy, path, reader)
    if chosen == "mmap":
        # as TorchCheckpointIO: keep the device each tensor was saved from
        checkpoint = load_mmap(path, lambda storage, loc: storage, weights_only)
        return LoadedCheckpoint(checkpoint, "mmap", _file_size(local_path(path)))
    if reason is not None:
        logger.info(f"Reading {path!r} eagerly instead of memory-mapped: {reason}.")
    checkpoint = (read_eagerly or strategy.load_checkpoint)(path, weights_only=weights_only)
    return LoadedCheckpoint(checkpoint, "eager", _file_size(local_path(path)))


def wait_for_device_copies() -> None:
    """(one rank) Wait until the copies queued on the current CUDA stream are done, before the checkpoint's host
    memory (for a memory-mapped file, the mapping itself) is dropped: a host-to-device copy may still be reading it,
    and on machines with unified memory CUDA may not stage a pageable copy through a buffer of its own. Does nothing
    where CUDA is not initialised (nothing was copied to a GPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


def _strided_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every strided (not sparse) tensor in a nested structure of dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        if obj.layout is torch.strided:
            yield obj
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _strided_tensors(item)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _strided_tensors(item)


def storages_of(obj: Any) -> set[int]:
    """The storages (by data pointer) of every strided tensor in a nested structure of dicts, lists and tuples."""
    return {tensor.untyped_storage().data_ptr() for tensor in _strided_tensors(obj)}


def copy_kept_out_of_mapping(optimizers: list[Any], mapped: set[int]) -> int:
    """Copy into private memory every tensor an optimizer kept from the memory-mapped checkpoint; the bytes copied.

    ``mapped`` are the storages of the mapped optimizer state handed to ``load_state_dict``. Only what the optimizer
    still holds afterwards is copied: state ``load_state_dict`` moved to another device (a GPU) is a copy already, and
    state it dropped (a ZeRO or fairscale ``OSS`` rank keeps only its own shard) is freed with the checkpoint dict.
    Looked at: :func:`optimizer_containers`. A tensor reachable twice is copied once and replaced everywhere; tensors
    that are views of one storage are copied as one storage, so that they stay views of one another.
    """
    return copy_out_of_mapping(optimizer_containers(optimizers), mapped)


def optimizer_containers(optimizers: list[Any]) -> list[Any]:
    """Where optimizers keep tensors: each optimizer's ``state`` and ``param_groups``, and those of the optimizers
    it wraps, at any depth (the ``optim`` of ``ZeroRedundancyOptimizer`` and ``OSS``)."""
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
    """Replace, in place, every strided tensor in ``containers`` (dicts and lists, and tuples in them, which are
    rebuilt) whose storage is one of ``mapped`` by a private copy; the bytes copied. A tensor reachable twice is
    copied once; tensors that are views of one storage are copied as one storage and stay views of one another."""
    kept = {
        id(tensor): tensor
        for container in containers
        for tensor in _strided_tensors(container)
        if tensor.untyped_storage().data_ptr() in mapped
    }
    by_storage: dict[int, list[torch.Tensor]] = {}
    for tensor in kept.values():
        by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    copies: dict[int, torch.Tensor] = {}
    copied = 0
    for tensors in by_storage.values():
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
