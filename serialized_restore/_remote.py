"""Remote (fsspec) checkpoints: fetched once per node into a local temporary file, removed after the restore.

Upstream Lightning reads a remote checkpoint on every rank: N downloads per node, and no memory mapping. With
``serialized_checkpoint_loading`` on, local rank 0 of each node downloads the file during a first round of turns
(``"fetch checkpoint"``), the other ranks of the node wait for it, every rank restores from the local copy (which
can then be memory-mapped), and local rank 0 removes it when the restore ends, also when it fails.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from typing import Any, Optional

from serialized_restore._readers import local_path

TMPDIR_ENV = "SERIALIZED_RESTORE_TMPDIR"

log = logging.getLogger(__name__)


def is_remote(path: Any) -> bool:
    """Whether ``path`` is a URL that fsspec reads from somewhere other than the local file system."""
    return isinstance(path, (str, os.PathLike)) and local_path(path) is None


def fetch_directory() -> str:
    """Where local copies go: ``SERIALIZED_RESTORE_TMPDIR``, else the system's temporary directory."""
    return os.environ.get(TMPDIR_ENV, "").strip() or tempfile.gettempdir()


def ensure_free_space(directory: str, needed: int) -> None:
    """Raise ``OSError`` naming the directory and the figures if it cannot hold ``needed`` more bytes."""
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise OSError(
            f"Not enough free space in {directory!r} to fetch the checkpoint: it needs {needed / 2**30:.2f} GiB,"
            f" {free / 2**30:.2f} GiB are free. Set {TMPDIR_ENV} to a directory with more space."
        )


class NodeLocalCopy:
    """The local copy of a remote checkpoint, shared by the ranks of one node.

    Its file name is derived from the URL, the job's rendezvous address and the node, so that the ranks of a node
    agree on it without communicating and concurrent jobs do not collide.
    """

    def __init__(self, url: Any, node_rank: int, directory: Optional[str] = None) -> None:
        self.url = str(url)
        self.directory = directory or fetch_directory()
        port = os.environ.get("MASTER_PORT")
        job = f"{os.environ.get('MASTER_ADDR', '')}:{port}" if port else f"pid {os.getpid()}"
        digest = hashlib.sha1(f"{self.url}|{job}|{node_rank}".encode(), usedforsecurity=False).hexdigest()[:16]
        self.path = os.path.join(self.directory, f"serialized-restore-{digest}.ckpt")

    def fetch(self) -> int:
        """(local rank 0, inside its turn) Download the file; return its size. Leaves no partial file behind."""
        from fsspec.core import url_to_fs

        fs, remote = url_to_fs(self.url)
        try:
            size = fs.size(remote)
        except Exception:  # some servers do not report a size; the copy is checked against what arrives
            size = None
        if not os.path.isdir(self.directory):
            raise FileNotFoundError(f"{TMPDIR_ENV}={self.directory!r} is not a directory.")
        if size:
            ensure_free_space(self.directory, int(size))
        partial = self.path + ".partial"
        try:
            fs.get_file(remote, partial)
            written = os.path.getsize(partial)
            if size is not None and written != size:
                raise OSError(f"Fetching {self.url!r} stopped after {written} of {size} bytes.")
            os.replace(partial, self.path)
        except BaseException:
            _remove(partial)
            raise
        log.info(f"Fetched {self.url!r} ({written / 2**20:.1f} MiB) to {self.path!r}")
        return written

    def remove(self) -> None:
        _remove(self.path)
        _remove(self.path + ".partial")


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
