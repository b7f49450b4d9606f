"""Run a Lightning job as a process tree and measure the node memory of its restore, as the kernel sees it.

Shared by ``benchmarks/restore_benchmark.py`` and ``demo/demo.py``. The parent process (this one) launches
``benchmarks/_job.py``, which becomes global rank 0 and starts the other local ranks through Lightning's own
``ddp`` launcher, and samples the memory of every process of that tree from outside, with two channels:

* fast (``FAST_INTERVAL``): ``RssAnon`` of ``/proc/<pid>/status`` (the kernel's counter of resident anonymous
  pages, O(1) to read) summed over the tree;
* full (sweeps over the tree, using at most ``SMAPS_DUTY`` of one core): ``Anonymous:``, ``Pss:`` and
  ``Pss_Anon:`` of ``/proc/<pid>/smaps_rollup`` summed over the tree. The kernel builds ``smaps_rollup`` by walking
  the page tables, which costs about 10 ms per GiB resident on the development machine, so at several GiB one sweep
  over the tree takes 100 ms or more: too slow to catch a short peak, which is why the fast channel exists. Each
  sweep also reads ``RssAnon`` before and after every walk, so that the two channels can be checked against each
  other. The PSS peak combines both (see ``RestoreRun.pss_peak``).

The tree is found with psutil (``Process.children(recursive=True)``, which reads every process's ``stat``: about
4 ms). It is rescanned when the kernel may have created a process since the previous scan (the last PID in
``/proc/loadavg`` changed), at most every ``RESCAN_MIN_INTERVAL`` and at least every ``RESCAN_MAX_INTERVAL``; a
process that exited drops out as soon as its files vanish. Lightning's launcher starts the ranks seconds before any
restore window opens, so every rank is in the tree well before its window.

Until ``wake_on`` exists (rank 0 creates it in ``prepare_data``, after the process group is up and just before the
``setup`` hook that opens the window) the sampler runs no full sweeps and rescans the tree only every
``IDLE_RESCAN_INTERVAL``, so that it takes next to no CPU from the ranks while they import and start.

The restore window comes from the ranks' own markers (see ``_job.py``): from the earliest ``start`` to the latest
``end``. A sample counts when it lies inside the window (a full sweep: when it started and ended inside).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import platform
import socket
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import psutil

from harness.processes import job_env, kill_job, start_job

REPO = Path(__file__).resolve().parents[1]
JOB = Path(__file__).with_name("_job.py")
GIB = 2**30

FAST_INTERVAL = 0.005
SMAPS_DUTY = 0.2
SMAPS_MIN_INTERVAL = 0.005
RESCAN_MIN_INTERVAL = 0.1
RESCAN_MAX_INTERVAL = 1.0
SAMPLER_NICE = -10
TIMELINE_MARGIN = 1.0
TIMELINE_BIN = 0.02
IDLE_RESCAN_INTERVAL = 0.5  # until `wake_on` exists: no sweeps, and tree rescans only this often

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# mode -> environment of its ranks; how each mode builds its Trainer is in `_job.TRAINER_OF_MODE`
MODES: dict[str, dict[str, str]] = {
    "upstream": {},
    "mmap-plugin": {},
    "ours-off": {},
    "ours-true": {},
    "ours-2": {},
    "ours-true-eager": {"SERIALIZED_RESTORE_READER": "eager"},
    "proposal-2021": {},
    "fsdp-baseline": {},
    "fsdp-upstream": {},
    "fsdp-ours": {},
    "zero-upstream": {},
    "zero-ours": {},
    "oss-baseline": {},
    "oss-upstream": {},
    "oss-ours": {},
    "fabric-baseline": {},
    "fabric-upstream": {},
    "fabric-ours": {},
    "fabric-ours-eager": {"SERIALIZED_RESTORE_READER": "eager"},
    "fabric-fsdp-baseline": {},
    "fabric-fsdp-upstream": {},
    "fabric-fsdp-ours": {},
}
# FSDP modes run Lightning's FSDPStrategy (on CPU: `harness/models.py`'s CPUFSDPStrategy) and are compared with
# their own baseline and upstream
FSDP_MODES = ("fsdp-baseline", "fsdp-upstream", "fsdp-ours")
# sharded optimizer state, from the same checkpoint (a consolidated Adam state): torch's ZeroRedundancyOptimizer
# under DDP (the DDP baseline is its baseline: the same program but for the optimizer's wrapper), and fairscale's OSS
# with ShardedDataParallel (`harness/models.py`'s FairscaleShardedStrategy), which has a baseline of its own
ZERO_MODES = ("zero-upstream", "zero-ours")
OSS_MODES = ("oss-baseline", "oss-upstream", "oss-ours")
# Lightning Fabric under DDP: `fabric.load(path, {"model": ..., "optimizer": ...})` of the same weights and optimizer
# state, saved in Fabric's layout (see `fabric_checkpoint`); the window is the `fabric.load` call
FABRIC_MODES = ("fabric-baseline", "fabric-upstream", "fabric-ours", "fabric-ours-eager")
# the same `fabric.load` under Fabric's FSDPStrategy (on CPU: `harness/models.py`'s FabricCPUFSDPStrategy), one unit
# per layer, of the same full checkpoint
FABRIC_FSDP_MODES = ("fabric-fsdp-baseline", "fabric-fsdp-upstream", "fabric-fsdp-ours")
BASELINES = ("baseline", "fsdp-baseline", "oss-baseline", "fabric-baseline", "fabric-fsdp-baseline")


def baseline_of(mode: str) -> str:
    """The mode whose job (same N and entry point, no checkpoint) a mode's overheads are measured against."""
    for family in (FSDP_MODES, OSS_MODES, FABRIC_MODES, FABRIC_FSDP_MODES):
        if mode in family:
            return family[0]
    return "baseline"


def upstream_of(mode: str) -> str:
    """The mode whose restore time a mode's time is compared with."""
    for family in (FSDP_MODES, ZERO_MODES, OSS_MODES, FABRIC_MODES, FABRIC_FSDP_MODES):
        if mode in family:
            return next(m for m in family if m.endswith("-upstream"))
    return "upstream"


MODE_DESCRIPTIONS = {
    "upstream": "`pytorch_lightning.Trainer`",
    "mmap-plugin": "`pytorch_lightning.Trainer(plugins=[MmapTorchCheckpointIO()])`: upstream's restore, every rank at"
    " once, reading with `torch.load(..., mmap=True)` (a `TorchCheckpointIO` subclass in `benchmarks/_job.py`)",
    "ours-off": "`serialized_restore.Trainer(serialized_checkpoint_loading=False)`",
    "ours-true": "`serialized_restore.Trainer(serialized_checkpoint_loading=True)` (reads memory-mapped)",
    "ours-2": "`serialized_restore.Trainer(serialized_checkpoint_loading=2)`",
    "ours-true-eager": "`serialized_checkpoint_loading=True` with `SERIALIZED_RESTORE_READER=eager`",
    "proposal-2021": "upstream Trainer, local ranks one at a time, dropping only `state_dict` (issue #8043)",
    "baseline": "upstream Trainer, no checkpoint (`ckpt_path=None`)",
    "fsdp-baseline": "upstream Trainer with FSDP, no checkpoint",
    "fsdp-upstream": "`pytorch_lightning.Trainer` with FSDP: `FSDPStrategy.load_checkpoint`'s full-checkpoint path",
    "fsdp-ours": "`serialized_restore.Trainer(serialized_checkpoint_loading=True)` with FSDP: every rank maps the"
    " file and copies only its shard of the optimizer state",
    "zero-upstream": "`pytorch_lightning.Trainer`, DDP, Adam sharded by"
    " `torch.distributed.optim.ZeroRedundancyOptimizer`",
    "zero-ours": "`serialized_restore.Trainer(serialized_checkpoint_loading=True)`, DDP with `ZeroRedundancyOptimizer`",
    "oss-baseline": "upstream Trainer with fairscale's `OSS` + `ShardedDataParallel`, no checkpoint",
    "oss-upstream": "`pytorch_lightning.Trainer` with fairscale's `OSS` + `ShardedDataParallel` (Lightning 1.x's"
    " `ddp_sharded`)",
    "oss-ours": "`serialized_restore.Trainer(serialized_checkpoint_loading=True)` with fairscale's `OSS` +"
    " `ShardedDataParallel`",
    "fabric-baseline": "`lightning_fabric.Fabric`, DDP, model and Adam set up, no `fabric.load`",
    "fabric-upstream": '`lightning_fabric.Fabric`, DDP: `fabric.load(path, {"model": ..., "optimizer": ...})`',
    "fabric-ours": "`serialized_restore.fabric.Fabric(serialized_checkpoint_loading=True)`, the same `fabric.load`",
    "fabric-ours-eager": "`serialized_restore.fabric.Fabric(serialized_checkpoint_loading=True)` with"
    " `SERIALIZED_RESTORE_READER=eager`, the same `fabric.load`",
    "fabric-fsdp-baseline": "`lightning_fabric.Fabric` with FSDP, model and Adam set up, no `fabric.load`",
    "fabric-fsdp-upstream": "`lightning_fabric.Fabric` with FSDP: `FSDPStrategy.load_checkpoint`'s full-checkpoint"
    " path (`_lazy_load`, then every rank materializes the optimizer state)",
    "fabric-fsdp-ours": "`serialized_restore.fabric.Fabric(serialized_checkpoint_loading=True)` with FSDP: every rank"
    " maps the file and copies only its shard of the optimizer state",
}


def strategy_of(mode: str) -> str:
    """The ``strategy`` of a mode's job config (see ``_job._trainer``)."""
    return "fsdp_cpu" if mode in FSDP_MODES + FABRIC_FSDP_MODES else "fairscale_sharded" if mode in OSS_MODES else "ddp"


# ---------------------------------------------------------------- sampling


def _read_field(path: str, key: bytes) -> Optional[int]:
    """A ``kB`` field of a ``/proc`` file in bytes; ``None`` if the process is gone."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    i = data.find(key)
    if i < 0:
        return 0
    return int(data[i + len(key) : data.index(b"kB", i)]) * 1024


def _read_smaps_rollup(pid: int) -> Optional[tuple[int, int, int]]:
    """(``Anonymous:``, ``Pss:``, ``Pss_Anon:``) of one process in bytes; ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    values = {}
    for line in data.splitlines():
        if line.startswith((b"Anonymous:", b"Pss:", b"Pss_Anon:")):
            key, value = line.split(b":", 1)
            values[key] = int(value.split()[0]) * 1024
    return values.get(b"Anonymous", 0), values.get(b"Pss", 0), values.get(b"Pss_Anon", 0)


def _cpu_seconds(pid: int) -> Optional[float]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def system_busy_seconds() -> float:
    """CPU time all cores of the machine spent busy since boot (``/proc/stat``), seconds."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return (sum(values[:8]) - idle) / _CLOCK_TICKS


def _raise_priority() -> None:
    """Let the sampler's thread preempt the ranks it watches (root only; otherwise it keeps its priority)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SAMPLER_NICE)
    except OSError:
        pass


def _last_pid() -> str:
    with open("/proc/loadavg") as f:
        return f.read().rsplit(" ", 1)[-1]


class TreeSampler:
    """Samples the memory of a process and all its descendants from another process (see the module docstring).

    ``fast`` holds ``(time, sum of RssAnon, number of processes, CPU seconds used by the tree so far)``;
    ``sweeps`` holds ``(start, end, sum of Anonymous, sum of Pss, disagreement, sum of Pss - Pss_Anon)``; bytes,
    and ``time.time()`` seconds. The disagreement is the largest ``|Anonymous - RssAnon|`` of one process among
    those whose ``RssAnon`` read just before the walk equals the one read just after it (memory that moves during
    the walk cannot be compared).
    """

    def __init__(self, root_pid: int, wake_on: Optional[Path] = None) -> None:
        self.root = psutil.Process(root_pid)
        self.wake_on = wake_on
        self.fast: list[tuple[float, int, int, float]] = []
        self.sweeps: list[tuple[float, float, int, int, int, int]] = []
        self.cpu_seconds: dict[int, float] = {}
        """CPU time (user + system) each process of the tree had used when last seen."""
        self._pids: list[int] = [root_pid]
        self._stop = threading.Event()
        self._awake = threading.Event()
        self.woke_at = float("inf")
        self._threads = [
            threading.Thread(target=self._fast_loop, name="sampler-fast", daemon=True),
            threading.Thread(target=self._smaps_loop, name="sampler-smaps", daemon=True),
        ]

    def start(self) -> TreeSampler:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _scan(self) -> list[int]:
        try:
            return [self.root.pid] + [p.pid for p in self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _fast_loop(self) -> None:
        _raise_priority()
        last_pid, scanned = "", 0.0
        pids = self._pids
        while not self._stop.is_set():
            now = time.time()
            newest = _last_pid()
            if self._awake.is_set():
                rescan = (
                    newest != last_pid and now - scanned > RESCAN_MIN_INTERVAL
                ) or now - scanned > RESCAN_MAX_INTERVAL
            else:
                rescan = now - scanned > IDLE_RESCAN_INTERVAL
            if rescan:
                last_pid, scanned = newest, now
                pids = self._scan()
            t = time.time()
            values = [_read_field(f"/proc/{pid}/status", b"RssAnon:") for pid in pids]
            alive = [pid for pid, v in zip(pids, values) if v is not None]
            if len(alive) != len(pids):
                pids = alive
            self._pids = pids
            for pid in alive:
                cpu = _cpu_seconds(pid)
                if cpu is not None:
                    self.cpu_seconds[pid] = cpu
            anon = sum(v for v in values if v is not None)
            self.fast.append((t, anon, len(alive), sum(self.cpu_seconds.values())))
            if not self._awake.is_set() and (self.wake_on is None or self.wake_on.exists()):
                self.woke_at = time.time()
                self._awake.set()
            self._stop.wait(max(0.0, FAST_INTERVAL - (time.time() - now)))

    def _smaps_loop(self) -> None:
        _raise_priority()
        while not self._stop.is_set():
            if not self._awake.wait(0.1):
                continue
            t0 = time.time()
            anon = pss = pss_anon = disagreement = 0
            for pid in list(self._pids):
                before = _read_field(f"/proc/{pid}/status", b"RssAnon:")
                rollup = _read_smaps_rollup(pid)
                after = _read_field(f"/proc/{pid}/status", b"RssAnon:")
                if rollup is None or before is None or after is None:
                    continue
                anon += rollup[0]
                pss += rollup[1]
                pss_anon += rollup[2]
                # the walk takes a while and memory may change meanwhile: compare only when the counter held still
                if before == after:
                    disagreement = max(disagreement, abs(rollup[0] - before))
            t1 = time.time()
            self.sweeps.append((t0, t1, anon, pss, disagreement, pss - pss_anon))
            self._stop.wait(max(SMAPS_MIN_INTERVAL, (t1 - t0) * (1 / SMAPS_DUTY - 1)))


# ---------------------------------------------------------------- jobs


def free_port() -> int:
    """A TCP port that is free now, for one job's ``MASTER_PORT``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class JobOutcome:
    run_dir: Path
    returncode: int
    elapsed: float
    sampler: Optional[TreeSampler]
    other_cpu_seconds: float = 0.0
    """CPU time the rest of the machine used while the job ran (busy time minus the job's and this process's)."""

    def log_tail(self, chars: int = 4000) -> str:
        text = (self.run_dir / "job.log").read_text(errors="replace")
        errors = "".join(p.read_text() for p in sorted(self.run_dir.glob("rank*.error.txt")))
        return (errors + "\n" + text)[-chars:]


def _own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


class JobFailed(RuntimeError):
    pass


def run_job(
    config: dict[str, Any],
    *,
    timeout: float,
    env: Optional[dict[str, str]] = None,
    sample: bool = True,
    preexec_fn: Optional[Callable[[], None]] = None,
) -> JobOutcome:
    """Run ``_job.py`` with ``config`` (all its ranks) and sample its memory; kill the whole tree on timeout.

    ``preexec_fn`` runs in the job's first process before it starts (for example to enter a memory cgroup, which
    the ranks it launches inherit)."""
    run_dir = Path(config["out"])
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*run_dir.glob("rank*.json"), *run_dir.glob("rank*.error.txt"), run_dir / "markers.jsonl"]:
        stale.unlink(missing_ok=True)
    own = {k: v for k, v in os.environ.items() if not k.startswith("SERIALIZED_RESTORE_")}
    full_env = job_env(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONWARNINGS": "ignore", **(env or {})},
        base=own,
    )
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        full_env.pop(key, None)
    started = time.monotonic()
    busy_before, own_before = system_busy_seconds(), _own_cpu_seconds()
    with open(run_dir / "job.log", "w") as log:
        proc = start_job(JOB, config, cwd=run_dir, env=full_env, stdout=log, preexec_fn=preexec_fn)
        sampler = TreeSampler(proc.pid, wake_on=run_dir / "markers.jsonl").start() if sample else None
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = -9
        finally:
            # Lightning's launcher keeps its children in our session: never leave one behind
            kill_job(proc)
            if sampler is not None:
                sampler.stop()
    elapsed = time.monotonic() - started
    other = system_busy_seconds() - busy_before - (_own_cpu_seconds() - own_before)
    if sampler is not None:
        other -= sum(sampler.cpu_seconds.values())
    outcome = JobOutcome(run_dir, returncode, elapsed, sampler, max(0.0, other))
    if sampler is not None:
        samples = {"fast": sampler.fast, "sweeps": sampler.sweeps, "cpu_seconds": sampler.cpu_seconds}
        (run_dir / "samples.json").write_text(json.dumps(samples))
    if returncode != 0:
        why = f"timed out after {timeout:.0f}s" if returncode == -9 else f"exited with {returncode}"
        raise JobFailed(f"job in {run_dir} {why}:\n{outcome.log_tail()}")
    return outcome


# ---------------------------------------------------------------- bytecode


def compile_checkout() -> None:
    """Compile this checkout's Python sources to bytecode (``__pycache__``, ignored by git), as installing a package
    does. Where ``PYTHONDONTWRITEBYTECODE`` is set, every rank of every job would otherwise compile
    ``serialized_restore`` from source (about 35 ms of CPU per rank on the development machine), a cost upstream's
    installed, precompiled package never pays. Sources changed later are recompiled in memory, as usual."""
    import compileall

    for folder in ("serialized_restore", "harness", "benchmarks"):
        compileall.compile_dir(str(REPO / folder), quiet=2, workers=1)


# ---------------------------------------------------------------- whole process

WHOLE_MODES = ("upstream", "ours-true")  # the restore-only jobs timed as whole processes, alternating
CHILD_SCAN_INTERVAL = 0.5  # how often the parent looks for the ranks the launcher starts, until it has seen them all
EXIT_POLL_INTERVAL = 0.005
_PR_SET_CHILD_SUBREAPER = 36


@dataclass
class WholeProcessRun:
    """One restore-only job (``_job.resume_whole``) timed as a whole: from starting its first process to the exit of
    its last one. While it runs this process is a child subreaper, so that the ranks Lightning's launcher started
    become its children when rank 0 exits, and each rank's resources come from ``wait4`` when it is reaped: CPU time
    and page faults to the very end, the interpreter's shutdown included."""

    mode: str
    devices: int
    seconds: float
    """Wall time from starting the job's first process to the exit of its last rank."""
    rank0_seconds: float
    """Wall time from starting the job to the exit of global rank 0 (the process a shell would wait for)."""
    cpu_seconds: list[float]
    """User + system CPU seconds of each rank (by global rank), to its exit."""
    cpu_sys_seconds: list[float]
    """The system part of ``cpu_seconds``."""
    cpu_phases: dict[str, list[float]]
    """Each rank's CPU seconds at each marker (as ``phases``; ``gone``: to its exit)."""
    minor_faults: list[int]
    phases: dict[str, list[float]]
    """Seconds from the job's start to each marker (``imported``, ``setup``, ``fit_start``, ``fit_end``,
    ``returned``, ``exit``) and to each rank's exit (``gone``), by global rank."""
    other_cpu_seconds: float
    """CPU time the rest of the machine used while the job ran."""
    run_dir: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _child_subreaper(on: bool) -> bool:
    """Make this process adopt orphaned descendants (Linux ``prctl``); whether that took effect."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def measure_whole_process(
    *,
    mode: str,
    devices: int,
    checkpoint: CheckpointInfo,
    run_dir: Path,
    timeout: float,
    env: Optional[dict[str, str]] = None,
) -> WholeProcessRun:
    """Run one restore-only job of ``mode`` (``max_steps`` = the checkpoint's step: Lightning restores, skips the fit
    loop and returns) and time it from process start to the exit of its last rank. No memory sampler runs; the
    parent looks for the ranks every ``CHILD_SCAN_INTERVAL`` until it has seen them all, and otherwise only polls
    for exits."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*run_dir.glob("rank*.error.txt"), run_dir / "markers.jsonl"]:
        stale.unlink(missing_ok=True)
    config = {
        "action": "whole",
        "out": str(run_dir),
        "mode": mode,
        "devices": devices,
        "strategy": strategy_of(mode),
        "width": checkpoint.width,
        "depth": checkpoint.depth,
        "global_step": checkpoint.global_step,
        "ckpt_path": str(checkpoint.path),
    }
    own = {k: v for k, v in os.environ.items() if not k.startswith("SERIALIZED_RESTORE_")}
    extra = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONWARNINGS": "ignore"}
    full_env = job_env({**extra, **MODES.get(mode, {}), **(env or {})}, base=own)
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        full_env.pop(key, None)
    busy_before, own_before = system_busy_seconds(), _own_cpu_seconds()
    adopted = _child_subreaper(True)
    gone_at: dict[int, float] = {}  # pid -> seconds from the start to its exit (as seen here)
    rusage_of: dict[int, Any] = {}  # pid -> its resource usage, where it was reaped here
    known: set[int] = set()
    returncode: Optional[int] = None
    try:
        with open(run_dir / "job.log", "w") as log:
            wall_started, started = time.time(), time.monotonic()
            proc = start_job(JOB, config, cwd=run_dir, env=full_env, stdout=log)
            deadline, scanned = started + timeout, -CHILD_SCAN_INTERVAL
            try:
                while time.monotonic() < deadline:
                    now = time.monotonic()
                    rank0_gone = proc.pid in gone_at
                    if not rank0_gone and len(known) < devices - 1 and now - scanned >= CHILD_SCAN_INTERVAL:
                        scanned = now
                        with contextlib.suppress(psutil.NoSuchProcess):
                            known.update(c.pid for c in psutil.Process(proc.pid).children(recursive=True))
                    for pid in [proc.pid, *known]:
                        if pid in gone_at:
                            continue
                        try:
                            reaped, status, rusage = os.wait4(pid, os.WNOHANG)
                        except ChildProcessError:
                            # not a child of this process: rank 0 still lives (then it is rank 0's), or it was
                            # reaped elsewhere, or this process could not become a subreaper
                            if rank0_gone and not _exists(pid):
                                gone_at[pid] = time.monotonic() - started
                            continue
                        if reaped:
                            gone_at[pid], rusage_of[pid] = time.monotonic() - started, rusage
                            if pid == proc.pid:
                                returncode = proc.returncode = os.waitstatus_to_exitcode(status)
                    if proc.pid in gone_at and known <= gone_at.keys():
                        break
                    time.sleep(EXIT_POLL_INTERVAL)
            finally:
                kill_job(proc)
    finally:
        if adopted:
            _child_subreaper(False)
            for pid in known - gone_at.keys():  # killed stragglers, adopted: leave no zombie behind
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
    timed_out = proc.pid not in gone_at or not known <= gone_at.keys()
    other = system_busy_seconds() - busy_before - (_own_cpu_seconds() - own_before)
    markers_file = run_dir / "markers.jsonl"
    lines = markers_file.read_text().splitlines() if markers_file.exists() else []
    markers = [json.loads(line) for line in lines if line.strip()]
    exits = {m["rank"]: m for m in markers if m["event"] == "exit"}
    if timed_out or returncode != 0 or len(exits) != devices:
        errors = "".join(p.read_text() for p in sorted(run_dir.glob("rank*.error.txt")))
        tail = (errors + "\n" + (run_dir / "job.log").read_text(errors="replace"))[-4000:]
        why = f"timed out after {timeout:.0f}s" if timed_out else f"exited with {returncode}"
        raise JobFailed(f"whole-process job in {run_dir} {why}; {len(exits)} of {devices} ranks exited:\n{tail}")
    phases: dict[str, list[float]] = {}
    for event in ("imported", "setup", "fit_start", "fit_end", "returned", "exit"):
        by_rank = {m["rank"]: m["t"] - wall_started for m in markers if m["event"] == event}
        if by_rank:
            phases[event] = [round(by_rank[r], 3) for r in sorted(by_rank)]
    # each rank's own figures where it was reaped here (all of them, as a subreaper), else its atexit figures
    pid_of = {rank: m["pid"] for rank, m in exits.items()}
    at_exit = {rank: m["cpu_user"] + m["cpu_sys"] for rank, m in exits.items()}
    cpu, cpu_sys, faults, gone = [], [], [], []
    for rank in sorted(exits):
        rusage = rusage_of.get(pid_of[rank])
        cpu.append(round(rusage.ru_utime + rusage.ru_stime if rusage else at_exit[rank], 3))
        cpu_sys.append(round(rusage.ru_stime if rusage else exits[rank]["cpu_sys"], 3))
        faults.append(rusage.ru_minflt if rusage else exits[rank]["minflt"])
        gone.append(round(gone_at.get(pid_of[rank], phases["exit"][rank]), 3))
    phases["gone"] = gone
    cpu_phases: dict[str, list[float]] = {}
    for event in phases:
        by_rank = {m["rank"]: m["cpu"] for m in markers if m["event"] == event and "cpu" in m}
        if len(by_rank) == devices:
            cpu_phases[event] = [round(by_rank[r], 3) for r in sorted(by_rank)]
    cpu_phases["gone"] = cpu
    return WholeProcessRun(
        mode=mode,
        devices=devices,
        seconds=max(gone_at.values()),
        rank0_seconds=gone_at[proc.pid],
        cpu_seconds=cpu,
        cpu_sys_seconds=cpu_sys,
        cpu_phases=cpu_phases,
        minor_faults=faults,
        phases=phases,
        other_cpu_seconds=max(0.0, other - sum(cpu)),
        run_dir=str(run_dir),
    )


def _exists(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has exited)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


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


def mlp_shape(params: int, depth: int) -> tuple[int, int]:
    """(width, depth) of the benchmark MLP closest to ``params`` parameters."""
    width = max(8, round((params / depth) ** 0.5))
    return width, depth


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
    """Train the MLP ``steps`` Adam steps and save it with ``trainer.save_checkpoint``, unless already cached.

    Returns the checkpoint and whether it was created now. The cache key is the model's shape, steps, devices,
    accelerator (a checkpoint saved from a GPU model holds CUDA tensors) and ``strategy`` (default: ``ddp`` for more
    than one device; ``fsdp`` saves a full checkpoint through Lightning's ``FSDPStrategy``, GPU only).
    """
    width, depth = mlp_shape(params, depth)
    name = f"mlp-w{width}-d{depth}-s{steps}-n{devices}" + ("" if accelerator == "cpu" else f"-{accelerator}")
    name += f"-{strategy}" if strategy else ""
    ckpt_path = out_dir / f"{name}.ckpt"
    meta_path = out_dir / f"{name}.json"
    created = False
    if not (ckpt_path.is_file() and meta_path.is_file()):
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
        created = True
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
        partial = target.with_suffix(".partial")
        torch.save(state, partial)
        partial.rename(target)
    warm_page_cache(target)
    return target


def warm_page_cache(path: Path) -> None:
    """Read the file once, so that every measured run finds it in the page cache."""
    with open(path, "rb") as f:
        while f.read(64 * 2**20):
            pass


# ---------------------------------------------------------------- one restore


@dataclass
class RestoreRun:
    mode: str
    entry: str
    devices: int
    window_start: float
    window_end: float
    anon_peak: int
    """Peak of the tree's summed anonymous memory (fast channel, ``RssAnon``) inside the window, bytes."""
    anon_end: int
    """Summed anonymous memory (fast channel) at the last sample inside the window, bytes."""
    smaps_anon_peak: int
    """Peak of the summed ``Anonymous:`` of ``smaps_rollup`` inside the window, bytes."""
    pss_peak: int
    """Peak of the node's PSS inside the window, bytes: at every fast sample, its anonymous memory plus the
    non-anonymous part of PSS (``Pss - Pss_Anon``: file-backed and shared memory) of the full sweep nearest in
    time. Anonymous memory changes fast and is private to a process (its PSS is the page count), while the rest
    changes slowly; a full sweep takes too long to catch the peak of the sum by itself."""
    pss_sweep_peak: int
    """Peak of the summed ``Pss:`` of the full sweeps inside the window, bytes."""
    optimizer_state_bytes: int
    """Optimizer state held in host memory by all ranks together at the end of the window, bytes."""
    optimizer_state_mapped_bytes: int
    """The part of ``optimizer_state_bytes`` that lies in memory-mapped file pages, not in private memory, bytes."""
    window_cpu_seconds: float
    """CPU time (user + system) all ranks together used inside the window, from the first to the last sample."""
    checked: bool
    exact: bool
    mismatches: list[str]
    fast_samples: int
    fast_max_gap: float
    sweeps: int
    sweep_max_duration: float
    woke_before_window: float
    """Seconds between the sampler's switch to full rate and the window's start (negative: it switched late)."""
    rss_anon_vs_anonymous: float
    """Largest disagreement between ``Anonymous:`` and ``RssAnon`` of one process in a sweep in the window, bytes."""
    job_seconds: float
    other_cpu_seconds: float
    """CPU time used by other processes on the machine while the job ran."""
    run_dir: str
    gpu_bytes: Optional[int] = None
    """GPU memory allocated by torch on all ranks together at the end of the window (``None`` on CPU), bytes."""
    gpu_peak_bytes: Optional[int] = None
    """Sum over ranks of each rank's peak of GPU memory allocated by torch from ``setup`` to the window's end."""
    timeline: list[tuple[float, int]] = field(default_factory=list)
    """Fast-channel samples from ``TIMELINE_MARGIN`` before the window to its end, as (seconds since the window
    start, bytes), reduced to the largest value per ``TIMELINE_BIN``."""

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
) -> RestoreRun:
    """Run one restore (or, for a mode in ``BASELINES``, the same job without a checkpoint) and measure it.

    ``strategy`` replaces the mode's own (``strategy_of``): ``fsdp`` for Lightning's stock ``FSDPStrategy`` on GPU."""
    ckpt_path = None if mode in BASELINES else str(checkpoint.path)
    fabric = mode in FABRIC_MODES + FABRIC_FSDP_MODES
    if ckpt_path is not None and fabric:
        ckpt_path = str(fabric_checkpoint(checkpoint.path))
    config = {
        "accelerator": accelerator,
        "action": "fabric" if fabric else "restore",
        "out": str(run_dir),
        "mode": mode,
        "entry": entry,
        "devices": devices,
        "strategy": strategy or strategy_of(mode),
        "optimizer": "zero" if mode in ZERO_MODES else "adam",
        "width": checkpoint.width,
        "depth": checkpoint.depth,
        "global_step": checkpoint.global_step,
        "ckpt_path": ckpt_path,
    }
    outcome = run_job(config, timeout=timeout, env=MODES.get(mode, {}), preexec_fn=preexec_fn)
    return analyse(outcome, mode=mode, entry=entry, devices=devices)


def analyse(outcome: JobOutcome, *, mode: str, entry: str, devices: int) -> RestoreRun:
    """The restore window from the ranks' markers, and the memory peaks the sampler saw inside it."""
    run_dir = outcome.run_dir
    markers = [json.loads(line) for line in (run_dir / "markers.jsonl").read_text().splitlines() if line.strip()]
    starts = [m["t"] for m in markers if m["event"] == "start"]
    ends = [m for m in markers if m["event"] == "end"]
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("rank*.json"))]
    if len(starts) != devices or len(ends) != devices or len(ranks) != devices:
        raise JobFailed(
            f"job in {run_dir}: expected {devices} ranks to mark their restore window and report, got"
            f" {len(starts)} starts, {len(ends)} ends, {len(ranks)} reports:\n{outcome.log_tail()}"
        )
    start, end = min(starts), max(m["t"] for m in ends)
    assert outcome.sampler is not None
    fast = [s for s in outcome.sampler.fast if start <= s[0] <= end]
    if not fast:  # a window shorter than the sampling interval: take the samples on either side of it
        samples = outcome.sampler.fast
        fast = [s for s in samples if s[0] < start][-1:] + [s for s in samples if s[0] > end][:1]
    inside = [s for s in outcome.sampler.sweeps if start <= s[0] and s[1] <= end]
    if not inside:  # a window shorter than one sweep: take the sweeps that overlap it, else those on either side
        inside = [s for s in outcome.sampler.sweeps if s[0] <= end and s[1] >= start]
    if not inside:
        sweeps = outcome.sampler.sweeps
        inside = [s for s in sweeps if s[1] < start][-1:] + [s for s in sweeps if s[0] > end][:1]
    if not fast or not inside:
        raise JobFailed(f"job in {run_dir}: no memory sample inside its restore window ({end - start:.3f}s)")
    times = [start] + [s[0] for s in fast] + [end]
    mismatches = [f"rank {r['global_rank']}: {m}" for r in ranks for m in r["mismatches"]]
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
        pss_peak=_pss_peak(fast, outcome.sampler.sweeps),
        pss_sweep_peak=max(s[3] for s in inside),
        optimizer_state_bytes=sum(m.get("optimizer_state_bytes", 0) for m in ends),
        optimizer_state_mapped_bytes=sum(m.get("optimizer_state_mapped_bytes", 0) for m in ends),
        checked=all(r["checked"] for r in ranks),
        exact=all(r["exact"] for r in ranks),
        mismatches=mismatches,
        fast_samples=len(fast),
        fast_max_gap=max(b - a for a, b in zip(times, times[1:])),
        sweeps=len(inside),
        sweep_max_duration=max(s[1] - s[0] for s in inside),
        woke_before_window=start - outcome.sampler.woke_at,
        rss_anon_vs_anonymous=max(s[4] for s in inside),
        job_seconds=outcome.elapsed,
        other_cpu_seconds=outcome.other_cpu_seconds,
        run_dir=str(run_dir),
        gpu_bytes=_sum_or_none(r.get("gpu_bytes") for r in ranks),
        gpu_peak_bytes=_sum_or_none(r.get("gpu_peak_bytes") for r in ranks),
        timeline=_timeline(outcome.sampler.fast, start, end),
    )


def _sum_or_none(values: Iterable[Optional[int]]) -> Optional[int]:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


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


# ---------------------------------------------------------------- reporting helpers


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
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
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
