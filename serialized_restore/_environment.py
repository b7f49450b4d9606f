"""Environment variables that override the settings of a serialized restore, for operators.

The add-on's ``Trainer`` and ``Fabric`` read them when they are built (:func:`options_from`): an operator can tune a
job (a longer turn timeout, the eager reader, a memory figure for ``"auto"``, a directory for remote checkpoints)
without changing its code. Each overrides one field of :class:`~serialized_restore.SerializedLoading`, whichever way
the option was given. The modules proposed to Lightning itself do not read the environment (they take the settings
object only), so nothing outside this module does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from serialized_restore._options import READERS, SerializedLoading, settings_of

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
    AVAILABLE_MEMORY_ENV: "SerializedLoading.available_memory",
}
"""Every environment variable the package reads, and the field it overrides."""


def options_from(
    value: object, owner: str = "Trainer", environ: Mapping[str, str] = os.environ
) -> SerializedLoading | None:
    """:func:`~serialized_restore._options.settings_of` ``value``, with the fields the environment sets overridden;
    a malformed variable raises ``ValueError`` naming it, on every rank, when the ``Trainer`` or ``Fabric`` is
    built."""
    if value is False:
        return None
    overrides: dict[str, Any] = {}
    for name, field in ((TURN_TIMEOUT_ENV, "turn_timeout"), (HEARTBEAT_TIMEOUT_ENV, "heartbeat_timeout")):
        seconds = _positive_seconds(environ, name)
        if seconds is not None:
            overrides[field] = seconds
    reader = environ.get(READER_ENV, "").strip().lower()
    if reader:
        if reader not in READERS:
            raise ValueError(f"`{READER_ENV}={reader!r}` is not supported. Accepted values: {', '.join(READERS)}.")
        overrides["reader"] = reader
    tmpdir = environ.get(TMPDIR_ENV, "").strip()
    if tmpdir:
        overrides["tmpdir"] = tmpdir
    memory = _bytes(environ, AVAILABLE_MEMORY_ENV)
    if memory is not None:
        overrides["available_memory"] = memory
    return settings_of(value, owner, **overrides)


def _positive_seconds(environ: Mapping[str, str], name: str) -> float | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError as err:
        raise ValueError(
            f"`{name}={raw!r}` is not a number of seconds. Set it to a positive number, e.g. 600."
        ) from err
    if not value > 0:
        raise ValueError(f"`{name}={raw!r}` must be a positive number of seconds, e.g. 600.")
    return value


def _bytes(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(float(raw))
    except ValueError as err:
        raise ValueError(f"`{name}={raw!r}` is not a number of bytes, e.g. 17179869184.") from err
    if value < 0:
        raise ValueError(f"`{name}={raw!r}` must not be negative.")
    return value
