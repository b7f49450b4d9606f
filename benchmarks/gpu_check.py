"""GPU check: one bounded run that proves, on a GPU node, what the CPU measurements cannot, and cannot pass by mistake.

    bash benchmarks/gpu_check.sh --require-gpu --out DIR  # a GPU node (exits 2, saying why, without CUDA)
    python3 benchmarks/gpu_check.py --accelerator cpu     # the same jobs on CPU with gloo (the test suite runs this)

Every job is a real Lightning job (``_job.py``, DDP through Lightning's own launcher) measured from outside
(``_measure.py``: host anonymous memory of the job's process tree, the restore window from the ranks' markers, an
exact comparison of what each rank restored with the checkpoint). In one run:

1. **preflight** (5 s): a one-rank process group of the jobs' backend (NCCL on GPU, gloo on CPU) and a barrier, in a
   process of its own. If it fails, the environment is at fault (driver, NCCL, sockets), not the project: the run
   stops with exit code 3 and says so.
2. **checkpoint**: the benchmark MLP trained 3 Adam steps on one device and saved by ``trainer.save_checkpoint``
   (on GPU its storages are tagged ``cuda:0``).
3. **Trainer**, N = 1, ``fit`` and ``validate``: ``baseline`` (no checkpoint), ``upstream``, ``ours-true`` (memory
   mapped) and ``ours-true-eager`` (the eager reader); on CPU ``fit`` and no eager reader, which the suite covers.
4. **Fabric**, N = 1, ``fabric.load(path, {"model", "optimizer", "step"})``: the same.
5. With N >= 2 devices (every visible GPU; 2 ranks on CPU): DDP ``fit`` with N ranks, ``ours-true``, whose turns
   must follow one another, and FSDP ``fit`` from a full checkpoint (on GPU saved by Lightning's ``FSDPStrategy``
   on the N GPUs; on CPU by DDP, since torch's full-state FSDP save crashes on CPU), ``fsdp-upstream`` and
   ``fsdp-ours``, both exact.

Checks, each of which fails the run (exit code 1): every restore is exact (weights; for fit, optimizer state and
step); memory (N = 1, S the checkpoint's size): ``ours-true`` and ``fabric-ours`` add at most 0.1 x S of host
anonymous memory above their baseline (net of the optimizer state kept in host memory, which on GPU is none), and
``upstream`` and ``fabric-upstream`` at least 0.5 x S (upstream holds the whole checkpoint in host memory: if the
measurement misses that copy, it cannot see ours either; an upstream job whose peak was missed, a tenth of a second
on a busy host, is measured again, up to 3 times); the log says the file was read memory-mapped (the memory-mapped
modes), eagerly (the eager modes), and for FSDP that the full checkpoint was memory-mapped; with N ranks, each
rank's turn of the first stage starts after its predecessor's has ended.

Bounds: every job has its own timeout (``--job-timeout``, 120 s), the whole run ``--budget`` seconds (450): a job is
given at most what is left, and a job that would start with less than ``MIN_JOB_SECONDS`` left is not run.
``results.json`` and ``report.md`` in ``--out`` are rewritten after every job, so a run killed from outside still
leaves the result of every job that finished; each job's log is ``runs/<job>/job.log``.

Exit codes: 0 every check passed; 1 a check failed or a job failed, timed out or did not run; 2 ``--require-gpu``
without a usable CUDA device (or without torch); 3 the preflight failed (environment).

Runs with what a GPU image has: Python 3.10-3.12, torch, ``pytorch-lightning`` and ``lightning`` 2.6, psutil; no
fairscale, no jsonargparse. Checked with torch 2.13.0 (CPU) and Lightning 2.6.6 on the CPU branch; the torch calls on
its paths (``torch.load(mmap=True)``, ``torch.cuda.synchronize``, the FSDP ``FULL_STATE_DICT`` API, process groups on
a ``HashStore``, ``barrier(device_ids=...)``) all exist in torch 2.11, which the GPU image has.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _measure  # noqa: E402
from benchmarks.modes import baseline_of  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PARAMS = 126_000_000
DEPTH = 8
JOB_TIMEOUT = 120.0
BUDGET = 450.0
MIN_JOB_SECONDS = 15.0
UPSTREAM_MEMORY_ATTEMPTS = 3  # upstream's memory floor, measured again when its short peak was missed
PREFLIGHT_SECONDS = 5.0
OURS_AT_MOST = 0.1
UPSTREAM_AT_LEAST = 0.5  # of the copy upstream holds: a sampler on a busy machine may miss the top of its peak
STAGE_1 = "restore modules and callbacks"
FABRIC_STAGE = "load checkpoint"
EXIT_FAILED, EXIT_NO_GPU, EXIT_ENVIRONMENT = 1, 2, 3
MIB = 2**20

_PREFLIGHT = r"""
import faulthandler, sys, torch, torch.distributed as dist
backend = sys.argv[1]
faulthandler.dump_traceback_later(float(sys.argv[2]), exit=True)
dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
if backend == "nccl":
    torch.cuda.set_device(0)
    dist.barrier(device_ids=[0])
    torch.cuda.synchronize()
else:
    dist.barrier()
dist.destroy_process_group()
faulthandler.cancel_dump_traceback_later()
print("preflight ok")
"""


@dataclass
class Job:
    """One job of the run, what it depends on, and how it ended."""

    name: str
    kind: str
    """``checkpoint`` (save one) or ``restore`` (measure a restore, or its baseline)."""
    mode: str = ""
    entry: str = "fit"
    devices: int = 1
    strategy: Optional[str] = None
    needs: str = "checkpoint"
    status: str = "pending"
    """``passed``, ``failed`` (a check), ``error`` (the job failed or timed out), ``not run`` or ``pending``."""
    seconds: float = 0.0
    detail: str = ""
    checks: list[dict[str, Any]] = field(default_factory=list)
    cell: Optional[dict[str, Any]] = None


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--require-gpu", action="store_true", help="exit 2, saying why, where CUDA is not usable")
    parser.add_argument("--out", "--output-dir", dest="out", type=Path, default=REPO / "bench_output" / "gpu_check")
    parser.add_argument("--params", type=int, default=DEFAULT_PARAMS, help="checkpoint size in parameters")
    parser.add_argument("--ranks", type=int, help="N of the multi-rank jobs (default: every visible GPU; 2 on CPU)")
    parser.add_argument("--job-timeout", type=float, default=JOB_TIMEOUT, help="seconds one job may run")
    parser.add_argument("--budget", type=float, default=BUDGET, help="seconds the whole run may take")
    parser.add_argument("--docs", action="store_true", help="also write the report to docs/gpu_check.md")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    return args


def cuda_problem() -> Optional[str]:
    """Why this interpreter cannot run the GPU jobs, or ``None`` if it can."""
    try:
        import torch
    except ImportError as err:
        return f"{sys.executable} cannot import torch ({err})"
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (
            f"no CUDA device is visible to {sys.executable} (torch {torch.__version__}, built for CUDA"
            f" {torch.version.cuda}; CUDA_VISIBLE_DEVICES={visible!r})"
        )
    return None


def environment(accelerator: str) -> dict[str, Any]:
    import torch

    info = _measure.machine_info()
    info["python_executable"] = sys.executable
    if accelerator == "gpu":
        count = torch.cuda.device_count()
        info["gpus"] = count
        info["device"] = f"{count} x {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
    else:
        info["gpus"] = 0
        info["device"] = "CPU"
    return info


def preflight(accelerator: str) -> tuple[bool, str]:
    """(this process) A one-rank process group of the jobs' backend and a barrier, in a child process, within
    ``PREFLIGHT_SECONDS`` (plus the time to import torch)."""
    backend = "nccl" if accelerator == "gpu" else "gloo"
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PREFLIGHT, backend, str(PREFLIGHT_SECONDS)],
            capture_output=True,
            text=True,
            timeout=PREFLIGHT_SECONDS + 60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return False, f"{backend} preflight: no answer within {PREFLIGHT_SECONDS + 60:.0f}s"
    took = time.monotonic() - started
    if done.returncode == 0 and "preflight ok" in done.stdout:
        return True, f"{backend}: one-rank process group and barrier in {took:.1f}s"
    tail = (done.stdout + done.stderr).strip()[-3000:]
    return False, f"{backend} preflight exited with {done.returncode} after {took:.1f}s:\n{tail}"


def plan(accelerator: str, ranks: int) -> list[Job]:
    """Every job of the run, in the order it runs (the most telling first, so a short budget still shows them)."""
    jobs = [Job("checkpoint", "checkpoint", needs="")]
    # on CPU, a rehearsal of the device run inside the test suite: `validate` and the eager reader (which the suite
    # covers) on GPU only
    gpu = accelerator == "gpu"
    for entry in ("fit", "validate") if gpu else ("fit",):
        for mode in ("baseline", "upstream", "ours-true") + (("ours-true-eager",) if gpu else ()):
            jobs.append(Job(f"n1-{entry}-{mode}", "restore", mode, entry))
    for mode in ("fabric-baseline", "fabric-upstream", "fabric-ours") + (("fabric-ours-eager",) if gpu else ()):
        jobs.append(Job(f"n1-load-{mode}", "restore", mode, "fit"))
    if ranks >= 2:
        jobs.append(Job(f"n{ranks}-fit-ours-true", "restore", "ours-true", "fit", ranks))
        if accelerator == "gpu":
            jobs.append(Job("fsdp-checkpoint", "checkpoint", devices=ranks, strategy="fsdp", needs=""))
        fsdp = "fsdp" if accelerator == "gpu" else None
        needs = "fsdp-checkpoint" if accelerator == "gpu" else "checkpoint"
        for mode in ("fsdp-upstream", "fsdp-ours"):
            jobs.append(Job(f"n{ranks}-fit-{mode}", "restore", mode, "fit", ranks, strategy=fsdp, needs=needs))
    return jobs


class Run:
    """The jobs of one run, their outcomes and the files they are written to."""

    def __init__(self, args: argparse.Namespace, env: dict[str, Any], jobs: list[Job]) -> None:
        self.args = args
        self.env = env
        self.jobs = jobs
        self.checkpoints: dict[str, Any] = {}
        self.deadline = time.monotonic() + args.budget
        self.preflight = ""

    def execute(self) -> None:
        for job in self.jobs:
            left = self.deadline - time.monotonic()
            if job.needs and job.needs not in self.checkpoints:
                job.status, job.detail = "not run", f"needs the {job.needs} job, which did not pass"
            elif left < MIN_JOB_SECONDS:
                job.status, job.detail = "not run", f"whole-run bound: {left:.0f}s of --budget left"
            else:
                self._run_job(job, min(self.args.job_timeout, left))
                if job.status == "error" and left < self.args.job_timeout and "timed out" in job.detail:
                    job.detail = f"whole-run bound: stopped after the {left:.0f}s of --budget left ({job.detail})"
            print(f"{job.name:<28} {job.status:<8} {job.seconds:6.1f}s  {job.detail}".rstrip(), flush=True)
            self.write()

    def _run_job(self, job: Job, timeout: float) -> None:
        started = time.monotonic()
        try:
            if job.kind == "checkpoint":
                checkpoint, _ = _measure.create_checkpoint(
                    self.args.out / "checkpoints",
                    self.args.params,
                    DEPTH,
                    devices=job.devices,
                    timeout=timeout,
                    accelerator=self.args.accelerator,
                    strategy=job.strategy,
                )
                _measure.warm_page_cache(checkpoint.path)
                self.checkpoints[job.name] = checkpoint
                job.detail = (
                    f"{checkpoint.path.name}: {checkpoint.params:,} parameters, S = {_size(checkpoint.size_bytes)}"
                )
                job.status = "passed"
            else:
                checkpoint = self.checkpoints[job.needs]
                attempts = 0
                while True:
                    attempts += 1
                    result = _measure.measure_restore(
                        mode=job.mode,
                        entry=job.entry,
                        devices=job.devices,
                        checkpoint=checkpoint,
                        run_dir=self.args.out / "runs" / job.name,
                        timeout=max(1.0, timeout - (time.monotonic() - started)),
                        accelerator=self.args.accelerator,
                        strategy=job.strategy,
                    ).as_dict()
                    result.pop("timeline", None)
                    job.cell = result
                    job.checks = checks_of(job, self.jobs, checkpoint.size_bytes)
                    failed = [c["name"] for c in job.checks if not c["ok"]]
                    # upstream's floor checks the measurement, not the project: a sampler starved on a busy host can
                    # miss a peak of a tenth of a second, so upstream alone is measured again
                    if failed != ["memory"] or "upstream" not in job.mode or attempts == UPSTREAM_MEMORY_ATTEMPTS:
                        break
                job.status = "failed" if failed else "passed"
                job.detail = f"failed: {', '.join(failed)}" if failed else ""
                job.detail += f" (measured {attempts} times)" if attempts > 1 else ""
        except Exception as err:  # a job that fails or times out is a result, not the end of the run
            job.status = "error"
            job.detail = str(err).splitlines()[0] if str(err) else type(err).__name__
            job.checks = [{"name": "job", "ok": False, "detail": str(err)[-4000:]}]
        job.seconds = time.monotonic() - started

    def passed(self) -> bool:
        return all(job.status == "passed" for job in self.jobs)

    def results(self) -> dict[str, Any]:
        size = self.checkpoints["checkpoint"].size_bytes if "checkpoint" in self.checkpoints else None
        return {
            "accelerator": self.args.accelerator,
            "environment": self.env,
            "preflight": self.preflight,
            "checkpoint_bytes": size,
            "budget_s": self.args.budget,
            "job_timeout_s": self.args.job_timeout,
            "passed": self.passed(),
            "jobs": [asdict(job) for job in self.jobs],
        }

    def write(self) -> None:
        results = self.results()
        (self.args.out / "results.json").write_text(json.dumps(results, indent=1))
        (self.args.out / "report.md").write_text(report(results))


# ---------------------------------------------------------------- checks


def checks_of(job: Job, jobs: list[Job], size: int) -> list[dict[str, Any]]:
    """The checks of one finished restore job (see the module docstring); each ``{"name", "ok", "detail"}``."""
    cell = job.cell
    assert cell is not None
    checks: list[dict[str, Any]] = []
    if "baseline" in job.mode:
        return checks
    checks.append(_check("exact", cell["checked"] and cell["exact"], "; ".join(cell["mismatches"][:5])))
    log = (Path(cell["run_dir"]) / "job.log").read_text(errors="replace")
    stage = FABRIC_STAGE if job.mode.startswith("fabric-") else STAGE_1
    if job.mode.startswith("fsdp-ours"):
        said = "the full checkpoint is memory-mapped" in log
        checks.append(_check("log: memory-mapped", said, "" if said else "no FSDP memory-mapped line in job.log"))
    elif job.mode.endswith("-eager"):
        checks.append(_log_check(log, stage, "eagerly", job.devices))
    elif "ours" in job.mode:
        checks.append(_log_check(log, stage, "memory-mapped", job.devices))
    if job.mode in ("ours-true", "fabric-ours", "upstream", "fabric-upstream") and job.devices == 1:
        checks.append(memory_check(job, jobs, size))
    if job.mode == "ours-true" and job.devices > 1:
        checks.append(turns_check(log, job.devices))
    return checks


def _check(name: str, ok: bool, detail: str = "") -> dict[str, Any]:
    return {"name": name, "ok": bool(ok), "detail": detail}


def _log_check(log: str, stage: str, how: str, ranks: int) -> dict[str, Any]:
    at_once = "( with the node's other ranks at once)?"
    ended = rf"\[rank (\d+)\] serialized restore: turn for '{stage}' ended in [\d.]+s{at_once}"
    pattern = re.compile(rf"{ended}, read [^,\n]* {how}")
    seen = {int(m.group(1)) for m in pattern.finditer(log)}
    ok = seen == set(range(ranks))
    return _check(f"log: read {how}", ok, "" if ok else f"ranks saying they read {how}: {sorted(seen)} of {ranks}")


def memory_check(job: Job, jobs: list[Job], size: int) -> dict[str, Any]:
    """``ours`` adds at most ``OURS_AT_MOST`` x S above its baseline; ``upstream`` at least ``UPSTREAM_AT_LEAST`` x S
    (its raw peak: it holds the whole checkpoint dict in host memory)."""
    assert job.cell is not None
    baseline = _baseline_cell(asdict(job), {j.name: asdict(j) for j in jobs})
    if baseline is None:
        return _check("memory", False, f"no measured {baseline_of(job.mode)} job to compare with")
    overheads = _measure.overheads(job.cell, baseline)
    if "upstream" in job.mode:
        added = overheads["raw"]
        assert added is not None
        ok = added >= UPSTREAM_AT_LEAST * size
        bound = f">= {UPSTREAM_AT_LEAST} x S"
    else:
        added = overheads["net"] if job.entry == "fit" else overheads["raw"]
        assert added is not None
        ok = added <= OURS_AT_MOST * size
        bound = f"<= {OURS_AT_MOST} x S"
    return _check("memory", ok, f"{_size(added)} = {added / size:.2f} x S above the baseline (must be {bound})")


def turns_check(log: str, ranks: int) -> dict[str, Any]:
    """Stage 1 ran as `True` runs a memory-mapped read, every local rank at once (each says so); or, in turns, each
    local rank's turn started after its predecessor's ended (k = 1), in the shared job log."""
    at_once = re.findall(
        rf"\[rank (\d+)\] serialized restore: turn for '{STAGE_1}' ended in [\d.]+s with the node's", log
    )
    if sorted(int(rank) for rank in at_once) == list(range(ranks)):
        return _check("turns", True, f"{ranks} ranks at once (memory-mapped)")
    events = re.findall(rf"\[rank (\d+)\] serialized restore: turn for '{STAGE_1}' (started|ended)", log)
    order = [(int(rank), what) for rank, what in events]
    problems = []
    for rank in range(ranks):
        # the first rank of the node starts at once and logs its end only
        if (rank, "ended") not in order or (rank and (rank, "started") not in order):
            problems.append(f"rank {rank} did not log its turn")
        elif (
            rank and (rank - 1, "ended") in order and order.index((rank, "started")) < order.index((rank - 1, "ended"))
        ):
            problems.append(f"rank {rank} started before rank {rank - 1} ended")
    return _check("turns", not problems, "; ".join(problems) or f"{ranks} turns, one after another")


# ---------------------------------------------------------------- report


def report(results: dict[str, Any]) -> str:
    env = results["environment"]
    size = results["checkpoint_bytes"]
    verdict = "**passed**" if results["passed"] else "**failed**"
    lines = [
        f"GPU check ({results['accelerator']}): {verdict}. Device: {env['device']}; Python {env['python']}, torch"
        f" {env['torch']}, pytorch-lightning {env['pytorch-lightning']}, lightning {env['lightning']};"
        f" {env['cores']} cores, {env['ram_gib']:.0f} GiB.",
        f"Preflight: {results['preflight']}. Checkpoint: S = {_size(size)}." if size else "No checkpoint.",
        f"Bounds: {results['job_timeout_s']:.0f}s per job, {results['budget_s']:.0f}s for the run.",
        "",
        "| job | status | host anon above baseline | x S | GPU memory end / peak | restore time | checks |",
        "|---|---|---|---|---|---|---|",
    ]
    by_name = {job["name"]: job for job in results["jobs"]}
    for job in results["jobs"]:
        cell = job["cell"]
        added = gpu = window = "–"
        x_s = "–"
        if cell is not None and "baseline" not in job["mode"]:
            base = _baseline_cell(job, by_name)
            if base is not None and not job["mode"].startswith("fsdp-"):
                over = _measure.overheads(cell, base)
                value = over["net"] if job["entry"] == "fit" and "upstream" not in job["mode"] else over["raw"]
                if value is not None and size:
                    added, x_s = _size(value), f"{value / size:.2f}"
            if cell.get("gpu_bytes") is not None:
                gpu = f"{_size(cell['gpu_bytes'])} / {_size(cell['gpu_peak_bytes'])}"
            window = f"{cell['window']:.2f}s"
        checks = ", ".join(f"{c['name']} {'ok' if c['ok'] else 'FAILED'}" for c in job["checks"])
        detail = f" ({job['detail']})" if job["detail"] and job["status"] != "passed" else ""
        lines.append(
            f"| {job['name']} | {job['status']}{detail} | {added} | {x_s} | {gpu} | {window} | {checks or '–'} |"
        )
    failures = [
        f"- {job['name']}, {check['name']}: {check['detail']}"
        for job in results["jobs"]
        for check in job["checks"]
        if not check["ok"]
    ]
    lines += ["", *(["Failed checks:", *failures, ""] if failures else [])]
    lines.append(
        "Host memory: the job's process tree's anonymous memory (`RssAnon`, summed over the ranks, sampled every"
        " 5 ms) at its peak inside the restore window, minus the baseline job's (same N and entry point, no"
        " checkpoint); for ours in fit and Fabric, net of the optimizer state the ranks keep in host memory; for"
        " upstream, the raw difference (the checkpoint dict it holds). GPU memory: `torch.cuda.memory_allocated` /"
        " `max_memory_allocated`, summed over ranks. Job logs: `runs/<job>/job.log`."
    )
    return "\n".join(lines) + "\n"


def _baseline_cell(job: dict[str, Any], by_name: dict[str, dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The measured cell of ``job``'s baseline (same entry point and N), if any."""

    same = (baseline_of(job["mode"]), job["entry"], job["devices"])
    return next((j["cell"] for j in by_name.values() if (j["mode"], j["entry"], j["devices"]) == same), None)


def _size(value: Optional[int]) -> str:
    if value is None:
        return "–"
    return f"{value / 2**30:.2f} GiB" if abs(value) >= 2**30 else f"{value / MIB:.0f} MiB"


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.accelerator == "gpu":
        problem = cuda_problem()
        if problem is not None:
            if args.require_gpu:
                print(f"gpu_check: failed: --require-gpu, but {problem}", file=sys.stderr)
                return EXIT_NO_GPU
            print("gpu_check: skipped: no CUDA device is visible")
            return 0
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment(args.accelerator)
    ranks = args.ranks if args.ranks is not None else (env["gpus"] if args.accelerator == "gpu" else 2)
    run = Run(args, env, plan(args.accelerator, ranks))
    ok, run.preflight = preflight(args.accelerator)
    print(f"preflight: {run.preflight}", flush=True)
    if not ok:
        for job in run.jobs:
            job.status, job.detail = "not run", "the preflight failed"
        run.write()
        print(
            "gpu_check: environment failure (not the project's): the preflight failed; no job was run", file=sys.stderr
        )
        return EXIT_ENVIRONMENT
    run.execute()
    text = (args.out / "report.md").read_text()
    print()
    print(text)
    if args.docs:
        page = (
            "# GPU check\n\n" + f"Written by `bash benchmarks/gpu_check.sh --docs` ({time.strftime('%Y-%m-%d')}).\n\n"
        )
        (REPO / "docs" / "gpu_check.md").write_text(page + text)
    return 0 if run.passed() else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
