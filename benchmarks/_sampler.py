"""Samples the memory of a job's whole process tree from another process, with two channels:

* fast, every ``FAST_INTERVAL``: ``RssAnon`` of ``/proc/<pid>/status`` (resident anonymous pages, O(1) to read);
* full sweeps, at most ``SMAPS_DUTY`` of one core: ``Anonymous:``, ``Pss:``, ``Pss_Anon:`` of ``smaps_rollup``,
  which the kernel builds by walking page tables (about 10 ms per GiB resident): too slow for a short peak, which
  is why the fast channel exists. Each sweep reads ``RssAnon`` before and after every walk to check the channels.

The tree is rescanned (psutil) when the kernel may have created a process (the last PID in ``/proc/loadavg``
changed), every ``RESCAN_MIN_INTERVAL`` to ``RESCAN_MAX_INTERVAL``; until ``wake_on`` exists (rank 0 writes it right
before the ``setup`` hook that opens the window) only every ``IDLE_RESCAN_INTERVAL``, and no sweep runs, so that the
sampler takes next to no CPU while the ranks start.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Optional

import psutil

FAST_INTERVAL = 0.005
SMAPS_DUTY = 0.2
SMAPS_MIN_INTERVAL = 0.005
RESCAN_MIN_INTERVAL = 0.1
RESCAN_MAX_INTERVAL = 1.0
IDLE_RESCAN_INTERVAL = 0.5
SAMPLER_NICE = -10
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _read_field(path: str, key: bytes) -> Optional[int]:
    """A ``kB`` field of a ``/proc`` file in bytes; ``None`` if the process is gone."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    i = data.find(key)
    return 0 if i < 0 else int(data[i + len(key) : data.index(b"kB", i)]) * 1024


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
    return (sum(values[:8]) - values[3] - (values[4] if len(values) > 4 else 0)) / _CLOCK_TICKS


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
    those whose ``RssAnon`` read just before the walk equals the one read just after it.
    """

    def __init__(self, root_pid: int, wake_on: Optional[Path] = None) -> None:
        self.root = psutil.Process(root_pid)
        self.wake_on = wake_on
        self.fast: list[tuple[float, int, int, float]] = []
        self.sweeps: list[tuple[float, float, int, int, int, int]] = []
        self.cpu_seconds: dict[int, float] = {}  # CPU time each process of the tree had used when last seen
        self._pids: list[int] = [root_pid]
        self._stop = threading.Event()
        self._awake = threading.Event()
        self.woke_at = float("inf")
        self._threads = [threading.Thread(target=t, daemon=True) for t in (self._fast_loop, self._smaps_loop)]

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
                rescan = (newest != last_pid and now - scanned > RESCAN_MIN_INTERVAL) or now - scanned > (
                    RESCAN_MAX_INTERVAL
                )
            else:
                rescan = now - scanned > IDLE_RESCAN_INTERVAL
            if rescan:
                last_pid, scanned = newest, now
                pids = self._scan()
            t = time.time()
            values = [_read_field(f"/proc/{pid}/status", b"RssAnon:") for pid in pids]
            pids = [pid for pid, v in zip(pids, values) if v is not None]
            self._pids = pids
            for pid in pids:
                cpu = _cpu_seconds(pid)
                if cpu is not None:
                    self.cpu_seconds[pid] = cpu
            self.fast.append((t, sum(v for v in values if v is not None), len(pids), sum(self.cpu_seconds.values())))
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
                anon, pss, pss_anon = anon + rollup[0], pss + rollup[1], pss_anon + rollup[2]
                # the walk takes a while and memory may change meanwhile: compare only when the counter held still
                if before == after:
                    disagreement = max(disagreement, abs(rollup[0] - before))
            t1 = time.time()
            self.sweeps.append((t0, t1, anon, pss, disagreement, pss - pss_anon))
            self._stop.wait(max(SMAPS_MIN_INTERVAL, (t1 - t0) * (1 / SMAPS_DUTY - 1)))
