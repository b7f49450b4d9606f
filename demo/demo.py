"""Resume a DDP job with the upstream Trainer and with ``serialized_checkpoint_loading=True``; compare node memory.

1. Train an MLP (about 30M parameters by default) for a few Adam steps with DDP on N CPU processes and save a
   checkpoint with ``trainer.save_checkpoint``.
2. Run the resume program without a checkpoint (the baseline: what the job holds anyway).
3. Resume with ``pytorch_lightning.Trainer().fit(ckpt_path=...)`` (upstream).
4. Resume with ``serialized_restore.Trainer(serialized_checkpoint_loading=True).fit(ckpt_path=...)``.

With ``--fabric`` the same comparison runs under Lightning Fabric: ``fabric.load(path, {"model": ...,
"optimizer": ...})`` with ``lightning_fabric.Fabric`` against
``serialized_restore.fabric.Fabric(serialized_checkpoint_loading=True)``.

Each resume stops right before its first training step. While it runs, this process samples the anonymous memory
of every process of the job (from ``/proc``) and reports the peak above the baseline, and every rank checks that
what it restored equals the checkpoint bit for bit. Needs no GPU: DDP runs over gloo on the CPU.

The measuring code is the benchmark's (``benchmarks/_measure.py``); ``benchmarks/restore_benchmark.py`` runs the
full comparison and ``docs/benchmarks.md`` explains the figures.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _measure  # noqa: E402
from benchmarks._measure import GIB, JobFailed  # noqa: E402

PARAMS = 30_000_000
DEPTH = 8
DEVICES = 4
TRAIN_STEPS = 3
OUTPUT_DIR = Path(__file__).resolve().parents[1] / "demo_output"
JOB_TIMEOUT = 600.0

LABELS = {
    "baseline": "no checkpoint (baseline)",
    "upstream": "pytorch_lightning.Trainer",
    "ours-true": "serialized_checkpoint_loading=True",
    "fabric-baseline": "no fabric.load (baseline)",
    "fabric-upstream": "lightning_fabric.Fabric",
    "fabric-ours": "serialized_checkpoint_loading=True",
}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bash scripts/demo.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=int, default=PARAMS, help=f"model parameters (default {PARAMS:,})")
    parser.add_argument("--devices", type=int, default=DEVICES, help=f"local ranks N (default {DEVICES})")
    parser.add_argument(
        "--entry",
        choices=("fit", "validate"),
        default="fit",
        help="resume through trainer.fit or restore for trainer.validate (default fit)",
    )
    parser.add_argument(
        "--fabric",
        action="store_true",
        help="compare Lightning Fabric's fabric.load instead of the Trainer (the model and optimizer, like fit)",
    )
    parser.add_argument(
        "--output-dir", type=Path, default=OUTPUT_DIR, help="where the checkpoint and job logs go (default demo_output)"
    )
    parser.add_argument("--timeout", type=float, default=JOB_TIMEOUT, help="seconds before a job is killed")
    return parser.parse_args(argv)


def _size(value: float) -> str:
    return f"{value / GIB:.2f} GiB" if abs(value) >= 0.1 * GIB else f"{value / 2**20:.0f} MiB"


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.devices < 1 or args.params < 1000:
        sys.exit("--devices must be at least 1 and --params at least 1000")
    out: Path = args.output_dir
    shutil.rmtree(out, ignore_errors=True)
    started = time.monotonic()

    print(
        f"1. training ~{args.params / 1e6:.0f}M parameters, {TRAIN_STEPS} Adam steps, DDP on {args.devices} CPU ranks"
    )
    checkpoint, _ = _measure.create_checkpoint(
        out, args.params, DEPTH, steps=TRAIN_STEPS, devices=args.devices, timeout=args.timeout
    )
    size = checkpoint.size_bytes
    print(
        f"   saved {checkpoint.path.name}: {checkpoint.params:,} parameters, checkpoint size S = {size / GIB:.2f} GiB"
        f" (weights + Adam state)  [{time.monotonic() - started:.0f}s]"
    )
    _measure.warm_page_cache(checkpoint.path)

    runs: dict[str, dict[str, Any]] = {}
    if args.fabric:
        args.entry = "fit"  # fabric.load of the model and the optimizer
        baseline, upstream_mode, ours_mode = "fabric-baseline", "fabric-upstream", "fabric-ours"
        steps = [
            (baseline, "2. the same Fabric program without fabric.load"),
            (upstream_mode, "3. fabric.load with lightning_fabric.Fabric"),
            (ours_mode, f"4. fabric.load with {LABELS[ours_mode]}"),
        ]
    else:
        baseline, upstream_mode, ours_mode = "baseline", "upstream", "ours-true"
        steps = [
            (baseline, "2. the same program without a checkpoint"),
            (upstream_mode, "3. resuming with the upstream Trainer"),
            (ours_mode, f"4. resuming with {LABELS[ours_mode]}"),
        ]
    for mode, title in steps:
        print(f"{title} ({args.entry}, {args.devices} ranks) ...", flush=True)
        try:
            run = _measure.measure_restore(
                mode=mode,
                entry=args.entry,
                devices=args.devices,
                checkpoint=checkpoint,
                run_dir=out / f"{args.entry}-{mode}",
                timeout=args.timeout,
            )
        except JobFailed as err:
            print(f"FAILED: {err}", file=sys.stderr)
            return 1
        runs[mode] = run.as_dict()
        print(f"   peak node anonymous memory {_size(run.anon_peak)}, restore window {run.window:.1f}s")

    base = runs[baseline]
    fit = args.entry == "fit"
    what = "fabric.load" if args.fabric else f"trainer.{args.entry}"

    def cell(value: float) -> str:
        return f"{_size(value)} ({value / size:.2f} x S)"

    print()
    print(
        f"Resume through {what} on {args.devices} ranks: node anonymous memory, peak inside the restore"
        f" window; S = {size / GIB:.2f} GiB"
    )
    columns = ["above baseline", *(["optimizer state kept", "net"] if fit else []), "restore time", "exact"]
    widths = [36, 22, *([22, 22] if fit else []), 14, 5]
    print("  " + "".join(f"{c:<{w}}" for c, w in zip(["", *columns], widths)).rstrip())
    overhead = {}
    for mode in (upstream_mode, ours_mode):
        run = runs[mode]
        o = overhead[mode] = _measure.overheads(run, base)
        row = [LABELS[mode], cell(o["raw"])]
        row += [cell(run["optimizer_state_bytes"]), cell(o["net"])] if fit else []
        row += [f"{run['window']:.1f}s", "yes" if run["exact"] else "NO"]
        print("  " + "".join(f"{c:<{w}}" for c, w in zip(row, widths)).rstrip())
    print()
    # the headline is the README's measure: net of the optimizer state for fit, above the baseline otherwise
    measure, meaning = (
        ("net", "net of the optimizer state every training job holds anyway")
        if fit
        else ("raw", "above the same program without a checkpoint")
    )
    upstream, ours = overhead[upstream_mode][measure], overhead[ours_mode][measure]
    print(
        f"=> host memory the resume adds ({meaning}): {cell(upstream)} upstream,"
        f" {cell(ours)} with serialized_checkpoint_loading=True"
    )
    print(f"   (the README's measure; the program without a checkpoint peaks at {_size(base['anon_peak'])})")
    if fit:
        # net's baseline: the larger of the program's own peak and what it holds at the end with its optimizer state
        for mode in (upstream_mode, ours_mode):
            run = runs[mode]
            kept = run["optimizer_state_bytes"] - run.get("optimizer_state_mapped_bytes", 0)
            floor = max(base["anon_peak"], base["anon_end"] + kept)
            print(
                f"   net, {LABELS[mode]}: peak {_size(run['anon_peak'])} - max(baseline peak"
                f" {_size(base['anon_peak'])}, baseline at its end {_size(base['anon_end'])} + optimizer state kept"
                f" {_size(kept)}) = {_size(run['anon_peak'] - floor)}"
            )
    inexact = [mode for mode in (upstream_mode, ours_mode) if not runs[mode]["exact"]]
    if inexact:
        for mode in inexact:
            print(f"ERROR: {mode} did not restore the checkpoint exactly: {runs[mode]['mismatches']}", file=sys.stderr)
        return 1
    print(f"=> both restores are bit-for-bit exact on every rank. [{time.monotonic() - started:.0f}s in all]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
