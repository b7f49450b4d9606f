"""Lightning Fabric: ``fabric.load`` and ``fabric.load_raw`` in per-node turns (``docs/design.md``, *Lightning Fabric*);
FSDP with a full checkpoint loads with its ranks together."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch

from serialized_restore._coordination.placement import RankPlacement
from serialized_restore._lightning.names import Owner, flavour_of, lightning_names
from serialized_restore._lightning.strategies import StrategyPath
from serialized_restore._lightning.versions import check_supported
from serialized_restore._restore.fsdp import FULL, restore_full_state, upstream_reason
from serialized_restore._restore.mapping import (
    copy_kept_out_of_mapping,
    copy_modules_out_of_mapping,
    copy_out_of_mapping,
    module_containers,
    optimizer_containers,
    storages_of,
    wait_for_device_copies,
)
from serialized_restore._restore.plan import Notices, RestorePlan, Source, decide_strategy_path, plan_restore
from serialized_restore._restore.readers import MMAP, load_mmap, read_checkpoint
from serialized_restore._restore.stages import Stage
from serialized_restore.settings import SerializedCheckpointLoading, settings_for

_Load = Callable[..., dict[str, Any]]  # upstream's strategy.load_checkpoint


class SerializedFabricMixin:
    """Adds ``serialized_checkpoint_loading`` to Lightning ``Fabric``; every other argument is upstream's.

    Args:
        serialized_checkpoint_loading: as the Trainer's, for ``fabric.load`` and ``fabric.load_raw``. ``False``
            (default) loads exactly as upstream; ``True``, a positive int ``k`` or a
            :class:`~serialized_restore.SerializedLoading`: the local ranks of each node load in turns.
    """

    _strategy: Any

    def __init__(
        self, *args: Any, serialized_checkpoint_loading: SerializedCheckpointLoading = False, **kwargs: Any
    ) -> None:
        check_supported(flavour_of(self), Owner.FABRIC)
        settings = settings_for(serialized_checkpoint_loading, Owner.FABRIC, os.environ)
        super().__init__(*args, **kwargs)
        self._serialized_value = serialized_checkpoint_loading
        self._serialized_settings = settings
        self._serialized_notices = Notices()
        self._serialized_loading = False  # inside a `load` or `load_raw` whose strategy load stands in for upstream's
        self._serialized_log = logging.getLogger(f"{flavour_of(self).fabric}.serialized_restore")

    # `**kwargs`: what the release's own `load` takes besides (`weights_only` from 2.6 on), passed on unchanged
    def load(
        self, path: Any, state: dict[str, Any] | None = None, strict: bool = True, **kwargs: Any
    ) -> dict[str, Any]:
        with self._loading_in_turns():
            return super().load(path, state, strict, **kwargs)  # type: ignore[misc]

    def load_raw(self, path: Any, obj: Any, strict: bool = True, **kwargs: Any) -> None:
        with self._loading_in_turns():
            return super().load_raw(path, obj, strict, **kwargs)  # type: ignore[misc]

    load.__doc__ = "Upstream's ``Fabric.load``; with ``serialized_checkpoint_loading`` on, in turns (see the class)."
    load_raw.__doc__ = "Upstream's ``Fabric.load_raw``; with ``serialized_checkpoint_loading`` on, in turns."

    @contextlib.contextmanager
    def _loading_in_turns(self) -> Iterator[None]:
        """While upstream's ``load`` / ``load_raw`` runs, its ``strategy.load_checkpoint`` loads as planned: the
        strategy's path is decided first, on the strategy as the user left it; where it restores as upstream,
        nothing is replaced."""
        strategy, settings, value = self._strategy, self._serialized_settings, self._serialized_value
        if settings is None or self._serialized_loading:  # off, or inside a load already (a `load_raw` in `load`)
            yield
            return
        decided = decide_strategy_path(Owner.FABRIC, strategy, value, self._serialized_notices)
        if decided is StrategyPath.UPSTREAM:
            yield
            return
        upstream = strategy.load_checkpoint

        # as the release's strategy.load_checkpoint: `weights_only` only where it takes one (2.6 on)
        def load_checkpoint(path: Any, state: Any = None, strict: bool = True, **kwargs: Any) -> dict[str, Any]:
            modules = {}
            if isinstance(state, dict):
                has_fsdp_modules = lightning_names(self).has_fsdp_modules
                modules = {key: obj for key, obj in state.items() if has_fsdp_modules(obj)}
            # FSDP's own load restores a full checkpoint into exactly one FSDP module, as upstream's
            how = StrategyPath.UPSTREAM if decided is StrategyPath.FSDP and len(modules) != 1 else decided
            plan = plan_restore(
                Owner.FABRIC, strategy, RankPlacement.of(self), how, value, settings, path, self._serialized_notices
            )
            if plan.strategy_path is StrategyPath.UPSTREAM:
                return upstream(path=path, state=state, strict=strict, **kwargs)
            if plan.strategy_path is StrategyPath.FSDP:
                return self._load_fsdp(plan, modules, state, strict)
            return self._load_in_turn(plan, upstream, state, strict, kwargs)

        strategy.load_checkpoint = load_checkpoint
        self._serialized_loading = True
        try:
            yield
        finally:
            self._serialized_loading = False
            del strategy.load_checkpoint  # the instance attribute: the class's method shows through again

    def _load_in_turn(self, plan: RestorePlan, upstream: _Load, state: Any, strict: bool, kwargs: dict[str, Any]
                      ) -> dict[str, Any]:  # fmt: skip
        """(all ranks) Upstream's ``strategy.load_checkpoint`` in this rank's turn, on the checkpoint read with the
        plan's reader; then, every rank at once, copy what the rank keeps out of the mapping."""
        strategy, path, log = self._strategy, plan.checkpoint_path, self._serialized_log
        turns = plan.turns(strategy, log)
        source = Source.of(strategy, path, plan.settings)
        with turns.turn(Stage.LOAD, k=plan.k_to_read(Stage.LOAD, source, log), logged=True) as record:
            loaded = read_checkpoint(
                strategy, source.path, kwargs.get("weights_only"), source.reader, source.reason, log,
                read_eagerly=strategy.checkpoint_io.load_checkpoint, owner=Owner.FABRIC,
            )  # fmt: skip
            record.bytes_read, record.reader = loaded.bytes_read, loaded.reader
            mapped = storages_of(loaded.checkpoint) if loaded.reader == MMAP else set()
            if mapped:
                record.bytes_copied += self._copy_for_stateful_objects(loaded.checkpoint, state, mapped)
            checkpoint_io = strategy.checkpoint_io
            strategy.checkpoint_io = _AlreadyRead(loaded.checkpoint)
            loaded.checkpoint = {}  # upstream pops what it restores: nothing else holds on to it
            try:
                remainder = upstream(path=path, state=state, strict=strict, **kwargs)
            finally:
                strategy.checkpoint_io = checkpoint_io
        # what the rank keeps is copied with the node's other ranks at once: it allocates only memory the rank keeps
        # (as the Trainer's second stage); every rank takes part, also one that read eagerly and copies nothing
        with turns.turn(Stage.COPY, k=None, logged=bool(mapped)) as record:
            if mapped:
                record.bytes_copied = self._copy_kept(state, remainder, mapped)
            wait_for_device_copies()
        return remainder

    def _load_fsdp(self, plan: RestorePlan, modules: dict[str, Any], state: dict[str, Any], strict: bool
                   ) -> dict[str, Any]:  # fmt: skip
        """(all ranks together) FSDP's load of a full checkpoint into one FSDP model, memory-mapped, each rank copying
        its shard (``_restore/fsdp.py``); unpickled without restriction whatever ``weights_only`` says, as upstream."""
        strategy, names = self._strategy, lightning_names(self)
        self._rank_zero_info(upstream_reason(FULL, "", Owner.FABRIC.verb))
        ((module_key, module),) = modules.items()
        optimizers = {key: obj for key, obj in state.items() if isinstance(obj, torch.optim.Optimizer)}
        turns = plan.turns(strategy, self._serialized_log)
        checkpoint = load_mmap(Path(plan.fsdp_path), "cpu", False)
        mapped = storages_of(checkpoint)
        states = [checkpoint.pop(key) for key in optimizers]
        restore_full_state(strategy, module, checkpoint.pop(module_key), list(optimizers.values()), states, turns,
                           strict)  # fmt: skip
        del states
        requested = state.keys() - modules.keys() - optimizers.keys()
        names.validate_keys_for_strict_loading(requested, checkpoint.keys(), strict=strict)
        self._copy_for_stateful_objects(checkpoint, state, mapped)
        names.move_state_into(source=checkpoint, destination=state, keys=requested)
        with turns.turn(Stage.COPY, k=None, logged=True) as record:
            record.bytes_copied = self._copy_kept(state, checkpoint, mapped)
            wait_for_device_copies()
        return checkpoint

    def _rank_zero_info(self, message: str) -> None:
        Owner.FABRIC.info(self)(message)

    def _copy_for_stateful_objects(self, checkpoint: Any, state: Any, mapped: set[int]) -> int:
        """Give stateful objects other than modules and optimizers a private copy of their entry (what they keep of it
        cannot be found afterwards)."""
        if not isinstance(state, dict) or not isinstance(checkpoint, dict):
            return 0
        stateful = lightning_names(self).Stateful
        others = (torch.nn.Module, torch.optim.Optimizer)
        entries = {
            name: checkpoint[name]
            for name, obj in state.items()
            if name in checkpoint and isinstance(obj, stateful) and not isinstance(obj, others)
        }
        copied = copy_out_of_mapping([entries], mapped)
        checkpoint.update(entries)
        return copied

    @staticmethod
    def _copy_kept(state: Any, remainder: Any, mapped: set[int]) -> int:
        """Copy out of the mapping what the optimizers kept, what the modules kept of their weights instead of copying
        them (a persistent torchmetrics state), the values put into ``state`` and the remainder, in one walk: a tensor
        reachable from several of them gets one shared copy."""
        if isinstance(state, torch.optim.Optimizer):
            return copy_kept_out_of_mapping([state], mapped)
        if isinstance(state, torch.nn.Module):
            return copy_modules_out_of_mapping([state], mapped)
        containers: list[Any] = [remainder]
        modules: list[torch.nn.Module] = []
        if isinstance(state, dict):
            optimizers = [obj for obj in state.values() if isinstance(obj, torch.optim.Optimizer)]
            modules = [obj for obj in state.values() if isinstance(obj, torch.nn.Module)]
            containers += [*optimizer_containers(optimizers), state]
        held, put_back = module_containers(modules, mapped)
        copied = copy_out_of_mapping(containers + held, mapped)
        put_back()
        return copied


class _AlreadyRead:
    """A stand-in ``CheckpointIO`` whose one read returns the checkpoint the rank read in its turn."""

    def __init__(self, checkpoint: Any) -> None:
        self._checkpoint: Any = checkpoint

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        checkpoint, self._checkpoint = self._checkpoint, None
        assert checkpoint is not None, "the checkpoint was read once already"
        return checkpoint
