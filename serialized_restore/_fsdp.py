"""FSDP: restore a full-state checkpoint holding the optimizer state once, without turns.

``FSDPStrategy`` restores after ``strategy.setup``, inside ``load_checkpoint``, and both halves of it are collectives:
the weights are loaded under a full state-dict context (FSDP gathers and re-shards them), and so is the optimizer
state. A collective cannot run while ranks take turns, so here every rank restores at once, as upstream, and memory
is bounded by *how* the file is read instead of *when*:

* upstream reads the file lazily (``_lazy_load``), loads the weights tensor by tensor, then materializes everything
  else, the whole optimizer state included, on every rank: N copies of the optimizer state per node, held until
  ``resume_end``, for ``validate``/``test``/``predict`` too.
* here every rank memory-maps the file (clean page cache, shared by the ranks of a node), loads the weights from the
  mapping as upstream does, and hands FSDP the optimizer state as mapped tensors: every rank reads its own shard of
  each state tensor from the mapping and copies only that shard (``FSDP.optim_state_dict_to_load`` with the
  ``use_orig_params=True`` that Lightning sets slices each full tensor, a view of the mapping, and clones the slice).
  No rank holds a private copy of the full optimizer state, nor receives one by broadcast; the hooks still see the
  complete dict (``state_dict`` popped, as upstream), backed by the mapped file.
* what FSDP allocates and frees per unit while it loads (the gathered flat parameter of one unit, for the weights)
  is handed back to the operating system as soon as that unit is done (:func:`release_freed_memory`): glibc keeps
  freed blocks below its dynamic mmap threshold (at most 32 MiB) in its heap, so that with units of a few MiB to
  tens of MiB a rank would otherwise keep the high-water mark of several units' transients in private memory
  for the rest of the job.

A sharded checkpoint (a directory written with ``state_dict_type="sharded"``) is already read shard by shard by each
rank, so it is restored by upstream's code unchanged.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any, Callable

from serialized_restore._flavour import flavour_of
from serialized_restore._readers import (
    copy_kept_out_of_mapping,
    load_mmap,
    local_path,
    path_unmappable_reason,
    storages_of,
    wait_for_device_copies,
)
from serialized_restore._turns import TurnSchedule

STAGE_PREPARE_OPTIMIZER_STATE = "prepare optimizer state for FSDP"
FULL = "full"
SHARDED = "sharded"


def checkpoint_kind(strategy: Any, path: Any) -> tuple[str | None, str]:
    """``(FULL, "")`` for a full checkpoint this module can restore, ``(SHARDED, "")`` for a sharded one, else
    ``(None, why)``: upstream's code then restores (or rejects) the path as it always does."""
    local = local_path(path)
    if local is None:
        return None, f"{path!r} is not a local path"
    if flavour_of(strategy).import_("strategies.fsdp", "_is_sharded_checkpoint", fabric=True)(Path(local)):
        return SHARDED, ""
    reason = path_unmappable_reason(local)
    return (FULL, "") if reason is None else (None, reason)


_SHARDED_INFO = (
    "serialized restore: each FSDP rank reads only its own shards of a sharded checkpoint; no turns are needed."
)


def upstream_reason(kind: str | None, why: str, verb: str) -> str:
    """The INFO line for a checkpoint FSDP's own code restores (``kind`` and ``why`` from :func:`checkpoint_kind`,
    not ``FULL``); ``verb``: ``"restore"`` (Trainer) or ``"load"`` (Fabric)."""
    if kind == SHARDED:
        return _SHARDED_INFO
    return f"serialized restore: FSDP's own {verb} is used as is: {why}."


def load_full_checkpoint(
    strategy: Any, path: Any, weights_only: bool | None, fitting: bool, schedule: TurnSchedule
) -> dict[str, Any]:
    """(all ranks together) ``FSDPStrategy.load_checkpoint`` for a full checkpoint, with the file memory-mapped and
    every rank copying only its shard of the optimizer state. Returns the checkpoint dict without ``state_dict``.
    ``schedule`` shares rank 0's step (``TurnSchedule.on_one_rank``); no rank takes turns with the weights.

    ``weights_only=None`` means ``False`` here, as for upstream's FSDP restore, which unpickles without restriction.
    """
    model = strategy.model
    checkpoint = load_mmap(path, "cpu", False if weights_only is None else weights_only)
    # popped, so that nothing but FSDP's load holds the weights' dict, and it goes as soon as the load is done
    load_weights(strategy, checkpoint.pop("state_dict"), model, strict=strategy.lightning_module.strict_loading)
    optimizer_states = checkpoint.get("optimizer_states")
    if optimizer_states is None or not fitting:
        return checkpoint
    if len(strategy.optimizers) != len(optimizer_states):
        raise RuntimeError(
            f"You have configured {len(strategy.optimizers)} optimizers but the checkpoint contains"
            f" {len(optimizer_states)} optimizers to load. Please resume training with the same number"
            " of optimizers or edit the checkpoint manually to remove states."
        )
    mapped = storages_of(optimizer_states)
    load_optimizer_states(strategy, model, strategy.optimizers, optimizer_states, schedule, rekey=_keyed_by_name)
    # what the optimizers keep of the mapped state (each parameter's `step`; with NO_SHARD, everything) becomes
    # private memory, as on Fabric's FSDP path: no training state stays backed by the file
    copy_kept_out_of_mapping(strategy.optimizers, mapped)
    # the optimizers' state went to the GPU from the mapping: done before anything lets go of it
    wait_for_device_copies()
    return checkpoint


def load_weights(strategy: Any, state_dict: dict[str, Any], model: Any, strict: bool) -> None:
    """(all ranks together) Lightning's ``_load_raw_module_state`` of the full ``state_dict`` into the FSDP ``model``,
    one unit after another, the memory each unit gathers handed back as soon as it is done."""
    load_raw_module_state = flavour_of(strategy).import_(
        "strategies.model_parallel", "_load_raw_module_state", fabric=True
    )
    _load_weights_unit_by_unit(
        functools.partial(
            load_raw_module_state, state_dict, module=model, world_size=strategy.world_size, strict=strict
        ),
        model,
    )


def load_optimizer_states(
    strategy: Any,
    model: Any,
    optimizers: list[Any],
    states: list[dict[str, Any]],
    schedule: TurnSchedule,
    rekey: Callable[[dict[str, Any], Any], dict[str, Any]],
) -> None:
    """(all ranks together) Load each full optimizer state (tensors of the mapped file) into its optimizer, every
    rank copying only its shard. ``rekey`` turns a state keyed by parameter index into one keyed by name.

    Rank 0 re-keys first, before any collective: if it fails, the other ranks must hear of it instead of waiting in
    a collective until the process group times out (``schedule`` shares its step, ``TurnSchedule.on_one_rank``).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    full_state_dict_context = flavour_of(strategy).import_(
        "strategies.fsdp", "_get_full_state_dict_context", fabric=True
    )
    prepared: list[dict[str, Any]] = [{} for _ in states]

    def prepare() -> None:
        prepared[:] = [rekey(state, model) for state in states]

    schedule.on_one_rank(STAGE_PREPARE_OPTIMIZER_STATE, prepare, central=strategy.global_rank == 0)
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


def _load_weights_unit_by_unit(load: Callable[[], Any], model: Any) -> None:
    """Run ``load`` (Lightning's ``_load_raw_module_state``: each FSDP unit gathers its full flat parameter, copies
    the weights into it and keeps its shard) with the freed memory handed back after every unit."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    # registered after FSDP's own post-hook, so it runs once the unit has resharded and freed its gathered parameter
    handles = [
        unit.register_load_state_dict_post_hook(lambda *_: release_freed_memory()) for unit in FSDP.fsdp_modules(model)
    ]
    try:
        load()
    finally:
        for handle in handles:
            handle.remove()
    release_freed_memory()


def release_freed_memory() -> None:
    """Give the memory the C allocator keeps after frees back to the operating system (glibc's ``malloc_trim``).

    glibc serves allocations below its dynamic mmap threshold (raised up to 32 MiB by every freed mapped block) from
    its heap, and freed heap blocks stay resident unless they border the top of the heap. A restore that allocates
    and frees one FSDP unit after another would keep their high-water mark as private memory. A no-op where the
    allocator has no ``malloc_trim``.
    """
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


def _keyed_by_name(state: dict[str, Any], model: Any) -> dict[str, Any]:
    """Optimizer state keyed by parameter name, as FSDP loads it (a plain optimizer saves parameter indices)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType

    if isinstance(next(iter(state["state"]), None), int):
        return FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_NAME, model)
    return state
