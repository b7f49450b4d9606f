"""``serialized-restore plan``: before a resume, how much host memory it adds per node, upstream and serialized, from
the checkpoint's tensor table alone (no tensor data is read).

Reading the table
-----------------
A torch zip checkpoint holds ``<archive>/data.pkl`` (the pickled dict, tensors as references to storages) and one
record per storage (``<archive>/data/<key>``). Only the zip's records list and ``data.pkl`` are read: a local file
through ``zipfile`` on the file, anything fsspec opens (``memory://``, ``http://``, ``s3://``) through fsspec's file
object, whose seeks are ranged reads. ``data.pkl`` is unpickled by a restricted unpickler: ``persistent_load`` records
each storage (key, storage type -> bytes per element, element count, saved device) without reading it; torch's
rebuild functions make stand-ins that know their storage; containers (``dict``, ``OrderedDict``, lists, sets) are
real; dtypes, devices and ``torch.Size`` are small stand-ins; any other global is recorded as an opaque object (never
imported, never called) that keeps what pickle gave it, so that storages under it are still found. Each storage is
counted once, under the first part it is found in: ``state_dict`` (the weights, W), ``optimizer_states`` (O, split
by state key: ``exp_avg``, ``exp_avg_sq``, ``step``, ...), or the rest (R: ``lr_schedulers``, ``callbacks``,
``loops``, ``hyper_parameters``, ...). A legacy (pre-1.6, non-zip) checkpoint is not planned: exit code 2.

The model (per node; :func:`predict`)
-------------------------------------
The measure is the benchmark's (``docs/benchmarks.md``, *Definitions*): the node's peak *anonymous* (private)
memory inside the restore window, minus the peak of the same job started without a checkpoint (``raw``); for
``fit`` also ``net``: the peak minus the larger of that job's peak and its memory at the window's end plus the
optimizer state the job keeps (every training job holds that state from its first step on). The README reports
``net`` for fit, ``raw`` for validate. The file's pages in the page cache are not anonymous memory and are left out,
in every mode (each reads the file through the page cache: S once per node, reclaimable).

Inputs: N local ranks per node (``--devices``), M nodes, S the file's bytes, W, O, R as above (D = W + O + R),
c the unpickled containers per rank (estimated: 4 x ``data.pkl``'s bytes + 1 KiB per tensor), and two properties of
the job, not of the checkpoint:

- K, the optimizer state a rank keeps after the restore: DDP on CPU, all of O (Adam's ``exp_avg``, ``exp_avg_sq``,
  ``step``); FSDP, its shard O / (N x M); validate, nothing. On GPUs the state moves to GPU memory and the host
  keeps only the ``step`` tensors.
- T, the job's own transient at its peak per rank (the baseline's peak minus its memory at the window's end, per
  rank): DDP on CPU, W (DDP's setup copies the weights: measured for fit, 0.445 GiB per rank at W = 0.47 GiB;
  validate's setup broadcasts the weights too, not measured apart); FSDP and GPUs, 0 (not modeled: FSDP restores
  after its setup; on a GPU DDP's copies are on the device).

Both are arguments of :func:`predict` (``kept_per_rank``, ``setup_transient_per_rank``) for a check against the
benchmark's measured baseline. Then, per node, with ``held`` the checkpoint's bytes in private memory at the
restore's peak, and the job's peak without a checkpoint N x T above its memory outside that transient:

1. Upstream, DDP: every rank holds the whole dict (D + c) from before ``strategy.setup`` until ``resume_end``, so
   also at the job's own peak (DDP's setup); for fit the optimizers adopt the dict's own state tensors (K of it stays
   afterwards, no copy). held = N x (D + c); raw = held; net = raw - N x max(0, K - T).
2. Serialized, DDP, memory-mapped (the default reader for a local zip file, and for a remote one after its per-node
   local copy): in its turn a rank maps the file and copies the weights into its model (no new private memory),
   then drops everything but the containers; for fit, after ``strategy.setup``, every rank copies out of the mapping
   the state its optimizers keep (K). Private memory per rank: the containers plus a fixed allowance F = 4 MiB (the
   benchmark measured 2.3 to 7.2 MiB per rank above the baseline at 8M to 126M parameters: the turn's thread and
   store client, allocator slack). held = N x (K + c + F); raw = max(N x (c + F), held - N x T); net = raw -
   N x max(0, K - T) = N x (c + F). ``k`` changes nothing here: a turn allocates only containers.
3. Serialized, DDP, read eagerly (``SERIALIZED_RESTORE_READER=eager``, a custom ``CheckpointIO``): k ranks at a
   time read the whole file into private memory in their turn (stage 1, before DDP's setup); for fit the optimizer
   state is dropped and read again in stage 2, in turns, while the ranks done keep K. Stage 1 holds k x D + N x
   (c + F); stage 2, at the last turn, (N - k) x K + k x D + N x (c + F). Neither coincides with the job's own
   peak: raw = max(N x (c + F), max of the stages - N x T); net = raw - N x max(0, K - T).
4. Upstream, FSDP (a full checkpoint; Lightning's ``_lazy_load``): the weights are read tensor by tensor; then every
   rank materializes the optimizer state and the rest (also for validate) and keeps them until ``resume_end``; for
   fit ``optim_state_dict_to_load`` makes each rank its shard (K, a copy). held = N x (O + R + c + K); raw = held -
   N x T; net = raw - N x max(0, K - T). Rougher than DDP's: the C heap can keep FSDP's per-unit transients
   (small units), and the FSDP baseline peaks while its model is still unsharded, before the restore.
5. Serialized, FSDP: every rank maps the file, loads the weights one FSDP unit at a time (at most one unit in
   flight, trimmed after each; counted as U, the largest weight tensor, a lower bound of a unit), then copies only
   its shard of the optimizer state (K). held = N x (c + F + max(U, K)); raw = held - N x T; net = raw - N x
   max(0, K - T). A local file only: a remote one is restored by FSDP's own code, as in step 4.

Against docs/benchmarks.md (an MLP with Adam, 8M to 126M parameters, N = 1, 2, 4, on CPU), steps 1 and 2 are
within 0.2 x S of every figure measured, raw and net (e.g. 126M, N = 4, fit: upstream raw 4.00 / net 2.67 x S
predicted, 4.04 / 2.63 measured; serialized raw 1.34 / net 0.01 predicted, 1.42 / 0.01 measured; validate: upstream
4.00 predicted, 3.83 measured); step 3 has not been measured; step 4 is 0.4 to 1.25 x the measured figure and step 5
within 0.2 x S of it.

What it does not model: the job's own memory (the model, gradients, data loaders: the baseline) and its first
training step, which allocates gradients and can peak above the restore in either mode; tensors a user's hook keeps;
``ZeroRedundancyOptimizer`` or fairscale's ``OSS`` (stage 2 in turns, each rank keeping O / N); Fabric's ``load``.
Nothing of this has been measured on a GPU.

Fits: the entry's measure (net for fit, raw for validate) against the memory available to the job: the cgroup limit
of this process's cgroup where one is set (v2 ``memory.max``, the smallest over its ancestors; v1
``memory.limit_in_bytes``), else the host's ``MemAvailable`` (``/proc/meminfo``). The job's own memory must fit in
what is left.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import io
import json
import os
import pickle
import struct
import sys
import textwrap
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, astuple, dataclass, field
from typing import IO, Any, Callable

from serialized_restore._memory import format_bytes

HELP = "say before resuming how much host memory a resume adds per node, upstream and serialized"
DESCRIPTION = """\
Read a checkpoint's tensor table (its zip records and data.pkl, never the tensor data; local paths and fsspec URLs)
and predict, per node, the host memory a resume adds above the same job started without a checkpoint: with upstream
Lightning and with serialized_checkpoint_loading=True. For fit the figure is net of the optimizer state the job
keeps (the raw peak beside it); for validate the raw peak. The model is in serialized_restore/_preflight.py's
docstring. Exit code 2: the checkpoint cannot be planned (legacy format, not a checkpoint, not found)."""

CONTAINER_BYTES_PER_PICKLE_BYTE = 4
CONTAINER_BYTES_PER_TENSOR = 1024
SERIALIZED_FIXED_PER_RANK = 4 * 2**20
"""F: what a serialized restore's rank adds besides its containers (the benchmark: 2.3 to 7.2 MiB per rank)."""

_ZIP_MAGIC = b"PK\x03\x04"
_ITEMSIZE = {
    "DoubleStorage": 8,
    "FloatStorage": 4,
    "HalfStorage": 2,
    "BFloat16Storage": 2,
    "LongStorage": 8,
    "IntStorage": 4,
    "ShortStorage": 2,
    "CharStorage": 1,
    "ByteStorage": 1,
    "BoolStorage": 1,
    "ComplexDoubleStorage": 16,
    "ComplexFloatStorage": 8,
    "QInt8Storage": 1,
    "QUInt8Storage": 1,
    "QInt32Storage": 4,
    "QUInt4x2Storage": 1,
    "QUInt2x4Storage": 1,
    "UntypedStorage": 1,  # numel is bytes
}
_DTYPES = frozenset(
    "float64 double float32 float float16 half bfloat16 int64 long int32 int int16 short int8 uint8 uint16 uint32"
    " uint64 bool complex128 cdouble complex64 cfloat complex32 chalf qint8 quint8 qint32 quint4x2 quint2x4"
    " float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz float8_e8m0fnu float4_e2m1fn_x2 bits8 bits16"
    " bits1x8 bits2x4 bits4x2".split()
)


class NotPlannable(Exception):
    """The checkpoint cannot be planned (legacy format, not a checkpoint, not found): the message says why."""


# --- reading the table -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StorageRef:
    """One storage of the file, as ``persistent_load`` describes it; its data is never read."""

    key: str
    storage_type: str
    numel: int
    location: str
    nbytes: int


@dataclass(frozen=True)
class _StorageType:
    name: str
    itemsize: int


@dataclass
class TensorStub:
    """A tensor as its rebuild call describes it: its storage (``None`` for a tensor without one), size, dtype."""

    storage: StorageRef | None
    size: tuple[Any, ...] = ()
    dtype: str | None = None
    parameter: bool = False


@dataclass(frozen=True)
class _Token:
    """A dtype, device, layout or tensor type: its name only."""

    kind: str
    name: str


class OpaqueObject:
    """An object of a global the planner does not import: it keeps whatever pickle gave it (arguments, items,
    state), so that the storages under it are still found. Its class is made per global (``global_name``)."""

    global_name = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> OpaqueObject:
        obj = super().__new__(cls)
        obj.__dict__.update(_args=args, _kwargs=kwargs, _items={}, _list=[], _state=None)
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.__dict__["_state"] = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__["_items"][key] = value

    def append(self, value: Any) -> None:
        self.__dict__["_list"].append(value)

    def extend(self, values: Any) -> None:
        self.__dict__["_list"].extend(values)

    def __repr__(self) -> str:
        return f"<opaque {self.global_name}>"

    def children(self) -> list[Any]:
        d = self.__dict__
        return [d["_args"], d["_kwargs"], d["_items"], d["_list"], d["_state"]]


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> TensorStub:
    return TensorStub(storage if isinstance(storage, StorageRef) else None, tuple(size or ()))


def _rebuild_tensor_v3(
    storage: Any, offset: Any, size: Any, stride: Any, grad: Any, hooks: Any, dtype: Any, *rest: Any
) -> TensorStub:
    stub = _rebuild_tensor(storage, offset, size, stride)
    stub.dtype = dtype.name if isinstance(dtype, _Token) else None
    return stub


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    if isinstance(data, TensorStub):
        data.parameter = True
    return data


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    return func(*args) if callable(func) else OpaqueObject(func, new_type, args, state)


def _rebuild_meta_tensor_no_storage(dtype: Any, size: Any, *rest: Any) -> TensorStub:
    return TensorStub(None, tuple(size or ()), dtype.name if isinstance(dtype, _Token) else None)


def _encode(text: Any, encoding: str = "utf-8", *rest: Any) -> Any:
    """``_codecs.encode``, as protocol-2 pickles write ``bytes``: only text, only to latin-1 or UTF-8."""
    if isinstance(text, str) and encoding in ("latin1", "latin-1", "utf-8", "utf8"):
        return text.encode(encoding)
    return OpaqueObject(text, encoding)


_CALLS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "list"): list,
    ("builtins", "dict"): dict,
    ("builtins", "tuple"): tuple,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): lambda *args: bytearray(args[0]) if args and isinstance(args[0], bytes) else b"",
    ("builtins", "slice"): slice,
    ("_codecs", "encode"): _encode,
    ("torch", "Size"): tuple,
    ("torch", "device"): lambda *args: _Token("device", ":".join(str(a) for a in args)),
    ("torch.serialization", "_get_layout"): lambda name: _Token("layout", str(name)),
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._utils", "_rebuild_meta_tensor_no_storage"): _rebuild_meta_tensor_no_storage,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch._tensor", "_rebuild_from_type"): lambda func, new_type, args, state: _rebuild_from_type_v2(
        func, new_type, args, state
    ),
}
_TYPES = {("torch", "Tensor"), ("torch._tensor", "Tensor"), ("torch.nn.parameter", "Parameter")}


class _TableUnpickler(pickle.Unpickler):
    """Unpickles ``data.pkl`` without reading a storage or executing a global that is not allowed (module doc)."""

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file, encoding="utf-8")
        self.storages: dict[str, StorageRef] = {}
        self.opaque: dict[str, type] = {}

    def find_class(self, module: str, name: str) -> Any:
        # protocol-2 pickles name Python 2's modules (``__builtin__``): map them as pickle's ``fix_imports`` does
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) in _CALLS:
            return _CALLS[(module, name)]
        if module in ("torch", "torch.storage", "torch.cuda") and name in _ITEMSIZE:
            return _StorageType(name, _ITEMSIZE[name])
        if module == "torch" and name in _DTYPES:
            return _Token("dtype", name)
        if (module, name) in _TYPES:
            return _Token("type", f"{module}.{name}")
        qualified = f"{module}.{name}"
        if qualified not in self.opaque:
            self.opaque[qualified] = type(name, (OpaqueObject,), {"global_name": qualified})
        return self.opaque[qualified]

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r:.80}")
        _, storage_type, key, location, numel = pid
        if not isinstance(storage_type, _StorageType) or not isinstance(numel, int):
            raise pickle.UnpicklingError(f"unsupported storage record {pid!r:.80}")
        key = str(key)
        if key not in self.storages:
            self.storages[key] = StorageRef(key, storage_type.name, numel, str(location), numel * storage_type.itemsize)
        return self.storages[key]


@dataclass
class TensorTable:
    """What the planner knows of a checkpoint: the bytes of its storages by part, and how it was read
    (``bytes_read``: what the reader asked the file for; a remote file system fetches whole blocks of up to 64 KiB,
    or a stream's chunks)."""

    path: str
    checkpoint_bytes: int
    data_pkl_bytes: int
    bytes_read: int
    records: int | None
    storages: int
    tensors: int
    weights_bytes: int
    optimizer_bytes: int
    optimizer_by_key: dict[str, int]
    optimizers: list[dict[str, int]]
    rest_bytes: int
    rest_by_key: dict[str, int]
    largest_weight_bytes: int
    locations: dict[str, int]
    filesystem: str
    seekable: bool
    opaque_globals: list[str] = field(default_factory=list)
    missing_records: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def tensor_bytes(self) -> int:
        """D: the bytes of every storage in the file."""
        return self.weights_bytes + self.optimizer_bytes + self.rest_bytes

    @property
    def optimizer_step_bytes(self) -> int:
        return self.optimizer_by_key.get("step", 0)

    @property
    def containers_per_rank(self) -> int:
        """c: an estimate of the unpickled dict without its tensor data, per rank."""
        return CONTAINER_BYTES_PER_PICKLE_BYTE * self.data_pkl_bytes + CONTAINER_BYTES_PER_TENSOR * self.tensors


def _walk(obj: Any, seen: set[int]) -> Iterator[TensorStub]:
    """Every tensor stand-in under ``obj`` (containers and opaque objects), each container visited once."""
    stack = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, TensorStub):
            yield value
            continue
        if isinstance(value, (str, bytes, int, float, bool, type(None), _Token, StorageRef)):
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, dict):
            items = [item for pair in value.items() for item in pair]
        elif isinstance(value, (list, tuple, set, frozenset)):
            items = list(value)
        elif isinstance(value, OpaqueObject):
            items = value.children()
        else:
            continue
        stack.extend(reversed(items))


class _Tally:
    """Counts each storage once, under the first part it is found in."""

    def __init__(self) -> None:
        self.counted: set[str] = set()
        self.tensors = 0
        self.locations: dict[str, int] = {}

    def add(self, obj: Any, seen: set[int]) -> tuple[int, int]:
        """The bytes of the storages under ``obj`` not counted before, and the largest of them."""
        total = largest = 0
        for stub in _walk(obj, seen):
            self.tensors += 1
            ref = stub.storage
            if ref is None or ref.key in self.counted:
                continue
            self.counted.add(ref.key)
            self.locations[ref.location] = self.locations.get(ref.location, 0) + ref.nbytes
            total += ref.nbytes
            largest = max(largest, ref.nbytes)
        return total, largest


def _describe(root: Any, unpickler: _TableUnpickler) -> dict[str, Any]:
    """The parts of an unpickled checkpoint (``state_dict``, ``optimizer_states``, the rest), by storage bytes."""
    tally, seen = _Tally(), set[int]()
    notes: list[str] = []
    top = root if isinstance(root, dict) else {"(the whole object)": root}
    if "state_dict" not in top:
        notes.append("no 'state_dict' key: not a Lightning Trainer checkpoint; its tensors count as the rest")
    weights, largest = tally.add(top.get("state_dict"), seen)
    by_key: dict[str, int] = {}
    optimizers: list[dict[str, int]] = []
    states = top.get("optimizer_states")
    for saved in states if isinstance(states, (list, tuple)) else [states] if states is not None else []:
        mine: dict[str, int] = {}
        entries = saved.get("state") if isinstance(saved, dict) else None
        for entry in entries.values() if isinstance(entries, dict) else []:
            for key, value in entry.items() if isinstance(entry, dict) else [("(state)", entry)]:
                mine[str(key)] = mine.get(str(key), 0) + tally.add(value, seen)[0]
        for key, value in saved.items() if isinstance(saved, dict) else [("(optimizer)", saved)]:
            if key != "state":
                mine[str(key)] = mine.get(str(key), 0) + tally.add(value, seen)[0]
        mine = {k: v for k, v in mine.items() if v or k in ("exp_avg", "exp_avg_sq", "step")}
        for key, value in mine.items():
            by_key[key] = by_key.get(key, 0) + value
        optimizers.append({"bytes": sum(mine.values()), **{f"{k}_bytes": v for k, v in mine.items()}})
    rest_by_key = {
        str(key): tally.add(value, seen)[0]
        for key, value in top.items()
        if key not in ("state_dict", "optimizer_states")
    }
    bare = [ref for key, ref in unpickler.storages.items() if key not in tally.counted]
    if bare:  # storages pickled without a tensor around them (a user's object): the rest
        rest_by_key["(storages without a tensor)"] = sum(ref.nbytes for ref in bare)
        for ref in bare:
            tally.locations[ref.location] = tally.locations.get(ref.location, 0) + ref.nbytes
    return {
        "storages": len(unpickler.storages),
        "tensors": tally.tensors,
        "weights_bytes": weights,
        "optimizer_bytes": sum(by_key.values()),
        "optimizer_by_key": by_key,
        "optimizers": optimizers,
        "rest_bytes": sum(rest_by_key.values()),
        "rest_by_key": rest_by_key,
        "largest_weight_bytes": largest,
        "locations": tally.locations,
        "opaque_globals": sorted(unpickler.opaque),
        "notes": notes,
    }


class _CountingReader(io.RawIOBase):
    """A file object's reads, counted (what the planner read of the checkpoint)."""

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


def _load(unpickler: _TableUnpickler, path: str) -> Any:
    try:
        return unpickler.load()
    except (pickle.UnpicklingError, EOFError, OSError, zipfile.BadZipFile):
        raise
    except Exception as err:  # a pickle that the stand-ins cannot follow: say so, do not guess
        raise NotPlannable(f"{path!r}: its data.pkl cannot be described ({type(err).__name__}: {err})") from None


def _from_archive(f: _CountingReader, path: str, size: int, filesystem: str) -> TensorTable:
    try:
        archive = zipfile.ZipFile(f)  # type: ignore[arg-type]  # a binary file object
    except zipfile.BadZipFile as err:
        raise NotPlannable(f"{path!r} starts as a zip archive but its records list cannot be read ({err})") from None
    with archive:
        infos = {info.filename: info for info in archive.infolist()}
        pickles = [name for name in infos if name.endswith("/data.pkl") and name.count("/") == 1]
        if not pickles:
            raise NotPlannable(f"{path!r} is a zip archive without a data.pkl: not a torch checkpoint")
        prefix = pickles[0].rsplit("/", 1)[0]
        with archive.open(pickles[0]) as pkl:
            unpickler = _TableUnpickler(pkl)  # type: ignore[arg-type]
            root = _load(unpickler, path)
        parts = _describe(root, unpickler)
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
    if len(header) < 30 or header[:4] != _ZIP_MAGIC:
        raise NotPlannable(f"{path!r}: the stream ended inside the first zip header")
    method, name_length, extra_length = struct.unpack("<8xH16xHH", header)
    name = f.read(name_length).decode("utf-8", "replace")
    f.read(extra_length)
    if not name.endswith("/data.pkl") or method != 0:
        raise NotPlannable(
            f"{path!r}: the file system cannot seek, and the archive does not start with an uncompressed data.pkl"
            " as torch writes it: planning it would mean reading the whole file"
        )
    start = f.count
    unpickler = _TableUnpickler(f)  # type: ignore[arg-type]
    root = _load(unpickler, path)
    parts = _describe(root, unpickler)
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
    if head[:4] == _ZIP_MAGIC:
        return
    if head[:1] == b"\x80":
        raise NotPlannable(
            f"{path!r} is a legacy (pre-1.6, non-zip) torch checkpoint (saved with"
            " `_use_new_zipfile_serialization=False`): its tensor table cannot be read without reading the whole"
            " file, so it cannot be planned. Re-save it in the zip format (`torch.save(torch.load(path), path)`) to"
            " plan it; note that the serialized restore reads a legacy file eagerly, as upstream does."
        )
    raise NotPlannable(f"{path!r} is not a torch checkpoint: neither a zip archive nor a pickle (starts {head!r})")


def _is_url(path: str) -> bool:
    return ("://" in path or "::" in path) and not path.startswith("file://")


def read_table(path: str) -> TensorTable:
    """The tensor table of the checkpoint at ``path`` (a local path or an fsspec URL), reading no tensor data;
    :class:`NotPlannable` if it cannot be planned."""
    path = os.fspath(path)
    try:
        return _local_table(path) if not _is_url(path) else _remote_table(path)
    except FileNotFoundError:
        raise NotPlannable(f"{path!r} does not exist") from None
    except (OSError, ImportError, ValueError) as err:  # ImportError: an fsspec protocol's package is missing
        raise NotPlannable(f"{path!r} cannot be read: {err}") from None
    except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, struct.error) as err:
        raise NotPlannable(f"{path!r} is truncated or damaged: its data.pkl cannot be read ({err})") from None


def _local_table(path: str) -> TensorTable:
    local = path.removeprefix("file://")
    if os.path.isdir(local):
        raise NotPlannable(
            f"{path!r} is a directory: a sharded (distributed) checkpoint, which each rank reads shard by shard"
            " already; there is nothing to plan"
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
        raise NotPlannable(f"{path!r} does not exist, or cannot be reached")
    if fs.isdir(fs_path):
        raise NotPlannable(f"{path!r} is a directory: a sharded checkpoint; there is nothing to plan")
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


# --- the prediction ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resume:
    """One way to resume, per node: the checkpoint's bytes in private memory at the restore's peak, by part
    (``held``), and what that adds above the same job without a checkpoint (``raw``; ``net`` for fit)."""

    label: str
    weights: int
    optimizer: int
    rest: int
    raw: int
    net: int | None
    kept: int

    @property
    def held(self) -> int:
        return self.weights + self.optimizer + self.rest


@dataclass(frozen=True)
class Plan:
    """The prediction for one job (module doc, *The model*); every figure is per node, in bytes."""

    table: TensorTable
    devices: int
    nodes: int
    entry: str
    strategy: str
    k: int
    accelerator: str
    containers_per_rank: int
    fixed_per_rank: int
    kept_per_rank: int
    setup_transient_per_rank: int
    upstream: Resume
    serialized: Resume
    serialized_eager: Resume | None
    page_cache: int
    notes: list[str]

    @property
    def measure(self) -> str:
        """The README's measure for the entry: ``net`` for fit, ``raw`` for validate."""
        return "net" if self.entry == "fit" else "raw"

    def added(self, resume: Resume) -> int:
        return resume.net if self.entry == "fit" and resume.net is not None else resume.raw


def predict(
    table: TensorTable,
    devices: int,
    nodes: int = 1,
    entry: str = "fit",
    strategy: str = "ddp",
    k: int = 1,
    *,
    accelerator: str = "cpu",
    kept_per_rank: int | None = None,
    setup_transient_per_rank: int | None = None,
) -> Plan:
    """The host memory a resume adds per node (module doc, *The model*); ``kept_per_rank`` (K) and
    ``setup_transient_per_rank`` (T) replace the model's defaults, e.g. with what a benchmark's baseline measured."""
    if entry not in ("fit", "validate") or strategy not in ("ddp", "fsdp") or accelerator not in ("cpu", "gpu"):
        raise ValueError(f"unsupported entry {entry!r}, strategy {strategy!r} or accelerator {accelerator!r}")
    if devices < 1 or nodes < 1 or k < 1:
        raise ValueError("devices, nodes and k must be positive")
    n, fit, gpu = devices, entry == "fit", accelerator == "gpu"
    w, o, r = table.weights_bytes, table.optimizer_bytes, table.rest_bytes
    d = w + o + r
    c = table.containers_per_rank
    cs = c + SERIALIZED_FIXED_PER_RANK
    if kept_per_rank is None:
        kept = table.optimizer_step_bytes if gpu else o if strategy == "ddp" else -(-o // (n * nodes))
        kept_per_rank = kept if fit else 0
    if setup_transient_per_rank is None:
        setup_transient_per_rank = w if strategy == "ddp" and not gpu else 0
    kk, t = kept_per_rank, setup_transient_per_rank
    credit = n * max(0, kk - t)  # what net takes off raw: the kept state beyond the job's own transient

    def resume(label: str, weights: int, optimizer: int, rest: int, raw: int) -> Resume:
        return Resume(label, weights, optimizer, rest, raw, raw - credit if fit else None, n * kk)

    notes: list[str] = []
    if strategy == "ddp":
        upstream = resume("upstream Lightning", n * w, n * o, n * (r + c), n * (d + c))
        held = n * (kk + cs)
        serialized = resume("serialized, memory-mapped", 0, n * kk, n * cs, max(n * cs, held - n * t))
        j = min(k, n)
        stage1 = (j * w, j * o, j * r + n * cs)
        stage2 = (j * w, (n - j) * kk + j * o, j * r + n * cs)
        peak = max((stage1, stage2) if fit else (stage1,), key=sum)
        eager: Resume | None = resume(f"serialized, read eagerly, k={k}", *peak, max(n * cs, sum(peak) - n * t))
        if k > 1:
            notes.append(f"k = {k} changes only the eager read: a memory-mapped turn allocates no tensor data")
    else:
        upstream = resume("upstream Lightning", 0, n * (o + kk), n * (r + c), n * (o + kk + r + c) - n * t)
        u = table.largest_weight_bytes
        held_parts = (n * u, 0) if u > kk else (0, n * kk)
        serialized = resume("serialized, memory-mapped", *held_parts, n * cs, n * (cs + max(u, kk)) - n * t)
        if table.filesystem != "local":  # the package maps only a local file under FSDP (design.md, FSDP)
            serialized = Resume("serialized (FSDP's own restore)", *astuple(upstream)[1:])
        eager = None
        notes.append(
            "FSDP: a rougher model than DDP's (module doc, steps 4 and 5); FSDP's ranks load together, so k does not"
            " apply, and a file the package cannot map (remote, legacy) is restored by FSDP's own code, as upstream"
        )
    if strategy == "ddp" and table.filesystem != "local":
        notes.append(
            f"a remote checkpoint is first copied to local disk once per node ({format_bytes(table.checkpoint_bytes)}"
            " in SERIALIZED_RESTORE_TMPDIR or the system's temporary directory; on a tmpfs that copy is memory),"
            " then memory-mapped; upstream reads it on every rank"
        )
    if gpu:
        notes.append(
            "GPU: the optimizer state moves to GPU memory, the host keeps only its step tensors; DDP's setup copies"
            " are on the GPU (T = 0). Not yet measured on a GPU"
        )
    return Plan(
        table=table,
        devices=devices,
        nodes=nodes,
        entry=entry,
        strategy=strategy,
        k=k,
        accelerator=accelerator,
        containers_per_rank=c,
        fixed_per_rank=SERIALIZED_FIXED_PER_RANK,
        kept_per_rank=kk,
        setup_transient_per_rank=t,
        upstream=upstream,
        serialized=serialized,
        serialized_eager=eager,
        page_cache=table.checkpoint_bytes,
        notes=notes,
    )


# --- the memory available ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Available:
    """The memory available to the job, and where the figure comes from."""

    bytes: int | None
    source: str


_UNLIMITED = 2**60


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) < _UNLIMITED else None


def memory_available(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> Available:
    """The cgroup memory limit of this process (v2 ``memory.max``, the smallest over its ancestors; v1
    ``memory.limit_in_bytes``), else the host's ``MemAvailable``."""
    try:
        with open(os.path.join(proc, "self", "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, group = rest.partition(":")
        group = group.strip("/")
        if hierarchy == "0" and controllers == "":
            parts = group.split("/") if group else []
            limits = []
            for depth in range(len(parts), -1, -1):
                where = os.path.join(cgroup_root, *parts[:depth], "memory.max")
                value = _read_int(where)
                if value is not None:
                    limits.append((value, where))
            if limits:
                value, where = min(limits)
                return Available(value, f"cgroup v2 memory.max ({where})")
        elif "memory" in controllers.split(","):
            for where in (
                os.path.join(cgroup_root, "memory", group, "memory.limit_in_bytes"),
                os.path.join(cgroup_root, "memory", "memory.limit_in_bytes"),
            ):
                value = _read_int(where)
                if value is not None:
                    return Available(value, f"cgroup v1 memory.limit_in_bytes ({where})")
    info: dict[str, int] = {}
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            for line in f:
                name, _, figure = line.partition(":")
                if figure.strip().endswith("kB"):
                    info[name] = int(figure.split()[0]) * 1024
    except OSError:
        return Available(None, "unknown: no cgroup memory limit and no /proc/meminfo")
    if "MemAvailable" not in info:
        return Available(None, "unknown: no cgroup memory limit and no MemAvailable in /proc/meminfo")
    total = f" of MemTotal {format_bytes(info['MemTotal'])}" if "MemTotal" in info else ""
    return Available(info["MemAvailable"], f"the host's MemAvailable{total} (no cgroup memory limit is set)")


# --- the command -------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser, positive_int: Callable[[str], int]) -> None:
    """The arguments of ``serialized-restore plan``."""
    parser.add_argument("checkpoint", help="a local path or an fsspec URL (memory://, http://, s3://, ...)")
    parser.add_argument("--devices", type=positive_int, required=True, help="local ranks per node (as the Trainer's)")
    parser.add_argument("--nodes", type=positive_int, default=1, help="nodes (default: 1; FSDP's shards only)")
    parser.add_argument("--entry", choices=("fit", "validate"), default="fit", help="the Trainer's entry point")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp", help="default: ddp")
    parser.add_argument("--k", type=positive_int, default=1, help="at most K local ranks restore at once (default 1)")
    parser.add_argument(
        "--accelerator",
        choices=("cpu", "gpu"),
        default="cpu",
        help="where the optimizer state lives after the restore (default: cpu, as measured; gpu: not yet measured)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of the table")


def run(args: argparse.Namespace) -> int:
    """``serialized-restore plan``: print the plan; 2 if the checkpoint cannot be planned."""
    try:
        table = read_table(args.checkpoint)
    except NotPlannable as err:
        if args.json:
            print(json.dumps({"checkpoint": args.checkpoint, "plannable": False, "error": str(err)}))
        print(f"serialized-restore plan: {err}", file=sys.stderr)
        return 2
    plan = predict(table, args.devices, args.nodes, args.entry, args.strategy, args.k, accelerator=args.accelerator)
    available = memory_available()
    print(json.dumps(to_json(plan, available), indent=2) if args.json else render(plan, available))
    return 0


def _fits(added: int, available: Available) -> bool | None:
    return None if available.bytes is None else added <= available.bytes


def to_json(plan: Plan, available: Available) -> dict[str, Any]:
    """The plan as a JSON object: ``checkpoint_bytes``, ``added_bytes_per_node`` (the entry's measure) and parts."""
    table = asdict(plan.table)

    def part(resume: Resume | None) -> dict[str, Any] | None:
        if resume is None:
            return None
        return {
            "label": resume.label,
            "weights_bytes": resume.weights,
            "optimizer_bytes": resume.optimizer,
            "rest_bytes": resume.rest,
            "held_bytes": resume.held,
            "raw_bytes": resume.raw,
            "net_bytes": resume.net,
            "kept_bytes": resume.kept,
            "added_bytes": plan.added(resume),
            "fits": _fits(plan.added(resume), available),
        }

    return {
        "checkpoint": plan.table.path,
        "checkpoint_bytes": plan.table.checkpoint_bytes,
        "plannable": True,
        "job": {
            "devices": plan.devices,
            "nodes": plan.nodes,
            "entry": plan.entry,
            "strategy": plan.strategy,
            "k": plan.k,
            "accelerator": plan.accelerator,
        },
        "measure": plan.measure,
        "added_bytes_per_node": {"upstream": plan.added(plan.upstream), "serialized": plan.added(plan.serialized)},
        "parts": {
            "upstream": part(plan.upstream),
            "serialized": part(plan.serialized),
            "serialized_eager": part(plan.serialized_eager),
        },
        "page_cache_bytes_per_node": plan.page_cache,
        "model": {
            "containers_per_rank": plan.containers_per_rank,
            "serialized_fixed_per_rank": plan.fixed_per_rank,
            "kept_per_rank": plan.kept_per_rank,
            "setup_transient_per_rank": plan.setup_transient_per_rank,
        },
        "memory": {"available_bytes": available.bytes, "source": available.source},
        "table": {**table, "tensor_bytes": plan.table.tensor_bytes},
        "notes": plan.table.notes + plan.notes,
    }


def _times(count: int, s: int) -> str:
    return f"{format_bytes(count)} ({count / s:.2f} x S)" if s else format_bytes(count)


def render(plan: Plan, available: Available) -> str:
    """The plan as a table a person reads at a glance."""
    t, s = plan.table, plan.table.checkpoint_bytes
    fit = plan.entry == "fit"
    keys = ", ".join(f"{key} {format_bytes(v)}" for key, v in t.optimizer_by_key.items())
    rest = ", ".join(f"{key} {format_bytes(v)}" for key, v in t.rest_by_key.items() if v) or "no tensors"
    where = ", ".join(f"{loc}" for loc in t.locations) or "none"
    lines = [
        f"serialized-restore plan: {t.path}",
        f"  checkpoint  S = {format_bytes(s)}, {t.tensors} tensors in {t.storages} storages saved on {where}; read"
        f" {format_bytes(t.bytes_read)} of it ({t.filesystem}{'' if t.seekable else ', cannot seek'})",
        f"              weights {format_bytes(t.weights_bytes)}; optimizer state {format_bytes(t.optimizer_bytes)}"
        f"{f' ({keys})' if keys else ''}; the rest {format_bytes(t.rest_bytes)} ({rest})",
        f"  resume      trainer.{plan.entry}, {plan.strategy}, {plan.devices} local ranks per node x {plan.nodes}"
        f" node{'s' if plan.nodes > 1 else ''}, {plan.accelerator}; serialized: k = {plan.k}",
        f"  memory      {format_bytes(available.bytes) if available.bytes is not None else 'unknown'} available to"
        f" the job: {available.source}",
        "",
        "Host memory the resume adds per node, above the same job started without a checkpoint"
        + (" (net of the optimizer state the job keeps; the raw peak beside it):" if fit else ":"),
        "",
    ]
    header = ["", "weights", "optimizer state", "the rest", "added" + (" (net)" if fit else "")]
    header += ["raw peak"] if fit else []
    header += ["fits?"]
    rows = [header]
    for resume in (plan.upstream, plan.serialized, plan.serialized_eager):
        if resume is None:
            continue
        added = plan.added(resume)
        fits = _fits(added, available)
        left = f", {format_bytes(available.bytes - added)} left" if available.bytes is not None and fits else ""
        row = [resume.label, format_bytes(resume.weights), format_bytes(resume.optimizer), format_bytes(resume.rest)]
        row += [_times(added, s)] + ([_times(resume.raw, s)] if fit else [])
        row += [("yes" + left) if fits else "NO" if fits is False else "?"]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        lines.append("  " + "   ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    n = plan.devices
    lines += [
        "",
        "  weights / optimizer state / the rest: the checkpoint's bytes in the node's private memory at the restore's"
        " peak (the rest includes the unpickled containers).",
    ]
    transient = format_bytes(plan.setup_transient_per_rank)
    own = (
        f", which includes DDP's setup copy of the weights ({n} x {transient}): bytes a restore holds at another"
        " moment add only what exceeds it"
        if plan.setup_transient_per_rank
        else " (its own transients not modeled: T = 0)"
    )
    if fit:
        lines.append(
            "  net: above what the job holds anyway once it has built its optimizer state"
            f" ({format_bytes(plan.upstream.kept)} per node kept: {n} x {format_bytes(plan.kept_per_rank)}); raw: above"
            f" the job's own peak{own}."
        )
    else:
        lines.append(f"  added (raw): above the job's own peak{own}.")
    lines.append(
        f"  page cache: every mode reads the file through it, {format_bytes(plan.page_cache)} once per node, shared"
        " and reclaimable: not in these figures (the benchmark's measure is private memory), but a cgroup's limit"
        " counts it and reclaims it under pressure (slower, not an OOM kill)."
    )
    lines.append(
        "  fits: the added figure against the memory available; the job's own memory (model, data, gradients) must"
        " fit in what is left. Model and its inputs: serialized_restore/_preflight.py."
    )
    notes = [f"note: {note}." for note in t.notes + plan.notes]
    if t.opaque_globals:
        shown = ", ".join(t.opaque_globals[:5]) + (", ..." if len(t.opaque_globals) > 5 else "")
        notes.append(f"note: globals not imported, described as opaque objects: {shown}.")
    start = lines.index(
        "  weights / optimizer state / the rest: the checkpoint's bytes in the node's private memory at the"
        " restore's peak (the rest includes the unpickled containers)."
    )
    wrapped = [
        textwrap.fill(line.strip(), 118, initial_indent="  ", subsequent_indent="    ") for line in lines[start:]
    ]
    wrapped += [textwrap.fill(note, 118, initial_indent="  ", subsequent_indent="    ") for note in notes]
    return "\n".join(lines[:start] + wrapped)
