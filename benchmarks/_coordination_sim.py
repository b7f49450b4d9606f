"""The processes of ``coordination_benchmark.py``: one store server, and workers whose threads are ranks.

Run as ``python benchmarks/_coordination_sim.py serve`` or ``... work <index>``; each reads one JSON command per line
on stdin and answers one JSON line on stdout, and exits when stdin closes (its parent is gone) or on ``quit``. The
driver (``coordination_benchmark.py``) owns these processes and kills them by pid.

What is real here: ``torch.distributed.TCPStore`` (server and one client connection per rank, over 127.0.0.1), the
project's ``TurnSchedule`` (imported from whichever ``serialized_restore`` is first on ``PYTHONPATH``) and its
liveness checks, which see the ranks of a killed worker process gone by pid. What is simulated: a rank is a thread,
many ranks share a process (and its interpreter lock), all "nodes" are one machine, and the body of a turn sleeps.
"""

from __future__ import annotations

import datetime
import gc
import inspect
import json
import os
import resource
import signal
import sys
import threading
import time
import traceback
from typing import Any, Optional

HOST = "127.0.0.1"
THREAD_STACK = 512 * 1024  # bytes per thread: a rank thread and the schedule's watcher thread each take one
CLIENT_TIMEOUT_S = 120.0  # the TCPStore clients' own timeout (connect, get of a missing key, wait)
BUCKET_S = 0.05  # store operations are counted per rank in buckets of this many seconds (failure runs only)


def raise_fd_limit() -> int:
    """Open files up to the hard limit: every rank holds at least one socket, the server one per connection."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent (the driver) exits, however it exits: a worker that a
    failure run froze with SIGSTOP cannot notice by itself that nobody will ever resume or kill it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the driver kills its processes by pid, and they exit when their stdin closes
    if os.getppid() == 1:
        os._exit(1)  # the parent is already gone


def process_cpu_seconds(pid: int) -> Optional[float]:
    """utime + stime of a process (all its threads), from ``/proc/<pid>/stat``; ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from ``/proc/stat``."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    total = sum(values[:8])
    tick = os.sysconf("SC_CLK_TCK")
    return (total - idle) / tick, total / tick


# ---------------------------------------------------------------- counting store


def _counting_store_class() -> type:
    import torch.distributed as dist

    class CountingStore(dist.Store):
        """A ``torch.distributed.Store`` that forwards every call to ``inner`` and counts it in ``counter``.

        Python subclasses of ``dist.Store`` are reached from C++ (``PrefixStore``) through torch's trampoline, which
        looks up ``set``, ``get``, ``add``, ``check``, ``compare_set``, ``append``, ``multi_get``, ``multi_set``,
        ``wait``, ``clone``, ``deleteKey`` and ``getNumKeys``; the snake-case names are there for Python callers.
        A clone is counted in the same counter (it is the same rank) and kept alive here: the trampoline needs the
        Python object to outlive the C++ reference.
        """

        def __init__(self, inner: Any, counter: Counter, spares: Optional[list[Any]] = None) -> None:
            super().__init__()
            self.inner = inner
            self.counter = counter
            self.spares = spares if spares is not None else []
            self._clones: list[Any] = []
            dist.Store.set_timeout(self, inner.timeout)

        def _sync_timeout(self) -> None:
            # a timeout set on this store (or through a PrefixStore over it) applies to the blocking calls
            if self.timeout != self.inner.timeout:
                self.inner.set_timeout(self.timeout)

        def set(self, key, value):  # noqa: ANN001, ANN201
            self.counter.hit("set")
            return self.inner.set(key, value)

        def get(self, key):  # noqa: ANN001, ANN201
            self.counter.hit("get")
            self._sync_timeout()
            return self.inner.get(key)

        def add(self, key, value):  # noqa: ANN001, ANN201
            self.counter.hit("add")
            return self.inner.add(key, value)

        def check(self, keys):  # noqa: ANN001, ANN201
            self.counter.hit("check")
            return self.inner.check(keys)

        def compare_set(self, key, expected, desired):  # noqa: ANN001, ANN201
            self.counter.hit("compare_set")
            return self.inner.compare_set(key, expected, desired)

        def append(self, key, value):  # noqa: ANN001, ANN201
            self.counter.hit("append")
            return self.inner.append(key, value)

        def multi_get(self, keys):  # noqa: ANN001, ANN201
            self.counter.hit("multi_get")
            self._sync_timeout()
            return self.inner.multi_get(keys)

        def multi_set(self, keys, values):  # noqa: ANN001, ANN201
            self.counter.hit("multi_set")
            return self.inner.multi_set(keys, values)

        def wait(self, keys, timeout=None):  # noqa: ANN001, ANN201
            self.counter.hit("wait")
            return self.inner.wait(keys, self.timeout if timeout is None else timeout)

        def deleteKey(self, key):  # noqa: ANN001, ANN201, N802
            self.counter.hit("delete_key")
            return self.inner.delete_key(key)

        delete_key = deleteKey

        def getNumKeys(self):  # noqa: ANN201, N802
            self.counter.hit("num_keys")
            return self.inner.num_keys()

        num_keys = getNumKeys

        def set_timeout(self, timeout):  # noqa: ANN001, ANN201
            dist.Store.set_timeout(self, timeout)
            self.inner.set_timeout(timeout)

        def clone(self):  # noqa: ANN201
            self.counter.hit("clone")
            if self.spares:
                # a connection to the same server made before the run (what TCPStore.clone() makes): connecting,
                # with torch's reverse lookup of the peer's name, is set-up cost, not coordination
                inner = self.spares.pop()
                inner.set_timeout(self.inner.timeout)
            else:
                self.counter.late_clones += 1
                inner = self.inner.clone()
            copy = CountingStore(inner, self.counter, self.spares)
            self._clones.append(copy)
            return copy

        def has_extended_api(self):  # noqa: ANN201
            return True

        def release(self) -> None:
            for copy in self._clones:
                copy.release()
            self._clones = []
            self.inner = None
            self.spares = []

    return CountingStore


class Counter:
    """Store operations of one rank (all its threads and clones): by phase, by method, and (optionally) over time."""

    def __init__(self, t0: float, timeline: bool) -> None:
        self.phase = "setup"
        self.by_phase: dict[str, int] = {}
        self.by_method: dict[str, int] = {}
        self.buckets: Optional[dict[int, int]] = {} if timeline else None
        self.t0 = t0
        self.late_clones = 0
        self._lock = threading.Lock()

    def hit(self, method: str) -> None:
        with self._lock:
            self.by_phase[self.phase] = self.by_phase.get(self.phase, 0) + 1
            self.by_method[method] = self.by_method.get(method, 0) + 1
            if self.buckets is not None:
                b = int((time.time() - self.t0) / BUCKET_S)
                self.buckets[b] = self.buckets.get(b, 0) + 1


# ---------------------------------------------------------------- server


def serve() -> None:
    """Host the TCPStore server of the whole benchmark (every run has a key prefix of its own)."""
    import torch.distributed as dist

    die_with_parent()
    limit = raise_fd_limit()
    out = _protocol_stream()
    store = dist.TCPStore(
        HOST, 0, world_size=None, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=CLIENT_TIMEOUT_S),
    )  # fmt: skip
    _answer(out, {"ready": True, "pid": os.getpid(), "fd_limit": limit, "port": store.port,
                  "libuv": bool(getattr(store, "libuvBackend", False))})  # fmt: skip
    for line in sys.stdin:
        if json.loads(line)["cmd"] == "quit":
            break
    os._exit(0)


# ---------------------------------------------------------------- worker


def work(index: int) -> None:
    """A worker process: ``prepare`` connects its ranks and starts their threads, ``go`` releases them at a given
    time and answers with every rank's record; ``plain`` runs the plain store load."""
    import logging

    import torch.distributed as dist

    logging.getLogger("serialized_restore").setLevel(logging.WARNING)
    die_with_parent()
    limit = raise_fd_limit()
    threading.stack_size(THREAD_STACK)
    out = _protocol_stream()
    _answer(out, {"ready": True, "pid": os.getpid(), "fd_limit": limit})
    run: Optional[_Run] = None
    pool = _Connections(dist)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "prepare":
                run = _Run(cmd, dist, pool)
                _answer(out, run.prepare())
            elif cmd["cmd"] == "go":
                assert run is not None
                _answer(out, run.go(cmd["at"], cmd["deadline"]))
                run.release()  # after answering: the driver's clock is running
                run = None
                gc.collect()
            elif cmd["cmd"] == "plain":
                _answer(out, _plain_load(cmd, dist, pool))
            elif cmd["cmd"] == "quit":
                break
        except Exception:
            _answer(out, {"error": traceback.format_exc()})
    os._exit(0)


class _Connections:
    """This process's client connections to the server, kept from run to run: connecting is not what is measured
    (and torch resolves the name of every peer address it connects to, which can stall on a slow resolver).
    Connections handed out as clones are closed after their run, since a thread of the run may still use one."""

    def __init__(self, dist: Any) -> None:
        self.dist = dist
        self.port: Optional[int] = None
        self.clients: list[Any] = []
        self.spares: list[Any] = []

    def _connect(self) -> Any:
        return self.dist.TCPStore(
            HOST, self.port, is_master=False, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=CLIENT_TIMEOUT_S),
        )  # fmt: skip

    def ensure(self, port: int, clients: int, spares: int) -> float:
        """At least this many connections of each kind; returns the seconds spent connecting."""
        if port != self.port:
            self.port, self.clients, self.spares = port, [], []
        t0 = time.monotonic()
        # one after another: thousands of simultaneous connects overflow the server's listen backlog
        while len(self.clients) < clients:
            self.clients.append(self._connect())
        while len(self.spares) < spares:
            self.spares.append(self._connect())
        return time.monotonic() - t0


_HOST: Any = None


def _watch_host() -> Any:
    """This worker's one ``_watch_host.SharedThread``, made on first use."""
    global _HOST
    if _HOST is None:
        from benchmarks._watch_host import SharedThread

        _HOST = SharedThread()
    return _HOST


class _Run:
    """This process's ranks of one simulated restore."""

    def __init__(self, cmd: dict[str, Any], dist: Any, pool: _Connections) -> None:
        self.cmd = cmd
        self.dist = dist
        self.pool = pool
        self.ranks: list[int] = cmd["ranks"]
        self.threads: list[threading.Thread] = []
        self.records: dict[int, dict[str, Any]] = {}
        self.released = threading.Event()
        self.start_at = 0.0

    def prepare(self) -> dict[str, Any]:
        from serialized_restore import CheckpointRestoreError
        from serialized_restore._turns import RankPlacement, TurnSchedule

        # every rank's watch on the process's one shared thread, where the schedule takes a host (the package's
        # default is a thread per watch, as in a job with one rank per process)
        hosted = {"host": _watch_host()} if "host" in inspect.signature(TurnSchedule).parameters else {}

        cmd = self.cmd
        counting_store = _counting_store_class()
        n = len(self.ranks)
        per_rank = cmd["spares_per_rank"]
        connect_s = self.pool.ensure(cmd["port"], n, n * per_rank)
        self.spares = self.pool.spares[: n * per_rank]
        del self.pool.spares[: n * per_rank]
        self.stores = []
        self.counted = []
        for i in range(n):
            counted = counting_store(
                self.pool.clients[i], Counter(0.0, timeline=cmd["failure"] is not None),
                self.spares[i * per_rank : (i + 1) * per_rank],
            )  # fmt: skip
            self.counted.append(counted)
            # a namespace of the run's own on the benchmark's one server, as a job's default group prefixes its keys
            self.stores.append(self.dist.PrefixStore(cmd["prefix"], counted))
        self.threads_before = threading.active_count()
        local_world = cmd["local_world_size"]
        for rank, store, counted in zip(self.ranks, self.stores, self.counted):
            placement = RankPlacement(
                global_rank=rank, world_size=cmd["world_size"], node_rank=rank // local_world,
                local_rank=rank % local_world, local_world_size=local_world,
            )  # fmt: skip
            schedule = TurnSchedule(
                store=store, placement=placement, max_concurrent=cmd["k"], checkpoint_path="simulated.ckpt",
                turn_timeout=cmd["turn_timeout"], heartbeat_timeout=cmd["heartbeat_timeout"], **hosted,
            )  # fmt: skip
            thread = threading.Thread(
                target=self._rank, args=(rank, placement, schedule, counted.counter, CheckpointRestoreError),
                name=f"rank-{rank}", daemon=True,
            )  # fmt: skip
            self.threads.append(thread)
        for thread in self.threads:
            thread.start()
        return {"prepared": n, "connect_s": connect_s, "threads": threading.active_count()}

    def go(self, at: float, deadline: float) -> dict[str, Any]:
        self.start_at = at
        for counted in self.counted:
            counted.counter.t0 = at
        cpu0 = time.process_time()
        self.released.set()
        for thread in self.threads:
            thread.join(timeout=max(0.0, deadline - time.time()))
        cpu1 = time.process_time()
        ended = time.time()
        unfinished = [t.name for t in self.threads if t.is_alive()]
        records = [self.records[r] for r in self.ranks if r in self.records]
        late_clones = sum(c.counter.late_clones for c in self.counted)
        time.sleep(0.1)  # the schedule's own threads end with their stage
        return {
            "records": records,
            "unfinished": len(unfinished),
            # threads of the run still alive (a watcher that did not stop): the process is replaced after the run
            "lingering_threads": max(0, threading.active_count() - self.threads_before),
            "late_clones": late_clones,
            "cpu_s": cpu1 - cpu0,
            "ended": ended,
            "pid": os.getpid(),
        }

    def release(self) -> None:
        for counted in self.counted:
            counted.release()
        self.counted, self.stores, self.spares = [], [], []

    def _rank(self, rank: int, placement: Any, schedule: Any, counter: Counter, restore_error: type) -> None:
        cmd = self.cmd
        failure = cmd["failure"]
        victim = failure is not None and failure["rank"] == rank
        record: dict[str, Any] = {"rank": rank, "node": placement.node_rank, "local": placement.local_rank}
        stages: list[dict[str, Any]] = []
        record["stages"] = stages
        self.released.wait()
        delay = self.start_at - time.time()
        if delay > 0:
            time.sleep(delay)
        try:
            for stage in cmd["stages"]:
                entry: dict[str, Any] = {"stage": stage, "enter": time.time()}
                stages.append(entry)
                counter.phase = f"wait:{stage}"
                with schedule.turn(stage):
                    entry["start"] = time.time()
                    counter.phase = f"turn:{stage}"
                    if victim and stage == failure["stage"]:
                        time.sleep(failure["after"])
                        _inject(failure, cmd["fail_file"], record)
                    time.sleep(cmd["body"])
                    entry["end"] = time.time()
                    counter.phase = f"after:{stage}"
                entry["exit"] = time.time()
        except restore_error as err:
            record["error"] = _describe_error(err)
        except Exception as err:  # noqa: BLE001 - reported as a broken run, not as a verdict
            record["error"] = {"time": time.time(), "type": type(err).__name__, "unexpected": True,
                               "message": str(err).splitlines()[0][:300] if str(err) else ""}  # fmt: skip
        finally:
            counter.phase = "done"
            record["ops_by_phase"] = dict(counter.by_phase)
            record["ops_by_method"] = dict(counter.by_method)
            if counter.buckets is not None:
                record["buckets"] = sorted(counter.buckets.items())
            self.records[rank] = record


def _inject(failure: dict[str, Any], fail_file: str, record: dict[str, Any]) -> None:
    """Fail this rank's turn: raise, or take the whole process down (SIGKILL) or freeze it (SIGSTOP)."""
    now = time.time()
    if failure["kind"] == "exception":
        record["failed_at"] = now
        raise RuntimeError("injected failure in the body of a turn")
    with open(fail_file, "w") as f:
        f.write(repr(now))
    os.kill(os.getpid(), signal.SIGKILL if failure["kind"] == "kill" else signal.SIGSTOP)
    time.sleep(3600)  # not reached after SIGKILL; after SIGCONT (never sent) the driver kills the process anyway


def _describe_error(err: BaseException) -> dict[str, Any]:
    failures = list(getattr(err, "failures", []) or [])
    message = str(err)
    return {
        "time": time.time(),
        "type": type(err).__name__,
        "failed_ranks": [int(r) for r in (getattr(err, "failed_ranks", None) or [])],
        "kinds": sorted({str(getattr(f, "kind", "?")) for f in failures}),
        "message": message.splitlines()[0][:300] if message else "",
    }


def _plain_load(cmd: dict[str, Any], dist: Any, pool: _Connections) -> dict[str, Any]:
    """``threads`` clients, each alternating ``add`` and ``check`` on its own key as fast as it can."""
    counting_store = _counting_store_class()
    pool.ensure(cmd["port"], cmd["threads"], len(pool.spares))
    clients = []
    keep = []  # the Python side of each counting store must outlive the PrefixStore's reference to it
    for client in pool.clients[: cmd["threads"]]:
        if cmd["counted"]:
            keep.append(counting_store(client, Counter(0.0, timeline=False)))
            client = dist.PrefixStore("plain", keep[-1])
        clients.append(client)
    counts = [0] * len(clients)

    def load(i: int, store: Any) -> None:
        key = f"plain/{os.getpid()}/{i}"
        delay = cmd["at"] - time.time()
        if delay > 0:
            time.sleep(delay)
        end = cmd["at"] + cmd["seconds"]
        n = 0
        while time.time() < end:
            store.add(key, 1)
            store.check([key])
            n += 2
        counts[i] = n

    threads = [threading.Thread(target=load, args=(i, c), daemon=True) for i, c in enumerate(clients)]
    cpu0 = time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=cmd["seconds"] + 60)
    for c in keep:
        c.release()
    return {"ops": sum(counts), "cpu_s": time.process_time() - cpu0}


# ---------------------------------------------------------------- protocol


def _protocol_stream() -> Any:
    """Answers go to the original stdout; anything else printed (warnings, logs) goes to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def _answer(out: Any, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


if __name__ == "__main__":
    # as in coordination_benchmark.py: PYTHONPATH first, then this checkout, then installed packages
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [*filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)), here]
    if sys.argv[1] == "serve":
        serve()
    elif sys.argv[1] == "work":
        work(int(sys.argv[2]))
    else:
        raise SystemExit(f"unknown role {sys.argv[1]!r}")
