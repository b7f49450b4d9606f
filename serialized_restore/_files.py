"""Checkpoint files without torch: where a path points (local or remote), what kind of file it is, what is wrong with
one that failed to load, how much of it the page cache holds, and byte counts as people read them. Used by the
readers, the prefetch, the failure records and the forecast alike, so that each of these is decided in one place."""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import functools
import os
import zipfile
from typing import Any

import fsspec

ZIP_MAGIC = b"PK\x03\x04"
PICKLE_MAGIC = b"\x80"  # a pickle's PROTO opcode: torch's legacy (pre-1.6) format starts with one

# small archive members worth a checksum test: the pickle and torch's format records
_CHECKED_MEMBERS = ("data.pkl", ".format_version", "version", "byteorder", ".storage_alignment")
_CHECKED_MEMBER_BYTES = 64 * 2**20


def local_path(path: Any) -> str | None:
    """The local path (fsspec's protocol ``file``, as for Lightning), or ``None`` for a URL or a file object."""
    if not isinstance(path, (str, os.PathLike)) or fsspec.utils.get_protocol(os.fspath(path)) != "file":
        return None
    return os.fspath(path).removeprefix("file://")


def is_remote(path: Any) -> bool:
    """Whether ``path`` is a URL that fsspec reads from somewhere other than the local file system."""
    return isinstance(path, (str, os.PathLike)) and local_path(path) is None


class FileKind(enum.Enum):
    """What a checkpoint path holds, from its first bytes (and, for a zip archive, whether its end record is there)."""

    NOT_LOCAL = "not a local path"
    MISSING = "nothing there"
    NOT_A_FILE = "not a regular file"
    UNREADABLE = "cannot be read"
    ZIP = "torch's zip format"
    TRUNCATED_ZIP = "a zip archive without its end"
    LEGACY = "torch's legacy (pickle) format"
    OTHER = "neither a zip archive nor a pickle"


def head_kind(head: bytes) -> FileKind:
    """The kind of a file from its first bytes alone: ``ZIP`` (not checked for its end), ``LEGACY`` or ``OTHER``."""
    if head.startswith(ZIP_MAGIC):
        return FileKind.ZIP
    return FileKind.LEGACY if head.startswith(PICKLE_MAGIC) else FileKind.OTHER


def file_kind(path: Any) -> tuple[FileKind, str]:
    """The kind of the file at ``path`` and, for ``UNREADABLE``, the system's reason; a few KiB read at most (the
    first bytes, and a zip archive's end record)."""
    local = local_path(path)
    if local is None:
        return FileKind.NOT_LOCAL, ""
    if not os.path.isfile(local):
        return (FileKind.NOT_A_FILE if os.path.lexists(local) else FileKind.MISSING), ""
    try:
        with open(local, "rb") as f:
            head = f.read(4)
    except OSError as err:
        return FileKind.UNREADABLE, str(err.strerror)
    kind = head_kind(head)
    if kind is FileKind.ZIP and not zipfile.is_zipfile(local):
        return FileKind.TRUNCATED_ZIP, ""
    return kind, ""


def unmappable_reason(path: Any) -> str | None:
    """Why ``path`` cannot be memory-mapped, or ``None`` if it can: it must be a local file in torch's zip format.
    ``""`` where no checkpoint is there (nothing, a file neither zip nor pickle, or a zip archive without its end, as
    a cut-short save leaves it): upstream's own error says why, raised by the first reader in its turn, and the
    package's error names it on every other rank."""
    kind, why = file_kind(path)
    if kind is FileKind.ZIP:
        return None
    if kind is FileKind.NOT_LOCAL:
        return f"{path!r} is not a local path"
    if kind is FileKind.NOT_A_FILE:
        return f"{path!r} is not a file"
    if kind is FileKind.UNREADABLE:
        return f"{path!r} cannot be read ({why})"
    if kind is FileKind.LEGACY:
        return f"{path!r} is not in torch's zip format (saved with `_use_new_zipfile_serialization=False`?)"
    return ""


def explain_failure(checkpoint_path: str, err: BaseException) -> str | None:
    """What a failed load of ``checkpoint_path`` most likely means, or ``None`` when the file looks sound."""
    problem = file_problem(checkpoint_path)
    if problem is not None:
        if "weights_only" in str(err):
            problem += " Loading it with `weights_only=False` would not help: it is damaged or not a checkpoint."
        return problem
    if isinstance(err, KeyError) and err.args in (("pytorch-lightning_version",), ("state_dict",)):
        return (
            f"{checkpoint_path!r} is not a Lightning checkpoint (it has no {err.args[0]!r} key): it looks like a"
            " bare `state_dict` saved with `torch.save(model.state_dict(), path)`. Load it into the model with"
            " `model.load_state_dict(torch.load(path))` before calling the Trainer, instead of passing it as"
            " `ckpt_path`."
        )
    return None


def file_problem(path: str) -> str | None:
    """What is wrong with the file at ``path`` itself, or ``None`` if nothing cheap to see is (or it is remote)."""
    local = local_path(path)
    if local is None:
        return None
    if not os.path.lexists(local):
        where = "" if os.path.isabs(local) else f" (relative to the working directory {os.getcwd()!r})"
        return f"{path!r} does not exist{where}."
    if os.path.isdir(local):
        files = sorted(name for name in os.listdir(local) if name.endswith(".ckpt"))[:3]
        inside = f" It contains {', '.join(map(repr, files))}." if files else ""
        return f"{path!r} is a directory, not a checkpoint file: pass the path of a checkpoint file.{inside}"
    try:
        size = os.path.getsize(local)
        with open(local, "rb") as f:
            head = f.read(16)
    except OSError as err:
        return f"{path!r} cannot be read: {err}."
    if size == 0:
        return f"{path!r} is empty (0 bytes): the save that wrote it was probably interrupted, or the disk was full."
    kind = head_kind(head)
    if kind is FileKind.ZIP:
        if not zipfile.is_zipfile(local):
            return (
                f"{path!r} is truncated or damaged: it starts as a PyTorch checkpoint (a zip archive) but the end of"
                f" the archive is missing ({size} bytes). The save or the copy that wrote it was probably cut short."
            )
        return _archive_problem(path, local)
    if kind is FileKind.LEGACY:
        return None  # torch's legacy (pre-1.6) format, which torch.load reads
    return (
        f"{path!r} is not a PyTorch checkpoint: it is neither a zip archive nor a pickle (it starts with"
        f" {head[:12]!r})."
    )


def _archive_problem(path: str, local: str) -> str | None:
    try:
        with zipfile.ZipFile(local) as archive:
            for info in archive.infolist():
                if info.filename.endswith(_CHECKED_MEMBERS) and info.file_size <= _CHECKED_MEMBER_BYTES:
                    with archive.open(info) as member:
                        while member.read(2**20):
                            pass
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        return f"{path!r} is corrupted: {err}."
    return None


def format_bytes(count: int) -> str:
    """``1.4 GiB``, ``35.2 KiB``, ``12 B``: a unit that fits, at every checkpoint size."""
    value = float(count)
    for unit in ("B", "KiB", "MiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


_PROT_READ, _MAP_SHARED = 1, 1
_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore's byte per page: its lowest bit says resident


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    return libc


def resident_bytes(path: str) -> int | None:
    """Bytes of the local file at ``path`` in the page cache now, in whole pages up to its size (``mincore`` over a
    read-only mapping of it, which reads nothing); ``None`` where the system cannot say (no ``mincore``, a file that
    cannot be mapped)."""
    try:
        libc, page = _libc(), os.sysconf("SC_PAGE_SIZE")
        fd = os.open(path, os.O_RDONLY)
    except (OSError, AttributeError, ValueError):
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        address = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vector = (ctypes.c_ubyte * ((size + page - 1) // page))()
            if libc.mincore(ctypes.c_void_p(address), size, vector) != 0:
                return None
            return min(bytes(vector).translate(_LOW_BIT).count(1) * page, size)
        finally:
            libc.munmap(ctypes.c_void_p(address), size)
    finally:
        os.close(fd)
