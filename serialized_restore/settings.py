"""The settings of a serialized restore: the one typed object, :class:`SerializedLoading`, what each value of
``serialized_checkpoint_loading`` stands for (:func:`settings_for`), and the ``SERIALIZED_RESTORE_*`` variables that
override its fields where the add-on's ``Trainer`` and ``Fabric`` pass the environment."""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, SupportsIndex, Union

PARAMETER = "serialized_checkpoint_loading"  # the Trainer's and Fabric's argument
# how messages name each setting
TURN_TIMEOUT_SETTING = "`SerializedLoading(turn_timeout=...)`"
TMPDIR_SETTING = "`SerializedLoading(tmpdir=...)`"
READERS = ("auto", "mmap", "eager")


@dataclass(frozen=True)
class SerializedLoading:
    """The settings of a serialized restore as one typed object:
    ``Trainer(serialized_checkpoint_loading=SerializedLoading(max_concurrent=2, turn_timeout=600))``.
    ``True`` means ``SerializedLoading()``, a positive int ``k`` ``SerializedLoading(max_concurrent=k)``. A field out
    of range raises ``ValueError`` naming it.
    """

    max_concurrent: int | None = None
    """The most local ranks of a node that restore at once. ``None`` (``True``): decided per stage from what bounds
    memory: a memory-mapped read, which allocates only what a rank keeps, with the node's ranks at once; anything that
    reads the file into memory or copies what it is given, one rank at a time."""
    reader: Literal["auto", "mmap", "eager"] = "auto"
    """How a rank reads the file: ``"auto"`` (memory-mapped where the file allows it, else as upstream reads it),
    ``"mmap"`` (the same, logging why when it cannot), ``"eager"`` (always as upstream reads it)."""
    turn_timeout: float = 1800.0
    """Seconds a waiting rank waits while no turn of its node starts or ends."""
    heartbeat_timeout: float | None = None
    """Deprecated, no effect: a rank that stops is found at the turn timeout, as upstream finds it at the process
    group's timeout (``docs/failures.md``)."""
    tmpdir: str | None = None
    """The directory for the per-node copy of a remote checkpoint; ``None``: the system's temporary directory."""

    def __post_init__(self) -> None:
        if self.max_concurrent is not None and _positive_int(self.max_concurrent) is None:
            raise ValueError(f"`SerializedLoading(max_concurrent={self.max_concurrent!r})`: expected a positive int.")
        if self.reader not in READERS:
            raise ValueError(f"`SerializedLoading(reader={self.reader!r})`: expected one of {', '.join(READERS)}.")
        for name in ("turn_timeout", "heartbeat_timeout")[: 1 if self.heartbeat_timeout is None else 2]:
            if isinstance(value := getattr(self, name), bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"`SerializedLoading({name}={value!r})`: expected a positive number of seconds.")
        if self.heartbeat_timeout is not None:
            warnings.warn(
                "`SerializedLoading(heartbeat_timeout=...)` is deprecated and has no effect: a rank that stops is"
                " found at the turn timeout, `SerializedLoading(turn_timeout=...)`.",
                DeprecationWarning,
                stacklevel=3,
            )
        if self.tmpdir is not None and not isinstance(self.tmpdir, (str, os.PathLike)):
            raise ValueError(f"`SerializedLoading(tmpdir={self.tmpdir!r})`: expected a directory path or None.")


def _positive_int(value: object) -> int | None:
    # bool is not a count; integer types such as numpy.int64 are accepted through __index__
    if isinstance(value, (bool, float, str)) or not isinstance(value, SupportsIndex):
        return None
    k = operator.index(value)
    return k if k >= 1 else None


# every override variable, and the field of SerializedLoading it overrides
ENVIRONMENT_OVERRIDES = {
    "SERIALIZED_RESTORE_TURN_TIMEOUT": "turn_timeout",
    "SERIALIZED_RESTORE_HEARTBEAT_TIMEOUT": "heartbeat_timeout",
    "SERIALIZED_RESTORE_READER": "reader",
    "SERIALIZED_RESTORE_TMPDIR": "tmpdir",
}


def settings_for(
    value: object, owner: str = "Trainer", environ: Mapping[str, str] | None = None
) -> SerializedLoading | None:
    """The :class:`SerializedLoading` that ``value`` stands for (``None`` for ``False``), with the fields that
    ``environ``'s ``SERIALIZED_RESTORE_*`` variables set overridden (the add-on's ``Trainer`` and ``Fabric`` pass
    ``os.environ``; without it nothing but ``value`` is read). Raises ``ValueError`` quoting ``value`` and ``owner``
    (``"Trainer"`` or ``"Fabric"``), or a malformed variable, for anything else."""
    if value is False:
        return None
    if isinstance(value, SerializedLoading):
        settings = value
    elif value is True:
        settings = SerializedLoading()
    elif (k := _positive_int(value)) is not None:
        settings = SerializedLoading(max_concurrent=k)
    else:
        raise ValueError(
            f"`{owner}(serialized_checkpoint_loading={value!r})` is not supported. Accepted values: `False`, `True`,"
            " a positive int (the most local ranks of a node that restore at once) or a `SerializedLoading(...)`."
        )
    overrides: dict[str, Any] = {}
    for name, field in ENVIRONMENT_OVERRIDES.items():
        raw = (environ or {}).get(name, "").strip()
        if raw:
            overrides[field] = _parse(name, field, raw)
    return dataclasses.replace(settings, **overrides) if overrides else settings


def _parse(name: str, field: str, raw: str) -> Any:
    """The value of the variable ``name`` for ``field``; a ``ValueError`` quoting it and what is expected."""
    if field == "tmpdir":
        return raw
    if field == "reader":
        if raw.lower() in READERS:
            return raw.lower()
        expected = f"one of {', '.join(READERS)}"
    else:
        with contextlib.suppress(ValueError):
            if (seconds := float(raw)) > 0:
                return seconds
        expected = "a positive number of seconds, e.g. 600"
    raise ValueError(f"`{name}={raw!r}` is not supported: expected {expected}.")


# `int`, not jsonargparse's PositiveInt: importing jsonargparse would cost every process 0.1 s; a count below 1 from
# LightningCLI is refused when the Trainer is built, as from code
SerializedCheckpointLoading = Union[bool, int, SerializedLoading]
"""The type of ``Trainer(serialized_checkpoint_loading=...)`` and ``Fabric(serialized_checkpoint_loading=...)``."""
