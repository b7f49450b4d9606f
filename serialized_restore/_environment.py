"""Environment variables that override fields of :class:`~serialized_restore.SerializedLoading`, for operators.

Read when the add-on's ``Trainer`` or ``Fabric`` is built, whichever way the option was given, so that a job can be
tuned without changing its code.
"""

from __future__ import annotations

import os
from typing import Any

from serialized_restore._options import READERS, SerializedLoading, settings_of

# every override variable, and the field of SerializedLoading it overrides
ENVIRONMENT_OVERRIDES = {
    "SERIALIZED_RESTORE_TURN_TIMEOUT": "turn_timeout",
    "SERIALIZED_RESTORE_HEARTBEAT_TIMEOUT": "heartbeat_timeout",
    "SERIALIZED_RESTORE_READER": "reader",
    "SERIALIZED_RESTORE_TMPDIR": "tmpdir",
    "SERIALIZED_RESTORE_AVAILABLE_MEMORY": "available_memory",
}


def options_from(value: object, owner: str = "Trainer") -> SerializedLoading | None:
    """:func:`~serialized_restore._options.settings_of` ``value``, with the fields the environment sets overridden;
    a malformed variable raises ``ValueError`` naming it."""
    if value is False:
        return None
    overrides: dict[str, Any] = {}
    for name, field in ENVIRONMENT_OVERRIDES.items():
        raw = os.environ.get(name, "").strip()
        if raw:
            overrides[field] = _parse(name, field, raw)
    return settings_of(value, owner, **overrides)


def _parse(name: str, field: str, raw: str) -> Any:
    """The value of the variable ``name`` for ``field``; a ``ValueError`` quoting it and what is expected."""
    if field == "tmpdir":
        return raw
    if field == "reader":
        if (reader := raw.lower()) not in READERS:
            raise ValueError(f"`{name}={reader!r}` is not supported. Accepted values: {', '.join(READERS)}.")
        return reader
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
