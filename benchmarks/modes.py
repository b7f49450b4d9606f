"""The benchmark's modes, and where its default run measures each: two tables.

A *family* is a kind of job (strategy, optimizer, Trainer or Fabric) with its own baseline (the same job without a
checkpoint: what the program holds anyway) and its own upstream (the mode whose time the others' are compared with).
A *mode* is one way of restoring within a family. ``restore_benchmark.py --modes`` measures any of them.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Family(NamedTuple):
    baseline: str
    upstream: str
    strategy: str  # ddp; fsdp_cpu: Lightning's FSDPStrategy wrapping with device_id=cpu; fairscale_sharded: OSS + SDP
    optimizer: str  # adam; zero: Adam sharded by torch's ZeroRedundancyOptimizer
    action: str  # restore: the Trainer's fit and validate; fabric: `fabric.load` of model and optimizer (as "fit")
    entries: tuple[str, ...]  # outside fit a sharded optimizer's state is dropped, whoever shards it


FAMILIES = {
    "ddp": Family("baseline", "upstream", "ddp", "adam", "restore", ("fit", "validate")),
    "fsdp": Family("fsdp-baseline", "fsdp-upstream", "fsdp_cpu", "adam", "restore", ("fit", "validate")),
    "zero": Family("baseline", "zero-upstream", "ddp", "zero", "restore", ("fit",)),
    "oss": Family("oss-baseline", "oss-upstream", "fairscale_sharded", "adam", "restore", ("fit",)),
    "fabric": Family("fabric-baseline", "fabric-upstream", "ddp", "adam", "fabric", ("fit",)),
    "fabric-fsdp": Family("fabric-fsdp-baseline", "fabric-fsdp-upstream", "fsdp_cpu", "adam", "fabric", ("fit",)),
}


class Mode(NamedTuple):
    family: str
    restorer: str  # upstream (every baseline too), ours, mmap-plugin, proposal-2021
    k: Any  # serialized_checkpoint_loading of `ours`: True, False, an int, or "N" (k = N: every local rank at once)
    reader: str  # SERIALIZED_RESTORE_READER ("": the default)
    largest: tuple[int, ...]  # the default run: the N it is measured at at the largest checkpoint size ...
    smaller: tuple[int, ...]  # ... and at every smaller one (baselines: wherever a mode of their family runs)
    min_n: int  # with --modes or --devices: the smallest N at which it differs from another mode


# The default run, 3 jobs per cell within 15 minutes on 2 cores: the headline modes at N = 2 and 4 at the largest size
# and at N = 4, the worst case, at the smaller one; k = 1 beside `True` likewise. The anchors (`mmap-plugin`,
# `proposal-2021`) and the other families, at N = 4 and the largest size, are a run of their own (`OTHERS`, the
# command in restore_benchmark.py's docstring): with them, 3 jobs per cell would take about 40 minutes. With one rank
# there are no turns to take, so the modes that differ in how ranks take turns start at N = 2.
# fmt: off
MODES = {
    #                        family         restorer         k      reader   largest    smaller  min N
    "baseline":         Mode("ddp",         "upstream",      None,  "",      (),        (),      1),
    "upstream":         Mode("ddp",         "upstream",      None,  "",      (2, 4),    (4,),    1),
    "ours-true":        Mode("ddp",         "ours",          True,  "",      (2, 4),    (4,),    1),
    "ours-1":           Mode("ddp",         "ours",          1,     "",      (2, 4),    (4,),    2),
    "mmap-plugin":      Mode("ddp",         "mmap-plugin",   None,  "",      (),        (),      1),
    "proposal-2021":    Mode("ddp",         "proposal-2021", None,  "",      (),        (),      2),
    "ours-off":         Mode("ddp",         "ours",          False, "",      (),        (),      1),
    "ours-2":           Mode("ddp",         "ours",          2,     "",      (),        (),      3),
    "ours-true-eager":  Mode("ddp",         "ours",          True,  "eager", (),        (),      2),
    "fsdp-baseline":    Mode("fsdp",        "upstream",      None,  "",      (),        (),      2),
    "fsdp-upstream":    Mode("fsdp",        "upstream",      None,  "",      (),        (),      2),
    "fsdp-ours":        Mode("fsdp",        "ours",          True,  "",      (),        (),      2),
    "zero-upstream":    Mode("zero",        "upstream",      None,  "",      (),        (),      1),
    "zero-ours":        Mode("zero",        "ours",          True,  "",      (),        (),      1),
    "oss-baseline":     Mode("oss",         "upstream",      None,  "",      (),        (),      1),
    "oss-upstream":     Mode("oss",         "upstream",      None,  "",      (),        (),      1),
    "oss-ours":         Mode("oss",         "ours",          True,  "",      (),        (),      1),
    "fabric-baseline":  Mode("fabric",      "upstream",      None,  "",      (),        (),      1),
    "fabric-upstream":  Mode("fabric",      "upstream",      None,  "",      (),        (),      1),
    "fabric-ours":      Mode("fabric",      "ours",          True,  "",      (),        (),      1),
    "fabric-ours-eager": Mode("fabric",     "ours",          True,  "eager", (),        (),      1),
    "fabric-fsdp-baseline": Mode("fabric-fsdp", "upstream",  None,  "",      (),        (),      2),
    "fabric-fsdp-upstream": Mode("fabric-fsdp", "upstream",  None,  "",      (),        (),      2),
    "fabric-fsdp-ours": Mode("fabric-fsdp", "ours",          True,  "",      (),        (),      2),
}
# fmt: on
BASELINES = tuple(dict.fromkeys(f.baseline for f in FAMILIES.values()))
MEASURED = tuple(m for m in MODES if m not in BASELINES)  # what --modes chooses from
DEFAULT = tuple(m for m in MEASURED if MODES[m].largest)  # the default run's modes
# what the default run measured before it took 3 jobs per cell: the anchors and the other families, a run of their own
OTHERS = ("mmap-plugin", "proposal-2021", "fsdp-upstream", "fsdp-ours", "zero-upstream", "zero-ours", "oss-upstream",
          "oss-ours", "fabric-upstream", "fabric-ours", "fabric-fsdp-upstream", "fabric-fsdp-ours")  # fmt: skip

# what each mode restores with (the report's table of modes)
TEXT = {
    "baseline": "upstream Trainer, no checkpoint (`ckpt_path=None`)",
    "upstream": "`pytorch_lightning.Trainer`",
    "ours-true": "`serialized_restore.Trainer(serialized_checkpoint_loading=True)`: reads memory-mapped, the node's"
    " ranks at once where that allocates only what a rank keeps, in turns where a turn bounds memory",
    "ours-1": "`serialized_checkpoint_loading=1`: k = 1, every stage in turns, one local rank at a time",
    "mmap-plugin": "`pytorch_lightning.Trainer(plugins=[MmapTorchCheckpointIO()])`: upstream's restore, every rank at"
    " once, reading with `torch.load(..., mmap=True)` (a `TorchCheckpointIO` subclass in `benchmarks/_job.py`)",
    "proposal-2021": "upstream Trainer, local ranks one at a time, dropping only `state_dict` (issue #8043)",
    "ours-off": "`serialized_restore.Trainer(serialized_checkpoint_loading=False)`",
    "ours-2": "`serialized_restore.Trainer(serialized_checkpoint_loading=2)`",
    "ours-true-eager": "`serialized_checkpoint_loading=True` with `SERIALIZED_RESTORE_READER=eager`",
    "fsdp-baseline": "upstream Trainer with FSDP, no checkpoint",
    "fsdp-upstream": "`pytorch_lightning.Trainer` with FSDP: `FSDPStrategy.load_checkpoint`'s full-checkpoint path",
    "fsdp-ours": "`serialized_checkpoint_loading=True` with FSDP: every rank maps the file and copies only its shard"
    " of the optimizer state",
    "zero-upstream": "`pytorch_lightning.Trainer`, DDP, Adam sharded by `ZeroRedundancyOptimizer`",
    "zero-ours": "`serialized_checkpoint_loading=True`, DDP with `ZeroRedundancyOptimizer`",
    "oss-baseline": "upstream Trainer with fairscale's `OSS` + `ShardedDataParallel`, no checkpoint",
    "oss-upstream": "`pytorch_lightning.Trainer` with fairscale's `OSS` + `ShardedDataParallel` (Lightning 1.x's"
    " `ddp_sharded`)",
    "oss-ours": "`serialized_checkpoint_loading=True` with fairscale's `OSS` + `ShardedDataParallel`",
    "fabric-baseline": "`lightning_fabric.Fabric`, DDP, model and Adam set up, no `fabric.load`",
    "fabric-upstream": '`lightning_fabric.Fabric`, DDP: `fabric.load(path, {"model": ..., "optimizer": ...})`',
    "fabric-ours": "`serialized_restore.fabric.Fabric(serialized_checkpoint_loading=True)`, the same `fabric.load`",
    "fabric-ours-eager": "`fabric-ours` with `SERIALIZED_RESTORE_READER=eager`",
    "fabric-fsdp-baseline": "`lightning_fabric.Fabric` with FSDP, model and Adam set up, no `fabric.load`",
    "fabric-fsdp-upstream": "`lightning_fabric.Fabric` with FSDP: `FSDPStrategy.load_checkpoint`'s full-checkpoint"
    " path (`_lazy_load`, then every rank materializes the optimizer state)",
    "fabric-fsdp-ours": "`serialized_restore.fabric.Fabric(serialized_checkpoint_loading=True)` with FSDP: every rank"
    " maps the file and copies only its shard of the optimizer state",
}


def family_of(mode: str) -> Family:
    return FAMILIES[MODES[mode].family]


def baseline_of(mode: str) -> str:
    """The mode whose job (same N and entry point, no checkpoint) a mode's overheads are measured against."""
    return family_of(mode).baseline


def upstream_of(mode: str) -> str:
    """The mode whose restore time a mode's time is compared with."""
    return family_of(mode).upstream
