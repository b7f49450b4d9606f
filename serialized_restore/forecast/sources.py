"""Where a checkpoint's tensor table is read from: a local file through ``zipfile`` on the file, anything fsspec
opens (``memory://``, ``http://``, ``s3://``) through fsspec's file object, whose seeks are ranged reads, or a stream
that cannot seek. Only the zip's records list and ``data.pkl`` are read, never the tensor data
(:func:`read_table`)."""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from typing import IO, Any

from serialized_restore._files import ZIP_MAGIC, FileKind, head_kind, local_path
from serialized_restore.forecast.table import CannotForecast, TableUnpickler, TensorTable, describe


class _CountingReader(io.RawIOBase):
    """A file object's reads, counted (what the forecast read of the checkpoint)."""

    def __init__(self, inner: IO[bytes]) -> None:
        super().__init__()
        self.inner = inner
        self.count = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        try:
            return bool(self.inner.seekable())
        except (AttributeError, OSError):
            return False

    def read(self, size: int | None = -1) -> bytes:
        data = self.inner.read(-1 if size is None else size)
        self.count += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readline(self, size: int | None = -1) -> bytes:  # a byte at a time: not every file object takes a size
        out = bytearray()
        while size is None or size < 0 or len(out) < size:
            byte = self.read(1)
            out += byte
            if not byte or byte == b"\n":
                break
        return bytes(out)

    def seek(self, offset: int, whence: int = 0) -> int:
        return int(self.inner.seek(offset, whence))

    def tell(self) -> int:
        return int(self.inner.tell())


def _load(unpickler: TableUnpickler, path: str) -> Any:
    try:
        return unpickler.load()
    except (pickle.UnpicklingError, EOFError, OSError, zipfile.BadZipFile):
        raise
    except Exception as err:  # a pickle that the stand-ins cannot follow: say so, do not guess
        raise CannotForecast(f"{path!r}: its data.pkl cannot be described ({type(err).__name__}: {err})") from None


def _from_archive(f: _CountingReader, path: str, size: int, filesystem: str) -> TensorTable:
    try:
        archive = zipfile.ZipFile(f)  # type: ignore[arg-type]  # a binary file object
    except zipfile.BadZipFile as err:
        raise CannotForecast(f"{path!r} starts as a zip archive but its records list cannot be read ({err})") from None
    with archive:
        infos = {info.filename: info for info in archive.infolist()}
        pickles = [name for name in infos if name.endswith("/data.pkl") and name.count("/") == 1]
        if not pickles:
            raise CannotForecast(f"{path!r} is a zip archive without a data.pkl: not a torch checkpoint")
        prefix = pickles[0].rsplit("/", 1)[0]
        with archive.open(pickles[0]) as pkl:
            unpickler = TableUnpickler(pkl)  # type: ignore[arg-type]
            root = _load(unpickler, path)
        parts = describe(root, unpickler)
        missing = []
        for key, ref in unpickler.storages.items():
            info = infos.get(f"{prefix}/data/{key}")
            if info is None or info.file_size != ref.nbytes:
                missing.append(key)
        notes = parts.pop("notes")
        if missing:
            notes.append(
                f"{len(missing)} storages have no record of their size in the archive: the file is incomplete or"
                " damaged, and a resume from it fails"
            )
        return TensorTable(
            path=path,
            checkpoint_bytes=size,
            data_pkl_bytes=infos[pickles[0]].file_size,
            bytes_read=f.count,
            records=len(infos),
            filesystem=filesystem,
            seekable=True,
            missing_records=missing,
            notes=notes,
            **parts,
        )


def _from_stream(f: _CountingReader, head: bytes, path: str, size: int, filesystem: str) -> TensorTable:
    """A file object that cannot seek (``head``, its first bytes, read already): torch writes ``data.pkl`` first,
    uncompressed, and a pickle ends itself, so it is unpickled from the start of the stream; the records list (at
    the end) is not read."""
    header = head + f.read(30 - len(head))
    if len(header) < 30 or header[:4] != ZIP_MAGIC:
        raise CannotForecast(f"{path!r}: the stream ended inside the first zip header")
    method, name_length, extra_length = struct.unpack("<8xH16xHH", header)
    name = f.read(name_length).decode("utf-8", "replace")
    f.read(extra_length)
    if not name.endswith("/data.pkl") or method != 0:
        raise CannotForecast(
            f"{path!r}: the file system cannot seek, and the archive does not start with an uncompressed data.pkl"
            " as torch writes it: forecasting it would mean reading the whole file"
        )
    start = f.count
    unpickler = TableUnpickler(f)  # type: ignore[arg-type]
    root = _load(unpickler, path)
    parts = describe(root, unpickler)
    notes = parts.pop("notes")
    notes.append(
        f"the file system ({filesystem}) cannot seek: data.pkl was read from the start of the stream (torch writes it"
        " first); the archive's records list, at its end, was not read, so the storages were not checked against it"
    )
    return TensorTable(
        path=path,
        checkpoint_bytes=size,
        data_pkl_bytes=f.count - start,
        bytes_read=f.count,
        records=None,
        filesystem=filesystem,
        seekable=False,
        notes=notes,
        **parts,
    )


def _check_head(path: str, head: bytes) -> None:
    kind = head_kind(head)
    if kind is FileKind.ZIP:
        return
    if kind is FileKind.LEGACY:
        raise CannotForecast(
            f"{path!r} is a legacy (pre-1.6, non-zip) torch checkpoint (saved with"
            " `_use_new_zipfile_serialization=False`): its tensor table cannot be read without reading the whole"
            " file, so it cannot be forecast. Re-save it in the zip format (`torch.save(torch.load(path), path)`) to"
            " forecast it; note that the serialized restore reads a legacy file eagerly, as upstream does."
        )
    raise CannotForecast(f"{path!r} is not a torch checkpoint: neither a zip archive nor a pickle (starts {head!r})")


def read_table(path: str) -> TensorTable:
    """The tensor table of the checkpoint at ``path`` (a local path or an fsspec URL), reading no tensor data;
    :class:`CannotForecast` if it cannot be forecast."""
    path = os.fspath(path)
    try:
        local = local_path(path)
        return _local_table(path, local) if local is not None else _remote_table(path)
    except FileNotFoundError:
        raise CannotForecast(f"{path!r} does not exist") from None
    except (OSError, ImportError, ValueError) as err:  # ImportError: an fsspec protocol's package is missing
        raise CannotForecast(f"{path!r} cannot be read: {err}") from None
    except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, struct.error) as err:
        raise CannotForecast(f"{path!r} is truncated or damaged: its data.pkl cannot be read ({err})") from None


def _local_table(path: str, local: str) -> TensorTable:
    if os.path.isdir(local):
        raise CannotForecast(
            f"{path!r} is a directory: a sharded (distributed) checkpoint, which each rank reads shard by shard"
            " already; there is nothing to forecast"
        )
    with open(local, "rb") as raw:
        size = os.fstat(raw.fileno()).st_size
        _check_head(path, raw.read(4))
        raw.seek(0)
        return _from_archive(_CountingReader(raw), path, size, "local")


def _remote_table(path: str) -> TensorTable:
    import fsspec

    fs, fs_path = fsspec.core.url_to_fs(path)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if not fs.exists(fs_path):
        raise CannotForecast(f"{path!r} does not exist, or cannot be reached")
    if fs.isdir(fs_path):
        raise CannotForecast(f"{path!r} is a directory: a sharded checkpoint; there is nothing to forecast")
    size = int(fs.size(fs_path))
    try:
        handle = fs.open(fs_path, "rb", block_size=2**16)  # small ranged reads: only data.pkl and the records list
    except TypeError:
        handle = fs.open(fs_path, "rb")
    try:
        with handle as raw:
            return _table_of_file(_CountingReader(raw), path, size, protocol)
    except ValueError as err:  # fsspec's HTTP file, where the server ignores ranged requests
        if "range" not in str(err):
            raise
    with fs.open(fs_path, "rb", block_size=0) as raw:  # a stream, which cannot seek
        table = _table_of_file(_CountingReader(raw), path, size, protocol)
    table.notes.insert(0, "the server does not support ranged requests (HTTP Range): the file was read as a stream")
    return table


def _table_of_file(counted: _CountingReader, path: str, size: int, protocol: str) -> TensorTable:
    head = counted.read(4)
    _check_head(path, head)
    try:
        seekable = counted.seekable()
        if seekable:
            counted.seek(0)
    except (ValueError, OSError):  # a file object that says it can seek and cannot (fsspec's HTTP stream)
        seekable = False
    if not seekable:
        return _from_stream(counted, head, path, size, protocol)
    counted.count = 0
    return _from_archive(counted, path, size, protocol)
