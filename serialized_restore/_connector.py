"""The serialized checkpoint connector: Lightning's two restore stages, run in turns.

Lightning restores a checkpoint in two stages (``trainer/connectors/checkpoint_connector.py``):

1. ``_restore_modules_and_callbacks`` before ``strategy.setup``: read the file, ``LightningModule.on_load_checkpoint``,
   the model weights, the datamodule, the callbacks.
2. ``restore_training_state`` after it: precision plugin, loops, and for ``fit`` the optimizers and lr schedulers.

then ``resume_end`` drops the cached checkpoint dict. Upstream, every rank holds the whole dict from stage 1 to
``resume_end``: N copies per node. Here, with ``serialized_checkpoint_loading`` on, both stages run as turns of
:class:`~serialized_restore._turns.TurnSchedule` and memory is released as soon as it is no longer needed:

* stage 1, in the rank's turn: the checkpoint is read (``_read``), the hooks run in upstream order on the complete
  dict, the weights are copied into the model. At the end of the turn the rank drops the model ``state_dict`` and,
  for validate/test/predict, the optimizer and lr scheduler states; for ``fit`` it keeps of the optimizer state only
  what stage 2 needs (``OptimizerSource``).
* stage 2, in the rank's turn: the optimizer state is handed to the optimizers (``_prepare_optimizer_states``), and
  the rest of the cached dict is dropped at the end of the turn.

Strategies whose restore runs collectives, which cannot run inside a turn, take other paths (``_choose_path``).

Where things live: a restore's state (its path through the code, its schedule, how the file was read, where the
optimizer state will come from) is one ``_Restore`` object, created when stage 1 starts and dropped at
``resume_end``.
"""

from __future__ import annotations

import atexit
import enum
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from serialized_restore._flavour import flavour_of
from serialized_restore._fsdp import FULL, checkpoint_kind, fsdp_strategy_class, load_full_checkpoint, upstream_reason
from serialized_restore._options import RestoreOptions
from serialized_restore._plan import decide_max_concurrent, job_schedule, local_world_size, placement_of
from serialized_restore._readers import (
    LoadedCheckpoint,
    copy_kept_out_of_mapping,
    read_checkpoint,
    storages_of,
    wait_for_device_copies,
)
from serialized_restore._remote import STAGE_CHECK, NodeLocalCopy, is_remote
from serialized_restore._turns import RankPlacement, TurnRecord, TurnSchedule

# series: remote
STAGE_FETCH = "fetch checkpoint"
# series: end
STAGE_MODULES = "restore modules and callbacks"
STAGE_TRAINING_STATE = "restore training state"

# the methods through which a strategy restores; a subclass that overrides any of them may run collectives there
_RESTORE_METHODS = ("load_checkpoint", "load_model_state_dict", "load_optimizer_state_dict")


class RestorePath(enum.Enum):
    """How the option restores with the trainer's strategy (``_choose_path``)."""

    TURNS = "turns"
    """Single device and the DDP family: both stages in per-node turns."""
    # series: fsdp
    FSDP_FULL = "fsdp-full"
    """FSDP and a full checkpoint: every rank together, memory-mapped (``_fsdp.py``)."""
    # series: end
    UPSTREAM = "upstream"
    """Anything else, or the option off: upstream's restore, untouched."""


class OptimizerSource(enum.Enum):
    """Where stage 2 takes the optimizer state from (fit only)."""

    IN_DICT = "in the dict"
    """Already in private memory in the cached dict (read eagerly and changed by a hook, or the strategy's own
    copy)."""
    # series: mmap
    COPY_FROM_MAPPING = "copy from the mapping"
    """Views of the memory-mapped file: handed to the optimizers, and what they keep of it copied into private memory
    in the rank's stage-2 turn."""
    # series: end
    READ_AGAIN = "read again"
    """Read eagerly and dropped after stage 1 (no hook changed it): read the file again in the stage-2 turn."""


@dataclass
class _Restore:
    """One serialized restore on one rank: created when stage 1 starts, dropped at ``resume_end``.

    After a failure it stays, holding nothing (what it held is freed at once), so that
    ``restore_incomplete`` keeps saying that the model may be partly restored until the next restore or
    ``resume_end``.
    """

    path: Any
    how: RestorePath
    weights_only: bool | None
    fitting: bool
    schedule: TurnSchedule | None = None
    """Stage 1's schedule, taken by stage 2 (``TURNS`` only); ``None`` once stage 2 started or after a failure."""
    # series: remote
    local_copy: NodeLocalCopy | None = None
    """The node's private copy of a remote checkpoint, removed once every rank ended stage 2."""
    # series: end
    reading: bool = False
    """Inside stage 1's ``resume_start``: read with this restore's reader, not upstream's."""
    loaded: LoadedCheckpoint | None = None
    """How stage 1 read the file (the dict itself lives in ``_loaded_checkpoint``, as upstream)."""
    optimizer_source: OptimizerSource = OptimizerSource.IN_DICT
    fingerprint: _Fingerprint | None = None
    """Of the eagerly read optimizer state before the hooks ran, until stage 1's turn ends."""
    failed: bool = False

    @property
    def reader(self) -> str:
        return self.loaded.reader if self.loaded is not None else ""

    def read_path(self) -> Any:
        """Where the rank reads: the path given, or the checked copy the restore made of it."""
        # series: remote
        if self.local_copy is not None:
            return self.local_copy.checked_path()
        # series: end
        return self.path


class _SerializedCheckpointConnectorMixin:
    """Mixed into Lightning's ``_CheckpointConnector``; see the module docstring.

    A restore's state lives in one ``_Restore`` (``self._restore``); every method below says which ranks call it.
    """

    trainer: Any
    _loaded_checkpoint: dict[str, Any]
    _ckpt_path: Any

    def __init__(self, trainer: Any, options: RestoreOptions) -> None:
        super().__init__(trainer)  # type: ignore[call-arg]
        self._options = options
        self._restore: _Restore | None = None
        self._warned_strategies: set[type] = set()
        flavour = flavour_of(self)
        self._log = logging.getLogger(f"{flavour.pytorch}.serialized_restore")

    @property
    def restore_incomplete(self) -> bool:
        """True from the start of a serialized restore until ``resume_end``, also after it failed: the model may be
        partly restored, so no checkpoint of it must be saved (``Trainer._run``)."""
        return self._restore is not None

    # ------------------------------------------------------------- stage 1

    def _restore_modules_and_callbacks(self, checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
        """(all ranks) Stage 1 in turns: read, hooks, weights, datamodule, callbacks; then free the rest.

        Memory: a rank reads in its turn (what that costs: ``_read``) and at the end of the turn keeps only what
        stage 2 needs: for fit, what ``OptimizerSource`` says of the optimizer state; otherwise nothing of the
        checkpoint's tensors.
        """
        if self._restore is not None:
            # an earlier restore whose resume_end never ran (its run failed between the stages): free what it holds
            self._abandon(self._restore)
        self._restore = None
        how = self._choose_path(checkpoint_path) if checkpoint_path and self._options.enabled else RestorePath.UPSTREAM
        if how is RestorePath.UPSTREAM:
            super()._restore_modules_and_callbacks(checkpoint_path, weights_only)  # type: ignore[misc]
            return
        restore = self._restore = _Restore(checkpoint_path, how, weights_only, self._fitting())
        # series: fsdp
        if how is RestorePath.FSDP_FULL:
            self._restore_fsdp_full(restore)
            return
        # series: end
        # as upstream's resume_start does first, also on a rank whose turn never comes because another rank failed
        self._ckpt_path = checkpoint_path
        try:
            # series: remote
            if is_remote(checkpoint_path):
                self._fetch(restore)
            # series: end
            # series: auto
            schedule = self._make_schedule(checkpoint_path, self._decide_max_concurrent(restore))
            # series: before auto
            # assert self._options.max_concurrent is not None  # the option is on
            # schedule = self._make_schedule(checkpoint_path, self._options.max_concurrent)
            # series: end
            note_one_rank_per_node(schedule.placement, self._rank_zero_info)
            with schedule.turn(STAGE_MODULES) as record:
                restore.reading = True
                try:
                    super()._restore_modules_and_callbacks(checkpoint_path, weights_only)  # type: ignore[misc]
                finally:
                    restore.reading = False
                if restore.loaded is not None:
                    record.bytes_read, record.reader = restore.loaded.bytes_read, restore.reader
                self._release_after_modules(restore)
        except BaseException:
            self._abandon(restore)
            raise
        restore.schedule = schedule

    # series: remote
    def _fetch(self, restore: _Restore) -> None:
        """(all ranks) Local rank 0 of each node downloads the remote checkpoint into a new private directory; every
        rank of the node takes its path from the store and checks it, in a second round, so that a refusal on any
        rank ends the restore on every rank."""
        schedule = self._make_schedule(restore.path, local_world_size(self.trainer.strategy))
        # SerializedLoading.tmpdir, else the system's temporary directory
        restore.local_copy = copy = NodeLocalCopy(restore.path, self._options.tmpdir, self._log)
        if self.trainer.local_rank == 0:
            # last resort for a job that dies between the stages: the copy never outlives the process
            atexit.register(copy.remove)
        decision = schedule.decide_per_node(STAGE_FETCH, copy.fetch)
        with schedule.turn(STAGE_CHECK):
            copy.adopt(decision)

    # series: end

    def _abandon(self, restore: _Restore) -> None:
        """(each rank, after a failed stage) Free what the restore holds; resume_end won't run."""
        self._loaded_checkpoint = {}
        restore.failed = True
        restore.schedule = restore.loaded = restore.fingerprint = None
        # series: remote
        self._remove_local_copy(restore)

    def _remove_local_copy(self, restore: _Restore) -> None:
        copy, restore.local_copy = restore.local_copy, None
        if copy is not None and self.trainer.local_rank == 0:
            copy.remove()
            atexit.unregister(copy.remove)
        # series: end

    # series: fsdp
    def _restore_fsdp_full(self, restore: _Restore) -> None:
        """(all ranks together) Stage 1 for FSDP and a full checkpoint: see ``_fsdp.py``; no turns (collectives).

        Memory: each rank copies into private memory only its shard of the weights and of the optimizer state, one
        unit at a time; the rest stays in the mapped file's pages, shared by the node's ranks."""
        self._rank_zero_info(
            "serialized restore: FSDP restores with collectives, so its ranks restore together instead of in turns;"
            " the full checkpoint is memory-mapped and each rank copies only its shard of the optimizer state."
        )
        restore.reading = True
        try:
            super()._restore_modules_and_callbacks(restore.path, restore.weights_only)  # type: ignore[misc]
            self._release_after_modules(restore)
        except BaseException:
            self._abandon(restore)
            raise
        finally:
            restore.reading = False

    # series: end
    def resume_start(self, checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
        """Upstream's ``resume_start``, except inside a serialized restore's stage 1: then read the restore's way (for
        ``TURNS``, with ``_read`` in the rank's turn)."""
        restore = self._restore
        if restore is None or not restore.reading:
            super().resume_start(checkpoint_path, weights_only)  # type: ignore[misc]
            return
        self._ckpt_path = checkpoint_path
        self._rank_zero_info(f"Restoring states from the checkpoint path at {checkpoint_path}")
        # series: fsdp
        if restore.how is RestorePath.FSDP_FULL:
            strategy = self.trainer.strategy
            schedule = self._make_schedule(checkpoint_path, local_world_size(strategy))
            checkpoint = load_full_checkpoint(strategy, checkpoint_path, weights_only, restore.fitting, schedule)
            restore.loaded = LoadedCheckpoint({}, "mmap", 0)
            self._loaded_checkpoint = self._migrate(checkpoint, checkpoint_path)
            return
        # series: end
        # series: mmap
        restore.loaded = self._read(restore, self._options.reader)
        # series: before mmap
        # restore.loaded = self._read(restore)
        # series: end
        self._loaded_checkpoint = restore.loaded.checkpoint
        restore.loaded.checkpoint = {}  # the dict lives in _loaded_checkpoint only
        if restore.fitting:
            # series: mmap
            if restore.reader == "mmap":
                restore.optimizer_source = OptimizerSource.COPY_FROM_MAPPING
            else:
                restore.fingerprint = _Fingerprint(self._loaded_checkpoint.get("optimizer_states"))
            # series: before mmap
            # restore.fingerprint = _Fingerprint(self._loaded_checkpoint.get("optimizer_states"))
            # series: end

    def _release_after_modules(self, restore: _Restore) -> None:
        """(one rank, end of its stage-1 turn) Drop what the second stage does not need."""
        wait_for_device_copies()
        checkpoint = self._loaded_checkpoint
        if "state_dict" in checkpoint:
            # keep the key, so that the dict never turns empty (upstream skips stage 2 for an empty dict)
            checkpoint["state_dict"] = {}
        if not restore.fitting:
            checkpoint.pop("optimizer_states", None)
            checkpoint.pop("lr_schedulers", None)
        elif restore.fingerprint is not None and "optimizer_states" in checkpoint:
            if _Fingerprint(checkpoint["optimizer_states"]) == restore.fingerprint:
                del checkpoint["optimizer_states"]
                restore.optimizer_source = OptimizerSource.READ_AGAIN
            else:
                self._log.info(
                    "serialized restore: a hook changed checkpoint['optimizer_states']; keeping it in memory until"
                    " the optimizers are restored instead of reading it again."
                )
        restore.fingerprint = None

    # ------------------------------------------------------------- stage 2

    def restore_training_state(self) -> None:
        """(all ranks) Stage 2 in turns: precision plugin, loops, optimizers, lr schedulers; then free the rest.

        Memory: for fit, a rank's private memory grows by the optimizer state its optimizers keep
        (``_prepare_optimizer_states``); the rest of the cached dict is dropped at the end of its turn. The stage runs
        in turns where it may allocate memory it then frees: when the optimizer state is read again, and when an
        optimizer's ``load_state_dict`` is not torch's own (a ``ZeroRedundancyOptimizer`` or fairscale ``OSS`` copies
        the state it is given before keeping its shard). Otherwise (torch's ``load_state_dict``, which keeps the
        given tensors or moves them to the parameter's device, so that every byte allocated is one the optimizers
        keep; or outside ``fit``, where the cached dict holds neither weights nor optimizer state by now) the ranks
        of a node run it at once (``ordered=False``: failures still reach every rank).
        """
        restore = self._restore
        schedule = restore.schedule if restore is not None else None
        if restore is None or schedule is None:
            super().restore_training_state()  # type: ignore[misc]
            return
        restore.schedule = None
        try:
            in_turns = restore.fitting and (
                restore.optimizer_source is OptimizerSource.READ_AGAIN
                or not _load_in_place(self.trainer.optimizers)
                or _converts_on_load(self.trainer.optimizers, self._loaded_checkpoint.get("optimizer_states"))
            )
            with schedule.turn(STAGE_TRAINING_STATE, ordered=in_turns, logged=restore.fitting) as record:
                # series: mmap
                mapped = self._prepare_optimizer_states(restore, record)
                try:
                    super().restore_training_state()  # type: ignore[misc]
                finally:
                    # also when a later step failed: no optimizer keeps pages of the file (which may be deleted)
                    if mapped:
                        record.bytes_copied = copy_kept_out_of_mapping(self.trainer.optimizers, mapped)
                # series: before mmap
                # self._prepare_optimizer_states(restore, record)
                # super().restore_training_state()  # type: ignore[misc]
                # series: end
                wait_for_device_copies()
                self._loaded_checkpoint = {}
        except BaseException:
            self._abandon(restore)
            raise
        # series: remote
        # every rank of the job has ended the stage: nobody reads the local copy any more
        self._remove_local_copy(restore)
        # series: end

    # series: mmap
    def _prepare_optimizer_states(self, restore: _Restore, record: TurnRecord) -> set[int]:
        """Give the cached dict its optimizer state: read it again where stage 1 dropped it (counted in ``record``);
        memory-mapped, return the storages of the file it hands the optimizers, whose tensors the optimizers keep are
        copied once they are loaded (``copy_kept_out_of_mapping``: a sharded optimizer's rank copies only its shard,
        and state moved to a GPU is no host copy at all)."""
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

    # series: before mmap
    # def _prepare_optimizer_states(self, restore: _Restore, record: TurnRecord) -> None:
    #     """Give the cached dict its optimizer state: read it again where stage 1 dropped it (counted in ``record``).
    #     It stays as stage 1 left it where a hook changed it."""
    #     if not restore.fitting:
    #         return
    #     source, restore.optimizer_source = restore.optimizer_source, OptimizerSource.IN_DICT
    #     if source is OptimizerSource.READ_AGAIN:
    #         reread = self._read(restore)
    #         self._loaded_checkpoint["optimizer_states"] = reread.checkpoint["optimizer_states"]
    #         record.bytes_read, record.reader = reread.bytes_read, reread.reader
    #
    # series: end

    def resume_end(self) -> None:
        # series: remote
        restore, self._restore = self._restore, None
        if restore is not None:
            self._remove_local_copy(restore)
        # series: before remote
        # self._restore = None
        # series: end
        super().resume_end()  # type: ignore[misc]

    # ------------------------------------------------------------- helpers

    # series: mmap
    def _read(self, restore: _Restore, reader: str) -> LoadedCheckpoint:
        """(one rank, inside its turn) Read and migrate the whole checkpoint with ``reader``."""
        strategy, source = self.trainer.strategy, restore.read_path()
        with flavour_of(self).import_("utilities.migration", "pl_legacy_patch")():
            loaded = read_checkpoint(strategy, source, restore.weights_only, reader, self._log)
        # series: before mmap
        # def _read(self, restore: _Restore) -> LoadedCheckpoint:
        #     """(one rank, inside its turn) Read and migrate the whole checkpoint."""
        #     strategy, source = self.trainer.strategy, restore.read_path()
        #     with flavour_of(self).import_("utilities.migration", "pl_legacy_patch")():
        #         loaded = read_checkpoint(strategy, source, restore.weights_only)
        # series: end
        loaded.checkpoint = self._migrate(loaded.checkpoint, restore.path)
        return loaded

    def _migrate(self, checkpoint: dict[str, Any], checkpoint_path: Any) -> dict[str, Any]:
        migrate = flavour_of(self).import_("utilities.migration.utils", "_pl_migrate_checkpoint")
        return migrate(checkpoint, checkpoint_path)

    def _fitting(self) -> bool:
        return self.trainer.state.fn == flavour_of(self).import_("trainer.states", "TrainerFn").FITTING

    def _rank_zero_info(self, message: str) -> None:
        flavour_of(self).import_("utilities.rank_zero", "rank_zero_info")(message)

    def _choose_path(self, checkpoint_path: Any) -> RestorePath:
        """(all ranks) How the option restores with this strategy (``RestorePath``).

        In turns only where the strategy restores without collectives: single device and the DDP family. A subclass
        that overrides a restore method of its base may run collectives there, so it, and any other strategy without
        a path of its own, is restored as upstream with one warning on rank zero.
        """
        strategy = self.trainer.strategy
        flavour = flavour_of(self)
        bases: list[type] = [
            flavour.import_("strategies", "DDPStrategy"),
            flavour.import_("strategies", "SingleDeviceStrategy"),
        ]
        # series: fsdp
        fsdp = fsdp_strategy_class(strategy)
        bases.append(fsdp)
        # series: end
        base = next((b for b in bases if isinstance(strategy, b)), None)
        overridden = [m for m in _RESTORE_METHODS if getattr(type(strategy), m) is not getattr(base, m)] if base else []
        # series: fsdp
        if base is fsdp and not overridden:
            # FSDP's own load_checkpoint broadcasts the path from rank 0 first: every rank decides on the same path
            kind, why = checkpoint_kind(strategy, strategy.broadcast(checkpoint_path))
            if kind == FULL:
                return RestorePath.FSDP_FULL
            self._rank_zero_info(upstream_reason(kind, why, "restore"))
            return RestorePath.UPSTREAM
        # series: end
        if base is not None and not overridden and not strategy.restore_checkpoint_after_setup:
            return RestorePath.TURNS
        if type(strategy) not in self._warned_strategies:
            self._warned_strategies.add(type(strategy))
            why = (
                f"it overrides {', '.join(overridden)}"
                if overridden
                else "its restore may run collectives, which cannot run while ranks take turns"
            )
            flavour.import_("utilities.rank_zero", "rank_zero_warn")(
                f"`Trainer(serialized_checkpoint_loading={self._options.value!r})` has no effect with"
                f" {type(strategy).__name__}: {why}. The checkpoint is restored as upstream Lightning does."
            )
        return RestorePath.UPSTREAM

    # series: auto
    def _decide_max_concurrent(self, restore: _Restore) -> int:
        """(all ranks) ``k`` as given, or for ``"auto"`` as local rank 0 of the node chose it (``_plan.py``)."""
        source = restore.path
        # series: remote
        if restore.local_copy is not None:
            source = restore.local_copy.path
        # series: end
        return decide_max_concurrent(
            self._options, self.trainer.strategy, self._placement(), restore.path, source, self._log
        )

    # series: end

    def _make_schedule(self, checkpoint_path: Any, max_concurrent: int) -> TurnSchedule:
        """(all ranks) A schedule over the job's default store (none for a single process)."""
        return job_schedule(self._placement(), checkpoint_path, max_concurrent, self._options, self._log)

    def _placement(self) -> RankPlacement:
        return placement_of(self.trainer, self.trainer.strategy)


class _Fingerprint:
    """A cheap structural snapshot: tensors by identity and version counter, plain leaves by value.

    Two snapshots are equal when nothing was added, removed, replaced or changed in place in between. The tensors
    themselves are referenced so that their ``id`` cannot be reused while the snapshot lives.
    """

    def __init__(self, obj: Any) -> None:
        self.shape: list[Any] = []
        self._tensors: list[torch.Tensor] = []
        self._visit(obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Fingerprint) and self.shape == other.shape

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


def _load_in_place(optimizers: list[Any]) -> bool:
    """Whether every optimizer's ``load_state_dict`` is torch's own, which keeps each given state tensor (or a copy
    of it on the parameter's device or in its dtype) and allocates nothing it frees again."""
    return all(type(optimizer).load_state_dict is torch.optim.Optimizer.load_state_dict for optimizer in optimizers)


def _converts_on_load(optimizers: list[Any], states: Any) -> bool:
    """Whether torch's ``load_state_dict`` converts a saved floating-point state tensor to its parameter's dtype (an
    fp32 state into a bf16 model): the conversion allocates a host temporary (before a copy to the GPU, the whole
    tensor), so the ranks of a node must not do it at once. Saved state is matched to parameters as torch matches it:
    the saved ``param_groups``' ids, in order, to the optimizer's parameters."""
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


_NOTED: set[str] = set()
"""Notes already logged by this process."""


def note_one_rank_per_node(placement: RankPlacement, info: Callable[[str], None]) -> None:
    """(every rank; ``info`` logs on global rank 0) Say once per process that with one rank per node (a GPU per
    container, each its own node) no two ranks share a node's memory: turns serialize nothing and save nothing."""
    if placement.local_world_size > 1 or placement.world_size == 1 or "one rank per node" in _NOTED:
        return
    _NOTED.add("one rank per node")
    info(
        f"serialized restore: each of the {placement.world_size} nodes runs one rank, so no two ranks restore on the"
        " same node: the turns serialize nothing and save no memory (each rank still reads memory-mapped where it"
        " can and keeps only what it restores)."
    )


def disable_checkpoint_callbacks(trainer: Any) -> None:
    """(each rank, a restore failed half-way) Keep checkpoint callbacks from saving the partly restored model while
    Lightning handles the exception (its ``on_exception`` hooks).

    Only the callbacks that can save in ``on_exception`` are removed from ``trainer.callbacks`` (a ``ModelCheckpoint``
    with ``save_on_exception=True``, an ``OnExceptionCheckpoint``, or any checkpoint callback that overrides
    ``on_exception``), with one warning naming them: for all others, and so by default, nothing changes.
    """
    flavour = flavour_of(trainer)
    checkpoint_cls = flavour.import_("callbacks", "Checkpoint")
    model_checkpoint_cls = flavour.import_("callbacks", "ModelCheckpoint")
    callback_cls = flavour.import_("callbacks", "Callback")

    def saves_on_exception(callback: Any) -> bool:
        own = type(callback).on_exception
        if own is callback_cls.on_exception:
            return False
        if own is model_checkpoint_cls.on_exception:
            return bool(getattr(callback, "save_on_exception", False))
        return True

    disabled = [cb for cb in trainer.callbacks if isinstance(cb, checkpoint_cls) and saves_on_exception(cb)]
    if not disabled:
        return
    trainer.callbacks = [cb for cb in trainer.callbacks if cb not in disabled]
    flavour.import_("utilities.rank_zero", "rank_zero_warn")(
        f"The checkpoint restore failed, so {', '.join(type(cb).__name__ for cb in disabled)} will not save a"
        " checkpoint of the partly restored model."
    )
