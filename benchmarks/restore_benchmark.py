"""Node memory and time of resuming a Lightning job from a checkpoint: upstream vs ``serialized_restore``.

For every checkpoint size, number of local ranks N and mode (``modes.py``: the modes and where the default run
measures each), a real job (gloo on CPU, Lightning's own launcher) restores the same checkpoint through
``trainer.fit(ckpt_path=...)`` and ``trainer.validate(ckpt_path=...)`` (Fabric: ``fabric.load``) while this process
samples the memory of its whole process tree (``_measure.py``); the family's baseline job, without a checkpoint, gives
what the program holds anyway. Each cell runs ``--repeats`` times (3), each repeat after its own baseline job, the
modes' order rotating: medians and ranges. At every size the run also measures the hardware's floor on the same
machine: reading the file once, and all N ranks at once copying what each keeps, the optimizer state into new memory.
``report.py`` turns ``results.json`` into the report, the plots and ``benchmark_results.json`` (one record per size,
N, mode, entry point and page cache state).

Before each job the checkpoint is put in the page cache and checked there with ``mincore`` (``--cache warm``, the
default), or dropped from it (``os.sync()``, ``posix_fadvise(POSIX_FADV_DONTNEED)``) and checked gone (``cold``: a
resume on a node that does not hold it; the run stops if a page stays), or both, alternating. A cold job is preceded
by a cold sequential read of the same file (8 MiB reads into one reused buffer, as ``dd``): the storage's own rate,
in the same run.

    python benchmarks/restore_benchmark.py             # default run, 8M and 126M parameters, 3 jobs per cell (about
                                                       # 14 minutes on 2 idle cores): docs/benchmarks.md,
                                                       # docs/benchmark_results.json (the warm records)
    python benchmarks/restore_benchmark.py --quick     # smoke run (8M parameters, N = 1, 2, 1 job per cell; 2-3
                                                       # minutes): bench_output/quick/
    python benchmarks/restore_benchmark.py --dry-run   # the jobs a run would run, and how many
    python benchmarks/restore_benchmark.py --whole-only --docs   # whole-process times, 5 of each mode per cell
                                                       # (about 10 minutes): that section of docs/benchmarks.md
    python benchmarks/restore_benchmark.py --cold --docs   # cold resumes, each warm and cold, 3 of each:
                                                       # upstream, ours-true, ours-1, ours-true-eager at N = 2 and 4
                                                       # at 126M, fit and validate, and whole processes (upstream,
                                                       # ours-true); upstream and ours-true at N = 4 at 8M and 40M
                                                       # (the time against S); 204 jobs, about an hour on 2 cores:
                                                       # the section "Cold resumes" of docs/benchmarks.md, its plot,
                                                       # the cold records of docs/benchmark_results.json
    python benchmarks/restore_benchmark.py --cold --params 126000000   # the same at 126M only (132 jobs)
    python benchmarks/report.py bench_output/full/results.json --docs   # the report again, from a run's results

``--modes`` / ``--devices`` / ``--params`` / ``--entries`` measure other cells: each mode at every N given from its
smallest sensible N on. The other committed pages come from such runs (``--no-docs``; the page is the run's
``report.md``, its plots go to ``docs/img/<page>/``):

    --modes others --devices 4 --params 126000000 --output-dir bench_output/others --no-docs
                                                       # the anchors (mmap-plugin, proposal-2021) and the other
                                                       # families (FSDP, ZeRO, OSS, Fabric): modes.OTHERS, about 18
                                                       # minutes: docs/benchmarks_strategies.md
    --modes fabric-fsdp-upstream,fabric-fsdp-ours,fabric-upstream,fabric-ours --devices 2,4
        --output-dir bench_output/fabric --no-docs      # docs/benchmarks_fabric_sizes.md
    --modes upstream,ours-true-eager,ours-true --devices 2,4 --output-dir bench_output/eager --no-docs
                                                       # docs/benchmarks_eager_sizes.md

Whole-process jobs (``--whole-modes``, default ``upstream`` and ``ours-true``, restore only: ``max_steps`` = the
checkpoint's step) alternate ABBA and are timed from the start of the first process to the exit of the last rank;
they run in ``--whole-only`` and ``--cold`` runs (``WHOLE_PLAN``) and, one of each at the largest N, in ``--quick``;
``--whole-repeats`` adds them to any run.

Exits non-zero if any restore is not bit-for-bit exact or any job fails.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _measure, report  # noqa: E402
from benchmarks._cache import cold_read, timed_read  # noqa: E402
from benchmarks._measure import CACHES, GIB, READ_CHUNK, JobFailed  # noqa: E402
from benchmarks._sampler import FAST_INTERVAL  # noqa: E402
from benchmarks.modes import BASELINES, DEFAULT, MEASURED, MODES, OTHERS, baseline_of, family_of  # noqa: E402
from harness.processes import fresh_job_env, run_to_exit  # noqa: E402

SIZES = (8_000_000, 40_000_000, 126_000_000)  # an 8-layer MLP; S ~ 12 bytes per parameter (weights + Adam)
DEFAULT_SIZES = (8_000_000, 126_000_000)  # the default run's: 3 jobs per cell at three sizes would take 18 minutes
DEPTH = 8
TRAIN_STEPS = 3  # Adam steps taken before the checkpoint is saved
DEVICES = (1, 2, 4)
ENTRIES = ("fit", "validate")
JOB_TIMEOUT = 600.0
WHOLE_MODES = ("upstream", "ours-true")
# whole-process jobs: N at the largest size, N at every smaller one (each N = 4 cell costs about 1.5 minutes per 3
# jobs of each mode on 2 cores); jobs of each mode per cell: --whole-only, --quick, --cold
WHOLE_PLAN = {"whole": ((1, 2, 4), (4,)), "cold": ((2, 4), ())}
WHOLE_REPEATS = {"whole": 5, "quick": 1, "full": 0, "cold": 3}
REPEATS = {"quick": 1}  # measured jobs per cell where --repeats is not given; else 3
QUICK = {"params": (8_000_000,), "devices": (1, 2), "modes": ("upstream", "ours-true", "ours-1")}  # S ~ 92 MiB
# --cold: the modes of the cold comparison at N = 2 and 4 at the largest size, upstream's and True's at N = 4
# at every smaller one (the time against S), each warm and cold, paired
COLD = {
    "largest": {"upstream": (2, 4), "ours-true": (2, 4), "ours-1": (2, 4), "ours-true-eager": (2, 4)},
    "smaller": {"upstream": (4,), "ours-true": (4,)},
}
REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/restore_benchmark.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--quick", action="store_true", help="smoke run: 8M parameters, N = 1, 2, upstream, ours-true, ours-1")
    add("--params", type=_ints, help=f"checkpoint sizes in parameters (default {','.join(map(str, SIZES))})")
    add("--devices", type=_ints, help="local ranks N (default: where modes.py places each mode; else 1,2,4)")
    add(
        "--modes",
        type=_names,
        help=f"modes (default {','.join(DEFAULT)}; any of {','.join(MEASURED)}; `others`: {','.join(OTHERS)})",
    )
    add("--entries", type=_names, help="entry points (default fit,validate)")
    add("--repeats", type=int, help="measured jobs per cell (default 3; --quick 1): medians and their range")
    add(
        "--whole-repeats",
        type=int,
        help="whole-process jobs of each mode per cell (--whole-only 5, --cold 3, --quick 1, else 0)",
    )
    add("--whole-modes", type=_names, help=f"modes of the whole-process jobs (default {','.join(WHOLE_MODES)})")
    add("--whole-only", action="store_true", help="only the whole-process jobs (and the floor): bench_output/whole")
    add(
        "--cache",
        choices=("warm", "cold", "both"),
        help="the checkpoint in the page cache before each job (warm; the default, but --cold: both), dropped from it"
        " (cold: the storage's own cold read rate is measured before each cold job), or both, alternating",
    )
    add("--cold", action="store_true", help="the cold comparison (COLD, --cache both, 3 whole-process jobs per cell)")
    add("--dry-run", action="store_true", help="print the jobs of the run and exit")
    add("--output-dir", type=Path, help="checkpoints, per-job data, results and report (default bench_output/<run>)")
    add("--docs", action=argparse.BooleanOptionalAction, help="write docs/ (default: yes for the default run only)")
    add("--timeout", type=float, default=JOB_TIMEOUT, help="seconds before a job is killed")
    args = parser.parse_args(argv)
    if sum((args.quick, args.whole_only, args.cold)) > 1:
        parser.error("--quick, --whole-only and --cold are runs of their own: give one")
    args.default_plan = not (args.quick or args.modes or args.devices)
    kind = args.kind = "quick" if args.quick else "whole" if args.whole_only else "cold" if args.cold else "full"
    default_sizes = DEFAULT_SIZES if kind == "full" and args.default_plan else SIZES
    args.params = tuple(sorted(set(args.params or (QUICK["params"] if args.quick else default_sizes))))
    args.devices = args.devices or (QUICK["devices"] if args.quick else (2, 4) if args.cold else DEVICES)
    args.modes = args.modes or (QUICK["modes"] if args.quick else tuple(COLD["largest"]) if args.cold else DEFAULT)
    args.modes = tuple(m for name in args.modes for m in (OTHERS if name == "others" else (name,)))
    args.entries = args.entries or ENTRIES
    args.whole_modes = args.whole_modes or WHOLE_MODES
    unknown = [m for m in args.modes + args.whole_modes if m not in MEASURED]
    unknown += [e for e in args.entries if e not in ENTRIES]
    if unknown:
        parser.error(f"unknown mode or entry point: {', '.join(unknown)}")
    if any(family_of(m).action != "restore" for m in args.whole_modes):
        parser.error("--whole-modes: the Trainer's modes only")
    args.repeats = REPEATS.get(kind, 3) if args.repeats is None else args.repeats
    args.whole_repeats = WHOLE_REPEATS[kind] if args.whole_repeats is None else args.whole_repeats
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.whole_only and args.whole_repeats < 1:
        parser.error("--whole-only needs --whole-repeats of at least 1")
    args.cache = args.cache or ("both" if args.cold else "warm")
    args.caches = CACHES if args.cache == "both" else (args.cache,)
    args.output_dir = (args.output_dir or REPO / "bench_output" / kind).resolve()
    args.docs = (kind == "full" and args.default_plan) if args.docs is None else args.docs
    return args


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def placement(args: argparse.Namespace, params: int) -> dict[str, tuple[int, ...]]:
    """Where each mode is measured at one size, ``{mode: (N, ...)}``: the default run as ``modes.MODES`` says;
    otherwise every N given from the mode's smallest sensible N on (``--whole-only``: none)."""
    if args.whole_only:
        return {}
    where = {}
    largest = params == max(args.params)
    for mode in args.modes:
        spec = MODES[mode]
        if args.default_plan and args.cold:
            where[mode] = COLD["largest" if largest else "smaller"].get(mode, ())
        elif args.default_plan:
            where[mode] = spec.largest if largest else spec.smaller
        else:
            where[mode] = tuple(n for n in args.devices if n >= spec.min_n)
    return {mode: devices for mode, devices in where.items() if devices}


def plan(args: argparse.Namespace, params: int) -> list[tuple[int, str, str, int]]:
    """The memory jobs at one size as (N, entry point, mode, repeat): per (N, entry point) each family's baseline
    first, then its modes, their order rotated between repeats so that no mode always follows the baseline."""
    where, jobs = placement(args, params), []
    for devices in sorted({n for ns in where.values() for n in ns}):
        for entry in args.entries:
            modes = [m for m, ns in where.items() if devices in ns and entry in family_of(m).entries]
            for repeat in range(args.repeats):
                for baseline in dict.fromkeys(map(baseline_of, modes)):
                    family = [m for m in modes if baseline_of(m) == baseline]
                    shift = repeat % len(family)
                    jobs += [(devices, entry, m, repeat) for m in [baseline, *family[shift:], *family[:shift]]]
    return jobs


def whole_plan(args: argparse.Namespace, params: int) -> list[tuple[int, str, int]]:
    """The whole-process jobs at one size as (N, mode, repeat): per N the modes (``--whole-modes``) in the order ABBA
    ABBA, so that each follows each equally often (a job can leave the machine in a state that costs the next one).
    ``WHOLE_PLAN`` in the default plan of ``--whole-only`` and ``--cold``; else every N given (``--quick``: the
    largest)."""
    if args.whole_repeats < 1:
        return []
    if args.default_plan:
        devices = WHOLE_PLAN.get(args.kind, ((), ()))[params != max(args.params)]
    else:
        devices = args.devices[-1:] if args.quick else args.devices
    modes = args.whole_modes
    return [
        (n, mode, repeat)
        for n in devices
        for repeat in range(args.whole_repeats)
        for mode in (modes if repeat % 2 == 0 else modes[::-1])
    ]


def with_caches(jobs: list[tuple[Any, ...]], caches: tuple[str, ...], baseline: Any = None) -> list[tuple[Any, ...]]:
    """Each job of ``plan`` or ``whole_plan`` once per page cache state in ``caches``, in turn (ABAB: the first of a
    repeat's pair alternates with the repeat, its last field), as the job with its cache state appended; a baseline
    job (``baseline(job)`` true) reads no checkpoint: it runs once, with the first cache state."""
    out = []
    for job in jobs:
        if baseline is not None and baseline(job):
            out.append((*job, caches[0]))
            continue
        out += [(*job, cache) for cache in (caches if job[-1] % 2 == 0 else caches[::-1])]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every size in ``args.params``, smallest first: its checkpoint, its floor, its memory jobs, its whole-process
    jobs, each job after the page cache was put in its state (``--cache``). ``results.json`` is rewritten after every
    job."""
    started = time.monotonic()
    out: Path = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    _measure.compile_checkout()  # the ranks read the package's bytecode, as from an installed package
    results: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/restore_benchmark.py", *map(shlex.quote, sys.argv[1:])]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _measure.machine_info(),
        "package": _package_state(),
        "quick": args.quick,
        "whole_only": args.whole_only,
        "kind": args.kind,
        "caches": list(args.caches),
        "sizes": [],
        "failures": [],
    }

    def save() -> None:
        results["wall_seconds"] = time.monotonic() - started
        (out / "results.json").write_text(json.dumps(results, indent=1))

    for params in args.params:
        label = f"{params / 1e6:.0f}M " if len(args.params) > 1 else ""
        runs_dir = out / "runs" / (f"p{params // 1_000_000}M" if len(args.params) > 1 else "")
        jobs, whole_jobs = plan(args, params), whole_plan(args, params)
        if not jobs and not whole_jobs:
            continue
        jobs = with_caches(jobs, args.caches, baseline=lambda job: job[2] in BASELINES)
        whole_jobs = with_caches(whole_jobs, args.caches)
        checkpoint, created = _measure.create_checkpoint(out / "checkpoints", params, DEPTH, steps=TRAIN_STEPS)
        _measure.warm_page_cache(checkpoint.path)
        print(
            f"checkpoint: {checkpoint.path.name}, {checkpoint.params:,} parameters, S = {checkpoint.size_gib:.3f}"
            f" GiB ({'created' if created else 'cached'})",
            flush=True,
        )
        size: dict[str, Any] = {
            "checkpoint": {**vars(checkpoint), "path": str(checkpoint.path)},
            "placement": placement(args, params),
            "entries": list(args.entries),
            "repeats": args.repeats,
            "whole_repeats": args.whole_repeats,
            "caches": list(args.caches),
            "fast_interval_s": FAST_INTERVAL,
            "runs": [],
            "whole": [],
        }
        results["sizes"].append(size)
        if not args.quick and len(results["sizes"]) == 1:  # unmeasured: Python's and torch's files into the page cache
            _measure.measure_restore(
                mode="baseline",
                entry="fit",
                devices=1,
                checkpoint=checkpoint,
                run_dir=out / "runs" / "warm-up",
                timeout=args.timeout,
            )
        devices = sorted({n for n, *_ in jobs + whole_jobs})
        try:
            size["floor"] = measure_floor(
                checkpoint, devices, runs_dir / "floor", args.timeout, cold="cold" in args.caches, repeats=args.repeats
            )
            copies = ", ".join(
                f"N={c['devices']}: {c['params_s']:.3f}s + {c['optimizer_fresh_s']:.3f}s" for c in size["floor"]["copy"]
            )
            cold = size["floor"].get("cold_read_s")
            rate = f"; cold {cold:.3f}s ({checkpoint.size_bytes / cold / GIB:.2f} GiB/s)" if cold else ""
            print(
                f"{label}floor: read {size['floor']['read_s']:.3f}s{rate}; copy weights + optimizer state into new"
                f" memory {copies}"
            )
        except JobFailed as err:
            results["failures"].append(f"{label}floor: {err}")
            size["floor"] = {"read_s": None, "copy": []}
        for i, (n, entry, mode, repeat, cache) in enumerate(jobs, 1):
            where = f"{label}[{i}/{len(jobs)}] N={n} {entry:8s} {mode:16s}"
            where += f" {cache}" if len(args.caches) > 1 or cache != "warm" else ""
            try:
                result = _measure.measure_restore(
                    mode=mode,
                    entry=entry,
                    devices=n,
                    checkpoint=checkpoint,
                    run_dir=runs_dir / f"n{n}-{entry}-{mode}-r{repeat}{'' if cache == 'warm' else '-' + cache}",
                    timeout=args.timeout,
                    cache=cache,
                )
            except JobFailed as err:
                results["failures"].append(f"{label}N={n} {entry} {mode} {cache}: {err}")
                print(f"{where} FAILED\n{err}", flush=True)
                continue
            size["runs"].append({**result.as_dict(), "repeat": repeat})
            verdict = "n/a" if not result.checked else "exact" if result.exact else "NOT EXACT"
            read = f"  cold read {result.cold_read_s:.2f}s" if result.cold_read_s is not None else ""
            print(
                f"{where} window {result.window:6.2f}s  anon peak {result.anon_peak / GIB:6.2f} GiB  pss peak"
                f" {result.pss_peak / GIB:6.2f} GiB  optimizer state {result.optimizer_state_bytes / GIB:5.2f} GiB"
                f"  {verdict}  (job {result.job_seconds:.0f}s{read})",
                flush=True,
            )
            save()
        for i, (n, mode, repeat, cache) in enumerate(whole_jobs, 1):
            where = f"{label}[whole {i}/{len(whole_jobs)}] N={n} {mode:10s}"
            where += f" {cache}" if len(args.caches) > 1 or cache != "warm" else ""
            try:
                whole = measure_whole_process(
                    mode=mode,
                    devices=n,
                    checkpoint=checkpoint,
                    run_dir=runs_dir / f"whole-n{n}-{mode}-r{repeat}{'' if cache == 'warm' else '-' + cache}",
                    timeout=args.timeout,
                    cache=cache,
                )
            except JobFailed as err:
                results["failures"].append(f"{label}whole process N={n} {mode} {cache}: {err}")
                print(f"{where} FAILED\n{err}", flush=True)
                continue
            size["whole"].append({**whole, "repeat": repeat})
            read = f"  cold read {whole['cold_read_s']:.2f}s" if whole.get("cold_read_s") is not None else ""
            print(
                f"{where} whole process {whole['seconds']:6.2f}s  CPU {sum(whole['cpu_seconds']):6.2f}s"
                f"  other load {whole['other_cpu_seconds'] / whole['seconds']:.2f}{read}",
                flush=True,
            )
            save()
        _measure.warm_page_cache(checkpoint.path)
    save()
    return results


# ---------------------------------------------------------------- the benchmark's own jobs


def measure_whole_process(
    *,
    mode: str,
    devices: int,
    checkpoint: _measure.CheckpointInfo,
    run_dir: Path,
    timeout: float,
    cache: Optional[str] = None,
) -> dict[str, Any]:
    """One restore-only job of ``mode`` (``max_steps`` = the checkpoint's step: Lightning restores, skips the fit loop
    and returns), timed from the start of its first process to the exit of its last rank (``run_to_exit``: CPU time
    from ``wait4``), with each rank's phases; ``cache`` as for ``_measure.measure_restore``. No memory sampler
    runs."""
    _measure.fresh_dir(run_dir)
    config = _measure.job_config(mode, "fit", devices, checkpoint, run_dir, action="whole")
    prepared = _measure.prepare_cache(config["ckpt_path"], cache) if cache else {}
    busy_before, own_before = _measure.system_busy_seconds(), _measure.own_cpu_seconds()
    env = fresh_job_env(_measure.reader_env(mode))
    returncode, gone, started = run_to_exit(
        _measure.JOB, config, cwd=run_dir, env=env, log=run_dir / "job.log", ranks=devices, timeout=timeout
    )
    other = _measure.system_busy_seconds() - busy_before - (_measure.own_cpu_seconds() - own_before)
    marks = _measure.markers(run_dir)
    exits = {m["rank"]: m for m in marks if m["event"] == "exit"}
    if returncode != 0 or len(exits) != devices:
        why = "timed out" if returncode is None else f"exited with {returncode}"
        tail = _measure.log_tail(run_dir)
        raise JobFailed(f"whole-process job in {run_dir} {why}; {len(exits)} of {devices} ranks exited:\n{tail}")
    phases: dict[str, list[float]] = {}
    for event in ("imported", "setup", "fit_start", "fit_end", "returned", "exit"):
        by_rank = {m["rank"]: m["t"] - started for m in marks if m["event"] == event}
        if by_rank:
            phases[event] = [round(by_rank[r], 3) for r in sorted(by_rank)]
    # each rank's figures where it was reaped here (all of them, as a subreaper), else those of its exit marker
    cpu, phases["gone"] = [], []
    for rank in sorted(exits):
        seconds, usage = gone.get(exits[rank]["pid"], (phases["exit"][rank], None))
        cpu.append(round(usage.ru_utime + usage.ru_stime if usage else exits[rank]["cpu"], 3))
        phases["gone"].append(round(seconds, 3))
    whole = max(seconds for seconds, _ in gone.values())
    io = {}
    for key in ("major_faults", "read_bytes"):  # all ranks, from Trainer setup to on_fit_end (the restore)
        before = {m["rank"]: m[key] for m in marks if m["event"] == "setup" and key in m}
        after = {m["rank"]: m[key] for m in marks if m["event"] == "fit_end" and key in m}
        io[key] = sum(after[r] - before[r] for r in after if r in before) if before else None
    return {
        "mode": mode,
        "devices": devices,
        "seconds": whole,
        "cpu_seconds": cpu,
        "phases": phases,
        "other_cpu_seconds": max(0.0, other - sum(cpu)),
        "run_dir": str(run_dir),
        "cache": cache or "warm",
        "cold_read_s": prepared.get("cold_read_s"),
        "resident_bytes": prepared.get("resident_bytes"),
        **io,
    }


def measure_floor(
    checkpoint: _measure.CheckpointInfo,
    devices: list[int],
    run_dir: Path,
    timeout: float,
    cold: bool = False,
    repeats: int = 1,
) -> dict:
    """The hardware's floor at one size: seconds to read the file once, sequentially into one reused buffer, from
    the page cache as a warm restore finds it (the median of 3); with ``cold``, also from storage, its pages dropped
    before each read (``cold_read_s``, the median of 3: the storage's own sequential read rate); and, for each N, N
    ranks at once (a Fabric DDP job, launched as the restores are: ``_job.copy_floor``) copying what each keeps from
    the memory-mapped checkpoint: into freshly allocated memory (``*_fresh_s``: first touch included) and into memory
    allocated and written beforehand (``params_s``, ``optimizer_s``); the weights, then, after a barrier, the
    optimizer state, each phase from the first rank's start to the last rank's end: the median of ``repeats``
    repeats in one job per N, each repeat's in ``*_all_s``. The floor (``report.records``) takes the weights into
    memory written beforehand (the model's own, which the job without a checkpoint has too) and the optimizer state
    into new memory."""
    _measure.warm_page_cache(checkpoint.path)
    reads = [timed_read(checkpoint.path, READ_CHUNK) for _ in range(3)]
    floor: dict[str, Any] = {"read_s": statistics.median(reads), "read_all_s": reads, "read_chunk": READ_CHUNK}
    if cold:
        floor["cold_read_all_s"] = [cold_read(checkpoint.path, READ_CHUNK) for _ in range(3)]
        floor["cold_read_s"] = statistics.median(floor["cold_read_all_s"])
        _measure.warm_page_cache(checkpoint.path)
    copies = []
    for n in devices:
        out = run_dir / f"copy-n{n}"
        config = {"action": "copy", "out": str(out), "devices": n, "ckpt_path": str(checkpoint.path)}
        config["repeats"] = repeats
        _measure.run_job(config, timeout=timeout, sample=False)
        marks = [m for m in _measure.markers(out) if m["event"] == "copied"]
        if len(marks) != n * repeats:
            raise JobFailed(f"copy job in {out}: {len(marks)} of {n} x {repeats} ranks and repeats reported")
        copy: dict[str, Any] = {"devices": n}
        for phase in ("params", "optimizer"):
            for name in (phase, f"{phase}_fresh"):
                each = [[m for m in marks if m.get("repeat", 0) == repeat] for repeat in range(repeats)]
                copy[f"{name}_all_s"] = [max(m[name][1] for m in r) - min(m[name][0] for m in r) for r in each]
                copy[f"{name}_s"] = statistics.median(copy[f"{name}_all_s"])
            copy[f"{phase}_bytes"] = sum(m[f"{phase}_bytes"] for m in marks if m.get("repeat", 0) == 0)
        copies.append(copy)
    floor["copy"] = copies
    return floor


def _package_state() -> str:
    """The commit the measured ``serialized_restore`` comes from, and whether it had local changes."""
    git = ["git", "-C", str(REPO)]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        changes = subprocess.run([*git, "status", "--porcelain", "--", "serialized_restore"], capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    dirty = " with uncommitted changes in serialized_restore/" if changes.stdout.strip() else ""
    return f"commit {commit.stdout.strip()}{dirty}"


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        total = 0
        for params in args.params:
            jobs = with_caches(plan(args, params), args.caches, baseline=lambda job: job[2] in BASELINES)
            whole = with_caches(whole_plan(args, params), args.caches)
            floors = len({n for n, *_ in jobs + whole})
            total += len(jobs) + len(whole) + floors
            print(
                f"{params:,} parameters: {len(jobs)} memory jobs, {len(whole)} whole-process jobs, {floors} copy jobs"
            )
            for n, entry, mode, repeat, cache in jobs:
                print(f"  N={n} {entry:8s} {mode} (repeat {repeat}{'' if mode in BASELINES else ', ' + cache})")
            for n, mode, repeat, cache in whole:
                print(f"  N={n} whole    {mode} (restore only, repeat {repeat}, {cache})")
        print(f"{total} jobs in all, and one checkpoint per size (cached in --output-dir)")
        return 0
    if not any(plan(args, params) or whole_plan(args, params) for params in args.params):
        print("no job to run: every mode chosen needs more ranks than --devices gives (modes.py, min N)")
        return 2
    results = run(args)
    written = report.write(results, args.output_dir, docs=args.docs)
    print("\nwrote " + ", ".join(str(p) for p in written))
    report.print_summary(results)
    print(f"total {results['wall_seconds'] / 60:.1f} minutes")
    inexact = [
        f"{s['checkpoint']['params']:,} parameters, N={r['devices']} {r['entry']} {r['mode']}: {r['mismatches'][:3]}"
        for s in results["sizes"]
        for r in s["runs"]
        if r["checked"] and not r["exact"]
    ]
    for where in inexact:
        print(f"ERROR: restore not exact: {where}", file=sys.stderr)
    for failure in results["failures"]:
        print(f"ERROR: job failed: {failure.splitlines()[0]}", file=sys.stderr)
    return 1 if inexact or results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
