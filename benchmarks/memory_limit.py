"""Resuming under a real memory limit: the job that fits without a checkpoint, upstream's resume, and ours.

The question a user asks: *my job trains within the node's memory; does resuming it?* This benchmark answers it
with a real limit instead of a figure. It puts every measured job (all its ranks) in a cgroup-v1 memory cgroup:

1. the job without a checkpoint (``validate`` on N ranks) runs unlimited, and its peak charge
   (``memory.max_usage_in_bytes``: private memory and page cache) is the memory the job needs anyway;
2. the limit is set to that peak plus one checkpoint size S, a node with room for one more copy of the checkpoint;
3. upstream's resume (``pytorch_lightning.Trainer``, every rank loads the whole checkpoint at once) and ours
   (``serialized_checkpoint_loading=True``) run under that limit: whether the kernel's OOM killer ended the job,
   and whether every rank restored bit for bit.

    python benchmarks/memory_limit.py             # 40M parameters, N = 4 (under a minute): docs/memory_limit.md
    python benchmarks/memory_limit.py --no-docs   # the same, printed only
    python benchmarks/memory_limit.py --ours-only --params 20000000 --devices 2  # ours only, smaller (the suite's)

Needs root and a writable cgroup-v1 memory controller (``/sys/fs/cgroup/memory``); without one it prints one line
saying so and exits 0. Swap is not counted (``memory.swappiness`` 0 in the cgroup, and ``memsw`` limited too where
the kernel accounts it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _measure  # noqa: E402
from benchmarks._measure import GIB, JobFailed  # noqa: E402

PARAMS = 40_000_000  # S ~ 0.45 GiB
DEPTH = 8
DEVICES = 4
ENTRY = "validate"  # the starkest case: nothing of the checkpoint is kept after the restore
MODES = ("upstream", "ours-true")
HEADROOM = 1.0  # x S above the job's own peak: room for one more copy of the checkpoint
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 600.0


def cgroup_unavailable() -> Optional[str]:
    """Why no memory cgroup can be made here, or ``None``."""
    if not (CGROUP_ROOT / "memory.limit_in_bytes").exists():
        return f"no cgroup-v1 memory controller at {CGROUP_ROOT}"
    if not os.access(CGROUP_ROOT, os.W_OK):
        return f"{CGROUP_ROOT} is not writable (needs root)"
    return None


class MemoryCgroup:
    """A cgroup-v1 memory cgroup of its own, removed on exit; processes enter it through :meth:`enter`."""

    def __init__(self, name: str) -> None:
        self.path = CGROUP_ROOT / name

    def __enter__(self) -> MemoryCgroup:
        self.path.mkdir()
        self._write("memory.swappiness", "0")
        return self

    def __exit__(self, *exc: Any) -> None:
        # run_job has killed every job's process tree; wait (bounded) until the kernel has let them all go
        deadline = time.monotonic() + 30
        while True:
            pids = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def _read(self, name: str) -> int:
        return int((self.path / name).read_text().split()[0])

    def set_limit(self, limit: Optional[int]) -> None:
        value = str(limit) if limit is not None else "-1"
        memsw = self.path / "memory.memsw.limit_in_bytes"
        # memsw must stay >= the memory limit: raise in the order that keeps it so
        order = ["memory.memsw.limit_in_bytes", "memory.limit_in_bytes"] if limit is None else [
            "memory.limit_in_bytes", "memory.memsw.limit_in_bytes"
        ]  # fmt: skip
        for name in order:
            if name != memsw.name or memsw.exists():
                self._write(name, value)

    def reset_peak(self) -> None:
        self._write("memory.max_usage_in_bytes", "0")

    def peak(self) -> int:
        return self._read("memory.max_usage_in_bytes")

    def oom_kills(self) -> int:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return self._read("memory.failcnt")

    def enter(self) -> None:
        """(in the job's first process, before it starts) join the cgroup; the ranks it launches inherit it."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))


def run(out_dir: Path, modes: tuple[str, ...] = MODES, params: int = PARAMS, devices: int = DEVICES) -> dict[str, Any]:
    checkpoint, _ = _measure.create_checkpoint(out_dir / "checkpoints", params, DEPTH)
    _measure.warm_page_cache(checkpoint.path)
    size = checkpoint.size_bytes
    rows: list[dict[str, Any]] = []
    with MemoryCgroup(f"serialized-restore-memory-limit-{os.getpid()}") as cgroup:

        def job(mode: str) -> dict[str, Any]:
            cgroup.reset_peak()
            kills = cgroup.oom_kills()
            row: dict[str, Any] = {"mode": mode, "limit": limit}
            try:
                result = _measure.measure_restore(
                    mode=mode, entry=ENTRY, devices=devices, checkpoint=checkpoint,
                    run_dir=out_dir / "runs" / mode, timeout=TIMEOUT, preexec_fn=cgroup.enter,
                )  # fmt: skip
                row.update(finished=True, exact=result.exact, seconds=result.window_end - result.window_start)
            except JobFailed as err:
                row.update(finished=False, exact=None, seconds=None, why=str(err).splitlines()[0])
            row.update(peak=cgroup.peak(), oom_kills=cgroup.oom_kills() - kills)
            return row

        limit = None
        cgroup.set_limit(None)
        baseline = job("baseline")
        limit = int(baseline["peak"] + HEADROOM * size)
        cgroup.set_limit(limit)
        rows = [baseline] + [job(mode) for mode in modes]
    checkpoint_figures = {"params": checkpoint.params, "size_bytes": size}
    return {"checkpoint": checkpoint_figures, "rows": rows, "limit": limit, "devices": devices}


def report(results: dict[str, Any], command: str) -> str:
    size = results["checkpoint"]["size_bytes"]
    limit = results["limit"]
    names = {
        "baseline": "the same job without a checkpoint (unlimited)",
        "upstream": "`pytorch_lightning.Trainer`, resuming",
        "ours-true": "`serialized_restore.Trainer(serialized_checkpoint_loading=True)`, resuming",
    }
    lines = [
        "# Resuming under a memory limit",
        "",
        f"Generated by `{command}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC. `{ENTRY}` on"
        f" {results['devices']} ranks (DDP, gloo on CPU) of a {results['checkpoint']['params']:,}-parameter MLP with"
        " Adam, checkpoint"
        f" S = {size / GIB:.2f} GiB; every job in a memory cgroup of its own (private memory and page cache charged,"
        " swap off).",
        "",
        f"The job without a checkpoint peaked at {results['rows'][0]['peak'] / GIB:.2f} GiB; the limit for the"
        f" resumes is that plus {HEADROOM:g} x S: **{limit / GIB:.2f} GiB**, a node with room for one more copy of"
        " the checkpoint.",
        "",
        "| job | under the limit | peak charge | OOM kills | restore time | exact |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        if row["mode"] == "baseline":
            outcome = "(no limit)"
        else:
            outcome = "**finished**" if row["finished"] else "**killed by the OOM killer**" if row["oom_kills"] else (
                "**failed**"
            )  # fmt: skip
        seconds = f"{row['seconds']:.1f}s" if row["seconds"] is not None else "-"
        exact = "-" if row["mode"] == "baseline" else {True: "yes", False: "**no**", None: "-"}[row["exact"]]
        lines.append(
            f"| {names[row['mode']]} | {outcome} | {row['peak'] / GIB:.2f} GiB | {row['oom_kills']} | {seconds}"
            f" | {exact} |"
        )
    lines += [
        "",
        "Peak charge: `memory.max_usage_in_bytes` of the job's cgroup (for a killed job: up to the kill). The page"
        " cache of the memory-mapped checkpoint is charged too, but it is clean and reclaimable: under the limit the"
        " kernel drops it instead of killing. Reproduce with the command above (root, cgroup v1).",
        "",
    ]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=REPO / "bench_output" / "memory_limit")
    parser.add_argument(
        "--docs", action=argparse.BooleanOptionalAction, default=True, help="write docs/memory_limit.md"
    )
    parser.add_argument(
        "--ours-only",
        action="store_true",
        help="skip upstream's resume (the test suite's smoke run; implies --no-docs)",
    )
    parser.add_argument("--params", type=int, default=PARAMS, help=f"the MLP's parameters (default {PARAMS:,})")
    parser.add_argument("--devices", type=int, default=DEVICES, help=f"ranks N (default {DEVICES})")
    args = parser.parse_args(argv)
    args.docs = args.docs and not args.ours_only and (args.params, args.devices) == (PARAMS, DEVICES)
    why = cgroup_unavailable()
    if why is not None:
        print(f"memory_limit: skipped: {why}")
        return 0
    results = run(args.output_dir, ("ours-true",) if args.ours_only else MODES, args.params, args.devices)
    command = " ".join(["python benchmarks/memory_limit.py", *(sys.argv[1:] if argv is None else argv)])
    text = report(results, command)
    print(text)
    if args.docs:
        (REPO / "docs" / "memory_limit.md").write_text(text)
    ours = next(r for r in results["rows"] if r["mode"] == "ours-true")
    return 0 if ours["finished"] and ours["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
