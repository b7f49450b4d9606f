"""Remote (fsspec) checkpoints: fetched once per node into a private temporary directory, removed after the restore
(``docs/security.md``). Upstream downloads on every rank instead."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tempfile
from typing import Any

from serialized_restore._files import format_bytes
from serialized_restore.settings import TMPDIR_SETTING

PREFIX = "serialized-restore-"
FILE_NAME = "checkpoint.ckpt"

log = logging.getLogger(__name__)


def check_fetch_directory(directory: str) -> None:
    """Raise, naming the directory and the setting, unless only we can write to it (or others with the sticky bit)."""
    where = f"{directory!r} ({TMPDIR_SETTING}, or the system's temporary directory when it is not set)"
    try:
        mode = os.stat(directory).st_mode
    except FileNotFoundError:
        mode = None
    if mode is None or not stat.S_ISDIR(mode):
        error = FileNotFoundError if mode is None else NotADirectoryError
        problem = "does not exist" if mode is None else "is not a directory"
        raise error(f"The directory for local copies of remote checkpoints, {where}, {problem}.")
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        raise PermissionError(
            f"Refusing to download the checkpoint into {where}: it is writable by other users (mode"
            f" {stat.S_IMODE(mode):04o}) without the sticky bit, so another user could rename or replace the copy."
            f" Set {TMPDIR_SETTING} to a directory that only you can write to (`mkdir -m 700 DIR`), or set the sticky"
            " bit on this one (`chmod +t DIR`)."
        )


def ensure_free_space(directory: str, needed: int) -> None:
    """Raise ``OSError`` naming the directory and the figures if it cannot hold ``needed`` more bytes."""
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise OSError(
            f"Not enough free space in {directory!r} to fetch the checkpoint: it needs {needed / 2**30:.2f} GiB,"
            f" {free / 2**30:.2f} GiB are free. Set {TMPDIR_SETTING} to a directory with more space."
        )


class NodeLocalCopy:
    """The local copy of a remote checkpoint, shared by the ranks of one node: local rank 0 fetches and removes it."""

    def __init__(self, url: Any, directory: str | None = None, logger: logging.Logger = log) -> None:
        self.url = str(url)
        self._log = logger
        self.directory = os.path.abspath(directory or tempfile.gettempdir())
        self.path: str | None = None
        self._size = 0
        self._private: str | None = None  # the directory this process created: the only thing ever removed

    def fetch(self) -> str:
        """(local rank 0, inside its turn) Download into a new private directory; the node's decision as JSON."""
        from fsspec.core import url_to_fs

        check_fetch_directory(self.directory)
        fs, remote = url_to_fs(self.url)
        try:
            size = fs.size(remote)
        except Exception:  # some servers do not report a size; the copy is checked against what arrives
            size = None
        if size:
            ensure_free_space(self.directory, int(size))
        self._private = tempfile.mkdtemp(prefix=PREFIX, dir=self.directory)
        path = os.path.join(self._private, FILE_NAME)
        try:
            os.chmod(self._private, 0o700)  # as mkdtemp creates it, whatever the umask
            # created here, private, before a byte arrives; fsspec then writes into it
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
            os.chmod(path, 0o600)
            fs.get_file(remote, path)
            written = os.lstat(path).st_size
            if size is not None and written != size:
                raise OSError(f"Fetching {self.url!r} stopped after {written} of {size} bytes.")
        except BaseException:
            self.remove()
            raise
        self._log.info(f"serialized restore: fetched {self.url!r} ({format_bytes(written)}) to {path!r}")
        return json.dumps({"path": path, "size": written})

    def adopt(self, decision: str) -> None:
        """(every rank of the node) Take the path from local rank 0's decision, once it is checked."""
        check_fetch_directory(self.directory)
        try:
            data = json.loads(decision)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{self._refusal(decision)}: it is not JSON ({err}).") from None
        if not (
            isinstance(data, dict)
            and set(data) == {"path", "size"}
            and isinstance(data["path"], str)
            and type(data["size"]) is int
        ):
            raise ValueError(f'{self._refusal(decision)}: it is not {{"path": <str>, "size": <int>}}.')
        self._check(data["path"], data["size"])
        self.path, self._size = data["path"], data["size"]

    def checked_path(self) -> str:
        """(every rank, before each read) The copy's path, once its directory is checked to be still the private one."""
        assert self.path is not None, "adopt() first"
        self._check(self.path, self._size)
        return self.path

    def remove(self) -> None:
        """(local rank 0) Remove the private directory and everything in it, if this process created it."""
        private, self._private = self._private, None
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)

    def _check(self, path: str, size: int) -> None:
        """Raise ``PermissionError`` unless ``path`` is our private copy of ``size`` bytes."""
        parent = os.path.dirname(path)
        if not (
            "\0" not in path
            and os.path.normpath(path) == path
            and os.path.dirname(parent) == self.directory
            and os.path.basename(parent).startswith(PREFIX)
            and os.path.basename(path) == FILE_NAME
        ):
            raise PermissionError(
                f"{self._refusal(path)}: it is not a file in a directory {PREFIX}* inside {self.directory!r}."
            )
        try:
            directory, file = os.lstat(parent), os.lstat(path)
        except OSError as err:
            raise PermissionError(f"{self._refusal(path)}: {err}.") from None
        uid = os.geteuid()
        directory_mode = stat.S_IMODE(directory.st_mode)
        checks = (
            ("its directory is not a directory (a symbolic link?)", not stat.S_ISDIR(directory.st_mode)),
            (f"its directory is owned by uid {directory.st_uid}, not {uid}", directory.st_uid != uid),
            (f"its directory has mode {directory_mode:04o}, not 0700", directory_mode != 0o700),
            ("it is not a regular file", not stat.S_ISREG(file.st_mode)),
            (f"it is owned by uid {file.st_uid}, not {uid}", file.st_uid != uid),
            (f"it has mode {stat.S_IMODE(file.st_mode):04o}", stat.S_IMODE(file.st_mode) & 0o077),
            (f"it has {file.st_size} bytes, not {size}", file.st_size != size),
        )
        problems = [what for what, bad in checks if bad]
        if problems:
            raise PermissionError(f"{self._refusal(path)}: {'; '.join(problems)}.")

    def _refusal(self, what: str) -> str:
        shown = what if len(what) <= 300 else what[:300] + "..."
        return (
            f"Refusing {shown!r} as the local copy of {self.url!r} (local rank 0 announces it through the job's store,"
            " which is not authenticated: any process that can reach the store can write to it)"
        )
