"""FSDP: restore a full checkpoint with every rank at once, memory-mapped (``docs/design.md``, *FSDP*): FSDP restores
with collectives, so its ranks cannot take turns; each rank copies only its own shard from the mapping."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from serialized_restore._files import local_path, unmappable_reason
from serialized_restore._lightning.names import lightning_names
from serialized_restore._restore.mapping import copy_kept_out_of_mapping, storages_of, wait_for_device_copies
from serialized_restore._restore.readers import load_mmap
from serialized_restore._restore.stages import Stage

if TYPE_CHECKING:
    from serialized_restore._coordination.turns import TurnSchedule

FULL = "full"
SHARDED = "sharded"


def checkpoint_kind(strategy: Any, path: Any) -> tuple[str | None, str]:
    """``(FULL, "")`` for a full checkpoint this module restores, ``(SHARDED, "")``, else ``(None, why)``."""
    local = local_path(path)
    if local is None:
        return None, f"{path!r} is not a local path"
    if lightning_names(strategy).is_sharded_checkpoint(Path(local)):
        return SHARDED, ""
    reason = unmappable_reason(local)
    return (FULL, "") if reason is None else (None, reason or f"{path!r} is not a checkpoint file")


def upstream_reason(kind: str | None, why: str, verb: str) -> str:
    """The INFO line for a checkpoint; ``verb``: ``"restore"`` or ``"load"`` (Fabric). ``kind`` ``FULL``: ours."""
    if kind == FULL:
        return (
            f"serialized restore: FSDP {verb}s with collectives, so its ranks {verb} together instead of in turns; the"
            " full checkpoint is memory-mapped and each rank copies only its shard of the optimizer state."
        )
    if kind == SHARDED:
        return (
            "serialized restore: each FSDP rank reads only its own shards of a sharded checkpoint; no turns are needed."
        )
    return f"serialized restore: FSDP's own {verb} is used as is: {why}."


def load_full_checkpoint(
    strategy: Any, path: Any, weights_only: bool | None, fitting: bool, turns: TurnSchedule
) -> dict[str, Any]:
    """(all ranks together) The Trainer's FSDP restore of a full checkpoint, mapped; the dict less its weights (and,
    when fitting, less nothing else: stage 2 finds the optimizer states restored already)."""
    checkpoint = load_mmap(path, "cpu", False if weights_only is None else weights_only)
    states = checkpoint.get("optimizer_states") if fitting else None
    # popped, so that nothing but FSDP's load holds the weights' dict, and it goes as soon as the load is done
    weights = checkpoint.pop("state_dict")
    optimizers = strategy.optimizers if states is not None else []
    restore_full_state(strategy, strategy.model, weights, optimizers, states or [], turns,
                       strict=strategy.lightning_module.strict_loading)  # fmt: skip
    return checkpoint


def restore_full_state(
    strategy: Any,
    module: Any,
    weights: dict[str, Any],
    optimizers: list[Any],
    states: list[dict[str, Any]],
    turns: TurnSchedule,
    strict: bool,
) -> int:
    """(all ranks together) The one FSDP restore of a full checkpoint's mapped tensors, the Trainer's and Fabric's:
    the weights into ``module``, each full optimizer state into its optimizer (each rank keeping its shard), then what
    the optimizers keep of the mapping (each parameter's ``step``; with ``NO_SHARD``, everything) copied into private
    memory, so that no training state stays backed by the file; the bytes copied."""
    load_weights(strategy, weights, module, strict=strict)
    del weights
    if len(optimizers) != len(states):
        raise RuntimeError(
            f"You have configured {len(optimizers)} optimizers but the checkpoint contains"
            f" {len(states)} optimizers to load. Please resume training with the same number"
            " of optimizers or edit the checkpoint manually to remove states."
        )
    if not optimizers:
        return 0
    mapped = storages_of(states)
    load_optimizer_states(strategy, module, optimizers, states, turns)
    copied = copy_kept_out_of_mapping(optimizers, mapped)
    # the optimizers' state went to the GPU from the mapping: done before anything lets go of it
    wait_for_device_copies()
    return copied


def load_weights(strategy: Any, state_dict: dict[str, Any], model: Any, strict: bool) -> None:
    """(all ranks together) Lightning's ``_load_raw_module_state``, each unit's gathered memory freed when done."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    load_raw_module_state = lightning_names(strategy).load_raw_module_state
    # registered after FSDP's own post-hook, so it runs once the unit has resharded and freed its gathered parameter
    handles = [
        unit.register_load_state_dict_post_hook(lambda *_: release_freed_memory()) for unit in FSDP.fsdp_modules(model)
    ]
    try:
        load_raw_module_state(state_dict, module=model, world_size=strategy.world_size, strict=strict)
    finally:
        for handle in handles:
            handle.remove()
    release_freed_memory()


def load_optimizer_states(
    strategy: Any, model: Any, optimizers: list[Any], states: list[dict[str, Any]], turns: TurnSchedule
) -> None:
    """(all ranks together) Load each full optimizer state (mapped) into its optimizer, each rank copying its shard.
    Rank 0 re-keys first, so that its failure reaches the others through the turns, not as a hung collective."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    names = lightning_names(strategy)
    full_state_dict_context = names.get_full_state_dict_context
    # Lightning's own re-keying (by parameter index to by name), as upstream's FSDP restore does it
    rekey = names.rekey_optimizer_state_if_needed
    prepared: list[dict[str, Any]] = [{} for _ in states]

    def prepare() -> None:
        prepared[:] = [rekey(state, model) for state in states]

    turns.on_one_rank(Stage.PREPARE_OPTIMIZER_STATE, prepare, central=strategy.global_rank == 0)
    if strategy.global_rank != 0:
        # the same file and model as rank 0's: re-keying cannot fail here where it did not there
        prepare()
    # rank0_only=False, as upstream: every rank passes the complete state, here tensors of the mapped file, and FSDP
    # keeps on each rank a copy of that rank's shard only
    with full_state_dict_context(model, world_size=strategy.world_size, rank0_only=False):
        for optimizer, state in zip(optimizers, prepared):
            to_load = FSDP.optim_state_dict_to_load(model=model, optim=optimizer, optim_state_dict=state)
            optimizer.load_state_dict(to_load)
            del to_load
            release_freed_memory()


def release_freed_memory() -> None:
    """Hand the memory glibc keeps after frees back to the operating system (``malloc_trim``; a no-op elsewhere)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim
