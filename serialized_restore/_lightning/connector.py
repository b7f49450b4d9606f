"""The serialized checkpoint connector: Lightning's two restore stages, run in turns (``docs/design.md``). Stage 1
reads the checkpoint in the rank's turn, runs upstream's hooks on the complete dict and drops what stage 2 does not
need; stage 2 hands the optimizer state to the optimizers and drops the rest."""

from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from serialized_restore._coordination.placement import RankPlacement
from serialized_restore._coordination.turn_log import TurnRecord
from serialized_restore._coordination.turns import TurnSchedule
from serialized_restore._lightning.callbacks import guard_checkpoint_callbacks, release
from serialized_restore._lightning.names import Owner, flavour_of, lightning_names
from serialized_restore._lightning.strategies import StrategyPath, strategy_path
from serialized_restore._lightning.versions import restores_callbacks_only_when_fitting, weights_only_for
from serialized_restore._restore.fsdp import FULL, load_full_checkpoint, upstream_reason
from serialized_restore._restore.mapping import (
    copy_kept_out_of_mapping,
    copy_modules_out_of_mapping,
    storages_of,
    wait_for_device_copies,
)
from serialized_restore._restore.optimizer_state import Fingerprint, OptimizerSource, converts_on_load, load_in_place
from serialized_restore._restore.plan import Notices, RestorePlan, Source, decide_strategy_path, plan_restore
from serialized_restore._restore.prefetch import Prefetch
from serialized_restore._restore.readers import EAGER, MMAP, LoadedCheckpoint, read_checkpoint
from serialized_restore._restore.remote import NodeLocalCopy
from serialized_restore._restore.stages import Stage
from serialized_restore.settings import SerializedLoading


@dataclass
class _Restore:
    """One serialized restore on one rank; after a failure it stays, holding nothing, until ``resume_end``."""

    weights_only: bool | None
    fitting: bool
    plan: RestorePlan | None = None  # None until every rank decided it
    source: Source | None = None  # what stage 1 reads, and how (TURNS only)
    turns: TurnSchedule | None = None  # stage 1's, taken by stage 2 (TURNS only)
    local_copy: NodeLocalCopy | None = None  # of a remote checkpoint, removed once every rank ended stage 2
    loaded: LoadedCheckpoint | None = None  # how stage 1 read the file (the dict lives in _loaded_checkpoint)
    optimizer_source: OptimizerSource = OptimizerSource.IN_DICT
    fingerprint: Fingerprint | None = None  # of the eagerly read optimizer state before the hooks ran (stage 1)
    guarded: list[Any] = field(default_factory=list)  # checkpoint callbacks that must not save until resume_end
    prefetch: Prefetch | None = None  # (local rank 0) the read of the file ahead of the restore, stopped at its end


class SerializedCheckpointConnectorMixin:
    """Mixed into Lightning's ``_CheckpointConnector``; see the module docstring."""

    trainer: Any
    _loaded_checkpoint: dict[str, Any]
    _ckpt_path: Any
    restore_model: Callable[[], None]
    restore_datamodule: Callable[[], None]
    restore_callbacks: Callable[[], None]

    def __init__(self, trainer: Any, settings: SerializedLoading | None) -> None:
        super().__init__(trainer)  # type: ignore[call-arg]
        self._settings = settings
        self._restore: _Restore | None = None
        self._prefetch: Prefetch | None = None  # started with the entry point, until its restore takes it
        self._notices = Notices()
        self._log = logging.getLogger(f"{flavour_of(self).pytorch}.serialized_restore")

    def _select_ckpt_path(self, *args: Any, **kwargs: Any) -> Any:
        """(every rank, as an entry point starts) Upstream's choice of the checkpoint path; local rank 0 of each node
        starts reading a local file into the page cache, ahead of the restore (``_restore/prefetch.py``)."""
        path = super()._select_ckpt_path(*args, **kwargs)  # type: ignore[misc]
        self._stop_prefetch()  # one an earlier entry point started, whose restore never came
        trainer = self.trainer
        if path and self._settings is not None and trainer.local_rank == 0:
            if strategy_path(trainer.strategy, Owner.TRAINER)[0] is not StrategyPath.UPSTREAM:
                self._prefetch = Prefetch.start(path, trainer.global_rank, self._log)
        return path

    def _stop_prefetch(self, restore: _Restore | None = None) -> None:
        prefetch = restore.prefetch if restore is not None else self._prefetch
        if restore is not None:
            restore.prefetch = None
        else:
            self._prefetch = None
        if prefetch is not None:
            prefetch.stop()

    def _restore_modules_and_callbacks(self, checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> None:
        """(all ranks) Stage 1: read, hooks, weights, datamodule, callbacks, in the rank's turn (FSDP: all together)."""
        if self._restore is not None:
            # an earlier restore whose resume_end never ran (its run failed between the stages): free what it holds
            self._abandon(self._restore)
            release(self._restore.guarded)
        self._restore = None
        if self._settings is None or not checkpoint_path:
            super()._restore_modules_and_callbacks(checkpoint_path, *args, **kwargs)  # type: ignore[misc]
            return
        trainer = self.trainer
        fitting = trainer.state.fn == lightning_names(self).TrainerFn.FITTING
        weights_only = kwargs.get("weights_only", args[0] if args else None)
        restore = self._restore = _Restore(weights_only, fitting, guarded=guard_checkpoint_callbacks(trainer))
        restore.prefetch, self._prefetch = self._prefetch, None
        try:
            value = trainer.serialized_checkpoint_loading
            how = decide_strategy_path(Owner.TRAINER, trainer.strategy, value, self._notices)
            restore.plan = plan = plan_restore(
                Owner.TRAINER, trainer.strategy, RankPlacement.of(trainer), how, value, self._settings,
                checkpoint_path, self._notices, fetch_remote=True,
            )  # fmt: skip
            if plan.strategy_path is StrategyPath.UPSTREAM:
                release(restore.guarded)
                self._stop_prefetch(restore)
                self._restore = None
                super()._restore_modules_and_callbacks(checkpoint_path, *args, **kwargs)  # type: ignore[misc]
                return
            # as upstream's resume_start does first, also on a rank whose turn never comes because another failed
            self._ckpt_path = checkpoint_path
            turns = plan.turns(trainer.strategy, self._log)
            if plan.strategy_path is StrategyPath.FSDP:
                Owner.TRAINER.info(trainer)(upstream_reason(FULL, "", Owner.TRAINER.verb))
                self._restore_fsdp(restore, plan, turns)
                return
            restore.source = source = Source.of(
                trainer.strategy, self._fetch(restore, plan, turns) if plan.fetch else checkpoint_path, plan.settings
            )
            with turns.turn(Stage.MODULES, k=plan.k_to_read(Stage.MODULES, source, self._log), logged=True) as record:
                self._restore_modules(restore)
                if restore.loaded is not None:
                    record.bytes_read, record.reader = restore.loaded.bytes_read, restore.loaded.reader
            restore.turns = turns
            if not fitting:  # the weights, which come first in the file, are read: the rest is never needed
                self._stop_prefetch(restore)
        except BaseException:
            self._abandon(restore)
            raise

    def _fetch(self, restore: _Restore, plan: RestorePlan, turns: TurnSchedule) -> str | None:
        """(all ranks) The node-local copy of a remote checkpoint: local rank 0 of each node downloads it, then every
        rank checks it in a second round, so that a refusal on any rank ends the restore on every rank."""
        restore.local_copy = copy = NodeLocalCopy(plan.checkpoint_path, plan.settings.tmpdir, self._log)
        if plan.placement.local_rank == 0:
            # last resort for a job that dies between the stages: the copy never outlives the process
            atexit.register(copy.remove)
        decision = turns.on_one_rank(
            Stage.FETCH,
            copy.fetch,
            central=plan.placement.local_rank == 0,
            per_node=True,
            doing="downloading the checkpoint",
        )
        # every rank of the node at once, each logging its own check
        with turns.turn(Stage.CHECK, k=plan.placement.local_world_size):
            copy.adopt(decision or "")
        return copy.path

    def _abandon(self, restore: _Restore) -> None:
        """(each rank, after a failed stage) Free what the restore holds; resume_end won't run."""
        self._loaded_checkpoint = {}
        restore.turns = restore.loaded = restore.fingerprint = None
        self._stop_prefetch(restore)
        self._remove_local_copy(restore)

    def _remove_local_copy(self, restore: _Restore) -> None:
        copy, restore.local_copy = restore.local_copy, None
        if copy is not None and self.trainer.local_rank == 0:
            copy.remove()
            atexit.unregister(copy.remove)

    def _restore_fsdp(self, restore: _Restore, plan: RestorePlan, turns: TurnSchedule) -> None:
        """(all ranks together) Stage 1 under FSDP: the full checkpoint rank 0 names, memory-mapped, weights and (fit)
        optimizer state restored (``_restore/fsdp.py``); then upstream's hooks for the rest."""
        self._rank_zero_info(f"Restoring states from the checkpoint path at {plan.checkpoint_path}")
        strategy = self.trainer.strategy
        checkpoint = load_full_checkpoint(strategy, plan.fsdp_path, restore.weights_only, restore.fitting, turns)
        self._loaded_checkpoint = self._migrate(checkpoint, plan.checkpoint_path)
        self._restore_the_rest(restore)

    def _restore_modules(self, restore: _Restore) -> None:
        """(one rank, in its turn) Upstream's stage 1 on the checkpoint read as the source says; then drop what stage 2
        does not need."""
        assert restore.plan is not None and restore.source is not None
        self._rank_zero_info(f"Restoring states from the checkpoint path at {restore.plan.checkpoint_path}")
        restore.loaded = self._read(restore, restore.source)
        self._loaded_checkpoint = restore.loaded.checkpoint
        restore.loaded.checkpoint = {}  # the dict lives in _loaded_checkpoint only
        if restore.fitting and restore.loaded.reader == MMAP:
            restore.optimizer_source = OptimizerSource.COPY_FROM_MAPPING
        elif restore.fitting:
            restore.fingerprint = Fingerprint(self._loaded_checkpoint.get("optimizer_states"))
        self._restore_the_rest(restore)

    def _restore_the_rest(self, restore: _Restore) -> None:
        """Upstream's stage 1 hooks and restores on the loaded dict, then what stage 2 does not need is dropped."""
        mapped = set()
        if restore.loaded is not None and restore.loaded.reader == MMAP:
            mapped = storages_of(self._loaded_checkpoint.get("state_dict"))
        self.restore_model()
        self.restore_datamodule()
        if restore.fitting or not restores_callbacks_only_when_fitting(flavour_of(self)):
            self.restore_callbacks()
        wait_for_device_copies()
        if mapped and self.trainer.lightning_module is not None:
            # what the model kept of the weights instead of copying them (a persistent torchmetrics state)
            copy_modules_out_of_mapping([self.trainer.lightning_module], mapped)
        checkpoint = self._loaded_checkpoint
        if "state_dict" in checkpoint:
            # keep the key, so that the dict never turns empty (upstream skips stage 2 for an empty dict)
            checkpoint["state_dict"] = {}
        if not restore.fitting:
            checkpoint.pop("optimizer_states", None)
            checkpoint.pop("lr_schedulers", None)
        elif restore.fingerprint is not None and "optimizer_states" in checkpoint:
            if Fingerprint(checkpoint["optimizer_states"]) == restore.fingerprint:
                del checkpoint["optimizer_states"]
                restore.optimizer_source = OptimizerSource.READ_AGAIN
            else:
                self._log.info(
                    "serialized restore: a hook changed checkpoint['optimizer_states']; keeping it in memory until"
                    " the optimizers are restored instead of reading it again."
                )
        restore.fingerprint = None

    def restore_training_state(self) -> None:
        """(all ranks) Stage 2: precision plugin, loops, optimizers, lr schedulers; then drop the rest. In turns only
        where it may allocate memory it frees again (optimizer state read again, a ``load_state_dict`` not torch's, a
        dtype conversion); otherwise the node's ranks at once (failures still reach every rank)."""
        restore = self._restore
        turns = restore.turns if restore is not None else None
        if restore is None or turns is None:
            super().restore_training_state()  # type: ignore[misc]
            return
        restore.turns = None
        try:
            k = None
            if restore.fitting and restore.plan is not None:
                k = restore.plan.k_for(Stage.TRAINING_STATE, *self._stage_2_bounds_memory(restore), self._log)
            with turns.turn(Stage.TRAINING_STATE, k=k, logged=restore.fitting) as record:
                mapped = self._prepare_optimizer_states(restore, record)
                try:
                    super().restore_training_state()  # type: ignore[misc]
                finally:
                    # also when a later step failed: no optimizer keeps pages of the file (which may be deleted)
                    if mapped:
                        record.bytes_copied = copy_kept_out_of_mapping(self.trainer.optimizers, mapped)
                wait_for_device_copies()
                self._loaded_checkpoint = {}
        except BaseException:
            self._abandon(restore)
            raise
        # every rank of the job has ended the stage: nobody reads the local copy any more
        self._remove_local_copy(restore)

    def _stage_2_bounds_memory(self, restore: _Restore) -> tuple[bool, str]:
        """(fit) Whether loading the optimizer state allocates memory it frees again, so that turns bound it; why."""
        optimizers = self.trainer.optimizers
        if restore.optimizer_source is OptimizerSource.READ_AGAIN:
            return True, "the optimizer state is read again from the file"
        if not load_in_place(optimizers):
            return True, "an optimizer's load_state_dict is not torch's own and may copy what it is given"
        if converts_on_load(optimizers, self._loaded_checkpoint.get("optimizer_states")):
            return True, "loading converts saved optimizer state to its parameters' dtype, through a copy"
        return False, "the optimizers keep the state they are given; a rank copies out of the mapping what it keeps"

    def _prepare_optimizer_states(self, restore: _Restore, record: TurnRecord) -> set[int]:
        """Give the cached dict its optimizer state (read again where stage 1 dropped it); the mapped storages to copy
        out of once the optimizers are loaded."""
        if not restore.fitting:
            return set()
        source, restore.optimizer_source = restore.optimizer_source, OptimizerSource.IN_DICT
        if source is OptimizerSource.READ_AGAIN:
            assert restore.source is not None
            reread = self._read(restore, Source(restore.source.path, EAGER))
            self._loaded_checkpoint["optimizer_states"] = reread.checkpoint["optimizer_states"]
            record.bytes_read, record.reader = reread.bytes_read, reread.reader
        elif source is OptimizerSource.COPY_FROM_MAPPING and "optimizer_states" in self._loaded_checkpoint:
            return storages_of(self._loaded_checkpoint["optimizer_states"])
        return set()

    def resume_end(self) -> None:
        restore, self._restore = self._restore, None
        if restore is not None:
            self._stop_prefetch(restore)
            self._remove_local_copy(restore)
            release(restore.guarded)
        super().resume_end()  # type: ignore[misc]

    def _read(self, restore: _Restore, source: Source) -> LoadedCheckpoint:
        """(one rank, inside its turn) Read and migrate the whole checkpoint (or the checked local copy of it)."""
        assert restore.plan is not None
        path = restore.plan.checkpoint_path
        read = restore.local_copy.checked_path() if restore.local_copy is not None else source.path
        # the local copy of a URL is read as upstream reads the URL
        weights_only = weights_only_for(path, restore.weights_only)
        with lightning_names(self).pl_legacy_patch():
            loaded = read_checkpoint(self.trainer.strategy, read, weights_only, source.reader, source.reason, self._log)
        loaded.checkpoint = self._migrate(loaded.checkpoint, path)
        return loaded

    def _migrate(self, checkpoint: dict[str, Any], checkpoint_path: Any) -> dict[str, Any]:
        return lightning_names(self).pl_migrate_checkpoint(checkpoint, checkpoint_path)

    def _rank_zero_info(self, message: str) -> None:
        Owner.TRAINER.info(self)(message)
