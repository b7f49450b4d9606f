"""Run a Lightning job as a process tree and measure its restore from outside: the node memory the sampler
(``_sampler.py``) sees inside the restore window, which the ranks mark themselves (``_job.py``).

Shared by ``restore_benchmark.py``, ``memory_limit.py``, ``gpu_check.py`` and ``demo/demo.py``. The job is started
through ``harness/processes.py`` as global rank 0, which starts the other ranks through Lightning's own launcher. The
restore window runs from the earliest ``start`` marker to the latest ``end``; a sample counts when it lies inside.
"""

from __future__ import annotations

import bisect
import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import psutil

from benchmarks._cache import cold_read, drop_cached, fill_cache, resident_bytes
from benchmarks._sampler import TreeSampler, system_busy_seconds
from benchmarks.modes import BASELINES, FAMILIES, MODES
from harness.processes import fresh_job_env, job_session

REPO = Path(__file__).resolve().parents[1]
JOB = Path(__file__).with_name("_job.py")
GIB = 2**30
TIMELINE_MARGIN = 1.0
TIMELINE_BIN = 0.02
CACHES = ("warm", "cold")
READ_CHUNK = 8 * 2**20  # the storage's sequential read (and the floor's read): one reused buffer of this size


class JobFailed(RuntimeError):
    pass


# ---------------------------------------------------------------- jobs


@dataclass
class JobOutcome:
    run_dir: Path
    returncode: int
    elapsed: float
    sampler: Optional[TreeSampler]
    other_cpu_seconds: float = 0.0  # the rest of the machine's while the job ran: busy time less the job's and ours


def own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def log_tail(run_dir: Path, chars: int = 4000) -> str:
    errors = "".join(p.read_text() for p in sorted(run_dir.glob("rank*.error.txt")))
    return (errors + "\n" + (run_dir / "job.log").read_text(errors="replace"))[-chars:]


def markers(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "markers.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def fresh_dir(run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*run_dir.glob("rank*.json"), *run_dir.glob("rank*.error.txt"), run_dir / "markers.jsonl"]:
        stale.unlink(missing_ok=True)


def run_job(
    config: dict[str, Any],
    *,
    timeout: float,
    env: Optional[dict[str, str]] = None,
    sample: bool = True,
    preexec_fn: Optional[Callable[[], None]] = None,
) -> JobOutcome:
    """Run ``_job.py`` with ``config`` (all its ranks) while sampling its memory; its whole tree is killed when it
    ends or times out. ``preexec_fn`` runs in the job's first process before it starts (to enter a cgroup, say)."""
    run_dir = Path(config["out"])
    fresh_dir(run_dir)
    started = time.monotonic()
    busy_before, own_before = system_busy_seconds(), own_cpu_seconds()
    sampler = None
    with job_session(
        JOB, config, cwd=run_dir, env=fresh_job_env(env), log=run_dir / "job.log", preexec_fn=preexec_fn
    ) as proc:
        sampler = TreeSampler(proc.pid, wake_on=run_dir / "markers.jsonl").start() if sample else None
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = -9
    if sampler is not None:
        sampler.stop()
    elapsed = time.monotonic() - started
    other = system_busy_seconds() - busy_before - (own_cpu_seconds() - own_before)
    if sampler is not None:
        other -= sum(sampler.cpu_seconds.values())
        samples = {"fast": sampler.fast, "sweeps": sampler.sweeps, "cpu_seconds": sampler.cpu_seconds}
        (run_dir / "samples.json").write_text(json.dumps(samples))
    if returncode != 0:
        why = f"timed out after {timeout:.0f}s" if returncode == -9 else f"exited with {returncode}"
        raise JobFailed(f"job in {run_dir} {why}:\n{log_tail(run_dir)}")
    return JobOutcome(run_dir, returncode, elapsed, sampler, max(0.0, other))


def job_config(mode: str, entry: str, devices: int, checkpoint: CheckpointInfo, run_dir: Path, **extra: Any) -> dict:
    """What ``_job.py`` runs for ``mode``: its family's program and strategy, how it restores, which checkpoint (none
    for a baseline; Fabric's layout for the Fabric modes)."""
    spec, family = MODES[mode], FAMILIES[MODES[mode].family]
    ckpt_path: Optional[Path] = None if mode in BASELINES else checkpoint.path
    if ckpt_path is not None and family.action == "fabric":
        ckpt_path = fabric_checkpoint(checkpoint.path)
    return {
        "action": family.action,
        "out": str(run_dir),
        "mode": mode,
        "entry": entry,
        "devices": devices,
        "restorer": spec.restorer,
        "k": devices if spec.k == "N" else spec.k,
        "strategy": family.strategy,
        "optimizer": family.optimizer,
        "accelerator": "cpu",
        "width": checkpoint.width,
        "depth": checkpoint.depth,
        "global_step": checkpoint.global_step,
        "ckpt_path": None if ckpt_path is None else str(ckpt_path),
        **{k: v for k, v in extra.items() if v is not None},
    }


def prepare_cache(path: Optional[str], cache: str, measure_read: bool = True) -> dict[str, Any]:
    """Put the checkpoint at ``path`` (a job's ``ckpt_path``; a baseline has none) in the page cache state ``cache``
    names, checked with ``mincore`` (``_cache.CacheError`` otherwise): ``warm``, every page resident; ``cold``,
    none. For ``cold`` and ``measure_read``, first one cold sequential read of the file (``READ_CHUNK`` bytes at a
    time into one reused buffer, pages dropped before): the storage's own rate right before the job. Returns what
    was done: ``cache``, ``cold_read_s`` (or ``None``), ``resident_bytes`` (as the job starts)."""
    done: dict[str, Any] = {"cache": cache, "cold_read_s": None, "resident_bytes": None}
    if path is None:
        return done
    if cache == "cold":
        if measure_read:
            done["cold_read_s"] = cold_read(path, READ_CHUNK)
        drop_cached(path)
    elif cache == "warm":
        fill_cache(path)
    else:
        raise ValueError(f"cache {cache!r}: one of {', '.join(CACHES)}")
    done["resident_bytes"] = resident_bytes(path)
    return done


def reader_env(mode: str) -> dict[str, str]:
    return {"SERIALIZED_RESTORE_READER": MODES[mode].reader} if MODES[mode].reader else {}


def compile_checkout() -> None:
    """Compile this checkout's sources to bytecode (``__pycache__``, ignored by git), as installing a package does:
    where ``PYTHONDONTWRITEBYTECODE`` is set, every rank would otherwise compile ``serialized_restore`` from source
    (about 35 ms of CPU per rank), a cost upstream's installed, precompiled package never pays."""
    import compileall

    for folder in ("serialized_restore", "harness", "benchmarks"):
        compileall.compile_dir(str(REPO / folder), quiet=2, workers=1)


# ---------------------------------------------------------------- checkpoint


@dataclass
class CheckpointInfo:
    path: Path
    params: int
    width: int
    depth: int
    global_step: int
    size_bytes: int

    @property
    def size_gib(self) -> float:
        return self.size_bytes / GIB


def create_checkpoint(
    out_dir: Path,
    params: int,
    depth: int,
    *,
    steps: int = 3,
    devices: int = 1,
    timeout: float = 600.0,
    accelerator: str = "cpu",
    strategy: Optional[str] = None,
) -> tuple[CheckpointInfo, bool]:
    """Train the MLP closest to ``params`` parameters ``steps`` Adam steps and save it with
    ``trainer.save_checkpoint``, unless already cached (by shape, steps, devices, accelerator and ``strategy``:
    default ``ddp`` for more than one device; ``fsdp`` saves a full checkpoint through Lightning's ``FSDPStrategy``,
    GPU only). Returns the checkpoint and whether it was created now."""
    width = max(8, round((params / depth) ** 0.5))
    name = f"mlp-w{width}-d{depth}-s{steps}-n{devices}" + ("" if accelerator == "cpu" else f"-{accelerator}")
    name += f"-{strategy}" if strategy else ""
    ckpt_path, meta_path = out_dir / f"{name}.ckpt", out_dir / f"{name}.json"
    created = not (ckpt_path.is_file() and meta_path.is_file())
    if created:
        out_dir.mkdir(parents=True, exist_ok=True)
        meta_path.unlink(missing_ok=True)
        config = {
            "action": "train",
            "out": str(out_dir / f"{name}.train"),
            "width": width,
            "depth": depth,
            "steps": steps,
            "devices": devices,
            "accelerator": accelerator,
            "strategy": strategy or ("ddp" if devices > 1 else "auto"),
            "ckpt_path": str(ckpt_path),
            "meta_path": str(meta_path),
        }
        run_job(config, timeout=timeout, sample=False)
    meta = json.loads(meta_path.read_text())
    meta["size_bytes"] = ckpt_path.stat().st_size
    return CheckpointInfo(path=ckpt_path, **meta), created


def fabric_checkpoint(path: Path) -> Path:
    """The checkpoint at ``path`` in the layout ``fabric.save(path, {"model": ..., "optimizer": ..., "step": ...})``
    writes (made once, next to it, and read into the page cache): the same tensors, for the Fabric modes."""
    target = path.with_suffix(".fabric.ckpt")
    if not target.is_file():
        import torch

        # where a GPU can take them, tensors keep the device they were saved from (a GPU checkpoint stays one)
        location = None if torch.cuda.is_available() else "cpu"
        checkpoint = torch.load(path, mmap=True, weights_only=False, map_location=location)
        state = {
            "model": {k.removeprefix("net."): v for k, v in checkpoint["state_dict"].items()},
            "optimizer": checkpoint["optimizer_states"][0],
            "step": checkpoint["global_step"],
        }
        torch.save(state, target.with_suffix(".partial"))
        target.with_suffix(".partial").rename(target)
    warm_page_cache(target)
    return target


def warm_page_cache(path: Path) -> None:
    """Read the file, so that every measured run finds it in the page cache (checked: ``_cache.fill_cache``)."""
    fill_cache(path)


# ---------------------------------------------------------------- one restore


@dataclass
class RestoreRun:
    """One restore job's figures; bytes and seconds. ``anon_peak`` / ``anon_end``: the tree's summed anonymous memory
    (fast channel) at its peak inside the window / at the window's last sample; ``smaps_anon_peak``: the peak of the
    sweeps' ``Anonymous:``; ``pss_peak``: at every fast sample, its anonymous memory plus ``Pss - Pss_Anon`` (file-
    backed and shared memory, which changes slowly) of the sweep nearest in time, at its peak; the optimizer state
    all ranks hold in host memory at the window's end, and the part of it still in memory-mapped file pages;
    ``window_cpu_seconds``: CPU time of all ranks inside the window; the sampling's quality (``woke_before_window``:
    how long before the window the sampler went to full rate; ``rss_anon_vs_anonymous``: the channels' largest
    disagreement in a sweep); GPU memory allocated by torch, summed over ranks, at the end and its peak; and the fast
    channel from ``TIMELINE_MARGIN`` before the window to its end, as (seconds since its start, bytes), the largest
    value per ``TIMELINE_BIN``."""

    mode: str
    entry: str
    devices: int
    window_start: float
    window_end: float
    anon_peak: int
    anon_end: int
    smaps_anon_peak: int
    pss_peak: int
    optimizer_state_bytes: int
    optimizer_state_mapped_bytes: int
    window_cpu_seconds: float
    checked: bool
    exact: bool
    mismatches: list[str]
    fast_max_gap: float
    sweeps: int
    sweep_max_duration: float
    woke_before_window: float
    rss_anon_vs_anonymous: float
    job_seconds: float
    other_cpu_seconds: float
    run_dir: str
    gpu_bytes: Optional[int] = None
    gpu_peak_bytes: Optional[int] = None
    timeline: list[tuple[float, int]] = field(default_factory=list)
    # the page cache as the job started (``prepare_cache``): ``warm`` or ``cold``, the storage's cold sequential read
    # of the file right before it (cold only), the file's bytes resident as the job started
    cache: str = "warm"
    cold_read_s: Optional[float] = None
    resident_bytes: Optional[int] = None
    # all ranks' page faults inside the window (major: read from storage) and bytes they had read from storage
    major_faults: Optional[int] = None
    minor_faults: Optional[int] = None
    read_bytes: Optional[int] = None

    @property
    def window(self) -> float:
        return self.window_end - self.window_start

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "window": self.window}


def measure_restore(
    *,
    mode: str,
    entry: str,
    devices: int,
    checkpoint: CheckpointInfo,
    run_dir: Path,
    timeout: float,
    preexec_fn: Optional[Callable[[], None]] = None,
    accelerator: str = "cpu",
    strategy: Optional[str] = None,
    cache: Optional[str] = None,
) -> RestoreRun:
    """Run one restore (or, for a baseline, the same job without a checkpoint) and measure it. ``strategy`` replaces
    the family's own: ``fsdp`` for Lightning's stock ``FSDPStrategy`` on GPU. ``cache``: the checkpoint's pages are
    made resident (``warm``) or dropped (``cold``) right before the job (``prepare_cache``); ``None`` leaves the page
    cache as it is (the caller warmed it once)."""
    config = job_config(mode, entry, devices, checkpoint, run_dir, accelerator=accelerator, strategy=strategy)
    prepared = prepare_cache(config["ckpt_path"], cache) if cache else {}
    outcome = run_job(config, timeout=timeout, env=reader_env(mode), preexec_fn=preexec_fn)
    run = analyse(outcome, mode=mode, entry=entry, devices=devices)
    run.cache = cache or "warm"
    run.cold_read_s, run.resident_bytes = prepared.get("cold_read_s"), prepared.get("resident_bytes")
    return run


def analyse(outcome: JobOutcome, *, mode: str, entry: str, devices: int) -> RestoreRun:
    """The restore window from the ranks' markers, and the memory peaks the sampler saw inside it."""
    run_dir, sampler = outcome.run_dir, outcome.sampler
    assert sampler is not None
    marks = markers(run_dir)
    starts = [m["t"] for m in marks if m["event"] == "start"]
    ends = [m for m in marks if m["event"] == "end"]
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("rank*.json"))]
    if not len(starts) == len(ends) == len(ranks) == devices:
        raise JobFailed(
            f"job in {run_dir}: expected {devices} ranks to mark their restore window and report, got"
            f" {len(starts)} starts, {len(ends)} ends, {len(ranks)} reports:\n{log_tail(run_dir)}"
        )
    start, end = min(starts), max(m["t"] for m in ends)
    io = {}
    for key in ("major_faults", "minor_faults", "read_bytes"):
        before = {m["rank"]: m[key] for m in marks if m["event"] == "start" and key in m}
        after = {m["rank"]: m[key] for m in marks if m["event"] == "end" and key in m}
        io[key] = sum(after[r] - before[r] for r in after if r in before) if before else None
    fast = [s for s in sampler.fast if start <= s[0] <= end]
    if not fast:  # a window shorter than the sampling interval: take the samples on either side of it
        fast = [s for s in sampler.fast if s[0] < start][-1:] + [s for s in sampler.fast if s[0] > end][:1]
    inside = [s for s in sampler.sweeps if start <= s[0] and s[1] <= end]
    if not inside:  # a window shorter than one sweep: take the sweeps that overlap it, else those on either side
        inside = [s for s in sampler.sweeps if s[0] <= end and s[1] >= start]
    if not inside:
        inside = [s for s in sampler.sweeps if s[1] < start][-1:] + [s for s in sampler.sweeps if s[0] > end][:1]
    if not fast or not inside:
        raise JobFailed(f"job in {run_dir}: no memory sample inside its restore window ({end - start:.3f}s)")
    times = [start] + [s[0] for s in fast] + [end]
    gpu = [r["gpu_bytes"] for r in ranks if r.get("gpu_bytes") is not None]
    gpu_peak = [r["gpu_peak_bytes"] for r in ranks if r.get("gpu_peak_bytes") is not None]
    return RestoreRun(
        mode=mode,
        entry=entry,
        devices=devices,
        window_start=start,
        window_end=end,
        anon_peak=max(s[1] for s in fast),
        anon_end=fast[-1][1],
        window_cpu_seconds=fast[-1][3] - fast[0][3],
        smaps_anon_peak=max(s[2] for s in inside),
        pss_peak=_pss_peak(fast, sampler.sweeps),
        optimizer_state_bytes=sum(m.get("optimizer_state_bytes", 0) for m in ends),
        optimizer_state_mapped_bytes=sum(m.get("optimizer_state_mapped_bytes", 0) for m in ends),
        checked=all(r["checked"] for r in ranks),
        exact=all(r["exact"] for r in ranks),
        mismatches=[f"rank {r['global_rank']}: {m}" for r in ranks for m in r["mismatches"]],
        fast_max_gap=max(b - a for a, b in zip(times, times[1:])),
        sweeps=len(inside),
        sweep_max_duration=max(s[1] - s[0] for s in inside),
        woke_before_window=start - sampler.woke_at,
        rss_anon_vs_anonymous=max(s[4] for s in inside),
        job_seconds=outcome.elapsed,
        other_cpu_seconds=outcome.other_cpu_seconds,
        run_dir=str(run_dir),
        gpu_bytes=sum(gpu) if gpu else None,
        gpu_peak_bytes=sum(gpu_peak) if gpu_peak else None,
        timeline=_timeline(sampler.fast, start, end),
        **io,
    )


def _pss_peak(fast: list[tuple[float, int, int, float]], sweeps: list[tuple[float, float, int, int, int, int]]) -> int:
    middles = [(s[0] + s[1]) / 2 for s in sweeps]
    peak = 0
    for t, anon, *_ in fast:
        i = bisect.bisect_left(middles, t)
        nearest = min((j for j in (i - 1, i) if 0 <= j < len(sweeps)), key=lambda j: abs(middles[j] - t))
        peak = max(peak, anon + sweeps[nearest][5])
    return peak


def _timeline(fast: list[tuple[float, int, int, float]], start: float, end: float) -> list[tuple[float, int]]:
    bins: dict[int, int] = {}
    for t, anon, *_ in fast:
        if start - TIMELINE_MARGIN <= t <= end:
            key = int((t - start) // TIMELINE_BIN)
            bins[key] = max(bins.get(key, 0), anon)
    return [(round(key * TIMELINE_BIN, 3), anon) for key, anon in sorted(bins.items())]


def overheads(run: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Optional[int]]:
    """A restore's overheads in bytes against the ``baseline`` job of the same N and entry point (both ``as_dict()``).

    * ``raw``: peak node anonymous memory in the window minus the baseline's peak in its window;
    * ``minus_optimizer`` (fit): ``raw`` minus the optimizer state the ranks hold in private memory at the end of
      the window (state still in memory-mapped file pages is not anonymous memory, so it is not subtracted);
    * ``net`` (fit): the peak minus the larger of the baseline's peak and the baseline's memory at the end of its
      window plus that private optimizer state: memory above what a job that did not restore holds at its peak or
      once it has built its optimizer state (see ``docs/benchmarks.md``);
    * ``pss``: peak node PSS (``RestoreRun.pss_peak``) minus the baseline's;
    * ``smaps_anon``: peak summed ``Anonymous:`` of the full sweeps minus the baseline's.
    """
    kept = run["optimizer_state_bytes"] - run.get("optimizer_state_mapped_bytes", 0)
    fit = run["entry"] == "fit"
    raw = run["anon_peak"] - baseline["anon_peak"]
    return {
        "raw": raw,
        "minus_optimizer": raw - kept if fit else None,
        "net": run["anon_peak"] - max(baseline["anon_peak"], baseline["anon_end"] + kept) if fit else None,
        "pss": run["pss_peak"] - baseline["pss_peak"],
        "smaps_anon": run["smaps_anon_peak"] - baseline["smaps_anon_peak"],
    }


def machine_info() -> dict[str, Any]:
    """Cores, memory, CPU model and package versions, for stamping results."""
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    cpu = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "ram_gib": psutil.virtual_memory().total / GIB,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": ver("torch"),
        "lightning": ver("lightning"),
        "pytorch-lightning": ver("pytorch-lightning"),
    }
