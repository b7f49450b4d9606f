"""Parsing of ``Trainer(serialized_checkpoint_loading=...)`` and of the settings read from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

TURN_TIMEOUT_ENV = "SERIALIZED_RESTORE_TURN_TIMEOUT"
HEARTBEAT_TIMEOUT_ENV = "SERIALIZED_RESTORE_HEARTBEAT_TIMEOUT"
READER_ENV = "SERIALIZED_RESTORE_READER"
AVAILABLE_MEMORY_ENV = "SERIALIZED_RESTORE_AVAILABLE_MEMORY"
AUTO = "auto"

DEFAULT_TURN_TIMEOUT = 1800.0
DEFAULT_HEARTBEAT_TIMEOUT = 60.0
READERS = ("auto", "mmap", "eager")

_ACCEPTED = (
    '`False`, `True`, a positive int (the most local ranks of a node that restore at once) or `"auto"` (chosen from'
    " the memory available)"
)


@dataclass(frozen=True)
class SerializedLoading:
    """The validated ``serialized_checkpoint_loading`` value and the settings that go with it.

    ``max_concurrent`` is ``None`` when the option is off or ``"auto"`` (chosen per node at restore time), else the
    most local ranks of one node inside a turn at the same time (``True`` means 1).
    """

    value: object
    max_concurrent: Optional[int]
    turn_timeout: float = DEFAULT_TURN_TIMEOUT
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    reader: str = "auto"

    @property
    def auto(self) -> bool:
        return self.value == AUTO

    @property
    def enabled(self) -> bool:
        return self.max_concurrent is not None or self.auto

    @classmethod
    def parse(cls, value: object) -> SerializedLoading:
        """Validate the user's value and the environment settings; raise ``ValueError`` quoting what is wrong."""
        if value == AUTO:
            available_memory_override()  # a malformed setting fails here, on every rank, not in the middle of a restore
        return cls(
            value=value,
            max_concurrent=_max_concurrent(value),
            turn_timeout=_positive_float_env(TURN_TIMEOUT_ENV, DEFAULT_TURN_TIMEOUT),
            heartbeat_timeout=_positive_float_env(HEARTBEAT_TIMEOUT_ENV, DEFAULT_HEARTBEAT_TIMEOUT),
            reader=_reader_env(),
        )


def _max_concurrent(value: object) -> Optional[int]:
    if value is False or value == AUTO:
        return None
    if value is True:
        return 1
    # bool was handled above; integer types such as numpy.int64 are accepted through __index__
    if not isinstance(value, (float, str)) and hasattr(value, "__index__"):
        k = int(value.__index__())
        if k >= 1:
            return k
    raise ValueError(
        f"`Trainer(serialized_checkpoint_loading={value!r})` is not supported. Accepted values: {_ACCEPTED}."
    )


def _positive_float_env(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError as err:
        raise ValueError(
            f"`{name}={raw!r}` is not a number of seconds. Set it to a positive number, e.g. 600."
        ) from err
    if not value > 0:
        raise ValueError(f"`{name}={raw!r}` must be a positive number of seconds, e.g. 600.")
    return value


def _reader_env() -> str:
    raw = os.environ.get(READER_ENV, "").strip().lower() or "auto"
    if raw not in READERS:
        raise ValueError(f"`{READER_ENV}={raw!r}` is not supported. Accepted values: {', '.join(READERS)}.")
    return raw


def available_memory_override() -> Optional[int]:
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
