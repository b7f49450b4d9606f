"""FSDP: restore a full-state checkpoint holding the optimizer state once, without turns.

``FSDPStrategy`` restores after ``strategy.setup``, inside ``load_checkpoint``, and both halves of it are collectives:
the weights are loaded under a full state-dict context (FSDP gathers and re-shards them), and so is the optimizer
state. A collective cannot run while ranks take turns, so here every rank restores at once, as upstream, and memory
is bounded by *how* the file is read instead of *when*:

* upstream reads the file lazily (``_lazy_load``), loads the weights tensor by tensor, then materializes everything
  else, the whole optimizer state included, on every rank: N copies of the optimizer state per node, held until
  ``resume_end``, for ``validate``/``test``/``predict`` too.
* here every rank memory-maps the file (clean page cache, shared by the ranks of a node), loads the weights from the
  mapping as upstream does, and hands the optimizer state to FSDP on rank 0 only, under
  ``FullOptimStateDictConfig(rank0_only=True)``: FSDP broadcasts each state tensor from rank 0 and every rank keeps
  its own shard. No rank holds a private copy of the full optimizer state; the hooks still see the complete dict
  (``state_dict`` popped, as upstream), backed by the mapped file.

A sharded checkpoint (a directory written with ``state_dict_type="sharded"``) is already read shard by shard by each
rank, so it is restored by upstream's code unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from serialized_restore._flavour import flavour_of
from serialized_restore._readers import load_mmap, local_path, path_unmappable_reason
from serialized_restore._turns import TurnSchedule

STAGE_PREPARE_OPTIMIZER_STATE = "prepare optimizer state for FSDP"
FULL = "full"
SHARDED = "sharded"


def fsdp_strategy_class(strategy: Any) -> Any:
    """The flavour's ``FSDPStrategy`` class."""
    return flavour_of(strategy).import_("strategies", "FSDPStrategy")


def checkpoint_kind(strategy: Any, path: Any) -> tuple[Optional[str], str]:
    """``(FULL, "")`` for a full checkpoint this module can restore, ``(SHARDED, "")`` for a sharded one, else
    ``(None, why)``: upstream's code then restores (or rejects) the path as it always does."""
    local = local_path(path)
    if local is None:
        return None, f"{path!r} is not a local path"
    if flavour_of(strategy).import_("strategies.fsdp", "_is_sharded_checkpoint", fabric=True)(Path(local)):
        return SHARDED, ""
    reason = path_unmappable_reason(local)
    return (FULL, "") if reason is None else (None, reason)


def load_full_checkpoint(
    strategy: Any, path: Any, weights_only: Optional[bool], fitting: bool, schedule: TurnSchedule
) -> dict[str, Any]:
    """(all ranks together) ``FSDPStrategy.load_checkpoint`` for a full checkpoint, with the file memory-mapped and
    the optimizer state given to FSDP by rank 0 only. Returns the checkpoint dict without ``state_dict``.
    ``schedule`` shares rank 0's step (``TurnSchedule.on_one_rank``); no rank takes turns with the weights.

    ``weights_only=None`` means ``False`` here, as for upstream's FSDP restore, which unpickles without restriction.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    flavour = flavour_of(strategy)
    load_raw_module_state = flavour.import_("strategies.model_parallel", "_load_raw_module_state", fabric=True)
    full_state_dict_context = flavour.import_("strategies.fsdp", "_get_full_state_dict_context", fabric=True)
    model, module = strategy.model, strategy.lightning_module

    checkpoint = load_mmap(path, "cpu", False if weights_only is None else weights_only)
    load_raw_module_state(
        checkpoint.pop("state_dict"), module=model, world_size=strategy.world_size, strict=module.strict_loading
    )
    optimizer_states = checkpoint.get("optimizer_states")
    if optimizer_states is None or not fitting:
        return checkpoint
    if len(strategy.optimizers) != len(optimizer_states):
        raise RuntimeError(
            f"You have configured {len(strategy.optimizers)} optimizers but the checkpoint contains"
            f" {len(optimizer_states)} optimizers to load. Please resume training with the same number"
            " of optimizers or edit the checkpoint manually to remove states."
        )
    # rank 0 prepares alone, before any collective: if it fails, the other ranks must hear of it instead of waiting in
    # FSDP's broadcast until the process group times out
    prepared: list[dict[str, Any]] = [{} for _ in optimizer_states]

    def prepare() -> None:
        prepared[:] = [_keyed_by_name(state, model) for state in optimizer_states]

    schedule.on_one_rank(STAGE_PREPARE_OPTIMIZER_STATE, prepare, central=strategy.global_rank == 0)
    with full_state_dict_context(model, world_size=strategy.world_size, rank0_only=True):
        for optimizer, state in zip(strategy.optimizers, prepared):
            # with rank0_only, FSDP reads the state on rank 0 and broadcasts it tensor by tensor; the others pass {}
            to_load = FSDP.optim_state_dict_to_load(model=model, optim=optimizer, optim_state_dict=state)
            optimizer.load_state_dict(to_load)
    return checkpoint


def _keyed_by_name(state: dict[str, Any], model: Any) -> dict[str, Any]:
    """Optimizer state keyed by parameter name, as FSDP loads it (a plain optimizer saves parameter indices)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType

    if isinstance(next(iter(state["state"]), None), int):
        return FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_NAME, model)
    return state

