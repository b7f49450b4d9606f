"""Environment variables that override the settings of a serialized restore, for operators.

The add-on's ``Trainer`` and ``Fabric`` read them when they are built (:func:`options_from`): an operator can tune a
job (a longer turn timeout, the eager reader, a memory figure for ``"auto"``, a directory for remote checkpoints)
without changing its code. Each overrides one field of :class:`~serialized_restore.SerializedLoading`, whichever way
the option was given. Besides these, only the launcher's switch, ``SERIALIZED_RESTORE`` (``_launch.py``), is read
from the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from serialized_restore._options import READERS, SerializedLoading, settings_of

ENVIRONMENT_OVERRIDES = {
    "SERIALIZED_RESTORE_TURN_TIMEOUT": "SerializedLoading.turn_timeout",
    "SERIALIZED_RESTORE_HEARTBEAT_TIMEOUT": "SerializedLoading.heartbeat_timeout",
    "SERIALIZED_RESTORE_READER": "SerializedLoading.reader",
    "SERIALIZED_RESTORE_TMPDIR": "SerializedLoading.tmpdir",
    "SERIALIZED_RESTORE_AVAILABLE_MEMORY": "SerializedLoading.available_memory",
}
"""Every override variable, and the field it overrides."""


def options_from(
    value: object, owner: str = "Trainer", environ: Mapping[str, str] = os.environ
) -> SerializedLoading | None:
    """:func:`~serialized_restore._options.settings_of` ``value``, with the fields the environment sets overridden;
    a malformed variable raises ``ValueError`` naming it, on every rank, when the ``Trainer`` or ``Fabric`` is
    built."""
    if value is False:
        return None
    overrides: dict[str, Any] = {}
    for name, field in ENVIRONMENT_OVERRIDES.items():
        raw = environ.get(name, "").strip()
        if raw:
            overrides[field.split(".")[1]] = _parse(name, field.split(".")[1], raw)
    return settings_of(value, owner, **overrides)


def _parse(name: str, field: str, raw: str) -> Any:
    """The value of the variable ``name`` for ``field``; a ``ValueError`` quoting it and what is expected."""
    if field == "tmpdir":
        return raw
    if field == "reader":
        if raw.lower() not in READERS:
            raise ValueError(f"`{name}={raw.lower()!r}` is not supported. Accepted values: {', '.join(READERS)}.")
        return raw.lower()
    if field == "available_memory":
        try:
            count = int(float(raw))
        except ValueError as err:
            raise ValueError(f"`{name}={raw!r}` is not a number of bytes, e.g. 17179869184.") from err
        if count < 0:
            raise ValueError(f"`{name}={raw!r}` must not be negative.")
        return count
    try:
        seconds = float(raw)
    except ValueError as err:
        raise ValueError(
            f"`{name}={raw!r}` is not a number of seconds. Set it to a positive number, e.g. 600."
        ) from err
    if not seconds > 0:
        raise ValueError(f"`{name}={raw!r}` must be a positive number of seconds, e.g. 600.")
    return seconds
