"""The serialized checkpoint connector: Lightning's two restore stages, run in turns (``docs/design.md``). Stage 1
reads the checkpoint in the rank's turn, runs upstream's hooks on the complete dict and drops what stage 2 does not
need; stage 2 hands the optimizer state to the optimizers and drops the rest."""

from __future__ import annotations

import atexit
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from serialized_restore._compat import restores_callbacks_only_when_fitting, weights_only_for
from serialized_restore._flavour import flavour_of, lightning_names
from serialized_restore._fsdp import FULL, load_full_checkpoint, upstream_reason
from serialized_restore._memory import TurnRecord
from serialized_restore._optimizer_state import Fingerprint, OptimizerSource, converts_on_load, load_in_place
from serialized_restore._options import SerializedLoading
from serialized_restore._plan import RestorePlan, StrategyPath, plan_restore
from serialized_restore._readers import (
    LoadedCheckpoint,
    copy_kept_out_of_mapping,
    read_checkpoint,
    storages_of,
    wait_for_device_copies,
)
from serialized_restore._remote import STAGE_CHECK, NodeLocalCopy
from serialized_restore._turns import TurnSchedule

STAGE_FETCH = "fetch checkpoint"
STAGE_MODULES = "restore modules and callbacks"
STAGE_TRAINING_STATE = "restore training state"


@dataclass
class _Restore:
    """One serialized restore on one rank; after a failure it stays, holding nothing, until ``resume_end``."""

    weights_only: bool | None
    fitting: bool
    plan: RestorePlan | None = None  # None until every rank decided it
    schedule: TurnSchedule | None = None  # stage 1's, taken by stage 2 (TURNS only)
    local_copy: NodeLocalCopy | None = None  # of a remote checkpoint, removed once every rank ended stage 2
    loaded: LoadedCheckpoint | None = None  # how stage 1 read the file (the dict lives in _loaded_checkpoint)
    optimizer_source: OptimizerSource = OptimizerSource.IN_DICT
    fingerprint: Fingerprint | None = None  # of the eagerly read optimizer state before the hooks ran (stage 1)
    guarded: list[Any] = field(default_factory=list)  # checkpoint callbacks that must not save until resume_end


class _SerializedCheckpointConnectorMixin:
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
        self._warned_strategies: set[type] = set()
        self._log = logging.getLogger(f"{flavour_of(self).pytorch}.serialized_restore")

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
        fitting = self.trainer.state.fn == lightning_names(self).TrainerFn.FITTING
        weights_only = kwargs.get("weights_only", args[0] if args else None)
        restore = self._restore = _Restore(weights_only, fitting, guarded=guard_checkpoint_callbacks(self.trainer))
        try:
            restore.plan = plan = plan_restore(
                self.trainer, "Trainer", self.trainer.serialized_checkpoint_loading, self._settings, checkpoint_path,
                self._warned_strategies, self._log, fetch_remote=True,
            )  # fmt: skip
            if plan.strategy_path is StrategyPath.UPSTREAM:
                release(restore.guarded)
                self._restore = None
                super()._restore_modules_and_callbacks(checkpoint_path, *args, **kwargs)  # type: ignore[misc]
                return
            # as upstream's resume_start does first, also on a rank whose turn never comes because another failed
            self._ckpt_path = checkpoint_path
            if plan.strategy_path is StrategyPath.FSDP:
                self._rank_zero_info(upstream_reason(FULL, "", "restore"))
                self._restore_modules(restore, plan)
                return
            if plan.fetch:
                plan.read_from(self._fetch(restore, plan))
            schedule = plan.schedule(in_turns=True)
            with schedule.turn(STAGE_MODULES, ordered=plan.reads_in_turns(STAGE_MODULES), logged=True) as record:
                self._restore_modules(restore, plan)
                if restore.loaded is not None:
                    record.bytes_read, record.reader = restore.loaded.bytes_read, restore.loaded.reader
            restore.schedule = schedule
        except BaseException:
            self._abandon(restore)
            raise

    def _fetch(self, restore: _Restore, plan: RestorePlan) -> str | None:
        """(all ranks) The node-local copy of a remote checkpoint: local rank 0 of each node downloads it, then every
        rank checks it in a second round, so that a refusal on any rank ends the restore on every rank."""
        schedule = plan.schedule()
        restore.local_copy = copy = NodeLocalCopy(plan.checkpoint_path, plan.settings.tmpdir, self._log)
        if self.trainer.local_rank == 0:
            # last resort for a job that dies between the stages: the copy never outlives the process
            atexit.register(copy.remove)
        decision = schedule.on_one_rank(
            STAGE_FETCH,
            copy.fetch,
            central=self.trainer.local_rank == 0,
            per_node=True,
            doing="downloading the checkpoint",
        )
        with schedule.turn(STAGE_CHECK):
            copy.adopt(decision or "")
        return copy.path

    def _abandon(self, restore: _Restore) -> None:
        """(each rank, after a failed stage) Free what the restore holds; resume_end won't run."""
        self._loaded_checkpoint = {}
        restore.schedule = restore.loaded = restore.fingerprint = None
        self._remove_local_copy(restore)

    def _remove_local_copy(self, restore: _Restore) -> None:
        copy, restore.local_copy = restore.local_copy, None
        if copy is not None and self.trainer.local_rank == 0:
            copy.remove()
            atexit.unregister(copy.remove)

    def _restore_modules(self, restore: _Restore, plan: RestorePlan) -> None:
        """Upstream's stage 1 with the plan's reader; then drop what stage 2 does not need."""
        path = plan.checkpoint_path
        self._rank_zero_info(f"Restoring states from the checkpoint path at {path}")
        if plan.strategy_path is StrategyPath.FSDP:
            strategy = self.trainer.strategy
            checkpoint = load_full_checkpoint(strategy, path, restore.weights_only, restore.fitting, plan.schedule())
            self._loaded_checkpoint = self._migrate(checkpoint, path)
        else:
            restore.loaded = self._read(restore, plan.reader, plan.reason)
            self._loaded_checkpoint = restore.loaded.checkpoint
            restore.loaded.checkpoint = {}  # the dict lives in _loaded_checkpoint only
            if restore.fitting and restore.loaded.reader == "mmap":
                restore.optimizer_source = OptimizerSource.COPY_FROM_MAPPING
            elif restore.fitting:
                restore.fingerprint = Fingerprint(self._loaded_checkpoint.get("optimizer_states"))
        self.restore_model()
        self.restore_datamodule()
        if restore.fitting or not restores_callbacks_only_when_fitting(flavour_of(self)):
            self.restore_callbacks()
        wait_for_device_copies()
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
        dtype conversion); otherwise the node's ranks at once (``ordered=False``: failures still reach every rank)."""
        restore = self._restore
        schedule = restore.schedule if restore is not None else None
        if restore is None or schedule is None:
            super().restore_training_state()  # type: ignore[misc]
            return
        restore.schedule = None
        try:
            in_turns = (
                restore.fitting
                and restore.plan is not None
                and restore.plan.in_turns(STAGE_TRAINING_STATE, *self._stage_2_bounds_memory(restore))
            )
            with schedule.turn(STAGE_TRAINING_STATE, ordered=in_turns, logged=restore.fitting) as record:
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
            reread = self._read(restore, "eager")
            self._loaded_checkpoint["optimizer_states"] = reread.checkpoint["optimizer_states"]
            record.bytes_read, record.reader = reread.bytes_read, reread.reader
        elif source is OptimizerSource.COPY_FROM_MAPPING and "optimizer_states" in self._loaded_checkpoint:
            return storages_of(self._loaded_checkpoint["optimizer_states"])
        return set()

    def resume_end(self) -> None:
        restore, self._restore = self._restore, None
        if restore is not None:
            self._remove_local_copy(restore)
            release(restore.guarded)
        super().resume_end()  # type: ignore[misc]

    def _read(self, restore: _Restore, reader: str, reason: str | None = None) -> LoadedCheckpoint:
        """(one rank, inside its turn) Read and migrate the whole checkpoint (or the checked local copy of it)."""
        assert restore.plan is not None
        path = restore.plan.checkpoint_path
        source = restore.local_copy.checked_path() if restore.local_copy is not None else path
        # the local copy of a URL is read as upstream reads the URL
        weights_only = weights_only_for(path, restore.weights_only)
        with lightning_names(self).pl_legacy_patch():
            loaded = read_checkpoint(self.trainer.strategy, source, weights_only, reader, reason, self._log)
        loaded.checkpoint = self._migrate(loaded.checkpoint, path)
        return loaded

    def _migrate(self, checkpoint: dict[str, Any], checkpoint_path: Any) -> dict[str, Any]:
        return lightning_names(self).pl_migrate_checkpoint(checkpoint, checkpoint_path)

    def _rank_zero_info(self, message: str) -> None:
        lightning_names(self).rank_zero_info(message)


def guard_checkpoint_callbacks(trainer: Any) -> list[Any]:
    """(each rank, as a serialized restore starts) Until :func:`release`, the checkpoint callbacks that would save in
    ``on_exception`` warn instead: a failure before the restore ends would save a partly restored model."""
    names = lightning_names(trainer)
    checkpoint_cls, model_checkpoint_cls, callback_cls = names.Checkpoint, names.ModelCheckpoint, names.Callback

    def saves_on_exception(callback: Any) -> bool:
        own = getattr(type(callback), "on_exception", None)
        if own is callback_cls.on_exception or not inspect.isfunction(own):
            # not a method of its class (a `Mock(spec=ModelCheckpoint)`): called as upstream calls it
            return False
        if own is model_checkpoint_cls.on_exception:
            return bool(getattr(callback, "save_on_exception", False))
        return True

    guarded = [cb for cb in trainer.callbacks if isinstance(cb, checkpoint_cls) and saves_on_exception(cb)]
    warned: list[bool] = []

    def on_exception(*args: Any, **kwargs: Any) -> None:
        if not warned:
            warned.append(True)
            names.rank_zero_warn(
                f"The checkpoint restore did not complete, so {', '.join(type(cb).__name__ for cb in guarded)} will"
                " not save a checkpoint of the partly restored model."
            )

    for callback in guarded:
        callback.on_exception = on_exception  # the instance's: the class's shows through again once released
    return guarded


def release(callbacks: list[Any]) -> None:
    """(each rank) Give ``callbacks`` their own ``on_exception`` back."""
    for callback in callbacks:
        callback.__dict__.pop("on_exception", None)
