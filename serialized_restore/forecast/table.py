"""A checkpoint's tensor table: its pickle described without reading a storage or running any code of the file.

``data.pkl`` is unpickled by a restricted unpickler: ``persistent_load`` records each storage (key, storage type ->
bytes per element, element count, saved device) without reading it; torch's rebuild functions make stand-ins that know
their storage; containers (``dict``, ``OrderedDict``, lists, sets) are real; dtypes, devices and ``torch.Size`` are
small stand-ins; any other global is recorded as an opaque object (never imported, never called) that keeps what
pickle gave it, so that storages under it are still found. Each storage is counted once, under the first part it is
found in: ``state_dict`` (the weights, W), ``optimizer_states`` (O, split by state key: ``exp_avg``, ``exp_avg_sq``,
``step``, ...), or the rest (R: ``lr_schedulers``, ``callbacks``, ``loops``, ``hyper_parameters``, ...)."""

from __future__ import annotations

import _compat_pickle
import pickle
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

CONTAINER_BYTES_PER_PICKLE_BYTE = 4
CONTAINER_BYTES_PER_TENSOR = 1024


class CannotForecast(Exception):
    """The checkpoint cannot be forecast (legacy format, not a checkpoint, not found): the message says why."""


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
    """A tensor as its rebuild call describes it: its storage (``None`` for a tensor without one)."""

    storage: StorageRef | None


@dataclass(frozen=True)
class _Token:
    """A dtype, device, layout or tensor type: its name only."""

    kind: str
    name: str


class OpaqueObject:
    """An object of a global the forecast does not import: it keeps whatever pickle gave it (arguments, items,
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


def _rebuild_tensor(storage: Any, *rest: Any) -> TensorStub:
    return TensorStub(storage if isinstance(storage, StorageRef) else None)


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    return data


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    return func(*args) if callable(func) else OpaqueObject(func, new_type, args, state)


def _rebuild_meta_tensor_no_storage(*rest: Any) -> TensorStub:
    return TensorStub(None)


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
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._utils", "_rebuild_meta_tensor_no_storage"): _rebuild_meta_tensor_no_storage,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch._tensor", "_rebuild_from_type"): lambda func, new_type, args, state: _rebuild_from_type_v2(
        func, new_type, args, state
    ),
}
_TYPES = {("torch", "Tensor"), ("torch._tensor", "Tensor"), ("torch.nn.parameter", "Parameter")}


class TableUnpickler(pickle.Unpickler):
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
    """What the forecast knows of a checkpoint: the bytes of its storages by part, and how it was read
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


def describe(root: Any, unpickler: TableUnpickler) -> dict[str, Any]:
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
