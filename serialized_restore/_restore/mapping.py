"""Copying out of a memory-mapped checkpoint what a rank keeps, so that nothing the job holds after a restore is
backed by the file (which may be overwritten, or deleted, by the next save)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch


def wait_for_device_copies() -> None:
    """(one rank) Before the host memory or mapping is dropped: a queued host-to-device copy may still read it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


def _storage_ptr(tensor: torch.Tensor) -> Optional[int]:
    """The data pointer of the storage under ``tensor``; ``None`` for a wrapper subclass with no storage of its own
    (``DTensor``, quantized weights), which is never a view of the file."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except RuntimeError:
        return None


def _strided_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every strided (not sparse) tensor with a storage of its own in a nested structure of dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        if obj.layout is torch.strided and _storage_ptr(obj) is not None:
            yield obj
    elif isinstance(obj, (dict, list, tuple)):
        for item in obj.values() if isinstance(obj, dict) else obj:
            yield from _strided_tensors(item)


def storages_of(obj: Any) -> set[int]:
    """The storages (by data pointer) of every strided tensor in a nested structure of dicts, lists and tuples."""
    return {tensor.untyped_storage().data_ptr() for tensor in _strided_tensors(obj)}


def _holds(obj: Any, mapped: set[int]) -> bool:
    return any(tensor.untyped_storage().data_ptr() in mapped for tensor in _strided_tensors(obj))


def copy_kept_out_of_mapping(optimizers: list[Any], mapped: set[int]) -> int:
    """Copy into private memory what the optimizers kept of the storages ``mapped``; the bytes copied."""
    return copy_out_of_mapping(optimizer_containers(optimizers), mapped)


def copy_modules_out_of_mapping(modules: list[torch.nn.Module], mapped: set[int]) -> int:
    """Copy into private memory what ``modules`` and their submodules still hold of the storages ``mapped``: the tensors
    a module keeps instead of copying them in ``load_state_dict`` (``assign=True``, a ``_load_from_state_dict`` of its
    own, the persistent states of a torchmetrics ``Metric``), as a parameter's data (the parameter stays the same
    object), a buffer, a tensor attribute or the tensors of a list attribute; the bytes copied. What
    ``load_state_dict`` copied into the module's own tensors is not touched, nor are tensors in other attributes."""
    containers, put_back = module_containers(modules, mapped)
    copied = copy_out_of_mapping(containers, mapped)
    put_back()
    return copied


def module_containers(modules: list[torch.nn.Module], mapped: set[int]) -> tuple[list[Any], Callable[[], None]]:
    """The containers of what ``modules`` hold of ``mapped`` (for :func:`copy_out_of_mapping`, with other containers in
    the same walk, so that a storage reachable from several of them gets one copy: tied weights stay tied), and what
    puts the copies back into the modules after the walk."""
    params = {id(p): p for module in modules for p in module.parameters() if _holds(p.data, mapped)}
    data = {key: param.data for key, param in params.items()}
    containers: list[Any] = [data]
    attributes: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for submodule in {id(sub): sub for module in modules for sub in module.modules()}.values():
        own = {
            name: value
            for name, value in vars(submodule).items()
            if isinstance(value, (torch.Tensor, list)) and _holds(value, mapped)
        }
        if own:
            attributes.append((vars(submodule), own))
        containers += [submodule._buffers, own]
    originals = dict(data)

    def put_back() -> None:
        for key, param in params.items():
            if data[key] is not originals[key]:
                param.data = data[key]
        for holder, own in attributes:  # a tensor attribute replaced by its copy (lists were changed in place)
            holder.update((name, value) for name, value in own.items() if holder[name] is not value)

    return containers, put_back


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
            if all(new is old for new, old in zip(items, value)):
                return value
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        return value

    if copies:
        for container in containers:
            replace(container)
    return copied
