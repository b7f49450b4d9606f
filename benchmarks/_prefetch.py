"""A file's pages in the page cache: how many are resident (``mincore``), dropping them, a timed cold sequential read,
and the benchmark's prefetcher (the ``prefetch`` modes of ``modes.py``), which runs as a process of its own.

Standard library only: the prefetcher is started with ``python -S`` next to a job's ranks, and costs them no import.

    python benchmarks/_prefetch.py OUT_DIR PATH STYLE CHUNK   # one prefetch of PATH, marked in OUT_DIR/markers.jsonl

``STYLE`` ``read``: sequential ``readinto`` calls of ``CHUNK`` bytes into one reused buffer, to the end of the file;
``willneed``: ``posix_fadvise(POSIX_FADV_WILLNEED)`` on each ``CHUNK`` in turn (the kernel reads them into the page
cache; no buffer), then, for the measurement only, ``mincore`` every ``RESIDENT_POLL`` seconds until every page is
resident. Either way the prefetcher holds no more private memory than its one buffer, and it stops on SIGTERM (the
job's first process sends it at the end of the restore window, so that it never outlives the restore).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

PAGE = os.sysconf("SC_PAGE_SIZE")
DROP_TRIES = 5
RESIDENT_POLL = 0.01
RESIDENT_WAIT = 120.0  # seconds a willneed prefetcher waits for the last page before it gives up
_LOW_BIT = bytes(b & 1 for b in range(256))
_PROT_READ, _MAP_SHARED = 1, 1
_MAP_FAILED = ctypes.c_void_p(-1).value


class CacheError(RuntimeError):
    """The page cache could not be put in the state a measurement needs (pages that will not drop, say)."""


def _libc() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    return libc


def resident_bytes(path: os.PathLike | str) -> int:
    """Bytes of the file at ``path`` in the page cache now (``mincore`` of a shared read-only mapping of it, which
    reads nothing), rounded to whole pages and capped at the file's size."""
    libc = _libc()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        address = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vector = (ctypes.c_ubyte * ((size + PAGE - 1) // PAGE))()
            if libc.mincore(ctypes.c_void_p(address), size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            pages = bytes(vector).translate(_LOW_BIT).count(1)
        finally:
            libc.munmap(ctypes.c_void_p(address), size)
    finally:
        os.close(fd)
    return min(pages * PAGE, size)


def drop_cached(path: os.PathLike | str) -> None:
    """Drop the file's pages from the page cache (dirty ones written first: ``os.sync``) and check with ``mincore``
    that none is left; raises :class:`CacheError` otherwise (a process that maps the file keeps its pages)."""
    left = 0
    for attempt in range(DROP_TRIES):
        os.sync()
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        left = resident_bytes(path)
        if left == 0:
            return
        time.sleep(0.05 * (attempt + 1))
    raise CacheError(
        f"{left} bytes of {path} are still in the page cache after {DROP_TRIES} tries of POSIX_FADV_DONTNEED (is a"
        " process mapping it?): a cold measurement cannot be made"
    )


def fill_cache(path: os.PathLike | str, chunk: int = 64 * 2**20) -> None:
    """Read the file into the page cache and check with ``mincore`` that all of it is there (:class:`CacheError`
    otherwise: the machine cannot hold it)."""
    size = os.path.getsize(path)
    for _ in range(3):
        if (resident := resident_bytes(path)) >= size:
            return
        timed_read(path, chunk)
    raise CacheError(f"only {resident} of {size} bytes of {path} stay in the page cache: no warm measurement")


def timed_read(path: os.PathLike | str, chunk: int) -> float:
    """Seconds to read the file sequentially, ``chunk`` bytes at a time into one reused buffer (as ``dd bs=chunk``)."""
    view = memoryview(bytearray(chunk))
    with open(path, "rb", buffering=0) as f:
        began = time.perf_counter()
        while f.readinto(view):
            pass
        return time.perf_counter() - began


def cold_read(path: os.PathLike | str, chunk: int) -> float:
    """The storage's own sequential read of the file: its pages dropped (and checked gone), then ``timed_read``; the
    file is in the page cache afterwards."""
    drop_cached(path)
    return timed_read(path, chunk)


# ---------------------------------------------------------------- the prefetcher process


def _mark(out: Path, event: str, **extra: Any) -> None:
    line = json.dumps({"rank": "prefetch", "event": event, "t": time.time(), "pid": os.getpid(), **extra})
    with open(out / "markers.jsonl", "a") as f:
        f.write(line + "\n")


def prefetch(out: Path, path: str, style: str, chunk: int) -> None:
    """One prefetch of ``path`` (see the module docstring), marked ``prefetch_start`` and ``prefetch_end`` (with how
    it ended: ``eof``, ``resident``, ``stopped``, ``gave up``; the bytes it read or advised; the bytes resident when it
    started and ended)."""
    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))
    size = os.path.getsize(path)
    _mark(out, "prefetch_start", style=style, chunk=chunk, resident=resident_bytes(path))
    done, how = 0, "eof"
    fd = os.open(path, os.O_RDONLY)
    try:
        if style == "read":
            view = memoryview(bytearray(chunk))
            while not stopped and (got := os.readv(fd, [view])):
                done += got
        elif style == "willneed":
            for offset in range(0, size, chunk):
                if stopped:
                    break
                os.posix_fadvise(fd, offset, min(chunk, size - offset), os.POSIX_FADV_WILLNEED)
                done = min(offset + chunk, size)
            deadline, how = time.monotonic() + RESIDENT_WAIT, "resident"
            while not stopped and resident_bytes(path) < size:
                if time.monotonic() > deadline:
                    how = "gave up"
                    break
                time.sleep(RESIDENT_POLL)
        else:
            raise ValueError(f"unknown prefetch style {style!r}")
    finally:
        os.close(fd)
    _mark(out, "prefetch_end", how="stopped" if stopped else how, bytes=done, resident=resident_bytes(path))


if __name__ == "__main__":
    prefetch(Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]))
