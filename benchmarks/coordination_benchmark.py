"""Coordination at scale: the turn schedule's store traffic, overhead, hand-offs and failure propagation for R ranks.

A simulation with the real parts that coordinate: one ``torch.distributed.TCPStore`` server (its own process), one
client connection per rank, and the project's own ``TurnSchedule`` (``serialized_restore._turns``), driven only
through its public API. Ranks are threads, ``R / P`` of them in each of ``P`` worker processes (rank r in process
r % P, so the local ranks of a "node" span several processes and a killed process leaves live ranks on its node);
each runs the stages of a restore with a sleep as the body of its turn. Every rank's store is wrapped in a counting
``torch.distributed.Store``, so that every operation the schedule makes, from any of its threads or clones, is
counted. See ``docs/benchmarks.md`` ("Coordination at scale") for the definitions and the committed results.

The code measured is the ``serialized_restore`` that comes first on ``PYTHONPATH`` (this checkout's otherwise):

    python benchmarks/coordination_benchmark.py                   # full run: R = 64 ... 4,096, docs/benchmarks.md
    python benchmarks/coordination_benchmark.py --quick           # smoke run (R = 64, 128): bench_output/...

Two versions side by side (how the committed section was made): today's schedule, capped at 1,024 ranks, then
another tree with the first run's results beside its own:

    python benchmarks/coordination_benchmark.py --max-ranks 1024 --label baseline --no-docs \\
        --output-dir bench_output/coordination-baseline
    PYTHONPATH=/path/to/other/tree python benchmarks/coordination_benchmark.py --label redesign \\
        --code-version "commit <hash>" --compare bench_output/coordination-baseline/results.json --docs

Every run has a time limit; a run that exceeds it is reported as not finished, and larger R of the same series are
then skipped. Exits non-zero if a process of the simulation fails (not when a goal is missed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import queue
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

# the package under test comes from PYTHONPATH, else from this checkout, whose `benchmarks` and `harness` also come
# before installed packages of those names (fairscale installs a `benchmarks` of its own)
sys.path[:0] = [*filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)), str(Path(__file__).parents[1])]

# ---------------------------------------------------------------- configuration

SIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # R, world sizes simulated
CONCURRENCY = (1, 2)  # k, the schedule's max_concurrent
LOCAL_RANKS = 8  # local ranks per node
STAGES = ("stage 1", "stage 2")  # the two restore stages, each one turn per rank
BODY_S = 0.1  # seconds of work (a sleep) in the body of every turn
PROCESSES = 8  # worker processes that host the rank threads
TURN_TIMEOUT_S = 1800.0  # the package's defaults (SERIALIZED_RESTORE_TURN_TIMEOUT, ..._HEARTBEAT_TIMEOUT)
HEARTBEAT_TIMEOUT_S = 60.0
# failure runs (k=1): kind -> R; the failing rank is local rank FAIL_LOCAL of node 0, FAIL_AFTER_S into its turn
# of the first stage. "exception": its body raises; "kill": SIGKILL to its whole process; "stop": SIGSTOP to it.
FAILURES = {"exception": (64, 512, 1024), "kill": (64, 512, 1024), "stop": (64, 512, 1024)}
FAIL_LOCAL = 3
FAIL_AFTER_S = 0.05
STOP_HEARTBEAT_TIMEOUT_S = 3.0  # heartbeat timeout of the "stop" runs (the default, 60 s, in all others)
RUN_LIMIT_S = 90.0  # from the start of a run; then it is reported as not finished
PREPARE_LIMIT_S = 180.0  # connecting the clients and starting the threads of one run
PLAIN_CLIENTS = 8  # plain store load: client threads in all (spread over the worker processes)
PLAIN_SECONDS = 2.0

QUICK_SIZES = (64, 128)
QUICK_FAILURES = {"exception": (64,)}
QUICK_PROCESSES = 4
QUICK_PLAIN_SECONDS = 1.0

# the goals of the redesign (issue 12); checked and reported per R, never tuned for
GOAL_WAITING_OPS = 5.0  # store ops/s per waiting rank, averaged over a stage, at every R
GOAL_TOTAL_OPS = 25_000.0  # store ops/s in all, at R = 4,096
GOAL_OVERHEAD_S = {1024: 0.5, 4096: 1.0}  # wall minus the ideal, k = 1 and 2
GOAL_HANDOFF_R = 1024
GOAL_HANDOFF_P50_S = 0.020
GOAL_HANDOFF_P99_S = 0.100
GOAL_EXCEPTION_S = {512: 2.0, 1024: 2.0}  # raise to the last rank's error
GOAL_KILL_S = 1.5  # SIGKILL to the last surviving rank's error (same machine: by pid); "~1 s", taken as <= 1.5 s
# SIGSTOP: no verdict before the heartbeat timeout less one heartbeat interval (the last beat precedes the stop by up
# to one interval; the schedule beats every 0.5 s), and at most this much after the timeout
GOAL_STOP_EARLY_S = 1.0
GOAL_STOP_MARGIN_S = 2.0
GOAL_NO_SPURIOUS_R = 1024

REPO = Path(__file__).resolve().parents[1]
SIM = Path(__file__).resolve().parent / "_coordination_sim.py"
from benchmarks import _measure  # noqa: E402  (this repository is on sys.path: see above)

DOCS = REPO / "docs"
DEFAULT_OUTPUT = REPO / "bench_output"
SECTION = "## Coordination at scale"
START_TIMEOUT_S = 120.0  # a child process's start (imports torch)
ANSWER_GRACE_S = 120.0  # after a run's limit, for a worker to report (its main thread may wait for a core)
BUCKET_S = 0.05  # must match _coordination_sim.BUCKET_S
PLOT_COLORS = ("tab:red", "tab:green", "tab:blue", "tab:purple", "tab:orange", "tab:brown")
FAILURE_MARKERS = {"exception": "o", "kill": "x", "stop": "s"}


# ---------------------------------------------------------------- processes


class ChildLost(Exception):
    pass


class Child:
    """One process of the simulation (the store server or a worker), spoken to in JSON lines, killed by pid."""

    def __init__(self, role: str, index: Optional[int], log: Path) -> None:
        args = [sys.executable, str(SIM), role] + ([str(index)] if index is not None else [])
        self.name = role if index is None else f"{role}-{index}"
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=_child_env()
        )
        self.pid = self.proc.pid
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.hello = self.receive(START_TIMEOUT_S)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                self._lines.put(json.loads(line))
        except (OSError, ValueError):
            pass
        self._lines.put(None)

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as err:
            raise ChildLost(f"{self.name}: {err}") from err

    def receive(self, timeout: float) -> dict[str, Any]:
        try:
            message = self._lines.get(timeout=max(0.0, timeout))
        except queue.Empty:
            raise ChildLost(f"{self.name}: no answer within {timeout:.0f}s") from None
        if message is None:
            raise ChildLost(f"{self.name}: exited (code {self.proc.poll()})")
        if "error" in message:
            raise ChildLost(f"{self.name}: {message['error']}")
        return message

    def ask(self, message: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.send(message)
        return self.receive(timeout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def _child_env() -> dict[str, str]:
    """The environment of the simulation's processes. torch's TCPStore looks up the name of every peer address it
    connects to or accepts (reverse DNS), on the server's event-loop thread too, and gives up resolving for the rest
    of the process after the first lookup that fails. A resolver that answers slowly would stall connections (and
    the server) for its full timeout and retries each time; with one try of one second, the first slow answer turns
    the lookups off instead."""
    env = dict(os.environ)
    env.setdefault("RES_OPTIONS", "attempts:1 timeout:1")
    return env


class Pool:
    """The store server and ``processes`` workers; a worker that was killed, stopped or left with threads that did
    not finish is replaced before the next run."""

    def __init__(self, processes: int, logs: Path) -> None:
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self.server = self._start("serve", None)
        self.port: int = self.server.hello["port"]
        self.workers: list[Child] = [self._start("work", i) for i in range(processes)]
        self.runs = 0
        self.spares_per_rank = 0

    def _start(self, role: str, index: Optional[int]) -> Child:
        name = role if index is None else f"{role}-{index}"
        child = Child(role, index, self.logs / f"{name}.log")
        self.children.append(child)
        return child

    def replace(self, index: int) -> None:
        self.workers[index].kill()
        self.workers[index] = self._start("work", index)

    def close(self) -> None:
        for child in self.children:
            child.kill()


# ---------------------------------------------------------------- running


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/coordination_benchmark.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: R={','.join(map(str, QUICK_SIZES))}, k={','.join(map(str, CONCURRENCY))},"
        f" one failure run (exception at R={QUICK_FAILURES['exception'][0]}), {QUICK_PROCESSES} processes;"
        " about a minute",
    )
    parser.add_argument("--sizes", type=_int_list, help=f"R to simulate (default {','.join(map(str, SIZES))})")
    parser.add_argument(
        "--max-ranks", type=int, help="leave out every R above this, for normal and failure runs (e.g. 1024)"
    )
    parser.add_argument("--concurrency", type=_int_list, help="k to simulate (default 1,2)")
    parser.add_argument(
        "--failures",
        type=_failure_list,
        help="failure runs as kind:R[+R...] comma-separated, kinds exception, kill, stop; 'none' for none"
        " (default " + ",".join(f"{k}:{'+'.join(map(str, v))}" for k, v in FAILURES.items()) + ")",
    )
    parser.add_argument(
        "--processes", type=int, help=f"worker processes (default {PROCESSES}; --quick {QUICK_PROCESSES})"
    )
    parser.add_argument("--local-ranks", type=int, default=LOCAL_RANKS, help="local ranks per node")
    parser.add_argument("--body", type=float, default=BODY_S, help="seconds of work in every turn")
    parser.add_argument("--run-limit", type=float, default=RUN_LIMIT_S, help="seconds before a run is given up")
    parser.add_argument("--label", help="name of the code under test in the report (default: its git commit)")
    parser.add_argument(
        "--code-version", help="the version of the code under test, for a tree that is not a git checkout"
    )
    parser.add_argument(
        "--compare",
        type=Path,
        action="append",
        default=[],
        metavar="RESULTS_JSON",
        help="also report the results.json of an earlier run (for example of another tree); repeatable",
    )
    parser.add_argument(
        "--from-results",
        type=Path,
        metavar="RESULTS_JSON",
        help="run nothing: rebuild the report and plot from this results.json (with --compare: beside others)",
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        help="results.json, report.md, the plot, per-run data and process logs (default bench_output/coordination,"
        " or bench_output/coordination-quick with --quick)",
    )
    parser.add_argument(
        "--docs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"also write the '{SECTION[3:]}' section of docs/benchmarks.md and docs/img/coordination.png (default:"
        " yes for the full run, no with --quick)",
    )
    args = parser.parse_args(argv)
    args.sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    args.concurrency = args.concurrency or CONCURRENCY
    if args.failures is None:
        args.failures = QUICK_FAILURES if args.quick else FAILURES
    if args.max_ranks:
        args.sizes = tuple(r for r in args.sizes if r <= args.max_ranks)
        args.failures = {k: tuple(r for r in v if r <= args.max_ranks) for k, v in args.failures.items()}
    args.processes = args.processes or (QUICK_PROCESSES if args.quick else PROCESSES)
    args.plain_seconds = QUICK_PLAIN_SECONDS if args.quick else PLAIN_SECONDS
    bad = [r for r in (*args.sizes, *[r for v in args.failures.values() for r in v]) if r % args.local_ranks]
    if bad:
        parser.error(f"R must be a multiple of the local ranks per node ({args.local_ranks}): {bad}")
    if args.local_ranks <= FAIL_LOCAL:
        parser.error(f"failure runs need more than {FAIL_LOCAL} local ranks")
    args.output_dir = args.output_dir or DEFAULT_OUTPUT / ("coordination-quick" if args.quick else "coordination")
    args.docs = (not args.quick) if args.docs is None else args.docs
    return args


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _failure_list(text: str) -> dict[str, tuple[int, ...]]:
    if text.strip() == "none":
        return {}
    failures: dict[str, tuple[int, ...]] = {}
    for item in text.split(","):
        kind, _, sizes = item.partition(":")
        if kind not in FAILURES or not sizes:
            raise argparse.ArgumentTypeError(f"expected kind:R[+R...] with kind in {', '.join(FAILURES)}: {item!r}")
        failures[kind.strip()] = tuple(int(v) for v in sizes.split("+"))
    return failures


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    out: Path = args.output_dir
    (out / "runs").mkdir(parents=True, exist_ok=True)
    code = code_under_test(args.code_version)
    print(f"code under test: {code['describe']} ({code['origin']})", flush=True)
    pool = Pool(args.processes, out / "logs")
    runs: list[dict[str, Any]] = []
    broken: list[str] = []
    try:
        print(f"started the store server and {args.processes} workers ({time.monotonic() - started:.0f}s)", flush=True)
        plain = [plain_load(pool, args, counted=False), plain_load(pool, args, counted=True)]
        for p in plain:
            print(
                f"plain store load ({p['variant']}): {p['clients']} clients, {p['ops_per_s']:,.0f} ops/s,"
                f" server {p['server_cpu_per_op_us']:.1f} us CPU per op, {p['server_core_share']:.2f} of a core",
                flush=True,
            )
        calibrate(pool, args)
        cases = []
        for k in args.concurrency:
            cases += [{"R": r, "k": k, "failure": None, "series": f"k={k}"} for r in sorted(args.sizes)]
        for kind, sizes in args.failures.items():
            cases += [{"R": r, "k": 1, "failure": kind, "series": kind} for r in sorted(sizes)]
        skipped_after: dict[str, int] = {}
        for i, case in enumerate(cases, 1):
            name = _case_name(case)
            if case["series"] in skipped_after:
                runs.append({**_case_info(case, args), "skipped": True,
                             "skipped_reason": f"R={skipped_after[case['series']]} did not finish"})  # fmt: skip
                print(f"[{i}/{len(cases)}] {name}: skipped (R={skipped_after[case['series']]} did not finish)")
                continue
            t0 = time.monotonic()
            try:
                run = run_case(pool, case, args)
            except ChildLost as err:
                # a worker that did not answer in time (its threads starved, for example) or died: the run counts
                # as not finished, and its series stops here
                broken.append(f"{name}: {err}")
                print(f"[{i}/{len(cases)}] {name}: BROKEN: {err}", flush=True)
                skipped_after[case["series"]] = case["R"]
                runs.append({**_case_info(case, args), "skipped": True,
                             "skipped_reason": "did not finish: a worker process did not report in time"})  # fmt: skip
                for index in range(len(pool.workers)):
                    pool.replace(index)
                continue
            runs.append(run)
            if not run["finished"]:
                skipped_after[case["series"]] = case["R"]
            print(f"[{i}/{len(cases)}] {name}: {_one_line(run)}  ({time.monotonic() - t0:.0f}s)", flush=True)
            (out / "results.partial.json").write_text(json.dumps(runs, indent=1))
    finally:
        pool.close()
    return {
        "label": args.label or code["describe"],
        "code": code,
        "command": ("PYTHONPATH=<a checkout of that version> " if code["origin"] != "this checkout" else "")
        + _command(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _measure.machine_info(),
        "config": {
            "sizes": list(args.sizes),
            "concurrency": list(args.concurrency),
            "failures": {k: list(v) for k, v in args.failures.items()},
            "processes": args.processes,
            "local_ranks": args.local_ranks,
            "stages": list(STAGES),
            "body_s": args.body,
            "turn_timeout_s": TURN_TIMEOUT_S,
            "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
            "stop_heartbeat_timeout_s": STOP_HEARTBEAT_TIMEOUT_S,
            "fail_local": FAIL_LOCAL,
            "fail_after_s": FAIL_AFTER_S,
            "run_limit_s": args.run_limit,
            "plain_clients": PLAIN_CLIENTS,
            "plain_seconds": args.plain_seconds,
            "quick": args.quick,
        },
        "plain": plain,
        "runs": runs,
        "broken": broken,
        "wall_seconds": time.monotonic() - started,
    }


def _case_name(case: dict[str, Any]) -> str:
    return f"R={case['R']} k={case['k']}" + (f" {case['failure']}" if case["failure"] else "")


def _case_info(case: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    kind = case["failure"]
    return {
        "R": case["R"],
        "k": case["k"],
        "failure": kind,
        "series": case["series"],
        "processes": min(args.processes, case["R"]),
        "local_ranks": args.local_ranks,
        "stages": list(STAGES),
        "body_s": args.body,
        "turn_timeout_s": TURN_TIMEOUT_S,
        "heartbeat_timeout_s": STOP_HEARTBEAT_TIMEOUT_S if kind == "stop" else HEARTBEAT_TIMEOUT_S,
        "limit_s": args.run_limit,
    }


def calibrate(pool: Pool, args: argparse.Namespace) -> None:
    """A small unmeasured run: how many times a rank clones its store (each clone is a connection of its own,
    made before every later run so that connecting stays out of the measured time)."""
    run = run_case(pool, {"R": 2 * args.local_ranks, "k": 1, "failure": None, "series": "calibration"}, args,
                   keep=False)  # fmt: skip
    pool.spares_per_rank = run["clones_per_rank_max"]
    print(
        f"calibration run (R={run['R']}): {'finished' if run['finished'] else 'DID NOT FINISH'},"
        f" {run['clones_per_rank_max']} clone(s) of the store per rank",
        flush=True,
    )


def plain_load(pool: Pool, args: argparse.Namespace, counted: bool) -> dict[str, Any]:
    """Clients doing ``add``/``check`` as fast as they can against a fresh server: the store's throughput on this
    machine with these Python clients, and the server's CPU per operation."""
    port = pool.port
    workers = pool.workers
    per = [PLAIN_CLIENTS // len(workers) + (1 if i < PLAIN_CLIENTS % len(workers) else 0) for i in range(len(workers))]
    at = time.time() + 1.0
    server0, busy0 = _cpu(pool.server.pid), _machine()
    for worker, n in zip(workers, per):
        if n:
            worker.send({"cmd": "plain", "port": port, "threads": n, "seconds": args.plain_seconds, "at": at,
                         "counted": counted})  # fmt: skip
    answers = [w.receive(args.plain_seconds + 120) for w, n in zip(workers, per) if n]
    server1, busy1 = _cpu(pool.server.pid), _machine()
    window = busy1[1] / max(1, os.cpu_count() or 1) - busy0[1] / max(1, os.cpu_count() or 1)
    ops = sum(a["ops"] for a in answers)
    server = (server1 or 0.0) - (server0 or 0.0)
    clients = sum(a["cpu_s"] for a in answers)
    return {
        "variant": "counted, through a PrefixStore" if counted else "raw TCPStore clients",
        "counted": counted,
        "clients": sum(per),
        "seconds": args.plain_seconds,
        "ops": ops,
        "ops_per_s": ops / args.plain_seconds,
        "server_cpu_s": server,
        "server_cpu_per_op_us": server / ops * 1e6 if ops else None,
        "server_core_share": server / args.plain_seconds,
        "clients_cpu_s": clients,
        "clients_cpu_per_op_us": clients / ops * 1e6 if ops else None,
        "machine_busy_cores": (busy1[0] - busy0[0]) / window if window > 0 else None,
    }


def run_case(pool: Pool, case: dict[str, Any], args: argparse.Namespace, keep: bool = True) -> dict[str, Any]:
    """One simulated restore of R ranks: connect, release every rank at once, collect every rank's record."""
    info = _case_info(case, args)
    R, P = case["R"], info["processes"]
    name = _case_name(case).replace(" ", "-").replace("=", "")
    fail_file = args.output_dir / "runs" / f"{name}.failed-at"
    fail_file.unlink(missing_ok=True)
    failure = None
    victim_process = None
    if case["failure"]:
        rank = FAIL_LOCAL  # node 0
        failure = {"kind": case["failure"], "rank": rank, "stage": STAGES[0], "after": FAIL_AFTER_S}
        victim_process = rank % P if case["failure"] in ("kill", "stop") else None
    pool.runs += 1
    workers = pool.workers[:P]
    t_prepare = time.monotonic()
    for j, worker in enumerate(workers):
        worker.send({
            "cmd": "prepare", "port": pool.port, "prefix": f"run{pool.runs}", "spares_per_rank": pool.spares_per_rank,
            "ranks": [r for r in range(R) if r % P == j], "world_size": R,
            "local_world_size": args.local_ranks, "k": case["k"], "stages": list(STAGES), "body": args.body,
            "turn_timeout": info["turn_timeout_s"], "heartbeat_timeout": info["heartbeat_timeout_s"],
            "failure": failure, "fail_file": str(fail_file),
        })  # fmt: skip
    prepared = [w.receive(PREPARE_LIMIT_S - (time.monotonic() - t_prepare)) for w in workers]
    prepare_s = time.monotonic() - t_prepare
    at = time.time() + 0.5
    deadline = at + args.run_limit
    server0, busy0, wall0 = _cpu(pool.server.pid), _machine(), time.monotonic()
    for worker in workers:
        worker.send({"cmd": "go", "at": at, "deadline": deadline})
    answers: dict[int, dict[str, Any]] = {}
    for j, worker in enumerate(workers):
        if j == victim_process:
            continue  # killed or stopped by its own rank: no answer
        answers[j] = worker.receive(deadline - time.time() + ANSWER_GRACE_S)
    server1, busy1, wall1 = _cpu(pool.server.pid), _machine(), time.monotonic()
    if victim_process is not None:
        victim = workers[victim_process]
        # a killed victim is gone by now (its survivors have reported its death); a stopped one is killed here
        victim_survived = case["failure"] == "kill" and victim.alive()
        pool.replace(victim_process)
    else:
        victim_survived = False
    for j, answer in answers.items():
        if answer["unfinished"] or answer["lingering_threads"]:
            pool.replace(j)
    records = [rec for a in answers.values() for rec in a["records"]]
    failed_at = None
    if case["failure"] == "exception":
        failed_at = next((r["failed_at"] for r in records if "failed_at" in r), None)
    elif case["failure"] and fail_file.exists():
        failed_at = float(fail_file.read_text())
    meta = {
        "start_at": at,
        "prepare_s": prepare_s,
        "connect_s": max(p["connect_s"] for p in prepared),
        "threads_per_process": max(p["threads"] for p in prepared),
        "cpu_window_s": wall1 - wall0,
        "server_cpu_s": (server1 or 0.0) - (server0 or 0.0),
        "workers_cpu_s": sum(a["cpu_s"] for a in answers.values()),
        "machine_busy_s": busy1[0] - busy0[0],
        "unfinished": sum(a["unfinished"] for a in answers.values()),
        "lingering_threads": sum(a["lingering_threads"] for a in answers.values()),
        "late_clones": sum(a["late_clones"] for a in answers.values()),
        "spares_per_rank": pool.spares_per_rank,
        "victim_process": victim_process,
        "victim_survived": victim_survived,
        "failed_at": failed_at,
        "fd_limit": pool.server.hello.get("fd_limit"),
    }
    if keep:
        (args.output_dir / "runs" / f"{name}.json").write_text(
            json.dumps({"case": info, "meta": meta, "records": records}, separators=(",", ":"))
        )
    return summarize_run(info, meta, records)


def _cpu(pid: int) -> Optional[float]:
    from _coordination_sim import process_cpu_seconds

    return process_cpu_seconds(pid)


def _machine() -> tuple[float, float]:
    from _coordination_sim import machine_busy_seconds

    return machine_busy_seconds()


# ---------------------------------------------------------------- figures


def summarize_run(info: dict[str, Any], meta: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one run, from every rank's record (see the docs section for the definitions)."""
    R, k, L, P = info["R"], info["k"], info["local_ranks"], info["processes"]
    stages, body, at = info["stages"], info["body_s"], meta["start_at"]
    kind = info["failure"]
    lost = {r for r in range(R) if meta["victim_process"] is not None and r % P == meta["victim_process"]}
    expected = R - len(lost)
    complete = [
        r for r in records if "error" not in r and len(r["stages"]) == len(stages) and "exit" in r["stages"][-1]
    ]
    errors = [r for r in records if "error" in r]
    unexpected = [r for r in errors if r["error"].get("unexpected")]
    finished = meta["unfinished"] == 0 and len(records) == expected
    run: dict[str, Any] = {
        **info,
        "finished": finished,
        "ranks_reported": len(records),
        "ranks_expected": expected,
        "ranks_completed": len(complete),
        "ranks_raised": len(errors),
        "unexpected_errors": len(unexpected),
        "unexpected_error_sample": unexpected[0]["error"]["message"] if unexpected else None,
        "prepare_s": meta["prepare_s"],
        "connect_s": meta["connect_s"],
        "threads_per_process": meta["threads_per_process"],
    }
    ideal = len(stages) * math.ceil(L / k) * body
    run["ideal_s"] = ideal
    ops_total = sum(sum(r["ops_by_phase"].values()) for r in records)
    by_method: dict[str, int] = {}
    for r in records:
        for m, n in r["ops_by_method"].items():
            by_method[m] = by_method.get(m, 0) + n
    run["ops_total"] = ops_total
    run["clones_per_rank_max"] = max((r["ops_by_method"].get("clone", 0) for r in records), default=0)
    run["late_clones"] = meta["late_clones"]
    run["spares_per_rank"] = meta["spares_per_rank"]
    run["lingering_threads"] = meta["lingering_threads"]
    run["ops_by_method"] = dict(sorted(by_method.items(), key=lambda kv: -kv[1]))
    ends = [e["exit"] for r in records for e in r["stages"] if "exit" in e]
    last = max([*ends, *[r["error"]["time"] for r in errors]], default=None)
    run["wall_s"] = (last - at) if (last is not None and finished) else None
    window = meta["cpu_window_s"]
    run["server_cpu_s"] = meta["server_cpu_s"]
    run["server_core_share"] = meta["server_cpu_s"] / window if window else None
    run["workers_cpu_s"] = meta["workers_cpu_s"]
    run["workers_cores"] = meta["workers_cpu_s"] / window if window else None
    other = meta["machine_busy_s"] - meta["server_cpu_s"] - meta["workers_cpu_s"]
    run["other_cores"] = max(0.0, other) / window if window else None
    run["start_lag_s"] = max((r["stages"][0]["enter"] - at for r in records if r["stages"]), default=None)
    bodies = [e["end"] - e["start"] for r in records for e in r["stages"] if "end" in e and "start" in e]
    run["body_mean_s"] = statistics.fmean(bodies) if bodies else None
    run["body_max_s"] = max(bodies) if bodies else None
    if run["wall_s"] is not None:
        run["overhead_s"] = run["wall_s"] - ideal
        run["ops_per_s"] = ops_total / run["wall_s"]
        run["ops_per_s_per_rank"] = run["ops_per_s"] / R
        run["server_cpu_per_op_us"] = meta["server_cpu_s"] / ops_total * 1e6 if ops_total else None
    # store load of a waiting rank: its operations (main thread, watcher, clones) while it waits for its turn or for
    # the others to end the stage, over the time it spends waiting, summed over ranks, per stage
    waiting = {}
    for stage in stages:
        ops = secs = 0.0
        for r in complete:
            e = next(e for e in r["stages"] if e["stage"] == stage)
            ops += r["ops_by_phase"].get(f"wait:{stage}", 0) + r["ops_by_phase"].get(f"after:{stage}", 0)
            secs += (e["start"] - e["enter"]) + (e["exit"] - e["end"])
        waiting[stage] = ops / secs if secs > 0 and complete else None
    run["waiting_ops_per_s"] = waiting
    handoffs = []
    starts = {(r["node"], r["local"], e["stage"]): e for r in records for e in r["stages"]}
    for (node, local, stage), e in starts.items():
        prev = starts.get((node, local - k, stage))
        if local >= k and prev is not None and "start" in e and "end" in prev:
            handoffs.append(e["start"] - prev["end"])
    run["handoffs"] = len(handoffs)
    run["handoff_p50_s"] = _quantile(handoffs, 0.5)
    run["handoff_p99_s"] = _quantile(handoffs, 0.99)
    run["handoff_max_s"] = max(handoffs) if handoffs else None
    if kind:
        run.update(_failure_figures(kind, info, meta, records, lost))
    else:
        run["spurious_errors"] = len(errors)
    return run


def _failure_figures(
    kind: str, info: dict[str, Any], meta: dict[str, Any], records: list[dict[str, Any]], lost: set[int]
) -> dict[str, Any]:
    victim = FAIL_LOCAL
    failed_at = meta["failed_at"]
    culprits = lost if lost else {victim}
    expected_kind = {"exception": "exception", "kill": "died", "stop": "unresponsive"}[kind]
    errors = [r for r in records if "error" in r]
    times = [r["error"]["time"] - failed_at for r in errors] if failed_at is not None else []
    named = [r for r in errors if set(r["error"].get("failed_ranks", [])) & culprits]
    right_kind = [r for r in named if expected_kind in r["error"].get("kinds", [])]
    blamed = set()
    for r in errors:
        blamed |= set(r["error"].get("failed_ranks", []))
    abort_ops = []
    if failed_at is not None:
        first = int((failed_at - meta["start_at"]) / BUCKET_S)
        for r in records:
            if "buckets" in r:
                abort_ops.append(sum(n for b, n in r["buckets"] if b >= first))
    return {
        "victim_rank": victim,
        "ranks_lost": len(lost),
        "failed_at_s": (failed_at - meta["start_at"]) if failed_at is not None else None,
        "first_error_s": min(times) if times else None,
        "last_error_s": max(times) if len(errors) == len(records) and times and meta["unfinished"] == 0 else None,
        "last_error_so_far_s": max(times) if times else None,
        "verdicts_naming_culprit": len(named),
        "verdicts_right_kind": len(right_kind),
        "expected_kind": expected_kind,
        "blamed_others": sorted(blamed - culprits)[:20],
        "blamed_others_count": len(blamed - culprits),
        "abort_ops_per_rank_mean": statistics.fmean(abort_ops) if abort_ops else None,
        "abort_ops_per_rank_max": max(abort_ops) if abort_ops else None,
        "victim_survived": meta["victim_survived"],
    }


def _quantile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _one_line(run: dict[str, Any]) -> str:
    if not run["finished"]:
        return (
            f"DID NOT FINISH in {run['limit_s']:.0f}s ({run['ranks_completed']} of {run['R']} ranks done,"
            f" {run['ranks_raised']} raised)"
        )
    if run["failure"]:
        return (
            f"failure at {_s(run['failed_at_s'])}: first error {_s(run['first_error_s'])}, last"
            f" {_s(run['last_error_s'])} after it; {run['ranks_raised']}/{run['ranks_expected']} raised,"
            f" {run['verdicts_right_kind']} name rank {run['victim_rank']}'s failure as {run['expected_kind']!r};"
            f" abort ops/rank {_f(run['abort_ops_per_rank_mean'], 1)}; server {_f(_server(run), 2)} core"
        )
    return (
        f"wall {run['wall_s']:.2f}s (ideal {run['ideal_s']:.1f}s), {run['ops_per_s']:,.0f} ops/s"
        f" ({run['ops_per_s_per_rank']:.1f}/rank; waiting "
        + "/".join(_f(v, 1) for v in run["waiting_ops_per_s"].values())
        + f"), hand-off {_ms(run['handoff_p50_s'])}/{_ms(run['handoff_p99_s'])}, server"
        f" {_f(_server(run), 2)} core, workers {_f(_workers(run), 2)} cores,"
        f" errors {run['spurious_errors']}"
    )


def check_goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal of the redesign, per R (and k), for one results.json: measured, and met / missed / not run."""
    runs = [r for r in results["runs"] if not r.get("skipped")]
    skipped = [r for r in results["runs"] if r.get("skipped")]
    normal = {(r["R"], r["k"]): r for r in runs if not r["failure"]}
    failed = {(r["R"], r["failure"]): r for r in runs if r["failure"]}
    rows: list[dict[str, Any]] = []

    def row(goal: str, R: int, k: Optional[int], measured: str, met: Optional[bool]) -> None:
        rows.append({"goal": goal, "R": R, "k": k, "measured": measured, "met": met})

    def dnf(r: dict[str, Any]) -> str:
        return f"did not finish in {r['limit_s']:.0f}s"

    for (R, k), r in sorted(normal.items()):
        goal = f"store load per waiting rank <= {GOAL_WAITING_OPS:g} ops/s (each stage)"
        if not r["finished"]:
            row(goal, R, k, dnf(r), False)
        else:
            values = [v for v in r["waiting_ops_per_s"].values() if v is not None]
            row(goal, R, k, " / ".join(f"{v:.1f}" for v in values), all(v <= GOAL_WAITING_OPS for v in values))
    for k in sorted({k for _, k in normal} | set(results["config"]["concurrency"])):
        goal = f"total store load <= {GOAL_TOTAL_OPS:,.0f} ops/s at R=4,096"
        r = normal.get((4096, k))
        if r is None:
            row(goal, 4096, k, _not_run(skipped, 4096, f"k={k}"), None)
        elif not r["finished"]:
            row(goal, 4096, k, dnf(r), False)
        else:
            row(goal, 4096, k, f"{r['ops_per_s']:,.0f} ops/s", r["ops_per_s"] <= GOAL_TOTAL_OPS)
        for R, bound in GOAL_OVERHEAD_S.items():
            goal = f"coordination overhead <= {bound:g} s at R={R:,}"
            r = normal.get((R, k))
            if r is None:
                row(goal, R, k, _not_run(skipped, R, f"k={k}"), None)
            elif not r["finished"]:
                row(goal, R, k, dnf(r), False)
            else:
                row(goal, R, k, f"{r['overhead_s']:.2f} s (wall {r['wall_s']:.2f} s)", r["overhead_s"] <= bound)
        goal = (
            f"hand-off median <= {GOAL_HANDOFF_P50_S * 1000:.0f} ms, p99 <= {GOAL_HANDOFF_P99_S * 1000:.0f} ms"
            f" at R={GOAL_HANDOFF_R:,}"
        )
        r = normal.get((GOAL_HANDOFF_R, k))
        if r is None:
            row(goal, GOAL_HANDOFF_R, k, _not_run(skipped, GOAL_HANDOFF_R, f"k={k}"), None)
        elif not r["finished"]:
            row(goal, GOAL_HANDOFF_R, k, dnf(r), False)
        else:
            ok = r["handoff_p50_s"] <= GOAL_HANDOFF_P50_S and r["handoff_p99_s"] <= GOAL_HANDOFF_P99_S
            row(goal, GOAL_HANDOFF_R, k, f"{_ms(r['handoff_p50_s'])} / {_ms(r['handoff_p99_s'])}", ok)
        goal = f"no spurious verdicts at R={GOAL_NO_SPURIOUS_R:,}, default timeouts"
        r = normal.get((GOAL_NO_SPURIOUS_R, k))
        if r is None:
            row(goal, GOAL_NO_SPURIOUS_R, k, _not_run(skipped, GOAL_NO_SPURIOUS_R, f"k={k}"), None)
        else:
            text = f"{r['ranks_raised']} of {r['R']} ranks raised" + ("" if r["finished"] else f"; {dnf(r)}")
            row(goal, GOAL_NO_SPURIOUS_R, k, text, r["ranks_raised"] == 0 and r["finished"])

    def propagation(r: dict[str, Any]) -> tuple[str, bool]:
        """Measured text, and whether every rank got the right verdict (without blaming anyone else)."""
        if not r["finished"]:
            so_far = r.get("last_error_so_far_s")
            return (f"{dnf(r)} ({r['ranks_raised']} of {r['ranks_expected']} raised"
                    + (f", the last after {so_far:.2f} s" if so_far is not None else "") + ")", False)  # fmt: skip
        ok = r["verdicts_right_kind"] == r["ranks_expected"] and not r["blamed_others_count"]
        text = f"{r['last_error_s']:.2f} s" if r["last_error_s"] is not None else "–"
        if r["verdicts_right_kind"] != r["ranks_expected"]:
            text += f" ({r['verdicts_right_kind']} of {r['ranks_expected']} ranks named it)"
        if r["blamed_others_count"]:
            text += f" ({r['blamed_others_count']} other rank(s) blamed too)"
        return text, ok

    for R, bound in GOAL_EXCEPTION_S.items():
        goal = f"an exception on one rank reaches every rank within {bound:g} s"
        r = failed.get((R, "exception"))
        if r is None:
            row(goal, R, 1, _not_run(skipped, R, "exception"), None)
        else:
            text, ok = propagation(r)
            row(goal, R, 1, text, ok and r["last_error_s"] <= bound)
    for (R, kind), r in sorted(failed.items()):
        text, ok = propagation(r)
        if kind == "kill":
            row(f"a killed process (same machine) within ~1 s (taken as <= {GOAL_KILL_S:g} s)", R, 1, text,
                ok and r["last_error_s"] <= GOAL_KILL_S)  # fmt: skip
        elif kind == "stop":
            hb = r["heartbeat_timeout_s"]
            row(f"a stopped (silent) process after the heartbeat timeout ({hb:g} s): between {hb - GOAL_STOP_EARLY_S:g}"
                f" and {hb + GOAL_STOP_MARGIN_S:g} s", R, 1, text,
                ok and hb - GOAL_STOP_EARLY_S <= r["last_error_s"] <= hb + GOAL_STOP_MARGIN_S)  # fmt: skip
        elif kind == "exception" and R not in GOAL_EXCEPTION_S:
            row("an exception on one rank reaches every rank (no goal at this R)", R, 1, text, None)
    return rows


def _not_run(skipped: list[dict[str, Any]], R: int, series: str) -> str:
    for r in skipped:
        if r["R"] == R and r["series"] == series:
            return f"not run ({r['skipped_reason']})"
    return "not run"


# ---------------------------------------------------------------- output


def _s(value: Optional[float]) -> str:
    return "–" if value is None else f"{value:.2f}s"


def _ms(value: Optional[float]) -> str:
    return "–" if value is None else f"{value * 1000:.0f} ms"


def _f(value: Optional[float], digits: int) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def plot(all_results: list[dict[str, Any]], path: Path) -> Path:
    """Store load per rank, coordination overhead, and time to the last error, against R (log x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(16.5, 4.8))
    from matplotlib.ticker import FuncFormatter, NullFormatter

    sizes = sorted({r["R"] for res in all_results for r in res["runs"]} | set(GOAL_OVERHEAD_S) | set(GOAL_EXCEPTION_S))
    for i, res in enumerate(all_results):
        color = PLOT_COLORS[i % len(PLOT_COLORS)]
        runs = [r for r in res["runs"] if not r.get("skipped") and r["finished"]]
        for k in res["config"]["concurrency"]:
            sel = sorted((r for r in runs if not r["failure"] and r["k"] == k), key=lambda r: r["R"])
            ls = "-" if k == 1 else "--"
            if sel:
                axes[0].plot([r["R"] for r in sel], [r["ops_per_s_per_rank"] for r in sel], color=color, ls=ls,
                             marker="o", label=f"{res['label']}, k={k}: all ops / R")  # fmt: skip
                waiting = [(r["R"], max(v for v in r["waiting_ops_per_s"].values() if v is not None)) for r in sel]
                axes[0].plot(*zip(*waiting), color=color, ls=ls, marker="v", alpha=0.55,
                             label=f"{res['label']}, k={k}: per waiting rank")  # fmt: skip
                axes[1].plot([r["R"] for r in sel], [max(r["overhead_s"], 1e-3) for r in sel], color=color, ls=ls,
                             marker="o", label=f"{res['label']}, k={k}")  # fmt: skip
            dnf = [r for r in res["runs"] if not r.get("skipped") and not r["finished"] and not r["failure"]]
            for r in (r for r in dnf if r["k"] == k):
                axes[1].scatter([r["R"]], [r["limit_s"]], color=color, marker="^", s=60)
        for kind in FAILURE_MARKERS:
            sel = sorted((r for r in runs if r["failure"] == kind and r["last_error_s"] is not None),
                         key=lambda r: r["R"])  # fmt: skip
            if sel:
                axes[2].plot([r["R"] for r in sel], [max(r["last_error_s"], 1e-3) for r in sel], color=color,
                             marker=FAILURE_MARKERS[kind], label=f"{res['label']}: {kind}")  # fmt: skip
            for r in res["runs"]:
                if r["failure"] == kind and not r.get("skipped") and not r["finished"]:
                    axes[2].scatter([r["R"]], [r["limit_s"]], color=color, marker="^", s=60)
    axes[0].axhline(GOAL_WAITING_OPS, color="0.3", lw=0.8, ls=":", label=f"goal: {GOAL_WAITING_OPS:g} per waiting rank")
    axes[0].set_ylabel("store operations per second, per rank")
    axes[0].set_title("store load per rank", fontsize=10)
    for R, bound in GOAL_OVERHEAD_S.items():
        axes[1].scatter([R], [bound], color="0.3", marker="_", s=300, zorder=3)
    axes[1].set_ylabel("wall minus ideal (s); triangles: did not finish (at the limit)")
    axes[1].set_title("coordination overhead (bars: goals)", fontsize=10)
    for R, bound in GOAL_EXCEPTION_S.items():
        axes[2].scatter([R], [bound], color="0.3", marker="_", s=300, zorder=3)
    axes[2].set_ylabel("failure to the last rank's error (s); triangles: did not finish")
    axes[2].set_title("failure propagation, k=1 (bars: exception goals)", fontsize=10)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes)
        ax.set_xticklabels([f"{r:,}" for r in sizes], fontsize=8)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("ranks R")
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    first = all_results[0]
    cfg = first["config"]
    fig.suptitle(
        f"TurnSchedule over one TCPStore: {cfg['local_ranks']} local ranks per node, {len(cfg['stages'])} stages,"
        f" {cfg['body_s']:g} s per turn; ranks as threads in {cfg['processes']} processes on"
        f" {first['machine']['cores']} cores",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def section(all_results: list[dict[str, Any]], image: str) -> str:
    """The "Coordination at scale" section of docs/benchmarks.md (also the whole of report.md)."""
    first = all_results[0]
    cfg, machine = first["config"], first["machine"]
    lines = [
        SECTION,
        "",
        "Generated, with its plot, by `benchmarks/coordination_benchmark.py`; every number in this section comes from"
        " the run(s) below, one per version of the code measured (a section of several runs is written from their"
        " `results.json` files with `--from-results` and `--compare`).",
        "",
    ]
    for res in all_results:
        c = res["config"]
        failures = "; ".join(f"{kind} at R = {', '.join(f'{r:,}' for r in sizes)}"
                             for kind, sizes in c["failures"].items() if sizes)  # fmt: skip
        lines.append(
            f"- **{res['label']}**: `{res['command']}` ({res['date']}, {res['wall_seconds'] / 60:.1f} minutes);"
            f" `serialized_restore` at {res['code']['describe']}. R = {', '.join(f'{r:,}' for r in c['sizes'])}"
            f" with k = {', '.join(map(str, c['concurrency']))}; failures: {failures or 'none'}."
        )
    lines += [
        f"- Versions: torch {machine['torch']}, Python {machine['python']}",
        f"- Machine: {machine['cores']} cores ({machine['cpu']}), {machine['ram_gib']:.1f} GiB RAM, Linux"
        f" {machine['kernel']}; other processes shared it (the *other* column below).",
        "",
        "**What is real**: the store (`torch.distributed.TCPStore`, its libuv server in a process of its own, one"
        " client connection per rank over 127.0.0.1), the schedule (`TurnSchedule` of the measured tree, built and"
        " driven through its public API exactly as the connector drives it), its heartbeats, failure reports and"
        " liveness checks (a rank's process found gone by pid on the same machine). **What is simulated**: a rank is"
        f" a thread, and R / {cfg['processes']} of them share a worker process and its interpreter lock (rank r in"
        f" process r % {cfg['processes']}, so that the {cfg['local_ranks']} local ranks of a node span several"
        " processes); every node is this one machine; the body of a turn is a sleep of"
        f" {cfg['body_s']:g} s; the {len(cfg['stages'])} stages follow each other with nothing in between. Each"
        " rank's store is wrapped in a counting `torch.distributed.Store` (Python), so that every operation of the"
        " schedule, from the rank's thread, its watcher or a clone of the store, is counted.",
        "",
        "Definitions:",
        "",
        f"- **ideal**: the turn bodies on the slowest node, {len(cfg['stages'])} stages x ceil({cfg['local_ranks']}"
        f" / k) turns x {cfg['body_s']:g} s; **wall**: from the moment every rank is released (all clients connected,"
        " all schedules built) to the last rank leaving the last stage; **overhead** = wall - ideal.",
        "- **ops/s**: store operations of all ranks over the wall time, in all and per rank. **Per waiting rank**:"
        " the operations a rank makes while it waits for its turn or for the others to end the stage, over the time"
        " it spends so, summed over ranks, for each stage (stage 1 / stage 2); it includes what a rank does once per"
        " stage (announcing itself, its turn's start and end, the end of the stage), which weighs more the shorter"
        " the wait. **Ops per rank and stage**: all operations over R and the number of stages.",
        "- **hand-off**: on each node, the start of a turn minus the end of its predecessor's turn (local rank r - k),"
        " both taken by the ranks' own clocks inside the body; median and 99th percentile over all nodes and stages.",
        "- **server**: the store server process's CPU time (utime + stime from `/proc`) over the run, as a share of"
        " one core (the libuv server is one thread); **workers**: the worker processes' CPU over the run, in cores;"
        " **other**: the rest of the machine's busy time (other processes), in cores. The machine has"
        f" {machine['cores']} cores: when server + workers + other reach that, the run measures the simulator's"
        " (and the machine's) limit, not the store's.",
        "- **workers' CPU per rank**: the workers' CPU time over the run, per rank and second of wall time: what"
        " hosting one rank costs the simulator (its threads, its store calls through the counting wrapper, its"
        " liveness checks). R times this figure has to fit in the machine's cores next to the server and the other"
        " load; where it does not, the run is limited by the simulator.",
        "- **body**: the measured length of a turn's sleep, mean / max: above the nominal length when the rank's"
        " thread waits for the interpreter lock or a core after its sleep ends.",
        f"- Failure runs (k=1, R ranks, default timeouts unless stated): local rank {cfg['fail_local']} of node 0"
        f" (global rank {cfg['fail_local']}) fails {cfg['fail_after_s']:g} s into its turn of stage 1:"
        " *exception*: its body raises `RuntimeError`; *kill*: it sends SIGKILL to its own worker process, which"
        f" takes R / {cfg['processes']} ranks down with it (on every node, inside or waiting for their turn);"
        f" *stop*: it sends SIGSTOP to its process (heartbeat timeout {cfg['stop_heartbeat_timeout_s']:g} s for these"
        " runs). **Last error**: from the failure (the raise, or just before the signal) to the last surviving"
        " rank's `CheckpointRestoreError`; *named* counts the ranks whose error names a failed rank with the expected"
        " kind (`exception`, `died`, `unresponsive`); **abort ops**: store operations per surviving rank from the"
        f" failure on (counted in {BUCKET_S * 1000:.0f} ms buckets), mean / max.",
        "- Set-up, not measured: the server and the workers are started once; each worker connects its ranks'"
        " clients before the first run that needs them and keeps them (every run has a key prefix of its own on the"
        " one server), and a rank's `clone()` of its store is handed a connection made before the run (a small"
        " unmeasured run first counts the clones per rank). torch's `TCPStore` looks up the name of every peer"
        " address it connects to or accepts (reverse DNS), on the server's event loop too; on this machine a slow"
        " resolver stalled such connections by 5 s at times, so the processes run with"
        " `RES_OPTIONS=attempts:1 timeout:1`, after which torch stops resolving at the first slow answer.",
        f"- Every run has a limit of {cfg['run_limit_s']:.0f} s: a run that does not end in time is reported as not"
        " finished, its worker processes are replaced, and larger R of the same series are not run.",
        "",
        f"![store load, overhead and failure propagation against R]({image})",
        "",
        "### Plain store load",
        "",
        f"{cfg['plain_clients']} client threads spread over the worker processes, each alternating `add` and `check`"
        " on its own key as fast as it can, against a fresh server, measured in the same run as the results below:"
        " the most these Python clients get from the store on this machine, and the server's CPU per operation.",
        "",
        "| code | clients | ops/s | server CPU per op | server, share of a core | clients' CPU per op | machine busy"
        " (cores) |",
        "|---|---|---|---|---|---|---|",
    ]
    for res in all_results:
        for p in res["plain"]:
            lines.append(
                f"| {res['label']} | {p['clients']}, {p['variant']} | {p['ops_per_s']:,.0f} |"
                f" {_f(p['server_cpu_per_op_us'], 1)} us | {p['server_core_share']:.2f} |"
                f" {_f(p['clients_cpu_per_op_us'], 1)} us | {_f(p['machine_busy_cores'], 2)} |"
            )
    lines += [
        "",
        "### Restores without failures",
        "",
        "| code | R | k | wall (s) | ideal (s) | overhead (s) | ops/s | ops/s per rank | per waiting rank | ops per"
        " rank and stage |"
        " hand-off p50 / p99 | server (core) | server CPU per op | workers (cores) | workers' CPU per rank | other"
        " (cores) | body mean / max | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in all_results:
        for r in sorted((r for r in res["runs"] if not r["failure"]), key=lambda r: (r["k"], r["R"])):
            head = f"| {res['label']} | {r['R']:,} | {r['k']} |"
            if r.get("skipped"):
                lines.append(head + f" not run: {r['skipped_reason']} |" + " |" * 14)
                continue
            if not r["finished"]:
                lines.append(
                    head + f" **did not finish in {r['limit_s']:.0f} s** ({r['ranks_completed']:,} of {r['R']:,} ranks"
                    f" done) | {r['ideal_s']:.1f} | – | – | – | – | – | – | –"
                    f" | {_f(_server(r), 2)} | – |"
                    f" {_f(_workers(r), 2)} | – | {_f(r['other_cores'], 2)} | – | {r['ranks_raised']} |"
                )
                continue
            waiting = " / ".join(_f(v, 1) for v in r["waiting_ops_per_s"].values())
            lines.append(
                head + f" {r['wall_s']:.2f} | {r['ideal_s']:.1f} | **{r['overhead_s']:.2f}** | {r['ops_per_s']:,.0f} |"
                f" {r['ops_per_s_per_rank']:.1f} | {waiting} | {r['ops_total'] / r['R'] / len(r['stages']):.0f} |"
                f" {_ms(r['handoff_p50_s'])} / {_ms(r['handoff_p99_s'])} |"
                f" {_f(_server(r), 2)} | {_f(r['server_cpu_per_op_us'], 1)} us |"
                f" {_f(_workers(r), 2)} | {_per_rank_ms(r)} | {_f(r['other_cores'], 2)} |"
                f" {r['body_mean_s'] * 1000:.0f} / {r['body_max_s'] * 1000:.0f} ms | {r['ranks_raised']} |"
            )
    mix = []
    for res in all_results:
        done = [r for r in res["runs"] if not r.get("skipped") and r["finished"] and not r["failure"]]
        if done:
            top = max(done, key=lambda r: (r["R"], -r["k"]))
            total = sum(top["ops_by_method"].values()) or 1
            parts = ", ".join(f"`{m}` {n / total:.0%}" for m, n in top["ops_by_method"].items() if n / total >= 0.005)
            mix.append(f"- {res['label']}, R={top['R']:,}, k={top['k']}: {parts}")
    if mix:
        lines += ["", "Store operations by kind, at the largest R that finished:", "", *mix]
    failures = [(res, r) for res in all_results for r in res["runs"] if r["failure"]]
    if failures:
        lines += [
            "",
            "### Failures",
            "",
            "| code | failure | R | heartbeat timeout | failed at | first / last error after it | ranks raised |"
            " named | others blamed | abort ops per rank, mean / max | server (core) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for res, r in sorted(failures, key=lambda x: (x[0]["label"], list(FAILURE_MARKERS).index(x[1]["failure"]),
                                                      x[1]["R"])):  # fmt: skip
            head = f"| {res['label']} | {r['failure']} | {r['R']:,} | {r['heartbeat_timeout_s']:g} s |"
            if r.get("skipped"):
                lines.append(head + f" not run: {r['skipped_reason']} |" + " |" * 6)
                continue
            last = _s(r["last_error_s"]) if r["finished"] else f"did not finish in {r['limit_s']:.0f} s"
            lost = f" ({r['ranks_lost']:,} lost with the process)" if r["ranks_lost"] else ""
            lines.append(
                head + f" {_s(r['failed_at_s'])} | {_s(r['first_error_s'])} / **{last}** |"
                f" {r['ranks_raised']:,} of {r['ranks_expected']:,}{lost} | {r['verdicts_right_kind']:,} |"
                f" {r['blamed_others_count']} | {_f(r['abort_ops_per_rank_mean'], 0)} /"
                f" {_f(r['abort_ops_per_rank_max'], 0)} | {_f(_server(r), 2)} |"
            )
    lines += [
        "",
        "### Goals",
        "",
        "The goals of the redesign of the schedule, checked per R against what each version measured (nothing was"
        " tuned to meet them). *Not run*: R above the version's cap, or after a smaller R of the series did not"
        " finish.",
        "",
        *_capacity_lines(all_results),
        "| goal | R | k | " + " | ".join(res["label"] for res in all_results) + " |",
        "|---|---|---|" + "---|" * len(all_results),
    ]
    goals = [{(g["goal"], g["R"], g["k"]): g for g in check_goals(res)} for res in all_results]
    keys = list(dict.fromkeys(key for g in goals for key in g))
    order = {goal: i for i, goal in enumerate(dict.fromkeys(key[0] for key in keys))}
    keys.sort(key=lambda key: (order[key[0]], key[1], key[2] or 0))
    for key in keys:
        cells = []
        for g in goals:
            item = g.get(key)
            if item is None:
                cells.append("not run")
            elif item["met"] is None:
                cells.append(item["measured"])
            else:
                verdict = {True: "met", False: "**missed**", None: "–"}[item["met"]]
                cells.append(f"{item['measured']}: {verdict}")
        goal, R, k = key
        lines.append(f"| {goal} | {R:,} | {k if k is not None else '–'} | " + " | ".join(cells) + " |")
    lines += ["", "### What limits the simulation", "", *limits_notes(all_results), ""]
    return "\n".join(lines)


def _server(run: dict[str, Any]) -> Optional[float]:
    """The server's CPU over the run as a share of one core: over the wall time when the run finished (the server
    does nothing else between runs), else over the whole window."""
    if run.get("wall_s"):
        return run["server_cpu_s"] / run["wall_s"]
    return run.get("server_core_share")


def _workers(run: dict[str, Any]) -> Optional[float]:
    """The workers' CPU over the run, in cores (over the wall time when the run finished)."""
    if run.get("wall_s"):
        return run["workers_cpu_s"] / run["wall_s"]
    return run.get("workers_cores")


def _capacity_lines(all_results: list[dict[str, Any]]) -> list[str]:
    """Where a version's runs need more CPU than the machine has: above that R they measure the simulator."""
    parts = []
    for res in all_results:
        done = [r for r in res["runs"] if not r.get("skipped") and r["finished"] and not r["failure"]]
        costs = [r["workers_cpu_s"] / r["R"] / r["wall_s"] for r in done if r["workers_cpu_s"]]
        if costs:
            top = round(res["machine"]["cores"] / statistics.median(costs), -1)
            parts.append(f"{res['label']} above about {top:,.0f} ranks")
    if not parts:
        return []
    return [
        "Hosting the ranks takes more CPU than this machine's cores have for "
        + ", ".join(parts)
        + " (see *What limits the simulation*): there, and wherever the other load took the cores, the figures"
        " measure the simulator on this machine rather than the schedule, and a goal missed there is not evidence"
        " against the schedule.",
        "",
    ]


def _per_rank_ms(run: dict[str, Any]) -> str:
    """The worker processes' CPU per rank and second of the run: what the simulator spends to host one rank."""
    if not run.get("wall_s") or not run.get("workers_cpu_s"):
        return "–"
    return f"{run['workers_cpu_s'] / run['R'] / run['wall_s'] * 1000:.2f} ms/s"


def limits_notes(all_results: list[dict[str, Any]]) -> list[str]:
    """Where the figures stop describing the schedule and start describing this simulator and machine."""
    notes = []
    for res in all_results:
        cores = res["machine"]["cores"]
        plain = max(res["plain"], key=lambda p: p["ops_per_s"])
        done = [r for r in res["runs"] if not r.get("skipped") and r["finished"] and not r["failure"]]
        if not done:
            continue
        busiest = max(done, key=lambda r: r["ops_per_s"])
        saturated = [r for r in done if (_workers(r) or 0) + (_server(r) or 0)
                     + (r["other_cores"] or 0) >= 0.9 * cores]  # fmt: skip
        text = (
            f"- **{res['label']}**: the plain load reached {plain['ops_per_s']:,.0f} ops/s with the server at"
            f" {plain['server_core_share']:.2f} of a core ({_f(plain['server_cpu_per_op_us'], 1)} us per op), so one"
            f" server core would serve about {1e6 / plain['server_cpu_per_op_us']:,.0f} ops/s if the clients could"
            f" send them. The schedule's busiest run (R={busiest['R']:,}, k={busiest['k']}) made"
            f" {busiest['ops_per_s']:,.0f} ops/s with the server at {_f(_server(busiest), 2)} of a core."
        )
        if saturated:
            where = ", ".join(f"{r['R']:,} (k={r['k']})" for r in saturated)
            text += (
                " The machine's cores were all busy (server + workers + other >= 90% of"
                f" {cores}) at R = {where}: there, wall time,"
                " hand-offs and body lengths include waiting for a core and for the worker's interpreter lock."
            )
        costs = [r["workers_cpu_s"] / r["R"] / r["wall_s"] for r in done if r["workers_cpu_s"]]
        if costs:
            cost = statistics.median(costs)
            text += (
                f" Hosting one rank cost the workers about {cost * 1000:.1f} ms of CPU per second (median over the"
                f" runs), so {cores} cores host at most about {round(cores / cost, -1):,.0f} ranks at that rate,"
                " fewer next to the server and the other load."
            )
        busiest_server = max((_server(r) or 0) for r in res["runs"] if not r.get("skipped"))
        text += (
            f" The server never used more than {busiest_server:.2f} of a core in a run: the store limited none of them."
        )
        late = [r for r in done if r["body_max_s"] is not None and r["body_max_s"] > 2 * r["body_s"]]
        if late:
            worst = max(late, key=lambda r: r["body_max_s"])
            text += (
                f" Turn bodies (sleeps of {worst['body_s']:g} s) lasted up to {worst['body_max_s']:.2f} s"
                f" (R={worst['R']:,}, k={worst['k']}): the sleeping thread waited to run again."
            )
        for r in res["runs"]:
            if not r.get("skipped") and not r["failure"] and r["ranks_raised"]:
                text += (
                    f" In the run at R={r['R']:,}, k={r['k']}, no failure was injected, yet {r['ranks_raised']:,}"
                    f" rank(s) raised: threads kept from running for longer than the heartbeat timeout"
                    f" ({r['heartbeat_timeout_s']:g} s) by the simulator look silent to their peers."
                )
        blamed = [r for r in res["runs"] if not r.get("skipped") and r["failure"] and r.get("blamed_others_count")]
        for r in blamed:
            text += (
                f" In the {r['failure']} run at R={r['R']:,} (heartbeat timeout {r['heartbeat_timeout_s']:g} s),"
                f" {r['blamed_others_count']} live rank(s) were reported as failed too: a thread kept from running"
                " for seconds by the simulator misses its heartbeats like a silent rank."
            )
        notes.append(text)
    notes.append(
        "- Ranks share worker processes: one interpreter lock serves R / P ranks and their watcher threads, and a"
        " rank's Python work (building messages, the counting wrapper: a few microseconds per operation) delays"
        " its process's other ranks. On a real job each rank has its own process and the nodes their own cores, so"
        " the same schedule is likely faster there; the store server, a single thread in a real job too, is the"
        " part measured as it is."
    )
    return notes


def write_section(path: Path, text: str) -> None:
    """Replace the section (from its heading to the next level-2 heading, or the end) in ``path``, or append it;
    the rest of the file stays byte for byte as it was."""
    old = path.read_text() if path.exists() else ""
    body = text.rstrip("\n") + "\n"
    start = 0 if old.startswith(SECTION + "\n") else old.find("\n" + SECTION + "\n") + 1
    if start == 0 and not old.startswith(SECTION + "\n"):
        new = (old + ("\n" if old.endswith("\n") else "\n\n") + body) if old else body
    else:
        end = old.find("\n## ", start + len(SECTION))
        new = old[:start] + body + ("\n" + old[end + 1 :] if end >= 0 else "")
    path.write_text(new)


# ---------------------------------------------------------------- stamping


def code_under_test(version_text: Optional[str] = None) -> dict[str, Any]:
    """Which ``serialized_restore`` the workers import (they see the same ``sys.path`` as this process), and the git
    commit that last changed it in its tree."""
    spec = importlib.util.find_spec("serialized_restore")
    if spec is None or spec.origin is None:
        raise SystemExit("serialized_restore is not importable: set PYTHONPATH to a checkout of it")
    tree = Path(spec.origin).resolve().parents[1]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=tree, capture_output=True, text=True, check=True,
                                  timeout=30).stdout.strip()  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("log", "-1", "--format=%h", "--", "serialized_restore") if (tree / ".git").exists() else ""
    changes = git("status", "--porcelain", "--", "serialized_restore") if commit else ""
    if version_text:
        describe = version_text
    elif commit:
        describe = f"commit {commit}" + (" with uncommitted changes in serialized_restore/" if changes else "")
    else:
        describe = "an unknown version (not a git checkout)"
    origin = "this checkout" if tree == REPO else "another tree (PYTHONPATH)"
    return {"commit": commit, "changes": bool(changes), "describe": describe, "origin": origin}


def _command() -> str:
    args = []
    for arg in sys.argv[1:]:
        path = Path(arg)
        if path.is_absolute():
            try:
                arg = str(path.resolve().relative_to(REPO))
            except ValueError:
                arg = path.name
        args.append(shlex.quote(arg))
    return " ".join(["python", "benchmarks/coordination_benchmark.py", *args])


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(SIM.parent))
    if args.from_results:
        results = json.loads(args.from_results.read_text())
        out = args.output_dir if args.output_dir != DEFAULT_OUTPUT / "coordination" else args.from_results.parent
    else:
        results = run_all(args)
        out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    if not args.from_results:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    all_results = [results] + [json.loads(p.read_text()) for p in args.compare]
    # the earlier runs first (the version measured before), this one after it
    all_results = all_results[1:] + all_results[:1]
    written = ([] if args.from_results else [out / "results.json"]) + [plot(all_results, out / "coordination.png")]
    (out / "report.md").write_text(section(all_results, "coordination.png") + "\n")
    written.append(out / "report.md")
    if args.docs:
        written.append(plot(all_results, DOCS / "img" / "coordination.png"))
        write_section(DOCS / "benchmarks.md", section(all_results, "img/coordination.png"))
        written.append(DOCS / "benchmarks.md")
    print("\nwrote " + ", ".join(_rel(p) for p in written))
    for goal in check_goals(results):
        verdict = {True: "met   ", False: "MISSED", None: "  –   "}[goal["met"]]
        k = f" k={goal['k']}" if goal["k"] is not None else ""
        print(f"  goal {verdict} R={goal['R']}{k}: {goal['goal']}: {goal['measured']}")
    print(f"total {results['wall_seconds'] / 60:.1f} minutes")
    for broken in results["broken"]:
        print(f"ERROR: {broken.splitlines()[0]}", file=sys.stderr)
    return 1 if results["broken"] else 0


if __name__ == "__main__":
    sys.exit(main())
