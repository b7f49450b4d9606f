"""A file's pages in the page cache, for measurements that need them there or gone: dropping them (checked gone with
the package's own ``mincore`` count), filling the cache, and a timed cold sequential read (the storage's rate)."""

from __future__ import annotations

import os
import time

from serialized_restore._files import resident_bytes as _resident

DROP_TRIES = 5


class CacheError(RuntimeError):
    """The page cache could not be put in the state a measurement needs (pages that will not drop, say)."""


def resident_bytes(path: os.PathLike | str) -> int:
    """Bytes of the file in the page cache now (the package's ``mincore`` count, which the prefetch decides by)."""
    resident = _resident(os.fspath(path))
    if resident is None:
        raise CacheError(f"the page cache cannot be inspected here (no mincore for {path}): no cache measurement")
    return resident


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
