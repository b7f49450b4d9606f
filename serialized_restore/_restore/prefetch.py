"""Reading a local checkpoint into the page cache ahead of the restore (``docs/design.md``, *From cold storage*).

A resume after a preemption or on a fresh node finds the checkpoint on storage, not in the page cache. The ranks'
memory-mapped reads then wait on page faults, in the order they copy tensors, much slower than one sequential read of
the file. So local rank 0 of each node reads the file once, sequentially, as soon as the entry point has its
checkpoint path (``trainer.fit(ckpt_path=...)``), while the node's other processes start, the process group forms and
the model is set up; the ranks' mapped copies then find the pages resident. It holds one buffer of
:data:`CHUNK` bytes, reads each byte once, and stops at the end of the file or when the restore ends. It does nothing
where the file is in the page cache already, or would not fit in the memory available to the job."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

from serialized_restore._files import format_bytes, local_path, resident_bytes
from serialized_restore._host import memory_available

CHUNK = 8 * 2**20  # the storage's readahead here; the largest reads a local disk or NFS serves in one request
MOSTLY_RESIDENT = 0.9  # of the file already in the page cache: nothing to gain
MOST_OF_AVAILABLE = 0.5  # the most of the memory available to the job the file may take: else its pages would evict


class Prefetch:
    """One read of a checkpoint file into the page cache, on a daemon thread of local rank 0 (:meth:`start`)."""

    def __init__(self, path: str, size: int, rank: int, log: logging.Logger) -> None:
        self.path, self.size, self.rank, self._log = path, size, rank, log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="serialized-restore-prefetch", daemon=True)

    @classmethod
    def start(cls, checkpoint_path: object, rank: int, log: logging.Logger) -> Prefetch | None:
        """(local rank 0 of each node, as the entry point has its checkpoint path) Start reading ``checkpoint_path``
        into the page cache, unless it is not a local file, is mostly there already, or would not fit; ``None``
        then. ``rank``: the global rank, for the line that says what was read."""
        path = local_path(checkpoint_path)
        if path is None or not os.path.isfile(path):
            return None
        size = os.path.getsize(path)
        resident = resident_bytes(path)
        available = memory_available().bytes
        if resident is None or resident >= MOSTLY_RESIDENT * size:
            return None
        if available is not None and size > MOST_OF_AVAILABLE * available:
            return None
        prefetch = cls(path, size, rank, log)
        prefetch._thread.start()
        return prefetch

    def stop(self) -> None:
        """(the rank that started it, when the restore ends) Stop after the read in flight; wait for it."""
        self._stop.set()
        self._thread.join()

    def _read(self) -> None:
        began, done = time.monotonic(), 0
        with contextlib.suppress(OSError):  # a file that went away: the restore's own read says what happened
            view = memoryview(bytearray(CHUNK))
            with open(self.path, "rb", buffering=0) as f:
                while not self._stop.is_set() and (read := f.readinto(view)):
                    done += read
        how = "stopped after" if self._stop.is_set() and done < self.size else "read"
        self._log.info(
            f"[rank {self.rank}] serialized restore: {how} {format_bytes(done)} of {self.path!r} into the page cache"
            f" ahead of the restore in {time.monotonic() - began:.2f}s"
        )
