"""Node memory and time of resuming a Lightning DDP job from a checkpoint: upstream vs ``serialized_restore``.

For every number of local ranks N and every mode, a real DDP job (gloo on CPU, Lightning's own launcher) restores
the same checkpoint through ``trainer.fit(ckpt_path=...)`` and ``trainer.validate(ckpt_path=...)`` while this
process samples the memory of the job's whole process tree; a job without a checkpoint (``baseline``) gives what the
same program holds anyway. See ``docs/benchmarks.md`` for the definitions and the committed results, and
``benchmarks/_measure.py`` for how memory is sampled.

    python benchmarks/restore_benchmark.py            # full run (8M, 40M, 126M parameters, ~15 min): docs/benchmarks.md
    python benchmarks/restore_benchmark.py --quick    # smoke run (~8M parameters, N = 1, 2): bench_output/quick/
    python benchmarks/restore_benchmark.py --dry-run  # the jobs a run would measure
    python benchmarks/restore_benchmark.py --whole-only  # only the whole-process times (~5 min): bench_output/whole/

Every mode runs where ``DEFAULT_PLAN`` says: the headline modes at every size (N = 2 and 4, and N = 1 at the
largest), the anchors and variants at the largest only; each target is checked at every size it was measured at and
the worst case is the figure it reports. ``--modes`` / ``--devices`` / ``--params`` choose other cells.

After the memory jobs of each size, restore-only jobs of ``upstream`` and ``ours-true`` (``max_steps`` = the
checkpoint's step: Lightning restores, skips the fit loop and returns) alternate and are timed as whole processes, from
the start of the first process to the exit of the last rank (``WHOLE_PLAN``, ``--whole-repeats``).

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

from benchmarks import _measure  # noqa: E402
from benchmarks._measure import BASELINES, GIB, MODE_DESCRIPTIONS, JobFailed  # noqa: E402

# ---------------------------------------------------------------- configuration

# checkpoint sizes: an 8-layer MLP of this many parameters, S ~ 12 bytes/parameter (weights + Adam)
SIZES = (8_000_000, 40_000_000, 126_000_000)
DEPTH = 8
TRAIN_STEPS = 3  # Adam steps taken before the checkpoint is saved
DEVICES = (1, 2, 4)
ENTRIES = ("fit", "validate")
DDP_MODES = (
    "upstream", "mmap-plugin", "ours-off", "ours-true", "ours-2", "ours-true-eager", "proposal-2021"
)  # fmt: skip
FSDP_MODES = ("fsdp-upstream", "fsdp-ours")  # measured against their own baseline, `fsdp-baseline`
# sharded optimizer state (ZeroRedundancyOptimizer under DDP; fairscale OSS with its own baseline, `oss-baseline`);
# fit only: outside fit the optimizer state is dropped, whoever shards it
SHARDED_MODES = ("zero-upstream", "zero-ours", "oss-upstream", "oss-ours")
# Lightning Fabric's `fabric.load` of the model and optimizer (against its own baseline, `fabric-baseline`): "fit"
FABRIC_MODES = ("fabric-upstream", "fabric-ours")
# the same under Fabric's FSDP (against its own baseline, `fabric-fsdp-baseline`)
FABRIC_FSDP_MODES = ("fabric-fsdp-upstream", "fabric-fsdp-ours")
MODES = DDP_MODES + FSDP_MODES + SHARDED_MODES + FABRIC_MODES + FABRIC_FSDP_MODES
# entry points a mode runs at (default: all given)
MODE_ENTRIES = {mode: ("fit",) for mode in SHARDED_MODES + FABRIC_MODES + FABRIC_FSDP_MODES}
# The default run, within 15 minutes on 2 cores: where each mode is measured, as (N at the largest size, N at every
# smaller size). The headline modes run at every size at N = 2 and 4 (FSDP's at N = 4, the worst case, below the
# largest); the anchors and variants at the largest only.
# With one rank there are no turns to take, so the modes that differ in how ranks take turns start at N=2.
DEFAULT_PLAN: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "upstream": ((1, 2, 4), (2, 4)),
    "ours-true": ((1, 2, 4), (2, 4)),
    "fsdp-upstream": ((2, 4), (4,)),
    "fsdp-ours": ((2, 4), (4,)),
    "mmap-plugin": ((4,), ()),
    "proposal-2021": ((4,), ()),
    "ours-off": ((1,), ()),
    "zero-upstream": ((4,), ()),
    "zero-ours": ((4,), ()),
    "oss-upstream": ((4,), ()),
    "oss-ours": ((4,), ()),
    "fabric-upstream": ((2, 4), ()),
    "fabric-ours": ((2, 4), ()),
    "fabric-fsdp-upstream": ((4,), ()),
    "fabric-fsdp-ours": ((4,), ()),
}
# modes outside the default run (`--modes` measures them): k = 2 and the eager reader, variants of `ours-true`
EXTRA_MODES = tuple(m for m in MODES if m not in DEFAULT_PLAN)
# with --modes or --devices: every mode at every N given, except where it cannot differ from another mode
MODE_MAX_DEVICES = {"ours-off": 1}
MODE_MIN_DEVICES = {
    "ours-2": 3, "ours-true-eager": 2, "proposal-2021": 2, "fsdp-upstream": 2, "fsdp-ours": 2,
    "fabric-fsdp-upstream": 2, "fabric-fsdp-ours": 2,
}  # fmt: skip
REPEATS = 1
JOB_TIMEOUT = 600.0
# whole-process times (restore only, alternating upstream and ours-true): at which N, as (N at the largest size, N at
# every smaller size) in the default run, and how many jobs of each mode per cell (the median is reported). Every N
# the memory part runs at the largest size, and N = 4, the case and the largest ratio of ranks to cores, at the
# smaller ones: each N = 4 cell costs about 1.5 minutes on 2 cores, every cell at every size would add 9 minutes.
WHOLE_PLAN: tuple[tuple[int, ...], tuple[int, ...]] = ((1, 2, 4), (4,))
WHOLE_REPEATS = 3
QUICK_WHOLE_REPEATS = 1
WHOLE_MODES = _measure.WHOLE_MODES
TARGET_WHOLE_TIME = 1.0  # x upstream's whole-process time, every size and N measured

QUICK_PARAMS = 8_000_000  # S ~ 92 MiB: big enough that the restores show above a few MiB of fixed costs
QUICK_DEVICES = (1, 2)
QUICK_MODES = ("upstream", "ours-true")

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
DEFAULT_OUTPUT = REPO / "bench_output"

# the figures this benchmark is meant to show; checked and reported, never tuned for
TARGET_OURS_MAX_OVERHEAD = 0.3  # x S, fit (net) and validate, every N
TARGET_FLAT_RISE = 0.1  # x S: "flat in N" = the overhead rises by at most this from a smaller N to a larger one
TARGET_MMAP_PLUGIN_MAX_OVERHEAD = 0.1  # x S, mmap-plugin at the largest N: fit (net) and validate
TARGET_FSDP_MAX_OVERHEAD = 0.1  # x S, fsdp-ours fit (net) and validate, every N
TARGET_SHARDED_MAX_OVERHEAD = 0.1  # x S, zero-ours and oss-ours fit (net), every N
TARGET_OURS_FIT_TIME = 0.5  # x upstream's restore time, ours-true fit at the largest N
TARGET_FABRIC_MAX_OVERHEAD = (
    0.1  # x S, fabric-ours and fabric-fsdp-ours fabric.load (net of the optimizer state), every N
)
PLOT_STYLE = {
    "upstream": ("tab:red", "o", "-"),
    "mmap-plugin": ("tab:brown", "P", "-."),
    "ours-off": ("tab:orange", "x", ":"),
    "ours-true": ("tab:green", "s", "-"),
    "ours-2": ("tab:olive", "^", "-"),
    "ours-true-eager": ("tab:cyan", "v", "--"),
    "proposal-2021": ("tab:purple", "D", "--"),
    "baseline": ("0.45", ".", ":"),
    "fsdp-upstream": ("tab:red", "o", "--"),
    "fsdp-ours": ("tab:green", "s", "--"),
    "fsdp-baseline": ("0.45", ".", "--"),
}


# ---------------------------------------------------------------- running


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/restore_benchmark.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK_PARAMS:,} parameters, N={','.join(map(str, QUICK_DEVICES))},"
        f" modes {', '.join(QUICK_MODES)}; under 2 minutes on 2 idle cores",
    )
    parser.add_argument(
        "--params",
        type=_int_list,
        help="checkpoint sizes in parameters, comma-separated (default "
        + ",".join(map(str, SIZES))
        + f"; with --quick {QUICK_PARAMS}); without --modes and --devices each mode runs where DEFAULT_PLAN says",
    )
    parser.add_argument("--devices", type=_int_list, help="local ranks N to measure, comma-separated (default 1,2,4)")
    parser.add_argument(
        "--modes",
        type=_str_list,
        help=f"modes, comma-separated (default {','.join(DEFAULT_PLAN)}; also {','.join(EXTRA_MODES)})",
    )
    parser.add_argument("--entries", type=_str_list, help="entry points, comma-separated (default fit,validate)")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="measured jobs per cell; medians are reported")
    parser.add_argument(
        "--all-modes-everywhere",
        action="store_true",
        help="measure every mode at every N and size given (by default "
        + ", ".join(f"{k} only up to N={v}" for k, v in MODE_MAX_DEVICES.items())
        + ", "
        + ", ".join(f"{k} only from N={v}" for k, v in MODE_MIN_DEVICES.items())
        + ")",
    )
    parser.add_argument(
        "--whole-repeats",
        type=int,
        help=f"whole-process jobs of each of {', '.join(WHOLE_MODES)} per cell, alternating (default {WHOLE_REPEATS};"
        f" with --quick {QUICK_WHOLE_REPEATS}; 0: none)",
    )
    parser.add_argument(
        "--whole-only",
        action="store_true",
        help="run only the whole-process jobs (no memory jobs): results.json and report.md in bench_output/whole"
        " (with --docs, the whole-process section of docs/benchmarks.md is replaced in place)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the jobs of the run and exit")
    parser.add_argument(
        "--output-dir",
        type=Path,
        help="checkpoint cache, per-job data, results.json, report.md and plots"
        " (default bench_output/full, or bench_output/quick with --quick)",
    )
    parser.add_argument(
        "--docs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also write docs/benchmarks.md and docs/img/*.png (default: yes for the full run, no with --quick)",
    )
    parser.add_argument("--timeout", type=float, default=JOB_TIMEOUT, help="seconds before a job is killed")
    parser.add_argument(
        "--from-results",
        type=Path,
        metavar="RESULTS_JSON",
        help="run no job: rebuild report.md and the plots (and, with --docs, the docs page) from the results.json"
        " of an earlier run",
    )
    args = parser.parse_args(argv)
    args.default_plan = not (args.quick or args.modes or args.devices or args.all_modes_everywhere)
    args.params = tuple(sorted(set(args.params or ((QUICK_PARAMS,) if args.quick else SIZES))))
    args.devices = args.devices or (QUICK_DEVICES if args.quick else DEVICES)
    args.modes = args.modes or (QUICK_MODES if args.quick else tuple(DEFAULT_PLAN))
    args.entries = args.entries or ENTRIES
    unknown = [m for m in args.modes if m not in MODES] + [e for e in args.entries if e not in ENTRIES]
    if unknown:
        parser.error(f"unknown mode or entry point: {', '.join(unknown)}")
    # absolute: each job runs in a directory of its own and is given paths under this one
    if args.whole_repeats is None:
        args.whole_repeats = QUICK_WHOLE_REPEATS if args.quick else WHOLE_REPEATS
    if args.whole_only and args.whole_repeats < 1:
        parser.error("--whole-only needs --whole-repeats of at least 1")
    kind = "quick" if args.quick else "whole" if args.whole_only else "full"
    args.output_dir = (args.output_dir or DEFAULT_OUTPUT / kind).resolve()
    args.docs_given = args.docs is not None
    args.docs = (not args.quick and not args.whole_only) if args.docs is None else args.docs
    args.warm_up_job = not args.quick
    return args


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def size_plan(args: argparse.Namespace, params: int) -> dict[str, tuple[int, ...]]:
    """Where each mode is measured at one checkpoint size: {mode: (N, ...)}, in the order of ``args.modes``. The
    default run follows ``DEFAULT_PLAN``; with --modes, --devices or --quick each mode runs at every N given, within
    ``MODE_MIN_DEVICES`` / ``MODE_MAX_DEVICES`` unless --all-modes-everywhere."""
    largest = params == max(args.params)
    where: dict[str, tuple[int, ...]] = {}
    for mode in args.modes:
        if args.default_plan:
            devices = DEFAULT_PLAN[mode][0 if largest else 1]
        elif args.all_modes_everywhere:
            devices = tuple(args.devices)
        else:
            low, high = MODE_MIN_DEVICES.get(mode, 0), MODE_MAX_DEVICES.get(mode, 1 << 30)
            devices = tuple(n for n in args.devices if low <= n <= high)
        if devices:
            where[mode] = devices
    return where


def plan(args: argparse.Namespace, params: Optional[int] = None) -> list[tuple[int, str, str, int]]:
    """Every measured job at one size as (N, entry point, mode, repeat): per (N, entry) the baseline first, then each
    mode. None with --whole-only."""
    if args.whole_only:
        return []
    where = size_plan(args, max(args.params) if params is None else params)
    jobs = []
    for devices in sorted({n for ns in where.values() for n in ns}):
        for entry in args.entries:
            for repeat in range(args.repeats):
                modes = [m for m, ns in where.items() if devices in ns and entry in MODE_ENTRIES.get(m, (entry,))]
                # each family (DDP, FSDP) after its own baseline
                for baseline in dict.fromkeys(_measure.baseline_of(m) for m in modes):
                    family = [m for m in modes if _measure.baseline_of(m) == baseline]
                    # rotate the order between repeats, so that no mode always runs right after the baseline
                    shift = repeat % len(family) if family else 0
                    for mode in [baseline, *family[shift:], *family[:shift]]:
                        jobs.append((devices, entry, mode, repeat))
    return jobs


def whole_devices(args: argparse.Namespace, params: int) -> tuple[int, ...]:
    """The N at which whole-process jobs run at one size: ``WHOLE_PLAN`` in the default run; otherwise every N at
    which both of ``WHOLE_MODES`` are measured (with --whole-only, every N given), with --quick the largest only."""
    if args.whole_repeats < 1:
        return ()
    if args.default_plan:
        return WHOLE_PLAN[0 if params == max(args.params) else 1]
    if args.whole_only:
        return tuple(sorted(args.devices))
    where = size_plan(args, params)
    devices = tuple(n for n in sorted(args.devices) if all(n in where.get(mode, ()) for mode in WHOLE_MODES))
    return devices[-1:] if args.quick else devices


def whole_plan(args: argparse.Namespace, params: int) -> list[tuple[int, str, int]]:
    """The whole-process jobs at one size as (N, mode, repeat): per N, the modes alternating in the order ABBA ABBA
    (``upstream`` first), so that each mode follows each mode equally often: a job can leave the machine in a state
    that costs the next one (page cache, memory a virtual machine's host must back again), and plain ABAB would
    charge that to one mode."""
    return [
        (devices, mode, repeat)
        for devices in whole_devices(args, params)
        for repeat in range(args.whole_repeats)
        for mode in (WHOLE_MODES if repeat % 2 == 0 else WHOLE_MODES[::-1])
    ]


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Every size in ``args.params``, smallest first: its checkpoint, then its jobs (``plan``)."""
    started = time.monotonic()
    out: Path = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    # every rank then reads the package's bytecode, as from an installed package, whatever PYTHONDONTWRITEBYTECODE says
    _measure.compile_checkout()
    sizes: list[dict[str, Any]] = []
    failures: list[str] = []
    warmed_up = False
    for params in args.params:
        many = len(args.params) > 1
        size = _run_size(args, params, out / "runs" / f"p{params // 1_000_000}M" if many else out / "runs", warmed_up)
        warmed_up = True
        sizes.append(size)
        failures += [f"{params:,} parameters: {f}" if many else f for f in size["failures"]]
    results = {
        "command": _command(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _measure.machine_info(),
        "package": _package_state(),
        "quick": args.quick,
        "sizes": sizes,
        "failures": failures,
        "wall_seconds": time.monotonic() - started,
    }
    for size in sizes:
        size["cells"] = summarize(size)
        size["whole_cells"] = summarize_whole(size)
    return results


def _run_size(args: argparse.Namespace, params: int, runs_dir: Path, warmed_up: bool) -> dict[str, Any]:
    """The jobs of one checkpoint size; returns its part of ``results["sizes"]``."""
    started = time.monotonic()
    out: Path = args.output_dir
    print(f"checkpoint: ~{params:,} parameters ...", flush=True)
    checkpoint, created = _measure.create_checkpoint(out / "checkpoints", params, DEPTH, steps=TRAIN_STEPS)
    print(
        f"checkpoint: {_rel(checkpoint.path)}, {checkpoint.params:,} parameters, S = {checkpoint.size_gib:.3f} GiB"
        f" ({'created' if created else 'cached'}, {time.monotonic() - started:.0f}s)",
        flush=True,
    )
    # warm-up: the checkpoint into the page cache; then (full run) one unmeasured job, so that the first measured
    # job finds Python's and torch's files in the page cache too
    _measure.warm_page_cache(checkpoint.path)
    if args.warm_up_job and not warmed_up and args.whole_only:
        _measure.measure_whole_process(
            mode="upstream", devices=1, checkpoint=checkpoint, run_dir=out / "runs" / "warm-up", timeout=args.timeout
        )
    elif args.warm_up_job and not warmed_up:
        _measure.measure_restore(
            mode="baseline", entry="fit", devices=1, checkpoint=checkpoint, run_dir=out / "runs" / "warm-up",
            timeout=args.timeout,
        )  # fmt: skip
    runs: list[dict[str, Any]] = []
    failures: list[str] = []
    jobs = plan(args, params)
    label = f"{checkpoint.params / 1e6:.0f}M " if len(args.params) > 1 else ""
    for i, (devices, entry, mode, repeat) in enumerate(jobs, 1):
        run_dir = runs_dir / f"n{devices}-{entry}-{mode}-r{repeat}"
        t0 = time.monotonic()
        try:
            run = _measure.measure_restore(
                mode=mode, entry=entry, devices=devices, checkpoint=checkpoint, run_dir=run_dir, timeout=args.timeout
            )
        except JobFailed as err:
            failures.append(f"N={devices} {entry} {mode}: {err}")
            print(f"{label}[{i}/{len(jobs)}] N={devices} {entry:8s} {mode:16s} FAILED\n{err}", flush=True)
            continue
        record = {**run.as_dict(), "repeat": repeat, "run_dir": _rel(Path(run.run_dir))}
        runs.append(record)
        verdict = "n/a" if not run.checked else ("exact" if run.exact else "NOT EXACT: " + "; ".join(run.mismatches))
        mapped = f" ({run.optimizer_state_mapped_bytes / GIB:.2f} mapped)" if run.optimizer_state_mapped_bytes else ""
        print(
            f"{label}[{i}/{len(jobs)}] N={devices} {entry:8s} {mode:16s} window {run.window:6.2f}s"
            f"  anon peak {run.anon_peak / GIB:6.2f} GiB  pss peak {run.pss_peak / GIB:6.2f} GiB"
            f"  optimizer state {run.optimizer_state_bytes / GIB:5.2f} GiB{mapped}  {verdict}"
            + f"  (job {time.monotonic() - t0:.0f}s)",
            flush=True,
        )
        (runs_dir / "results.partial.json").write_text(json.dumps(runs, indent=1))
    whole, whole_failures = _run_whole(args, params, checkpoint, runs_dir, label)
    failures += whole_failures
    where = {} if args.whole_only else size_plan(args, params)
    return {
        "checkpoint": {
            "path": _rel(checkpoint.path),
            "params": checkpoint.params,
            "width": checkpoint.width,
            "depth": checkpoint.depth,
            "global_step": checkpoint.global_step,
            "size_bytes": checkpoint.size_bytes,
        },
        "config": {
            "devices": sorted({n for ns in where.values() for n in ns}),
            "entries": list(args.entries),
            "modes": list(where),
            "mode_devices": {m: list(ns) for m, ns in where.items()},
            "repeats": args.repeats,
            "whole_devices": list(whole_devices(args, params)),
            "whole_repeats": args.whole_repeats,
            "whole_only": args.whole_only,
            "fast_interval_s": _measure.FAST_INTERVAL,
            "smaps_duty": _measure.SMAPS_DUTY,
            "quick": args.quick,
        },
        "runs": runs,
        "whole": whole,
        "failures": failures,
        "wall_seconds": time.monotonic() - started,
    }


def _run_whole(
    args: argparse.Namespace, params: int, checkpoint: _measure.CheckpointInfo, runs_dir: Path, label: str
) -> tuple[list[dict[str, Any]], list[str]]:
    """The whole-process jobs of one size (``whole_plan``): their records and failures."""
    jobs = whole_plan(args, params)
    records: list[dict[str, Any]] = []
    failures: list[str] = []
    for i, (devices, mode, repeat) in enumerate(jobs, 1):
        run_dir = runs_dir / f"whole-n{devices}-{mode}-r{repeat}"
        try:
            run = _measure.measure_whole_process(
                mode=mode, devices=devices, checkpoint=checkpoint, run_dir=run_dir, timeout=args.timeout
            )
        except JobFailed as err:
            failures.append(f"whole process N={devices} {mode}: {err}")
            print(f"{label}[whole {i}/{len(jobs)}] N={devices} {mode:16s} FAILED\n{err}", flush=True)
            continue
        records.append({**run.as_dict(), "repeat": repeat, "run_dir": _rel(run_dir)})
        per_rank = ", ".join(f"{c:.2f}" for c in run.cpu_seconds)
        print(
            f"{label}[whole {i}/{len(jobs)}] N={devices} {mode:16s} whole process {run.seconds:6.2f}s"
            f" (rank 0 {run.rank0_seconds:6.2f}s)  CPU {sum(run.cpu_seconds):6.2f}s ({per_rank})"
            f"  other load {run.other_cpu_seconds / run.seconds:.2f}",
            flush=True,
        )
        (runs_dir / "whole.partial.json").write_text(json.dumps(records, indent=1))
    return records, failures


def size_views(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per checkpoint size, smallest first, each shaped as a single-size run's results (the common keys
    and that size's ``checkpoint``, ``config``, ``runs``, ``cells``). Results of a single-size run written before
    sizes existed (one ``checkpoint`` at the top) give one view."""
    if "sizes" not in results:
        return [results]
    common = {k: v for k, v in results.items() if k not in ("sizes", "failures", "wall_seconds")}
    views = [
        {**common, **size, "failures": results["failures"], "wall_seconds": results["wall_seconds"]}
        for size in results["sizes"]
    ]
    return sorted(views, key=lambda v: v["checkpoint"]["size_bytes"])


def _package_state() -> str:
    """The commit the measured ``serialized_restore`` comes from, and whether it had local changes."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        changes = subprocess.run(
            ["git", "status", "--porcelain", "--", "serialized_restore"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"commit {commit}" + (" with uncommitted changes in serialized_restore/" if changes else "")


def _command() -> str:
    return " ".join(["python", "benchmarks/restore_benchmark.py", *map(shlex.quote, sys.argv[1:])])


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return path.name


# ---------------------------------------------------------------- figures


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One cell per (N, entry, mode): medians over repeats of the overheads (``_measure.overheads``) against the
    baseline job of the same N, entry point and repeat, and of the restore time."""
    by_key: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    baselines = {
        (r["devices"], r["entry"], r["repeat"], r["mode"]): r for r in results["runs"] if r["mode"] in BASELINES
    }
    for run in results["runs"]:
        by_key.setdefault((run["devices"], run["entry"], run["mode"]), []).append(run)

    def median(values: list[Any]) -> Optional[float]:
        return statistics.median(values) if values else None

    cells: list[dict[str, Any]] = []
    for (devices, entry, mode), runs in sorted(by_key.items()):
        measured = [
            _measure.overheads(run, base)
            for run in runs
            if (base := baselines.get((devices, entry, run["repeat"], _measure.baseline_of(mode)))) is not None
        ]
        fit = entry == "fit"
        cells.append(
            {
                "devices": devices,
                "entry": entry,
                "mode": mode,
                "repeats": len(runs),
                "anon_peak": median([r["anon_peak"] for r in runs]),
                "anon_end": median([r["anon_end"] for r in runs]),
                "overhead": median([o["raw"] for o in measured]),
                "overhead_minus_optimizer": median([o["minus_optimizer"] for o in measured]) if fit else None,
                "overhead_net": median([o["net"] for o in measured]) if fit else None,
                "overhead_smaps": median([o["smaps_anon"] for o in measured]),
                "overhead_pss": median([o["pss"] for o in measured]),
                "optimizer_state_bytes": median([r["optimizer_state_bytes"] for r in runs]),
                "optimizer_state_mapped_bytes": median([r.get("optimizer_state_mapped_bytes", 0) for r in runs]),
                "window": median([r["window"] for r in runs]),
                "window_cpu_seconds": median([r["window_cpu_seconds"] for r in runs]),
                "exact": all(r["exact"] for r in runs) if mode not in BASELINES else None,
                "other_cpu_share": median([r["other_cpu_seconds"] / r["job_seconds"] for r in runs]),
            }
        )
    upstream = {(c["devices"], c["entry"], c["mode"]): c["window"] for c in cells}
    for cell in cells:
        ref = upstream.get((cell["devices"], cell["entry"], _measure.upstream_of(cell["mode"])))
        cell["time_ratio"] = cell["window"] / ref if ref else None
        cell["headline"] = cell["overhead_net"] if cell["entry"] == "fit" else cell["overhead"]
    return cells


def restore_window(run: dict[str, Any]) -> Optional[float]:
    """The part of a whole-process job where the modes run different code: from the first rank's ``setup`` (the
    process group exists, no stage has run) to the last rank's ``fit_end`` (both stages, DDP's setup between them).
    None where a rank's marks are missing."""
    phases = run.get("phases") or {}
    marks = (phases.get("setup") or [], phases.get("fit_end") or [])
    if any(len(m) != run["devices"] for m in marks):
        return None
    return max(marks[1]) - min(marks[0])


def _median(values: Any) -> Optional[float]:
    """The median of the values that are not None; None if none is."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarize_whole(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One cell per N of the whole-process jobs at one size: per mode the median wall time (start of the first
    process to the exit of the last rank), of rank 0's, of the CPU time of all ranks together and of the restore
    window (``restore_window``); and the ratios of ``ours-true``'s medians to ``upstream``'s."""
    runs = results.get("whole") or []
    cells = []
    for devices in sorted({r["devices"] for r in runs}):
        cell: dict[str, Any] = {"devices": devices}
        for mode in WHOLE_MODES:
            mine = [r for r in runs if r["devices"] == devices and r["mode"] == mode]
            cell[mode] = {
                "repeats": len(mine),
                "seconds": statistics.median(r["seconds"] for r in mine) if mine else None,
                "all_seconds": [round(r["seconds"], 3) for r in mine],
                "rank0_seconds": statistics.median(r["rank0_seconds"] for r in mine) if mine else None,
                "cpu_seconds": statistics.median(sum(r["cpu_seconds"]) for r in mine) if mine else None,
                "restore_seconds": _median(map(restore_window, mine)),
                "other_cpu_share": statistics.median(r["other_cpu_seconds"] / r["seconds"] for r in mine)
                if mine
                else None,
            }
        ours, theirs = (cell[mode] for mode in WHOLE_MODES[::-1])
        for key in ("seconds", "cpu_seconds", "restore_seconds"):
            known = ours[key] is not None and theirs[key]
            cell[f"{key}_ratio"] = ours[key] / theirs[key] if known else None
        cells.append(cell)
    return cells


Target = tuple[str, str, Optional[bool], Optional[float]]


def check_targets(results: dict[str, Any]) -> list[Target]:
    """(target, measured, met, figure) for each figure the benchmark is meant to show, at one checkpoint size
    (``results`` is one of ``size_views``); figure: the worst case in x S (or, for times, the ratio), else None."""
    cells = results.get("cells") or []
    size = results["checkpoint"]["size_bytes"]
    find = {(c["devices"], c["entry"], c["mode"]): c for c in cells}
    devices = sorted({c["devices"] for c in cells})
    top = max(devices) if devices else 0

    def series(entry: str, mode: str, key: str) -> list[tuple[int, float]]:
        found = [(n, find.get((n, entry, mode))) for n in devices]
        return [(n, c[key] / size) for n, c in found if c is not None and c[key] is not None]

    def text(values: list[tuple[int, float]]) -> str:
        return ", ".join(f"N={n}: {v:.2f}" for n, v in values) + " x S"

    rows: list[Target] = []
    for entry, label in (("validate", "validate"), ("fit", "fit (raw)")):
        values = series(entry, "upstream", "overhead")
        if values:
            growing = all(b > a for (_, a), (_, b) in zip(values, values[1:]))
            near = top == 4 and abs(values[-1][1] - 3.9) <= 0.4
            rows.append(
                (f"upstream {label}: ~3.9 x S at N=4, growing with N", text(values), growing and near, values[-1][1])
            )
    for entry, label in (("fit", "fit (net)"), ("validate", "validate")):
        values = series(entry, "ours-true", "headline")
        if values:
            worst = max(v for _, v in values)
            # growth with N is what "flat" rules out (upstream's N x S); an overhead that falls with N (turns stagger
            # DDP's setup transient, so the peak can end below the baseline's) is no growth
            rise = max([b - a for i, (_, a) in enumerate(values) for _, b in values[i + 1 :]], default=0.0)
            measured = f"{text(values)}; largest rise with N {max(rise, 0.0):.2f} x S"
            if entry == "fit":
                literal = series(entry, "ours-true", "overhead_minus_optimizer")
                measured += f" (raw minus optimizer state: {text(literal)})"
            ok = worst <= TARGET_OURS_MAX_OVERHEAD and rise <= TARGET_FLAT_RISE
            rows.append((f"ours-true {label}: <= {TARGET_OURS_MAX_OVERHEAD} x S, flat in N", measured, ok, worst))
    for entry, key, label in (("fit", "overhead_net", "fit (net)"), ("validate", "overhead", "validate")):
        cell = find.get((top, entry, "mmap-plugin"))
        if cell is not None and cell[key] is not None:
            # mapped pages are shared, not free: PSS is shown beside the anonymous figure
            rows.append(
                (f"mmap-plugin {label}: <= {TARGET_MMAP_PLUGIN_MAX_OVERHEAD} x S anonymous at N={top}",
                 f"{cell[key] / size:.2f} x S (PSS above baseline: {cell['overhead_pss'] / size:.2f} x S)",
                 cell[key] / size <= TARGET_MMAP_PLUGIN_MAX_OVERHEAD, cell[key] / size)
            )  # fmt: skip
    every_n = [("fsdp-ours", entry, TARGET_FSDP_MAX_OVERHEAD) for entry in ("fit", "validate")]
    every_n += [(mode, "fit", TARGET_SHARDED_MAX_OVERHEAD) for mode in ("zero-ours", "oss-ours")]
    every_n += [(mode, "fit", TARGET_FABRIC_MAX_OVERHEAD) for mode in ("fabric-ours", "fabric-fsdp-ours")]
    for mode, entry, bound in every_n:
        values = series(entry, mode, "headline")
        if values:
            upstream_mode = _measure.upstream_of(mode)
            reference = series(entry, upstream_mode, "headline")
            upstream = f" ({upstream_mode}: {text(reference)})" if reference else ""
            worst = max(v for _, v in values)
            label = "load (net)" if mode.startswith("fabric") else "fit (net)" if entry == "fit" else "validate"
            rows.append(
                (f"{mode} {label}: <= {bound} x S at every N", f"{text(values)}{upstream}", worst <= bound, worst)
            )
    for mode in ("ours-true", "mmap-plugin", "fsdp-ours", "zero-ours", "oss-ours", "fabric-ours", "fabric-fsdp-ours"):
        for entry in ("fit", "validate"):
            cell = find.get((top, entry, mode))
            if cell is not None and cell["time_ratio"] is not None:
                upstream = _measure.upstream_of(mode)
                bound = TARGET_OURS_FIT_TIME if (mode, entry) == ("ours-true", "fit") else 1.0
                theirs = cell["window"] / cell["time_ratio"]
                measured = f"{cell['window']:.2f}s vs {theirs:.2f}s = {cell['time_ratio']:.2f} x {upstream}"
                baseline = find.get((top, entry, _measure.baseline_of(mode)))
                if baseline is not None and theirs > baseline["window"]:
                    # the window also holds DDP's setup, which the baseline job does too
                    ours_net, theirs_net = cell["window"] - baseline["window"], theirs - baseline["window"]
                    measured += f" (above the baseline's {baseline['window']:.2f}s: {ours_net / theirs_net:.2f} x)"
                rows.append(
                    (f"{mode} restore time <= {'' if bound == 1.0 else f'{bound} x '}{upstream}'s at N={top}, {entry}",
                     measured, cell["time_ratio"] <= bound, cell["time_ratio"])
                )  # fmt: skip
    whole = [c for c in results.get("whole_cells") or [] if c["seconds_ratio"] is not None]
    if whole:
        worst = max(c["seconds_ratio"] for c in whole)
        measured = ", ".join(
            f"N={c['devices']}: {c['ours-true']['seconds']:.2f}s vs {c['upstream']['seconds']:.2f}s ="
            f" {c['seconds_ratio']:.2f} x (CPU {c['cpu_seconds_ratio']:.2f} x)"
            for c in whole
        )
        rows.append(
            (f"ours-true whole-process restore time <= {TARGET_WHOLE_TIME:g} x upstream's at every N (restore only,"
             " process start to exit)", measured, worst <= TARGET_WHOLE_TIME, worst)
        )  # fmt: skip
    return rows


def check_targets_by_size(views: list[dict[str, Any]]) -> list[Target]:
    """Each target of ``check_targets`` at every checkpoint size of ``views``: met only if met at every size it was
    checked at; the figure is the worst case over the sizes (the largest; for the upstream rows, the smallest, since
    their target is a lower bound on how much upstream holds), and the measured text gives every size."""
    by_target: dict[str, list[tuple[str, Target]]] = {}
    for view in views:
        label = f"{view['checkpoint']['params'] / 1e6:.0f}M (S = {view['checkpoint']['size_bytes'] / GIB:.2f} GiB)"
        for row in check_targets(view):
            by_target.setdefault(row[0], []).append((label, row))
    merged: list[Target] = []
    for target, rows in by_target.items():
        figures = [row[3] for _, row in rows if row[3] is not None]
        worst = (min if target.startswith("upstream ") else max)(figures) if figures else None
        met = [row[2] for _, row in rows if row[2] is not None]
        measured = rows[0][1][1] if len(views) == 1 else "; ".join(f"{label}: {row[1]}" for label, row in rows)
        if len(views) > 1 and len(rows) < len(views):
            measured += f" (measured at {len(rows)} of {len(views)} sizes)"
        merged.append((target, measured, all(met) if met else None, worst))
    return merged


# ---------------------------------------------------------------- output


def plot(all_results: dict[str, Any], out_dir: Path) -> list[Path]:
    """The plots of the largest checkpoint size (``_plot_size``) and, with several sizes, ``restore_sizes.png``."""
    views = size_views(all_results)
    written = _plot_size(views[-1], out_dir)
    if len(views) > 1:
        written.append(_plot_sizes(views, out_dir))
    return written


def _plot_sizes(views: list[dict[str, Any]], out_dir: Path) -> Path:
    """``restore_sizes.png``: the headline overhead / S of the modes measured at every size, against S."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [v["checkpoint"]["size_bytes"] / GIB for v in views]
    modes = [m for m in MODES if all(any(c["mode"] == m for c in v["cells"]) for v in views)]
    devices = sorted(set.intersection(*({c["devices"] for c in v["cells"]} for v in views)))
    entries = [e for e in ENTRIES if all(any(c["entry"] == e for c in v["cells"]) for v in views)]
    fig, axes = plt.subplots(1, len(entries), figsize=(5.6 * len(entries), 4.6), sharey=True, squeeze=False)
    dashes = {n: ls for n, ls in zip(reversed(devices), ["-", "--", ":", "-."])}
    for ax, entry in zip(axes[0], entries):
        for mode in modes:
            color, marker, _ = PLOT_STYLE.get(mode, ("0.45", ".", ":"))
            for n in devices:
                pts = []
                for v, s in zip(views, sizes):
                    c = next((c for c in v["cells"] if (c["devices"], c["entry"], c["mode"]) == (n, entry, mode)), None)
                    if c is not None and c["headline"] is not None:
                        pts.append((s, c["headline"] / v["checkpoint"]["size_bytes"]))
                if pts:
                    ax.plot(*zip(*pts), color=color, marker=marker, ls=dashes[n], label=f"{mode}, N={n}")
        ax.axhline(TARGET_FSDP_MAX_OVERHEAD, color="tab:green", lw=0.8, ls="--", alpha=0.6)
        ax.axhline(0, color="0.3", lw=0.6)
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(sizes)
        ax.set_xticklabels([f"{s:.2f}" for s in sizes])
        ax.set_xlabel("checkpoint size S (GiB)")
        ax.set_title(f"{entry} ({'net' if entry == 'fit' else 'raw'}): restore overhead / S", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("restore overhead / S")
    axes[0][0].legend(fontsize=7, loc="upper left", ncol=2)
    fig.suptitle(
        f"Headline overheads at every checkpoint size; dashed green: {TARGET_FSDP_MAX_OVERHEAD} x S", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(out_dir / "restore_sizes.png", dpi=110)
    plt.close(fig)
    return out_dir / "restore_sizes.png"


def _plot_size(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``restore_memory.png``, ``restore_time.png`` and ``restore_timeline.png`` in ``out_dir``, for one size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    cells = results["cells"]
    size = results["checkpoint"]["size_bytes"]
    devices = sorted({c["devices"] for c in cells})
    modes = [m for m in DDP_MODES if any(c["mode"] == m for c in cells)]
    entries = [e for e in ENTRIES if any(c["entry"] == e for c in cells)]
    title = (
        f"{results['checkpoint']['params'] / 1e6:.0f}M-parameter MLP + Adam, S = {size / GIB:.2f} GiB;"
        f" DDP over gloo on CPU, {results['machine']['cores']} cores"
    )

    def save(fig: Any, axes: Any, suptitle: str, name: str) -> Path:
        """Legend in the first panel, the title, then ``out_dir / name``; closes the figure."""
        axes[0][0].legend(fontsize=8, loc="upper left")
        fig.suptitle(suptitle, fontsize=10)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        return out_dir / name

    def style(mode: str) -> dict[str, Any]:
        color, marker, line = PLOT_STYLE.get(mode, ("0.45", ".", ":"))
        return {"color": color, "marker": marker, "ls": line, "label": mode}

    # overhead / S against N
    panels = [
        ("fit", "overhead_net", "fit (net): above baseline + optimizer state kept"),
        ("fit", "overhead", "fit (raw): above baseline"),
        ("validate", "overhead", "validate: above baseline"),
    ]
    panels = [p for p in panels if p[0] in entries]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 4.6), sharey=True, squeeze=False)
    for ax, (entry, key, label) in zip(axes[0], panels):
        ax.plot(devices, devices, color="0.7", lw=1, ls=":", label="N x S")
        for mode in modes:
            pts = [(c["devices"], c[key] / size) for c in cells if c["entry"] == entry and c["mode"] == mode]
            if pts:
                ax.plot(*zip(*pts), **style(mode))
        ax.axhline(TARGET_OURS_MAX_OVERHEAD, color="tab:green", lw=0.8, ls="--", alpha=0.6)
        if "mmap-plugin" in modes:
            ax.axhline(TARGET_MMAP_PLUGIN_MAX_OVERHEAD, color="tab:brown", lw=0.8, ls="-.", alpha=0.6)
        ax.axhline(0, color="0.3", lw=0.6)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("local ranks N")
        ax.set_xticks(devices)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("restore overhead / S\n(peak node anonymous memory in the restore window)")
    targets = f"dashed green: {TARGET_OURS_MAX_OVERHEAD} x S"
    if "mmap-plugin" in modes:
        targets += f"; dash-dotted brown: {TARGET_MMAP_PLUGIN_MAX_OVERHEAD} x S (mmap-plugin, largest N)"
    written = [save(fig, axes, title + "\n" + targets, "restore_memory.png")]

    # restore time against N
    fig, axes = plt.subplots(1, len(entries), figsize=(5.4 * len(entries), 4.6), squeeze=False)
    for ax, entry in zip(axes[0], entries):
        for mode in ["baseline", *modes]:
            pts = [(c["devices"], c["window"]) for c in cells if c["entry"] == entry and c["mode"] == mode]
            if pts:
                ax.plot(*zip(*pts), **style(mode))
        hook = "on_train_start" if entry == "fit" else "on_validation_start"
        ax.set_title(f"{entry}: restore window (end of setup to {hook})", fontsize=10)
        ax.set_xlabel("local ranks N")
        ax.set_ylabel("seconds")
        ax.set_xticks(devices)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    written.append(save(fig, axes, title, "restore_time.png"))

    # node memory over time at the largest N
    top = max(devices)
    fig, axes = plt.subplots(1, len(entries), figsize=(6.5 * len(entries), 4.6), sharey=True, squeeze=False)
    for ax, entry in zip(axes[0], entries):
        for mode in ["baseline", *modes]:
            wanted = (top, entry, mode, 0)
            run = next(
                (r for r in results["runs"] if (r["devices"], r["entry"], r["mode"], r["repeat"]) == wanted), None
            )
            if run is None or not run["timeline"]:
                continue
            kwargs = style(mode)
            kwargs.pop("marker")
            t, anon = zip(*run["timeline"])
            ax.plot(t, [a / GIB for a in anon], lw=1.2, **kwargs)
            ax.axvline(run["window"], color=kwargs["color"], lw=0.8, ls=":")
        ax.set_title(f"{entry}, N={top}: node anonymous memory (dotted: end of each window)", fontsize=10)
        ax.set_xlabel("seconds since the start of the restore window")
        ax.set_ylabel("GiB")
        ax.grid(alpha=0.3)
    written.append(save(fig, axes, title, "restore_timeline.png"))

    # FSDP: overhead / S against N
    fsdp_modes = [m for m in FSDP_MODES if any(c["mode"] == m for c in cells)]
    if fsdp_modes:
        panels = [("fit", "overhead_net", "fit (net)"), ("validate", "overhead", "validate (raw)")]
        panels = [p for p in panels if p[0] in entries]
        fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 4.2), sharey=True, squeeze=False)
        for ax, (entry, key, label) in zip(axes[0], panels):
            for mode in fsdp_modes:
                pts = [(c["devices"], c[key] / size) for c in cells if c["entry"] == entry and c["mode"] == mode]
                if pts:
                    ax.plot(*zip(*pts), **style(mode))
            ax.axhline(TARGET_FSDP_MAX_OVERHEAD, color="tab:green", lw=0.8, ls="--", alpha=0.6)
            ax.axhline(0, color="0.3", lw=0.6)
            ax.set_title(f"FSDP, {label}: above fsdp-baseline", fontsize=10)
            ax.set_xlabel("ranks N")
            ax.set_xticks(sorted({c["devices"] for c in cells if c["mode"] in fsdp_modes}))
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("restore overhead / S")
        written.append(save(fig, axes, title.replace("DDP over gloo", "FSDP over gloo"), "restore_fsdp.png"))
    return written


def _figure(target: str, worst: Optional[float]) -> str:
    if worst is None:
        return "–"
    if "restore time" not in target:
        return f"{worst:.2f} x S"
    return f"{worst:.2f} x upstream"


def _gib(value: Optional[float], size: int, bold: bool = False) -> str:
    if value is None:
        return "–"
    text = f"{value / GIB:.2f} ({value / size:.2f})"
    return f"**{text}**" if bold else text


# sections of docs/benchmarks.md written by other benchmarks, kept as they are when this one rewrites the page
KEPT_SECTIONS = ("## The turns at scale", "## What a failure prints")


def _kept_sections(page: Path) -> str:
    """The page's sections that other benchmarks write (``scale.py``, ``failure_output.py``), from the first one on."""
    text = page.read_text() if page.exists() else ""
    starts = [text.find(f"\n{heading}\n") for heading in KEPT_SECTIONS if f"\n{heading}\n" in text]
    return "\n" + text[min(starts) + 1 :] if starts else ""


def _coverage_paragraph(results: dict[str, Any], modes: list[str]) -> list[str]:
    """Which modes were measured at which N only (and which modes not at all), from the cells themselves."""
    cells = results["cells"]
    devices = sorted({c["devices"] for c in cells})
    trimmed = []
    for mode in modes:
        measured = sorted({c["devices"] for c in cells if c["mode"] == mode})
        if measured and measured != devices:
            trimmed.append(f"`{mode}` only at N={','.join(map(str, measured))}")
    missing = [m for m in MODES if not any(c["mode"] == m for c in cells)]
    if not trimmed and not missing:
        return []
    text = "To keep the run short on 2 cores, " if not results.get("quick") else ""
    parts = []
    if trimmed:
        parts.append("some modes are measured at some N only: " + ", ".join(trimmed))
    if missing:
        parts.append(", ".join(f"`{m}`" for m in missing) + " not at all (`--modes` measures them)")
    text += "; ".join(parts)
    return [
        text[0].upper()
        + text[1:]
        + " (with one rank there are no turns to take; `--all-modes-everywhere` measures every mode at every N).",
        "",
    ]


def report(all_results: dict[str, Any], image_dir: str) -> str:
    """The Markdown page: what was run, the definitions, the tables and plots (those of the largest checkpoint
    size, then the headline figures at every size), the targets at every size."""
    views = size_views(all_results)
    results = views[-1]
    m = results["machine"]
    ck = results["checkpoint"]
    size = ck["size_bytes"]
    cfg = results["config"]
    cells = results["cells"]
    runs = results["runs"]
    devices = sorted({c["devices"] for c in cells})
    modes = [mode for mode in DDP_MODES if any(c["mode"] == mode for c in cells)]
    find = {(c["devices"], c["entry"], c["mode"]): c for c in cells}
    other = statistics.mean(r["other_cpu_seconds"] / r["job_seconds"] for r in runs) if runs else 0.0
    lines = [
        "# Benchmark: node memory and time of a restore (DDP, FSDP, sharded optimizers, Fabric)",
        "",
        "Generated, with its plots, by `benchmarks/restore_benchmark.py`; rerun the command below to regenerate"
        " all of it. Every number on this page comes from that one run.",
        "",
        f"- Command: `{results['command']}` ({results['date']}, {results['wall_seconds'] / 60:.1f} minutes in all)",
        f"- Versions: torch {m['torch']}, pytorch-lightning {m['pytorch-lightning']}, lightning {m['lightning']},"
        f" Python {m['python']}; `serialized_restore` at {results['package']}",
        f"- Machine: {m['cores']} cores ({m['cpu']}), {m['ram_gib']:.1f} GiB RAM, Linux {m['kernel']}, no GPU",
        f"- Checkpoint: an MLP of {ck['params']:,} parameters ({ck['depth']} linear layers of {ck['width']}"
        f" features) trained {ck['global_step']} steps with Adam and saved with `trainer.save_checkpoint`:"
        f" **S = {size / GIB:.3f} GiB** (weights, Adam's `exp_avg` and `exp_avg_sq`; {size:,} bytes)"
        + (
            "; the tables and plots below are for this size, *By checkpoint size* gives the headline figures at"
            " every size: "
            + ", ".join(
                f"{v['checkpoint']['params']:,} parameters (S = {v['checkpoint']['size_bytes'] / GIB:.3f} GiB)"
                for v in views
            )
            if len(views) > 1
            else ""
        ),
        '- Jobs: DDP over gloo on CPU through Lightning\'s own launcher (`strategy="ddp", accelerator="cpu",'
        f" devices=N`), `OMP_NUM_THREADS=1`, a fresh `MASTER_PORT` per job. {cfg['repeats']} measured job(s) per"
        " cell (the median is shown); the checkpoint is read once beforehand so that every job finds it in the"
        " page cache, and each (N, entry point) starts with its baseline job. Restore jobs build the model with"
        " zeros instead of a random init (the same pages written, in a tenth of the time); the checkpoint"
        " overwrites them.",
        f"- Load: other processes on the machine used on average {other:.2f} of its {m['cores']} cores while the"
        " jobs ran (the machine's busy CPU time minus the jobs' and the sampler's). Restore times are sensitive to"
        " that; memory figures are not.",
        "",
        "## Modes",
        "",
        "| mode | what restores |",
        "|---|---|",
        *[f"| `{mode}` | {MODE_DESCRIPTIONS[mode]} |" for mode in ["baseline", *modes]],
        "",
    ]
    lines += [
        "How each mode holds the checkpoint (S_opt, Adam's state, is about two thirds of S):",
        "",
        "- `upstream`, `ours-off`: every rank reads the whole file into private memory before DDP's setup and"
        " keeps it until `resume_end`: about N x S above the baseline, on top of DDP's setup transient. For fit,"
        " Adam adopts the checkpoint's own `exp_avg` and `exp_avg_sq` tensors, so N x S_opt of it stays.",
        "- `proposal-2021`: ranks read one after the other and drop the weights after their turn, but keep the"
        " optimizer state until `resume_end`, also for validate: the peak comes in the last turn, S + (N-1) x"
        " S_opt.",
        "- `mmap-plugin`: upstream's restore, every rank at once, but `torch.load(..., mmap=True)` maps the file"
        " copy-on-write into every rank instead of unpickling a private copy: the file's pages sit in the page"
        " cache, shared by every rank and not anonymous. Each rank copies the weights from them into its model;"
        " for fit, `Optimizer.load_state_dict` keeps the loaded tensors as Adam's state (same dtype and device),"
        " so at the end of the window that state is still the file's pages, and the mapping stays until it is"
        " gone. The first optimizer step writes to the state, and the kernel then copies those pages into"
        " private memory: the state every training job holds anyway. Mapped pages are shared, not free: they"
        " are in the *PSS* figures, which count each shared file page divided among the processes that map it,"
        " so N ranks that touch the same pages add about one copy to the node, not N.",
        "- `ours-true`, `ours-2` (memory-mapped): the file's pages sit in the page cache, shared by"
        " every rank and not anonymous; each rank copies the weights from them into its model in its turn and"
        " drops everything it no longer needs at the end of the turn. For fit, after DDP's setup, every rank at once"
        " copies into private memory the optimizer state its optimizers keep: the state every training job holds"
        " anyway (it allocates nothing else, so it needs no turns).",
        "- `ours-true-eager`: each rank reads the whole file into private memory in its turn (S at a time); for"
        " fit it drops the optimizer state after the first stage and reads the file again in its second turn.",
        "",
    ]
    lines += _coverage_paragraph(results, [*modes, *FSDP_MODES])
    lines += [
        "## Definitions",
        "",
        "- **Node memory**: what the kernel reports for the job's whole process tree (the launched rank 0 and all"
        " its descendants, found with psutil and rescanned while the job runs), summed over the processes and"
        " sampled from a separate parent process. *Anonymous* memory is private memory that only exiting (or swap)"
        " gives back: what a restore allocates when it unpickles a checkpoint. *PSS* adds file-backed pages, each"
        " shared page divided among the processes mapping it, so a memory-mapped checkpoint counts about once per"
        " node. Anonymous memory is read from `RssAnon` in `/proc/<pid>/status` every"
        f" {cfg['fast_interval_s'] * 1000:.0f} ms (the kernel's counter of resident anonymous pages); `Anonymous:`"
        " and `Pss:` are read from `/proc/<pid>/smaps_rollup` in sweeps over the tree. The kernel builds"
        " `smaps_rollup` by walking page tables (about 10 ms per GiB resident here), so a sweep over a tree of"
        " several GiB takes 100 ms or more and would miss short peaks; the fast channel does not. The two are"
        " checked against each other in every sweep (see *Sampling* below). The PSS curve is the fast channel's"
        " anonymous memory plus the non-anonymous part of PSS (`Pss - Pss_Anon`: file-backed and shared pages,"
        " which change slowly) from the sweep nearest in time; anonymous pages here are private to one process,"
        " so they count fully in PSS.",
        "- **Restore window**: from the earliest rank's end of `LightningModule.setup` (the process group exists,"
        " Lightning's first restore stage has not started) to the latest rank's `on_train_start` (fit) or"
        " `on_validation_start` (validate), which follow `resume_end`. Every rank writes these two time stamps to a"
        " file. The window also contains DDP's `strategy.setup` (parameter broadcast, gradient buckets), which the"
        " baseline does too.",
        "- **Restore overhead, raw**: peak node anonymous memory inside the window, minus the peak inside the"
        " window of the `baseline` job (same N, same entry point, same program, `ckpt_path=None`): how much higher"
        " the restore drives the node's peak. It is not the bytes a restore allocates: the baseline's own peak is"
        " a transient while `DistributedDataParallel` wraps the model (about the size of the weights per rank"
        " here), and a restore that has freed its memory before then adds less to the peak than it allocated.",
        "- **Fit: optimizer state kept.** At the end of its window every rank records the bytes of its optimizers'"
        " state tensors (Adam's `exp_avg`, `exp_avg_sq`, `step`: about two thirds of S). Every training job holds"
        " that state from its first step on, restored or not, so it is not restore overhead; upstream keeps the"
        " checkpoint's own tensors as that state, so its raw peak contains them as well. State that at the end of"
        " the window still lies in the checkpoint's memory-mapped pages (`mmap-plugin`, shown as *mapped*) is not"
        " anonymous memory and is left in: only state in private memory is taken out. Two ways to take it out"
        " are reported:",
        "  - *raw minus optimizer state*: the raw overhead minus the sum over ranks. This undercounts, and can go"
        " below zero: the baseline's peak is a transient of DDP's setup, while a restore that frees as it goes"
        " reaches its own peak later, when the optimizer state has been built and that transient is over, so the"
        " two are subtracted from each other although they never coexist (see the timeline plot).",
        "  - **net** (used for the fit targets): peak node anonymous memory inside the window minus the larger of"
        " the baseline's peak and the baseline's memory at the end of its window plus the optimizer state kept,"
        " i.e. the memory above what a job that did not restore holds at its peak or once it has built its"
        " optimizer state. A real first training step also allocates gradients, so this reference is low and the"
        " net figure, if anything, overstates the overhead.",
        "- Validate keeps no optimizer state; its targets use the raw overhead.",
        "- **Restore time**: the window's length, and its ratio to `upstream` at the same N and entry point.",
        "- **Exactness**: after the window (and a barrier) every rank compares its weights, and for fit its"
        " optimizer state and `global_step`, bit for bit (`torch.equal`) with the checkpoint loaded"
        " memory-mapped; the benchmark exits non-zero if any rank of any job differs. Ranks then leave with"
        " `os._exit`, since nothing after the window is measured.",
        "",
        "## Results",
        "",
        f"![restore overhead / S against N]({image_dir}/restore_memory.png)",
        "",
        f"![restore time against N]({image_dir}/restore_time.png)",
        "",
        f"![node memory over time at N={max(devices)}]({image_dir}/restore_timeline.png)",
        "",
        "Overheads in GiB, the multiple of S in parentheses; the headline figure is in bold (net for fit, raw for"
        " validate). Baseline rows show the baseline's own memory. *PSS above baseline* counts file-backed pages"
        " too, each shared page divided among the processes that map it: for the memory-mapped modes it includes"
        " the checkpoint's pages that the anonymous figures leave out. *exact*: every rank restored the checkpoint"
        " bit for bit.",
        "",
    ]
    for entry in cfg["entries"]:
        fit = entry == "fit"
        lines.append(f"### Memory, `trainer.{entry}(ckpt_path=...)`")
        lines.append("")
        header = ["mode", "N", "raw"]
        header += ["optimizer state kept", "raw minus optimizer state", "net"] if fit else []
        header += ["PSS above baseline", "exact"]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for mode in ["baseline", *modes]:
            for n in devices:
                c = find.get((n, entry, mode))
                if c is None:
                    continue
                if mode == "baseline":
                    own = f"its peak: {c['anon_peak'] / GIB:.2f} GiB"
                    own += f", at its end: {c['anon_end'] / GIB:.2f} GiB" if fit else ""
                    row = [f"`{mode}`", str(n), own, *(["–"] * (len(header) - 3))]
                else:
                    row = [f"`{mode}`", str(n), _gib(c["overhead"], size, bold=not fit)]
                    if fit:
                        kept = _gib(c["optimizer_state_bytes"], size)
                        if c.get("optimizer_state_mapped_bytes"):
                            kept += f", mapped: {_gib(c['optimizer_state_mapped_bytes'], size)}"
                        row += [kept, _gib(c["overhead_minus_optimizer"], size)]
                        row += [_gib(c["overhead_net"], size, bold=True)]
                    row += [_gib(c["overhead_pss"], size), "yes" if c["exact"] else "**NO**"]
                lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    lines += [
        "### Restore time",
        "",
        "The window's length in seconds, its ratio to `upstream`, the CPU time all ranks used inside it, and the"
        " load other processes put on the machine while the job ran (cores).",
        "",
    ]
    header = ["mode", "N"]
    for entry in cfg["entries"]:
        header += [f"{entry}: window (s)", "vs upstream", "CPU (s)", "other load"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for mode in ["baseline", *modes]:
        for n in devices:
            row = [f"`{mode}`", str(n)]
            for entry in cfg["entries"]:
                c = find.get((n, entry, mode))
                if c is None:
                    row += ["–"] * 4
                    continue
                ratio = f"**{c['time_ratio']:.2f}**" if c["time_ratio"] is not None and mode != "baseline" else "–"
                row += [f"{c['window']:.2f}", ratio, f"{c['window_cpu_seconds']:.2f}", f"{c['other_cpu_share']:.2f}"]
            if any(find.get((n, e, mode)) for e in cfg["entries"]):
                lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines += _whole_section(views)
    lines += _fsdp_section(results, image_dir)
    for family in FAMILY_SECTIONS:
        lines += _family_section(results, *family)
    lines += _sizes_section(views, image_dir)
    targets = [] if cfg["quick"] else check_targets_by_size(views)
    if cfg["quick"]:
        lines += [
            "## Targets",
            "",
            "Not checked in a `--quick` run: the targets are stated for the full run (three sizes, N up to 4);"
            " with a small model, fixed costs of a few MiB per rank (imports, threads, unpickling) are a large"
            " multiple of S.",
            "",
        ]
    else:
        lines += [
            "## Targets",
            "",
            "What this benchmark was written to show, against what it measured (nothing was tuned to meet them),"
            " checked at every checkpoint size measured: a target is met only if it is met at every size, and the"
            " figure is the worst case over the sizes (for the upstream rows, the smallest overhead).",
            "",
            "| target | measured | figure (worst case) | met |",
            "|---|---|---|---|",
            *[f"| {t} | {v} | {_figure(t, w)} | {'yes' if ok else '**no**'} |" for t, v, ok, w in targets],
            "",
        ]
    missed = [t for t, _, ok, _ in targets if not ok]
    if missed:
        lines += ["Missed: " + "; ".join(missed) + ". The measured figures are above.", ""]
    if any("restore time" in t for t in missed):
        lines += [
            "Restore times come from one job per cell and vary from run to run on this shared 2-core machine by"
            " more than the difference between these two modes at N=4 (compare the *other load* and *CPU*"
            " columns); `--repeats 3` reports medians.",
            "",
        ]
    lines += [
        "## Sampling",
        "",
        "| N | entry point | sampler at full rate before the window, at least | longest gap between fast samples"
        " in a window | fewest full sweeps in a window | longest sweep | largest disagreement of `Anonymous:` with"
        " `RssAnon` in a sweep |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in devices:
        for entry in cfg["entries"]:
            sel = [r for r in runs if r["devices"] == n and r["entry"] == entry]
            if sel:
                lines.append(
                    f"| {n} | {entry} | {min(r['woke_before_window'] for r in sel) * 1000:.0f} ms"
                    f" | {max(r['fast_max_gap'] for r in sel) * 1000:.0f} ms |"
                    f" {min(r['sweeps'] for r in sel)} | {max(r['sweep_max_duration'] for r in sel) * 1000:.0f} ms |"
                    f" {max(r['rss_anon_vs_anonymous'] for r in sel) / 2**20:.1f} MiB |"
                )
    lines += [
        "",
        "The disagreement is the largest difference between `Anonymous:` and `RssAnon` of one process, among the"
        " processes whose `RssAnon` was the same just before and just after the page-table walk (memory that"
        " moves during a walk cannot be compared). Few sweeps fall inside a window at N=4, which is why the PSS"
        " curve takes its anonymous part from the fast channel. Gaps between fast samples are the sampler waiting"
        " for a CPU: its threads run at a higher priority than the ranks where permitted.",
        "",
    ]
    if results["failures"]:
        lines += ["## Failed jobs", "", *[f"- {f.splitlines()[0]}" for f in results["failures"]], ""]
    return "\n".join(lines)


WHOLE_HEADING = "## Whole process, restore only"


def _whole_section(views: list[dict[str, Any]]) -> list[str]:
    """The whole-process times of every size and N measured: one table, and what was run."""
    measured = [(v, c) for v in views for c in v.get("whole_cells") or []]
    if not measured:
        return []
    repeats = sorted({v["config"].get("whole_repeats", 0) for v, _ in measured})
    lines = [
        WHOLE_HEADING,
        "",
        "Restore-only jobs timed as whole processes, as a user sees a resume: `trainer.fit(model, ckpt_path=...)` with"
        " `max_steps` equal to the checkpoint's step, so that Lightning restores (both stages), skips the fit loop,"
        " tears down and returns, and the script ends as any script does. Each job is timed from the start of its"
        " first process to the exit of its last rank: Python's and Lightning's imports, the launcher starting the"
        " other ranks, DDP's setup, the restore, the teardown and the interpreter's shutdown. No memory sampler runs."
        f" Jobs of `upstream` and `ours-true` alternate (ABBA, so that each follows each equally often),"
        f" {'/'.join(map(str, repeats))} of each per cell; the medians"
        " are shown, and every job's time. *CPU*: user + system time of all ranks together, up to their exit"
        " (from `wait4`: the benchmark adopts the ranks as a child subreaper), the figure to compare when the"
        " machine is shared. Most of a job is fixed costs (imports, start-up, shutdown: seconds per rank) that do"
        " not depend on the checkpoint; with more ranks than cores the job is CPU-bound, so CPU that a mode adds in"
        " any rank shows in the wall time.",
        "",
        "| model, S | N | upstream (s) | ours-true (s) | ours / upstream | CPU upstream (s) | CPU ours-true (s)"
        " | CPU ours / upstream | restore, upstream; ours-true (s) | restore ours / upstream"
        " | each job, upstream; ours-true (s) | other load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for view, cell in measured:
        ck = view["checkpoint"]
        up, ours = cell["upstream"], cell["ours-true"]

        def num(value: Optional[float], digits: int = 2) -> str:
            return "–" if value is None else f"{value:.{digits}f}"

        ratio = f"**{cell['seconds_ratio']:.2f}**" if cell["seconds_ratio"] is not None else "–"
        each = "; ".join(", ".join(f"{t:.1f}" for t in c["all_seconds"]) or "–" for c in (up, ours))
        loads = [c["other_cpu_share"] for c in (up, ours) if c["other_cpu_share"] is not None]
        lines.append(
            f"| {ck['params'] / 1e6:.0f}M, {ck['size_bytes'] / GIB:.2f} GiB | {cell['devices']} | {num(up['seconds'])}"
            f" | {num(ours['seconds'])} | {ratio} | {num(up['cpu_seconds'])} | {num(ours['cpu_seconds'])}"
            f" | {num(cell['cpu_seconds_ratio'])} | {num(up.get('restore_seconds'))};"
            f" {num(ours.get('restore_seconds'))} | {num(cell.get('restore_seconds_ratio'))} | {each}"
            f" | {num(max(loads) if loads else None)} |"
        )
    lines += [
        "",
        "*Restore*: the part of a job where the two modes run different code, from the first rank's Trainer `setup`"
        " (the process group exists, nothing is restored yet) to the last rank's `on_fit_end` (both restore stages"
        " and DDP's setup between them), from the ranks' own marks; outside it the modes differ only by the package's"
        " import and the Trainer's construction (about 10 ms per rank)."
        " *Other load*: cores' worth of CPU that other processes on the machine used while a job ran (the larger of"
        " the two modes' medians).",
        "",
    ]
    return lines


def report_whole(all_results: dict[str, Any]) -> str:
    """The page of a --whole-only run: what was run, and the whole-process section with its target."""
    views = size_views(all_results)
    m = all_results["machine"]
    lines = [
        "# Benchmark: whole-process time of a restore-only resume",
        "",
        f"- Command: `{all_results['command']}` ({all_results['date']},"
        f" {all_results['wall_seconds'] / 60:.1f} minutes in all)",
        f"- Versions: torch {m['torch']}, pytorch-lightning {m['pytorch-lightning']}, lightning {m['lightning']},"
        f" Python {m['python']}; `serialized_restore` at {all_results['package']}",
        f"- Machine: {m['cores']} cores ({m['cpu']}), {m['ram_gib']:.1f} GiB RAM, Linux {m['kernel']}",
        "",
        *_whole_section(views),
    ]
    for target, measured, ok, worst in check_targets_by_size(views):
        lines.append(f"- target {'met' if ok else '**missed**'}: {target}: {_figure(target, worst)} ({measured})")
    lines.append("")
    return "\n".join(lines)


def replace_section(page: str, heading: str, section: list[str]) -> str:
    """``page`` with the section under ``heading`` (up to the next ``## `` heading) replaced by ``section``; where
    the page has no such section, it goes before ``## FSDP, full checkpoint`` (or at the end)."""
    text = "\n".join(section)
    start = page.find(f"\n{heading}\n")
    if start >= 0:
        end = page.find("\n## ", start + 1)
        return page[: start + 1] + text + (page[end:] if end >= 0 else "\n")
    anchor = page.find("\n## FSDP, full checkpoint\n")
    if anchor < 0:
        return page.rstrip("\n") + "\n\n" + text + "\n"
    return page[: anchor + 1] + text + page[anchor:]


def _where_text(cfg: dict[str, Any]) -> str:
    """Which modes ran at which N at one size, from its config: modes grouped by the N they ran at."""
    where = cfg.get("mode_devices") or {m: cfg["devices"] for m in cfg["modes"]}
    groups: dict[tuple[int, ...], list[str]] = {}
    for mode, devices in where.items():
        groups.setdefault(tuple(devices), []).append(mode)
    return "; ".join(
        ", ".join(f"`{m}`" for m in modes) + f" at N={','.join(map(str, devices))}" for devices, modes in groups.items()
    )


def _sizes_section(views: list[dict[str, Any]], image_dir: str) -> list[str]:
    """With several checkpoint sizes: the headline overhead of every mode at every size and N, and its plot."""
    if len(views) < 2:
        return []
    modes = [m for m in MODES if any(c["mode"] == m for v in views for c in v["cells"])]
    devices = sorted({c["devices"] for v in views for c in v["cells"]})
    labels = [
        f"{v['checkpoint']['params'] / 1e6:.0f}M, S = {v['checkpoint']['size_bytes'] / GIB:.2f} GiB" for v in views
    ]
    lines = [
        "## By checkpoint size",
        "",
        "The headline overhead (fit: net; validate: raw) as a multiple of S, for every mode at every size it was"
        " measured at: the tables above are for the largest size. A figure holds for the design only if it holds"
        " at every size; the targets below are checked at each. Fixed costs (a few MiB per rank) are a larger"
        " multiple of a smaller S.",
        "",
        *[f"- {label}: {_where_text(v['config'])}" for label, v in zip(labels, views)],
        "",
        f"![restore overhead / S against checkpoint size]({image_dir}/restore_sizes.png)",
        "",
    ]
    for entry in ENTRIES:
        found = [{(c["devices"], c["mode"]): c for c in v["cells"] if c["entry"] == entry} for v in views]
        if not any(found):
            continue
        lines += [f"### `{entry}` ({'net' if entry == 'fit' else 'raw'}) / S", ""]
        lines += ["| mode | N | " + " | ".join(labels) + " | worst |", "|" + "---|" * (3 + len(views))]
        for mode in modes:
            if mode in BASELINES:
                continue
            for n in devices:
                values = [
                    c["headline"] / v["checkpoint"]["size_bytes"]
                    if (c := f.get((n, mode))) is not None and c["headline"] is not None
                    else None
                    for v, f in zip(views, found)
                ]
                if all(x is None for x in values):
                    continue
                worst = max(x for x in values if x is not None)
                cells = ["–" if x is None else f"{x:.2f}" for x in values]
                lines.append(f"| `{mode}` | {n} | " + " | ".join(cells) + f" | **{worst:.2f}** |")
        lines.append("")
    return lines


def _fsdp_section(results: dict[str, Any], image_dir: str) -> list[str]:
    """The FSDP part of the page: its modes, one table of memory and time, and its plot."""
    cells = results["cells"]
    size = results["checkpoint"]["size_bytes"]
    modes = [m for m in FSDP_MODES if any(c["mode"] == m for c in cells)]
    if not modes:
        return []
    find = {(c["devices"], c["entry"], c["mode"]): c for c in cells}
    devices = sorted({c["devices"] for c in cells if c["mode"] in modes})
    lines = [
        "## FSDP, full checkpoint",
        "",
        'The same checkpoint restored under Lightning\'s `FSDPStrategy` (`state_dict_type="full"`, one FSDP unit per'
        " linear layer). Lightning's stock strategy requires a GPU, so the jobs use the test suite's"
        " `CPUFSDPStrategy`, which differs only in wrapping the model with `device_id=cpu`; the restore code is"
        " Lightning's own (`fsdp-upstream`) or the package's (`fsdp-ours`). Overheads are against `fsdp-baseline`,"
        " the same FSDP job without a checkpoint, and times against `fsdp-upstream`. Exactness is checked on the"
        " gathered (full) weights and, for fit, on the optimizer state gathered with `FSDP.optim_state_dict`.",
        "",
        "| mode | what restores |",
        "|---|---|",
        *[f"| `{mode}` | {MODE_DESCRIPTIONS[mode]} |" for mode in ["fsdp-baseline", *modes]],
        "",
        "FSDP restores with collectives (the weights are gathered and re-sharded, and so is the optimizer state), so"
        " its ranks cannot take turns. `fsdp-upstream` reads the file lazily and materializes the whole optimizer"
        " state on every rank, for validate too. `fsdp-ours` maps the file on every rank (one copy in the page"
        " cache, not anonymous) and hands FSDP the mapped tensors: each rank copies only its own shard of the"
        " optimizer state, which it needs for training anyway, and the memory FSDP frees after each unit it loads"
        " (the unit's gathered flat parameter) goes back to the operating system at once instead of staying in the C"
        " allocator's heap.",
        "",
        f"![FSDP restore overhead / S against N]({image_dir}/restore_fsdp.png)",
        "",
    ]
    header = ["mode", "N", "fit: net", "fit: raw", "optimizer state kept", "fit: PSS above baseline", "fit: window (s)"]
    header += ["vs fsdp-upstream", "validate: raw", "validate: PSS above baseline", "validate: window (s)"]
    header += ["vs fsdp-upstream", "exact"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for mode in ["fsdp-baseline", *modes]:
        for n in devices:
            fit, val = find.get((n, "fit", mode)), find.get((n, "validate", mode))
            if fit is None and val is None:
                continue
            row = [f"`{mode}`", str(n)]
            for c, entry in ((fit, "fit"), (val, "validate")):
                if c is None:
                    row += ["–"] * (6 if entry == "fit" else 4)
                    continue
                if mode == "fsdp-baseline":
                    own = f"its peak: {c['anon_peak'] / GIB:.2f} GiB"
                    row += ["–", own, "–", "–"] if entry == "fit" else [own, "–"]
                    row += [f"{c['window']:.2f}", "–"]
                    continue
                if entry == "fit":
                    row += [_gib(c["overhead_net"], size, bold=True), _gib(c["overhead"], size)]
                    row += [_gib(c["optimizer_state_bytes"], size)]
                else:
                    row += [_gib(c["overhead"], size, bold=True)]
                ratio = f"**{c['time_ratio']:.2f}**" if c["time_ratio"] is not None else "–"
                row += [_gib(c["overhead_pss"], size), f"{c['window']:.2f}", ratio]
            exact = [c["exact"] for c in (fit, val) if c is not None and c["exact"] is not None]
            row.append("–" if mode == "fsdp-baseline" else ("yes" if all(exact) else "**NO**"))
            lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    return lines


_SHARDED_INTRO = (
    "The same checkpoint (its optimizer state is Adam's, consolidated as a sharded optimizer saves it) resumed"
    " with `trainer.fit` by optimizers that keep only their rank's shard: torch's `ZeroRedundancyOptimizer`"
    " under DDP, and fairscale's `OSS` with `ShardedDataParallel` (Lightning 1.x's `ddp_sharded`, the setup of"
    " the original report, as a Lightning 2.6 strategy: `harness/models.py`). Every rank loads the whole state"
    " and `load_state_dict` keeps its shard. The *optimizer state kept* is the sum of the ranks' shards, about"
    " S_opt in all, and *net* is measured against it as for DDP; the ZeRO modes' baseline is the DDP `baseline`,"
    " the OSS modes' `oss-baseline` (the same fairscale job without a checkpoint). Exactness is checked on every"
    " rank's weights and on the state of the parameters it owns."
)
_FABRIC_INTRO = (
    'The same weights and Adam state, saved in the layout `fabric.save(path, {"model": ..., "optimizer":'
    ' ..., "step": ...})` writes, loaded by `fabric.load(path, {"model": model, "optimizer": optimizer,'
    " \"step\": 0})` under Fabric's DDP (gloo on CPU, Fabric's own launcher) after `fabric.setup`. The window"
    " is the `fabric.load` call, from the earliest rank's start to the latest rank's return; the baseline is the"
    " same program without the call. *Net* is measured against the optimizer state the ranks keep, as for the"
    " Trainer's fit. Exactness is checked on every rank's weights and optimizer state."
)
_FABRIC_FSDP_INTRO = (
    'The same Fabric checkpoint (a full one, as a DDP job or `FSDPStrategy(state_dict_type="full")` writes it)'
    " loaded by the same `fabric.load` under Fabric's `FSDPStrategy` (on CPU: `harness/models.py`'s"
    " `FabricCPUFSDPStrategy`, which differs only in wrapping with `device_id=cpu`), one FSDP unit per layer."
    " Every rank loads together (FSDP loads with collectives); upstream reads the file lazily and then"
    " materializes the whole optimizer state on every rank, ours maps the file and each rank copies only its shard."
    " *Net* is measured against the ranks' shards of the optimizer state. Exactness is checked on the weights and"
    " optimizer state gathered to rank 0."
)
# modes measured against a baseline of their own, each with a section of the page: (modes, title, intro, entry point
# named in the table's header)
FAMILY_SECTIONS = (
    (SHARDED_MODES, "Sharded optimizer state", _SHARDED_INTRO, "fit"),
    (FABRIC_MODES, "Lightning Fabric", _FABRIC_INTRO, "load"),
    (FABRIC_FSDP_MODES, "Lightning Fabric with FSDP", _FABRIC_FSDP_INTRO, "load"),
)


def _family_section(results: dict[str, Any], family: tuple[str, ...], title: str, intro: str, entry: str) -> list[str]:
    """A family of modes measured against its own baseline at the "fit" entry point: their descriptions and one
    table (``entry`` names the entry point in the table's header)."""
    cells = results["cells"]
    size = results["checkpoint"]["size_bytes"]
    modes = [m for m in family if any(c["mode"] == m for c in cells)]
    if not modes:
        return []
    find = {(c["devices"], c["mode"]): c for c in cells if c["entry"] == "fit"}
    baselines = list(dict.fromkeys(_measure.baseline_of(m) for m in modes))
    lines = [
        f"## {title}",
        "",
        intro,
        "",
        "| mode | what restores |",
        "|---|---|",
        *[f"| `{mode}` | {MODE_DESCRIPTIONS[mode]} |" for mode in [b for b in baselines if b != "baseline"] + modes],
        "",
        f"| mode | N | {entry}: net | {entry}: raw | optimizer state kept | PSS above baseline | window (s)"
        " | vs upstream | exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in [b for b in baselines if b != "baseline"] + modes:
        for n in sorted({c["devices"] for c in cells if c["mode"] == mode}):
            c = find.get((n, mode))
            if c is None:
                continue
            if mode in BASELINES:
                own = f"its peak: {c['anon_peak'] / GIB:.2f} GiB"
                lines.append(f"| `{mode}` | {n} | – | {own} | – | – | {c['window']:.2f} | – | – |")
                continue
            ratio = f"**{c['time_ratio']:.2f}**" if c["time_ratio"] is not None else "–"
            lines.append(
                f"| `{mode}` | {n} | {_gib(c['overhead_net'], size, bold=True)} | {_gib(c['overhead'], size)}"
                f" | {_gib(c['optimizer_state_bytes'], size)} | {_gib(c['overhead_pss'], size)} | {c['window']:.2f}"
                f" | {ratio} | {'yes' if c['exact'] else '**NO**'} |"
            )
    lines.append("")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        total = 0
        for params in args.params:
            jobs, whole = plan(args, params), whole_plan(args, params)
            total += len(jobs) + len(whole)
            print(f"{params:,} parameters: {len(jobs)} jobs, {len(whole)} whole-process jobs")
            for devices, entry, mode, repeat in jobs:
                print(f"  N={devices} {entry:8s} {mode} (repeat {repeat})")
            for devices, mode, repeat in whole:
                print(f"  N={devices} whole    {mode} (restore only, repeat {repeat})")
        print(f"{total} jobs in all")
        return 0
    if args.from_results:
        results = json.loads(args.from_results.read_text())
        for view in results.get("sizes", [results]):
            view["cells"] = summarize(view)
            view["whole_cells"] = summarize_whole(view)
        args.quick = results["quick"] if "sizes" in results else results["config"]["quick"]
        args.whole_only = all(v["config"].get("whole_only") for v in results.get("sizes", [results]))
        args.docs = args.docs if args.docs_given else not (args.quick or args.whole_only)
        out = args.output_dir if "--output-dir" in (argv or sys.argv) else args.from_results.parent
    else:
        results = run_all(args)
        out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if args.whole_only:
        return _finish_whole_only(args, results, out)
    images = plot(results, out)
    (out / "report.md").write_text(report(results, "."))
    written = [out / "results.json", out / "report.md", *images]
    if args.docs:
        docs_images = plot(results, DOCS / "img")
        page = DOCS / "benchmarks.md"
        page.write_text(report(results, "img") + _kept_sections(page))
        written += [DOCS / "benchmarks.md", *docs_images]
    print("\nwrote " + ", ".join(_rel(p) for p in written))
    _print_targets([] if args.quick else check_targets_by_size(size_views(results)))
    _print_whole(results)
    print(f"total {results['wall_seconds'] / 60:.1f} minutes")
    inexact = [
        (view["checkpoint"]["params"], r)
        for view in size_views(results)
        for r in view["runs"]
        if r["mode"] not in BASELINES and not r["exact"]
    ]
    for params, run in inexact:
        where = f"{params:,} parameters, N={run['devices']} {run['entry']} {run['mode']}"
        print(f"ERROR: restore not exact: {where}: {'; '.join(run['mismatches'])}", file=sys.stderr)
    for failure in results["failures"]:
        print(f"ERROR: job failed: {failure.splitlines()[0]}", file=sys.stderr)
    return 1 if inexact or results["failures"] else 0


def _print_targets(targets: list[Target]) -> None:
    for target, measured, ok, worst in targets:
        print(
            f"  target {'met   ' if ok else 'MISSED' if ok is False else '  –   '} {target}: {_figure(target, worst)}"
            f" ({measured})"
        )


def _seconds(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f}s"


def _print_whole(results: dict[str, Any]) -> None:
    """The whole-process medians, one line per size and N."""
    for view in size_views(results):
        for cell in view.get("whole_cells") or []:
            up, ours = cell["upstream"], cell["ours-true"]
            if cell["seconds_ratio"] is None:
                continue
            print(
                f"  whole process, {view['checkpoint']['params'] / 1e6:.0f}M N={cell['devices']}: ours-true"
                f" {ours['seconds']:.2f}s vs upstream {up['seconds']:.2f}s = {cell['seconds_ratio']:.3f} x"
                f" (CPU {ours['cpu_seconds']:.2f}s vs {up['cpu_seconds']:.2f}s = {cell['cpu_seconds_ratio']:.3f} x;"
                f" restore {_seconds(ours.get('restore_seconds'))} vs {_seconds(up.get('restore_seconds'))})"
            )


def _finish_whole_only(args: argparse.Namespace, results: dict[str, Any], out: Path) -> int:
    """(--whole-only) report.md, and with --docs the whole-process section of docs/benchmarks.md; the exit code."""
    (out / "report.md").write_text(report_whole(results))
    written = [out / "results.json", out / "report.md"]
    if args.docs:
        page = DOCS / "benchmarks.md"
        section = _whole_section(size_views(results))
        page.write_text(replace_section(page.read_text() if page.exists() else "", WHOLE_HEADING, section))
        written.append(page)
    print("\nwrote " + ", ".join(_rel(p) for p in written))
    _print_targets(check_targets_by_size(size_views(results)))
    _print_whole(results)
    print(f"total {results['wall_seconds'] / 60:.1f} minutes")
    for failure in results["failures"]:
        print(f"ERROR: job failed: {failure.splitlines()[0]}", file=sys.stderr)
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
