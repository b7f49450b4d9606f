"""The forecast: the host memory a resume adds per node, upstream and serialized, from a checkpoint's tensor table
and the job's shape. The model, its inputs and how it compares with what the benchmark measured: ``docs/forecast.md``
(its steps are numbered there as in :func:`predict`)."""

from __future__ import annotations

from dataclasses import astuple, dataclass

from serialized_restore._files import format_bytes
from serialized_restore.forecast.table import TensorTable

SERIALIZED_FIXED_PER_RANK = 4 * 2**20
"""F: what a serialized restore's rank adds besides its containers (docs/forecast.md, *Inputs*)."""


@dataclass(frozen=True)
class Resume:
    """One way to resume, per node: the checkpoint's bytes in private memory at the restore's peak, by part
    (``held``), and what that adds above the same job without a checkpoint (``raw``; ``net`` for fit)."""

    label: str
    weights: int
    optimizer: int
    rest: int
    raw: int
    net: int | None
    kept: int

    @property
    def held(self) -> int:
        return self.weights + self.optimizer + self.rest


@dataclass(frozen=True)
class Forecast:
    """The forecast for one job (``docs/forecast.md``); every figure is per node, in bytes."""

    table: TensorTable
    devices: int
    nodes: int
    entry: str
    strategy: str
    k: int
    accelerator: str
    containers_per_rank: int
    fixed_per_rank: int
    kept_per_rank: int
    setup_transient_per_rank: int
    upstream: Resume
    serialized: Resume
    serialized_eager: Resume | None
    page_cache: int
    notes: list[str]

    @property
    def measure(self) -> str:
        """The README's measure for the entry: ``net`` for fit, ``raw`` for validate."""
        return "net" if self.entry == "fit" else "raw"

    def added(self, resume: Resume) -> int:
        return resume.net if self.entry == "fit" and resume.net is not None else resume.raw


def predict(
    table: TensorTable,
    devices: int,
    nodes: int = 1,
    entry: str = "fit",
    strategy: str = "ddp",
    k: int = 1,
    *,
    accelerator: str = "cpu",
    kept_per_rank: int | None = None,
    setup_transient_per_rank: int | None = None,
) -> Forecast:
    """The host memory a resume adds per node (``docs/forecast.md``, steps 1 to 5); ``kept_per_rank`` (K) and
    ``setup_transient_per_rank`` (T) replace the model's defaults, e.g. with what a benchmark's baseline measured."""
    if entry not in ("fit", "validate") or strategy not in ("ddp", "fsdp") or accelerator not in ("cpu", "gpu"):
        raise ValueError(f"unsupported entry {entry!r}, strategy {strategy!r} or accelerator {accelerator!r}")
    if devices < 1 or nodes < 1 or k < 1:
        raise ValueError("devices, nodes and k must be positive")
    n, fit, gpu = devices, entry == "fit", accelerator == "gpu"
    w, o, r = table.weights_bytes, table.optimizer_bytes, table.rest_bytes
    d = w + o + r
    c = table.containers_per_rank
    cs = c + SERIALIZED_FIXED_PER_RANK
    if kept_per_rank is None:
        kept = table.optimizer_step_bytes if gpu else o if strategy == "ddp" else -(-o // (n * nodes))
        kept_per_rank = kept if fit else 0
    if setup_transient_per_rank is None:
        setup_transient_per_rank = w if strategy == "ddp" and not gpu else 0
    kk, t = kept_per_rank, setup_transient_per_rank
    credit = n * max(0, kk - t)  # what net takes off raw: the kept state beyond the job's own transient

    def resume(label: str, weights: int, optimizer: int, rest: int, raw: int) -> Resume:
        return Resume(label, weights, optimizer, rest, raw, raw - credit if fit else None, n * kk)

    notes: list[str] = []
    if strategy == "ddp":
        upstream = resume("upstream Lightning", n * w, n * o, n * (r + c), n * (d + c))
        held = n * (kk + cs)
        serialized = resume("serialized, memory-mapped", 0, n * kk, n * cs, max(n * cs, held - n * t))
        j = min(k, n)
        stage1 = (j * w, j * o, j * r + n * cs)
        stage2 = (j * w, (n - j) * kk + j * o, j * r + n * cs)
        peak = max((stage1, stage2) if fit else (stage1,), key=sum)
        eager: Resume | None = resume(f"serialized, read eagerly, k={k}", *peak, max(n * cs, sum(peak) - n * t))
        if k > 1:
            notes.append(f"k = {k} changes only the eager read: a memory-mapped turn allocates no tensor data")
    else:
        upstream = resume("upstream Lightning", 0, n * (o + kk), n * (r + c), n * (o + kk + r + c) - n * t)
        u = table.largest_weight_bytes
        held_parts = (n * u, 0) if u > kk else (0, n * kk)
        serialized = resume("serialized, memory-mapped", *held_parts, n * cs, n * (cs + max(u, kk)) - n * t)
        if table.filesystem != "local":  # the package maps only a local file under FSDP (design.md, FSDP)
            serialized = Resume("serialized (FSDP's own restore)", *astuple(upstream)[1:])
        eager = None
        notes.append(
            "FSDP: a rougher model than DDP's (docs/forecast.md, steps 4 and 5); FSDP's ranks load together, so k does"
            " not apply, and a file the package cannot map (remote, legacy) is restored by FSDP's own code, as upstream"
        )
    if strategy == "ddp" and table.filesystem != "local":
        notes.append(
            f"a remote checkpoint is first copied to local disk once per node ({format_bytes(table.checkpoint_bytes)}"
            " in SERIALIZED_RESTORE_TMPDIR or the system's temporary directory; on a tmpfs that copy is memory),"
            " then memory-mapped; upstream reads it on every rank"
        )
    if gpu:
        notes.append(
            "GPU: the optimizer state moves to GPU memory, the host keeps only its step tensors; DDP's setup copies"
            " are on the GPU (T = 0). Not yet measured on a GPU"
        )
    return Forecast(
        table=table,
        devices=devices,
        nodes=nodes,
        entry=entry,
        strategy=strategy,
        k=k,
        accelerator=accelerator,
        containers_per_rank=c,
        fixed_per_rank=SERIALIZED_FIXED_PER_RANK,
        kept_per_rank=kk,
        setup_transient_per_rank=t,
        upstream=upstream,
        serialized=serialized,
        serialized_eager=eager,
        page_cache=table.checkpoint_bytes,
        notes=notes,
    )
