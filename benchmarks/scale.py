"""The turn schedule at scale: R ranks in nodes of L local ranks, k turns at a time per node, on one real store.

Real: one ``torch.distributed.TCPStore`` server (libuv, in this process, 127.0.0.1), one client per rank (counted by a
wrapping ``dist.Store``), the package's turn code: each rank runs one stage through its own ``TurnSchedule`` on its
own client. Simulated: ranks are threads in ``--procs`` worker processes forked by this one (blocking store calls
release the GIL), so all ranks share this machine's cores; a turn's body is ``time.sleep(T)``. Ranks connect, then are
released at once; ``wall_s`` runs until the last rank left the stage. ``--fail-rank X``: X raises ``ValueError`` at
the start of its turn; ``all_raised_s`` runs until the last other rank raised. Prints a JSON object; exits 1 if a rank
hung or raised unexpectedly (or another rank's error did not name X).

    python benchmarks/scale.py --ranks 1024 --ranks-per-node 8 --k 1 [--fail-rank 259] [--json out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("RES_OPTIONS", "attempts:1 timeout:1")  # as tests/conftest.py: no slow peer-name lookups
if __name__ == "__main__":  # before torch loads: c10d warns once per client where peer names don't resolve
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import argparse
import datetime
import functools
import gc
import json
import logging
import math
import multiprocessing
import resource
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from serialized_restore import CheckpointRestoreError
from serialized_restore._coordination.placement import RankPlacement
from serialized_restore._coordination.turns import TurnSchedule

HOST, STAGE, GO_KEY, TIMEOUT = "127.0.0.1", "restore modules and callbacks", "scale/go", datetime.timedelta(seconds=60)
QUIET = logging.Logger("serialized_restore.scale", logging.WARNING)  # the ranks' per-turn INFO lines are dropped
SCHEDULE: dict[str, Any] = {"checkpoint_path": "/sim/ckpt", "turn_timeout": 60.0, "logger": QUIET}
_client = functools.partial(dist.TCPStore, HOST, timeout=TIMEOUT, wait_for_workers=False, use_libuv=True)  # (port)


@dataclass(frozen=True)
class Config:
    ranks: int
    ranks_per_node: int
    k: int
    turn_s: float = 0.1
    fail_rank: Optional[int] = None
    procs: int = 0  # 0: one worker process per 128 ranks, at most 8
    deadline_s: float = 30.0  # a rank not done this long after the release counts as hung


class _CountingStore(dist.Store):
    """A real store's client, wrapped: forwards every call the turn code makes and counts it (``tests/test_turns``)."""

    def __init__(self, inner: dist.TCPStore, counts: dict[str, int]) -> None:
        super().__init__()
        self.inner, self.counts = inner, counts
        dist.Store.set_timeout(self, inner.timeout)  # type: ignore[attr-defined]

    def _call(self, name: str, *args: Any) -> Any:
        self.counts[name] = self.counts.get(name, 0) + 1
        return getattr(self.inner, name)(*args)

    def set(self, key: str, value: Any) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        if self.timeout != self.inner.timeout:  # type: ignore[attr-defined]
            self.inner.set_timeout(self.timeout)  # type: ignore[attr-defined]
        return self._call("get", key)

    def add(self, key: str, value: int) -> int:
        return self._call("add", key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call("compare_set", key, expected, desired)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._call("multi_set", keys, values)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        dist.Store.set_timeout(self, timeout)
        self.inner.set_timeout(timeout)


def _rank(g: int, cfg: Config, port: int, ready: threading.Barrier, go: threading.Event, out: dict[int, Any]) -> None:
    """(one rank's thread) connect, build the schedule, wait for the release, run the stage; record what happened."""
    counts: dict[str, int] = {}
    try:
        place = RankPlacement(g, cfg.ranks, *divmod(g, cfg.ranks_per_node), cfg.ranks_per_node)
        store = _CountingStore(_client(port), counts)
        sched = TurnSchedule(store=store, placement=place, **SCHEDULE)
    except Exception as err:
        out[g] = {"outcome": "unexpected", "message": f"connecting: {err!r}"}
        return
    finally:
        ready.wait()
    go.wait()
    rec: dict[str, Any] = {"released": time.monotonic(), "cpu": time.thread_time()}
    try:
        with sched.turn(STAGE, k=cfg.k):
            rec["start"] = time.monotonic()
            if g == cfg.fail_rank:
                raise ValueError(f"simulated failure in the turn of rank {g}")
            time.sleep(cfg.turn_s)
            rec["end"] = time.monotonic()
        rec["outcome"] = "ok"
    except CheckpointRestoreError as err:  # before ValueError: it derives from the failed rank's exception type
        rec.update(outcome="restore_error", failed_ranks=err.failed_ranks, message=str(err)[:200])
    except BaseException as err:
        own = g == cfg.fail_rank and isinstance(err, ValueError) and "simulated failure" in str(err)
        rec.update(outcome="own" if own else "unexpected", message=repr(err)[:200])
    rec.update(left=time.monotonic(), cpu=time.thread_time() - rec["cpu"], ops=sum(counts.values()), by_kind=counts)
    out[g] = rec


def _worker(conn: Connection, block: range, cfg: Config) -> None:
    """(a forked worker) one thread per rank of ``block``; reports when all connected, then every rank's record."""
    gc.freeze()  # what it inherits: never walked by a collection (a pause of all its ranks, and copy-on-write)
    control = _client(conn.recv())
    ready, go = threading.Barrier(len(block) + 1), threading.Event()
    out: dict[int, dict[str, Any]] = {}
    threading.stack_size(1 << 20)
    for g in block:
        threading.Thread(target=_rank, args=(g, cfg, control.port, ready, go, out), daemon=True).start()
    ready.wait()
    conn.send("connected")
    control.get(GO_KEY)  # the release: one blocking get per worker, then one event for its threads
    cpu, deadline = time.process_time(), time.monotonic() + cfg.deadline_s
    go.set()
    while len(out) < len(block) and time.monotonic() < deadline:
        time.sleep(0.01)
    conn.send({"records": dict(out), "cpu_s": time.process_time() - cpu})
    os._exit(0)


def _machine_cpu() -> tuple[float, float]:
    f = [int(v) / os.sysconf("SC_CLK_TCK") for v in Path("/proc/stat").read_text().split()[1:9]]
    return f[0] + f[1] + f[2], f[7]  # since boot, all processes: CPU seconds in user and system mode; stolen


def run(cfg: Config) -> dict[str, Any]:
    """Run one stage of ``cfg.ranks`` simulated ranks on one real store; the summary."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # the server's end of every client (a worker: fewer)
    want = cfg.ranks + 256 if hard == resource.RLIM_INFINITY else min(cfg.ranks + 256, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    ctx = multiprocessing.get_context("fork")  # forked before the server exists: no store thread is copied
    size = math.ceil(cfg.ranks / (cfg.procs or max(1, min(8, math.ceil(cfg.ranks / 128)))))
    blocks = [range(s, min(s + size, cfg.ranks)) for s in range(0, cfg.ranks, size)]
    pipes = [ctx.Pipe() for _ in blocks]
    workers = [ctx.Process(target=_worker, args=(p[1], b, cfg), daemon=True) for p, b in zip(pipes, blocks)]
    for proc in workers:
        proc.start()
    server = dist.TCPStore(HOST, 0, None, True, timeout=TIMEOUT, wait_for_workers=False, use_libuv=True)
    began, records, client_cpu = time.monotonic(), {}, 0.0
    try:
        for pipe, _ in pipes:
            pipe.send(server.port)
        for pipe, _ in pipes:
            if not pipe.poll(120) or pipe.recv() != "connected":
                raise RuntimeError("a worker did not connect its ranks within 120 s")
        connect_s, machine = time.monotonic() - began, _machine_cpu()
        server_cpu, t0 = time.process_time(), time.monotonic()
        server.set(GO_KEY, "1")
        for pipe, _ in pipes:
            if pipe.poll(cfg.deadline_s + 30):  # else its ranks count as hung
                report = pipe.recv()
                records.update(report["records"])
                client_cpu += report["cpu_s"]
        server_cpu = time.process_time() - server_cpu
        busy, stolen = (b - a for a, b in zip(machine, _machine_cpu()))
    finally:
        for proc in workers:
            proc.join(5)
            proc.kill()  # a no-op once it exited
    sim = {"procs": len(blocks), "fd_limit": max(soft, want), "connect_s": round(connect_s, 2)}
    cpu = {"client_cpu_s": round(client_cpu, 2), "server_cpu_s": round(server_cpu, 2), "stolen_cpu_s": round(stolen, 2)}
    cpu["other_cpu_s"] = round(busy - client_cpu - server_cpu, 2)  # other work on this machine during the stage
    return _summary(cfg, records, t0) | sim | cpu


def _summary(cfg: Config, records: dict[int, dict[str, Any]], t0: float) -> dict[str, Any]:
    done, lws, k, x = [r for r in records.values() if "left" in r], cfg.ranks_per_node, cfg.k, cfg.fail_rank
    bad = {"unexpected"} if x is not None else {"unexpected", "restore_error"}
    errors = [f"rank {g}: {r['message']}" for g, r in sorted(records.items()) if r["outcome"] in bad]
    ops, by_kind = [r["ops"] for r in done], sum((Counter(r["by_kind"]) for r in done), Counter())
    ends = {g: r["end"] for g, r in records.items() if "end" in r}
    gaps = [r["start"] - ends[g - k] for g, r in records.items() if g % lws >= k and g - k in ends and "start" in r]
    wall = max((r["left"] for r in done), default=t0) - t0
    ideal = math.ceil(lws / k) * cfg.turn_s
    result: dict[str, Any] = {
        **{f: v for f, v in asdict(cfg).items() if f != "procs"},
        "nodes": math.ceil(cfg.ranks / lws),
        "wall_s": round(wall, 3),
        "ideal_s": round(ideal, 3),
        "over_ideal_s": round(wall - ideal, 3),
        "ops_per_rank": _stats(ops, 1, 2),
        "ops_by_kind_per_rank": {n: round(c / max(1, len(ops)), 2) for n, c in sorted(by_kind.items())},
        "hung": cfg.ranks - len(records),
        "errors": {"count": len(errors), "messages": errors[:5]},
        "release_s": round(max((r["released"] for r in done), default=t0) - t0, 3),
        "handoff_ms": _stats(gaps, 1000, 1),  # a turn's start after the end of the one k places ahead
        "verdict_fanout_s": round(wall + t0 - max(ends.values()), 3) if ends and x is None else None,
        "rank_thread_cpu_ms": round(1000 * statistics.fmean([r["cpu"] for r in done] or [0]), 2),
    }
    if x is not None:
        raised = [r for g, r in records.items() if g != x and r["outcome"] == "restore_error"]
        at, latest = records.get(x, {}).get("start"), max((r["left"] for r in raised), default=None)
        named = len(raised) == cfg.ranks - 1 and all(r["failed_ranks"] == [x] for r in raised)
        late = round(latest - at, 3) if at is not None and latest is not None else None
        result |= {"all_raised_s": late, "others_raised": len(raised), "all_name_fail_rank": named}
    return result


def _stats(v: list[float], scale: float = 1.0, nd: int = 3) -> dict[str, float]:
    return {"max": round(scale * max(v, default=0), nd), "mean": round(scale * statistics.fmean(v or [0]), nd)}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--ranks-per-node", type=int, required=True)
    parser.add_argument("--k", type=int, default=1, help="turns at a time per node (max_concurrent)")
    parser.add_argument("--fail-rank", type=int, default=None, help="raises ValueError at the start of its turn")
    parser.add_argument("--turn-s", type=float, default=0.1, help="each turn's body: a sleep of this many seconds")
    parser.add_argument("--procs", type=int, default=0, help="worker processes (default: one per 128 ranks, <= 8)")
    parser.add_argument("--json", default=None, help="also write the JSON object to this file")
    a = parser.parse_args(argv)
    result = run(Config(a.ranks, a.ranks_per_node, a.k, a.turn_s, a.fail_rank, a.procs))
    print(text := json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(text + "\n")
    return int(bool(result["hung"] or result["errors"]["count"] or result.get("all_name_fail_rank") is False))


if __name__ == "__main__":
    sys.exit(main())
