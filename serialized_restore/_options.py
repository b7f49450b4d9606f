"""``Trainer(serialized_checkpoint_loading=...)``: the typed settings object, and what a value resolves to."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

TURN_TIMEOUT_ENV = "SERIALIZED_RESTORE_TURN_TIMEOUT"
HEARTBEAT_TIMEOUT_ENV = "SERIALIZED_RESTORE_HEARTBEAT_TIMEOUT"
READER_ENV = "SERIALIZED_RESTORE_READER"
AVAILABLE_MEMORY_ENV = "SERIALIZED_RESTORE_AVAILABLE_MEMORY"
TMPDIR_ENV = "SERIALIZED_RESTORE_TMPDIR"
ENVIRONMENT_OVERRIDES = {
    TURN_TIMEOUT_ENV: "SerializedLoading.turn_timeout",
    HEARTBEAT_TIMEOUT_ENV: "SerializedLoading.heartbeat_timeout",
    READER_ENV: "SerializedLoading.reader",
    TMPDIR_ENV: "SerializedLoading.tmpdir",
    AVAILABLE_MEMORY_ENV: 'the memory "auto" assumes available (bytes), instead of measuring it',
}
"""Every environment variable the package reads, and what it overrides: settings for operators, which win over what
the code says, so that a job can be tuned without changing it."""
AUTO = "auto"

DEFAULT_TURN_TIMEOUT = 1800.0
DEFAULT_HEARTBEAT_TIMEOUT = 60.0
READERS = ("auto", "mmap", "eager")

_ACCEPTED = (
    '`False`, `True`, a positive int (the most local ranks of a node that restore at once), `"auto"` (chosen from'
    " the memory available) or a `SerializedLoading(...)`"
)


@dataclass(frozen=True)
class SerializedLoading:
    """The settings of a serialized restore as one typed object:
    ``Trainer(serialized_checkpoint_loading=SerializedLoading(max_concurrent=2, turn_timeout=600))``.

    ``True`` means ``SerializedLoading()``, a positive int ``k`` means ``SerializedLoading(max_concurrent=k)`` and
    ``"auto"`` means ``SerializedLoading(max_concurrent="auto")``. The environment variables of
    :data:`ENVIRONMENT_OVERRIDES`, when set, override the matching field, for operators.

    Args:
        max_concurrent: The most local ranks of a node that restore at once (``1``: one at a time), or ``"auto"``
            to choose it per node from the memory available when the restore starts.
        reader: How a rank reads the file: ``"auto"`` (memory-mapped where the file allows it, else as upstream
            reads it), ``"mmap"`` (the same, logging why when it cannot), ``"eager"`` (always as upstream reads it).
        turn_timeout: Seconds a waiting rank waits while no turn of its node starts or ends.
        heartbeat_timeout: Seconds after which a silent rank on another machine counts as dead.
        tmpdir: The directory for the per-node local copy of a remote checkpoint; ``None``: the system's temporary
            directory.

    Raises:
        ValueError: a field out of range, naming it and what is accepted.
    """

    max_concurrent: int | Literal["auto"] = 1
    reader: Literal["auto", "mmap", "eager"] = "auto"
    turn_timeout: float = DEFAULT_TURN_TIMEOUT
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    tmpdir: str | None = None

    def __post_init__(self) -> None:
        if self.max_concurrent != AUTO and _positive_int(self.max_concurrent) is None:
            raise ValueError(
                f"`SerializedLoading(max_concurrent={self.max_concurrent!r})`: expected a positive int or {AUTO!r}."
            )
        if self.reader not in READERS:
            raise ValueError(f"`SerializedLoading(reader={self.reader!r})`: expected one of {', '.join(READERS)}.")
        for name in ("turn_timeout", "heartbeat_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"`SerializedLoading({name}={value!r})`: expected a positive number of seconds.")
        if self.tmpdir is not None and not isinstance(self.tmpdir, (str, os.PathLike)):
            raise ValueError(f"`SerializedLoading(tmpdir={self.tmpdir!r})`: expected a directory path or None.")


@dataclass(frozen=True)
class RestoreOptions:
    """What ``serialized_checkpoint_loading`` resolves to, environment overrides applied.

    ``max_concurrent`` is ``None`` when the option is off or ``"auto"`` (chosen per node at restore time), else the
    most local ranks of one node inside a turn at the same time.
    """

    value: object
    """What the user passed, as given: ``trainer.serialized_checkpoint_loading`` returns it."""
    max_concurrent: int | None
    turn_timeout: float = DEFAULT_TURN_TIMEOUT
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    reader: str = "auto"
    tmpdir: str | None = None
    auto: bool = False

    @property
    def enabled(self) -> bool:
        return self.max_concurrent is not None or self.auto

    @classmethod
    def parse(cls, value: object, owner: str = "Trainer") -> RestoreOptions:
        """Validate the user's value and the environment overrides; raise ``ValueError`` quoting what is wrong (and
        ``owner``, the class the value was given to: ``"Trainer"`` or ``"Fabric"``)."""
        settings = _settings(value, owner)
        if settings is None:
            return cls(value=value, max_concurrent=None)
        auto = settings.max_concurrent == AUTO
        if auto:
            available_memory_override()  # a malformed setting fails here, on every rank, not in the middle of a restore
        tmpdir = os.environ.get(TMPDIR_ENV, "").strip() or settings.tmpdir
        return cls(
            value=value,
            max_concurrent=None if auto else int(settings.max_concurrent),
            turn_timeout=_positive_float_env(TURN_TIMEOUT_ENV, settings.turn_timeout),
            heartbeat_timeout=_positive_float_env(HEARTBEAT_TIMEOUT_ENV, settings.heartbeat_timeout),
            reader=_reader_env(settings.reader),
            tmpdir=os.fspath(tmpdir) if tmpdir is not None else None,
            auto=auto,
        )


def _settings(value: object, owner: str) -> SerializedLoading | None:
    """The :class:`SerializedLoading` that ``value`` stands for; ``None`` for ``False``."""
    if isinstance(value, SerializedLoading):
        return value
    if value is False:
        return None
    if value is True:
        return SerializedLoading()
    if value == AUTO:
        return SerializedLoading(max_concurrent=AUTO)
    k = _positive_int(value)
    if k is not None:
        return SerializedLoading(max_concurrent=k)
    raise ValueError(
        f"`{owner}(serialized_checkpoint_loading={value!r})` is not supported. Accepted values: {_ACCEPTED}."
    )


def _positive_int(value: object) -> int | None:
    # bool is not a count; integer types such as numpy.int64 are accepted through __index__
    if isinstance(value, (bool, float, str)) or not hasattr(value, "__index__"):
        return None
    k = int(value.__index__())  # type: ignore[attr-defined]
    return k if k >= 1 else None


def _positive_float_env(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return float(default)
    try:
        value = float(raw)
    except ValueError as err:
        raise ValueError(
            f"`{name}={raw!r}` is not a number of seconds. Set it to a positive number, e.g. 600."
        ) from err
    if not value > 0:
        raise ValueError(f"`{name}={raw!r}` must be a positive number of seconds, e.g. 600.")
    return value


def _reader_env(default: str) -> str:
    raw = os.environ.get(READER_ENV, "").strip().lower() or default
    if raw not in READERS:
        raise ValueError(f"`{READER_ENV}={raw!r}` is not supported. Accepted values: {', '.join(READERS)}.")
    return raw


def available_memory_override() -> int | None:
    """Bytes of host memory to assume available for ``"auto"``, from ``SERIALIZED_RESTORE_AVAILABLE_MEMORY``."""
    raw = os.environ.get(AVAILABLE_MEMORY_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(float(raw))
    except ValueError as err:
        raise ValueError(f"`{AVAILABLE_MEMORY_ENV}={raw!r}` is not a number of bytes, e.g. 17179869184.") from err
    if value < 0:
        raise ValueError(f"`{AVAILABLE_MEMORY_ENV}={raw!r}` must not be negative.")
    return value
