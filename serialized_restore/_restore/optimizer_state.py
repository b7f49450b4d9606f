"""Stage 2 of a Trainer's restore and the optimizer state: where it comes from, and what loading it allocates."""

from __future__ import annotations

import enum
from typing import Any

import torch


class OptimizerSource(enum.Enum):
    """Where stage 2 takes the optimizer state from (fit only)."""

    IN_DICT = "in the dict"
    """In private memory in the cached dict (read eagerly and changed by a hook)."""
    COPY_FROM_MAPPING = "copy from the mapping"
    """Views of the mapped file: what the optimizers keep of it is copied out in stage 2."""
    READ_AGAIN = "read again"
    """Read eagerly and dropped after stage 1 (no hook changed it): read again in stage 2."""


class Fingerprint:
    """A cheap structural snapshot, equal when nothing was added, removed, replaced or changed in place in between:
    tensors by identity (kept referenced) and version counter, plain leaves by value."""

    def __init__(self, obj: Any) -> None:
        self.shape: list[Any] = []
        self._tensors: list[torch.Tensor] = []
        self._visit(obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fingerprint) and self.shape == other.shape

    def _visit(self, value: Any) -> None:
        out = self.shape
        if isinstance(value, torch.Tensor):
            self._tensors.append(value)
            out.append(("tensor", id(value), value._version))
        elif isinstance(value, dict):
            out.append(("dict", len(value)))
            for key, item in value.items():
                out.append(key)
                self._visit(item)
        elif isinstance(value, (list, tuple)):
            out.append((type(value), len(value)))
            for item in value:
                self._visit(item)
        elif value is None or isinstance(value, (bool, int, float, str, bytes)):
            out.append(value)
        else:
            out.append(("object", id(value)))


def load_in_place(optimizers: list[Any]) -> bool:
    """Whether every optimizer's ``load_state_dict`` is torch's own, which allocates nothing it frees again."""
    return all(type(optimizer).load_state_dict is torch.optim.Optimizer.load_state_dict for optimizer in optimizers)


def converts_on_load(optimizers: list[Any], states: Any) -> bool:
    """Whether torch's ``load_state_dict`` converts a saved floating-point state tensor to its parameter's dtype,
    which allocates a host temporary: then the ranks of a node must not do it at once."""
    for optimizer, saved in zip(optimizers, states or []):
        if not isinstance(saved, dict):
            continue
        saved_ids = [i for group in saved.get("param_groups", []) for i in group.get("params", [])]
        params = dict(zip(saved_ids, (p for group in optimizer.param_groups for p in group["params"])))
        for index, state in saved.get("state", {}).items():
            param = params.get(index)
            if param is None or not param.is_floating_point():
                continue
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.dtype != param.dtype:
                    return True
    return False
