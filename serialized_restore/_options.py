"""``Trainer(serialized_checkpoint_loading=...)``: the typed settings object, and what a value resolves to."""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from typing import Literal, SupportsIndex

from lightning_utilities.core.imports import RequirementCache

# series: auto
AUTO: Literal["auto"] = "auto"
# series: end
# how messages name each setting
TURN_TIMEOUT_SETTING = "`SerializedLoading(turn_timeout=...)`"
HEARTBEAT_TIMEOUT_SETTING = "`SerializedLoading(heartbeat_timeout=...)`"
# series: mmap
READER_SETTING = "`SerializedLoading(reader=...)`"
# series: end
# series: remote
TMPDIR_SETTING = "`SerializedLoading(tmpdir=...)`"
# series: end
# series: auto
AVAILABLE_MEMORY_SETTING = "`SerializedLoading(available_memory=...)`"
# series: end
PSUTIL_AVAILABLE = RequirementCache("psutil")
# series: auto
"""psutil measures a process's memory where ``/proc`` cannot be read, and the memory ``"auto"`` assumes available
(unless it is given)."""
# series: before auto
# """psutil measures a process's memory where ``/proc`` cannot be read."""
# series: end

DEFAULT_TURN_TIMEOUT = 1800.0
DEFAULT_HEARTBEAT_TIMEOUT = 60.0
# series: mmap
READERS = ("auto", "mmap", "eager")
# series: end

# series: auto
_ACCEPTED = (
    '`False`, `True`, a positive int (the most local ranks of a node that restore at once), `"auto"` (chosen from'
    " the memory available) or a `SerializedLoading(...)`"
)
# series: before auto
# _ACCEPTED = (
#     "`False`, `True`, a positive int (the most local ranks of a node that restore at once) or a"
#     " `SerializedLoading(...)`"
# )
# series: end


@dataclass(frozen=True)
class SerializedLoading:
    """The settings of a serialized restore as one typed object:
    ``Trainer(serialized_checkpoint_loading=SerializedLoading(max_concurrent=2, turn_timeout=600))``.

    ``True`` means ``SerializedLoading()`` and a positive int ``k`` means ``SerializedLoading(max_concurrent=k)``.

    Raises:
        ValueError: a field out of range, naming it and what is accepted.
    """

    # series: auto
    max_concurrent: int | Literal["auto"] = 1
    """The most local ranks of a node that restore at once (``1``: one at a time), or ``"auto"`` (what
    ``serialized_checkpoint_loading="auto"`` means) to choose it per node from the memory available when the restore
    starts."""
    # series: before auto
    # max_concurrent: int = 1
    # """The most local ranks of a node that restore at once (``1``: one at a time)."""
    # series: end
    # series: mmap
    reader: Literal["auto", "mmap", "eager"] = "auto"
    """How a rank reads the file: ``"auto"`` (memory-mapped where the file allows it, else as upstream reads it),
    ``"mmap"`` (the same, logging why when it cannot), ``"eager"`` (always as upstream reads it)."""
    # series: end
    turn_timeout: float = DEFAULT_TURN_TIMEOUT
    """Seconds a waiting rank waits while no turn of its node starts or ends."""
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    """Seconds after which a silent rank on another machine counts as dead."""
    # series: remote
    tmpdir: str | None = None
    """The directory for the per-node local copy of a remote checkpoint; ``None``: the system's temporary
    directory."""
    # series: end
    # series: auto
    available_memory: int | None = None
    """Bytes of host memory ``"auto"`` assumes available on each node, instead of measuring it (with psutil) when the
    restore starts; ``None``: measured."""
    # series: end

    def __post_init__(self) -> None:
        # series: auto
        if self.max_concurrent != AUTO and _positive_int(self.max_concurrent) is None:
            raise ValueError(
                f"`SerializedLoading(max_concurrent={self.max_concurrent!r})`: expected a positive int or {AUTO!r}."
            )
        # series: before auto
        # if _positive_int(self.max_concurrent) is None:
        #     raise ValueError(f"`SerializedLoading(max_concurrent={self.max_concurrent!r})`: expected a positive int.")
        # series: end
        # series: mmap
        if self.reader not in READERS:
            raise ValueError(f"`SerializedLoading(reader={self.reader!r})`: expected one of {', '.join(READERS)}.")
        # series: end
        for name in ("turn_timeout", "heartbeat_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"`SerializedLoading({name}={value!r})`: expected a positive number of seconds.")
        # series: remote
        if self.tmpdir is not None and not isinstance(self.tmpdir, (str, os.PathLike)):
            raise ValueError(f"`SerializedLoading(tmpdir={self.tmpdir!r})`: expected a directory path or None.")
        # series: end
        # series: auto
        memory = self.available_memory
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory < 0):
            raise ValueError(
                f"`SerializedLoading(available_memory={memory!r})`: expected a number of bytes (an int >= 0) or None."
            )
        # series: end


@dataclass(frozen=True)
class RestoreOptions:
    """What ``serialized_checkpoint_loading`` resolves to.

    ``max_concurrent`` is ``None`` when the option is off (or ``"auto"``: chosen per node at restore time), else the
    most local ranks of one node inside a turn at the same time.
    """

    value: object
    """What the user passed, as given: ``trainer.serialized_checkpoint_loading`` returns it."""
    max_concurrent: int | None
    turn_timeout: float = DEFAULT_TURN_TIMEOUT
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    # series: mmap
    reader: str = "auto"
    # series: end
    # series: remote
    tmpdir: str | None = None
    # series: end
    # series: auto
    auto: bool = False
    available_memory: int | None = None
    # series: end

    @property
    def enabled(self) -> bool:
        # series: auto
        return self.max_concurrent is not None or self.auto
        # series: before auto
        # return self.max_concurrent is not None
        # series: end

    @classmethod
    def parse(cls, value: object, owner: str = "Trainer") -> RestoreOptions:
        """Validate the user's value; raise ``ValueError`` quoting what is wrong (and ``owner``, the class the value
        was given to: ``"Trainer"`` or ``"Fabric"``)."""
        return cls.from_settings(value, settings_of(value, owner), owner)

    @classmethod
    def from_settings(cls, value: object, settings: SerializedLoading | None, owner: str = "Trainer") -> RestoreOptions:
        """The options of ``settings`` (``None``: off), ``value`` being what the user passed."""
        if settings is None:
            return cls(value=value, max_concurrent=None)
        # series: auto
        auto = settings.max_concurrent == AUTO
        if auto and settings.available_memory is None and not PSUTIL_AVAILABLE:
            raise ModuleNotFoundError(
                f"`{owner}(serialized_checkpoint_loading={value!r})` measures the memory available with psutil:"
                f" {PSUTIL_AVAILABLE}. Or give it: `SerializedLoading(max_concurrent='auto', available_memory=...)`."
            )
        # series: end
        return cls(
            value=value,
            # series: auto
            max_concurrent=None if auto else int(settings.max_concurrent),
            # series: before auto
            # max_concurrent=int(settings.max_concurrent),
            # series: end
            turn_timeout=float(settings.turn_timeout),
            heartbeat_timeout=float(settings.heartbeat_timeout),
            # series: mmap
            reader=settings.reader,
            # series: end
            # series: remote
            tmpdir=os.fspath(settings.tmpdir) if settings.tmpdir is not None else None,
            # series: end
            # series: auto
            auto=auto,
            available_memory=settings.available_memory,
            # series: end
        )


def settings_of(value: object, owner: str = "Trainer") -> SerializedLoading | None:
    """The :class:`SerializedLoading` that ``value`` stands for; ``None`` for ``False``."""
    if isinstance(value, SerializedLoading):
        return value
    if value is False:
        return None
    if value is True:
        return SerializedLoading()
    # series: auto
    if value == AUTO:
        return SerializedLoading(max_concurrent=AUTO)
    # series: end
    k = _positive_int(value)
    if k is not None:
        return SerializedLoading(max_concurrent=k)
    raise ValueError(
        f"`{owner}(serialized_checkpoint_loading={value!r})` is not supported. Accepted values: {_ACCEPTED}."
    )


def _positive_int(value: object) -> int | None:
    # bool is not a count; integer types such as numpy.int64 are accepted through __index__
    if isinstance(value, (bool, float, str)) or not isinstance(value, SupportsIndex):
        return None
    k = operator.index(value)
    return k if k >= 1 else None
