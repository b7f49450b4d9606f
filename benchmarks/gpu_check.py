"""GPU check: restore a checkpoint saved from a GPU model, on GPU, with upstream Lightning and with the option.

On a GPU node ``Optimizer.load_state_dict`` moves each state tensor to its parameter's device, so a host copy of
the optimizer state is a pure transient, and with ``serialized_checkpoint_loading=True`` the weights go from the
memory-mapped file straight to the device: the restore should hold next to no host memory above what the job holds
anyway. This script measures that, side by side with upstream, in one short run (a few minutes):

    bash benchmarks/gpu_check.sh                        # skips with one line where no CUDA device is visible
    python benchmarks/gpu_check.py --accelerator cpu    # the same jobs on CPU (keeps the script itself tested)

For each N (1 rank; also every visible GPU up to 4 when there are more) and entry point (``fit``, ``validate``) it
runs the benchmark's job (``benchmarks/_job.py``, DDP through Lightning's own launcher) three ways: ``baseline`` (no
checkpoint), ``upstream`` and ``ours-true``, and prints per restore: host anonymous memory of the job's process
tree above the baseline's (``net`` of the optimizer state kept in host memory for fit, as in
``docs/benchmarks.md``), GPU memory (torch's allocator, summed over ranks: at the end of the restore and the peak
since ``setup``), restore time and its ratio to upstream, and whether the restore is bit-for-bit exact. Exits
non-zero if a job fails or a restore is not exact. ``--docs`` also writes the table to ``docs/gpu_check.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _measure  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODES = ("baseline", "upstream", "ours-true")
ENTRIES = ("fit", "validate")
DEFAULT_PARAMS = 126_000_000
DEPTH = 8
MIB = 2**20


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--params", type=int, default=DEFAULT_PARAMS, help="checkpoint size in parameters")
    parser.add_argument(
        "--devices", help="N to measure, comma-separated (default: 1, and every visible GPU up to 4 when more)"
    )
    parser.add_argument("--entries", default=",".join(ENTRIES), help="entry points, comma-separated")
    parser.add_argument("--output-dir", type=Path, default=REPO / "bench_output" / "gpu_check")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one job may run")
    parser.add_argument("--docs", action="store_true", help="also write the table to docs/gpu_check.md")
    args = parser.parse_args(argv)
    args.output_dir = args.output_dir.resolve()
    args.entries = tuple(e for e in args.entries.split(",") if e)
    if any(e not in ENTRIES for e in args.entries):
        parser.error(f"--entries: choose from {', '.join(ENTRIES)}")
    if args.devices:
        args.devices = tuple(int(n) for n in args.devices.split(","))
    else:
        visible = _gpu_count() if args.accelerator == "gpu" else 1
        args.devices = (1,) + ((min(visible, 4),) if visible > 1 else ())
    return args


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _device_name(accelerator: str) -> str:
    import torch

    if accelerator == "gpu":
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
    return "CPU"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Save the checkpoint from a model trained on the accelerator, then measure every (N, entry, mode)."""
    out: Path = args.output_dir
    checkpoint, _ = _measure.create_checkpoint(
        out / "checkpoints", args.params, DEPTH, timeout=args.timeout, accelerator=args.accelerator
    )
    _measure.warm_page_cache(checkpoint.path)
    print(f"checkpoint: {checkpoint.path.name}, {checkpoint.params:,} parameters, S = {_gib(checkpoint.size_bytes)}")
    cells: list[dict[str, Any]] = []
    for devices in args.devices:
        for entry in args.entries:
            for mode in MODES:
                run_dir = out / "runs" / f"n{devices}-{entry}-{mode}"
                started = time.monotonic()
                result = _measure.measure_restore(
                    mode=mode,
                    entry=entry,
                    devices=devices,
                    checkpoint=checkpoint,
                    run_dir=run_dir,
                    timeout=args.timeout,
                    accelerator=args.accelerator,
                ).as_dict()
                result.pop("timeline", None)
                cells.append(result)
                print(
                    f"N={devices} {entry:<8} {mode:<9} window {result['window']:6.2f}s  host anon peak"
                    f" {_gib(result['anon_peak'])}  exact {result['exact'] if mode != 'baseline' else '-'}"
                    f"  (job {time.monotonic() - started:.0f}s)",
                    flush=True,
                )
    results = {
        "accelerator": args.accelerator,
        "device": _device_name(args.accelerator),
        "checkpoint": {"path": checkpoint.path.name, "params": checkpoint.params, "size_bytes": checkpoint.size_bytes},
        "cells": cells,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return results


def rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per restore (``upstream``, ``ours-true``) with its overheads against the baseline of its cell."""
    size = results["checkpoint"]["size_bytes"]
    by_key = {(c["devices"], c["entry"], c["mode"]): c for c in results["cells"]}
    out = []
    for (devices, entry, mode), cell in by_key.items():
        if mode == "baseline":
            continue
        overheads = _measure.overheads(cell, by_key[(devices, entry, "baseline")])
        host = overheads["net"] if entry == "fit" else overheads["raw"]
        upstream = by_key[(devices, entry, "upstream")]
        out.append(
            {
                "devices": devices,
                "entry": entry,
                "mode": mode,
                "host_over_baseline": host,
                "host_x_s": host / size if host is not None else None,
                "optimizer_host_bytes": cell["optimizer_state_bytes"] - cell["optimizer_state_mapped_bytes"],
                "gpu_bytes": cell.get("gpu_bytes"),
                "gpu_peak_bytes": cell.get("gpu_peak_bytes"),
                "window": cell["window"],
                "vs_upstream": cell["window"] / upstream["window"] if upstream["window"] > 0 else None,
                "exact": cell["exact"] and cell["checked"],
            }
        )
    return out


def table(results: dict[str, Any]) -> str:
    size = results["checkpoint"]["size_bytes"]
    lines = [
        f"Device: {results['device']}. Checkpoint: {results['checkpoint']['params']:,} parameters, Adam, saved from"
        f" the model on the {'GPU' if results['accelerator'] == 'gpu' else 'CPU'}: S = {_gib(size)}.",
        "",
        "| N | entry | mode | host anon above baseline | x S | optimizer state in host memory | GPU memory at end"
        " / peak | restore time | vs upstream | exact |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows(results):
        gpu = f"{_gib(row['gpu_bytes'])} / {_gib(row['gpu_peak_bytes'])}" if row["gpu_bytes"] is not None else "–"
        lines.append(
            f"| {row['devices']} | {row['entry']} | `{row['mode']}` | {_gib(row['host_over_baseline'])}"
            f" | {row['host_x_s']:.2f} | {_gib(row['optimizer_host_bytes'])} | {gpu} | {row['window']:.2f}s"
            f" | {row['vs_upstream']:.2f} x | {'yes' if row['exact'] else '**no**'} |"
        )
    lines += [
        "",
        "Host memory is the job's process tree's anonymous memory (`RssAnon`, summed over the ranks, sampled every"
        " 5 ms) at its peak inside the restore window, minus the baseline job's (same N and entry point, no"
        " checkpoint); for fit, net of the optimizer state the ranks keep in host memory (see `docs/benchmarks.md`)."
        " GPU memory is `torch.cuda.memory_allocated` / `max_memory_allocated`, summed over ranks.",
    ]
    return "\n".join(lines) + "\n"


def _gib(value: Optional[int]) -> str:
    if value is None:
        return "–"
    return f"{value / 2**30:.2f} GiB" if abs(value) >= 2**30 else f"{value / MIB:.0f} MiB"


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.accelerator == "gpu" and _gpu_count() == 0:
        print("gpu_check: skipped: no CUDA device is visible")
        return 0
    args.output_dir.mkdir(parents=True, exist_ok=True)
    results = run(args)
    text = table(results)
    print()
    print(text)
    (args.output_dir / "report.md").write_text(text)
    if args.docs:
        page = "# GPU check: a restore on GPU, upstream vs `serialized_checkpoint_loading=True`\n\n"
        page += f"Written by `bash benchmarks/gpu_check.sh --docs` ({time.strftime('%Y-%m-%d')}).\n\n" + text
        (REPO / "docs" / "gpu_check.md").write_text(page)
    return 0 if all(row["exact"] for row in rows(results)) else 1


if __name__ == "__main__":
    sys.exit(main())
