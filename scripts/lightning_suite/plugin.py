"""pytest plugin for Lightning's own test suites (``scripts/lightning_suite.sh``): with
``SERIALIZED_RESTORE_SUITE=ours`` in the environment, Lightning's ``Trainer`` and ``Fabric`` are replaced, before
collection, by ``serialized_restore.lightning``'s, defaulting to ``serialized_checkpoint_loading=True`` (a value a
test passes itself wins), under every name Lightning's tests import them from. Unset, the plugin does nothing: that is
the upstream side.

Loaded with ``-p lightning_suite.plugin`` (``scripts/`` on ``PYTHONPATH``); pytest-xdist's workers load it too. The
classes and the default are set by the launcher's own mechanism (``serialized_restore._launcher.switch.switch_on``),
without its one-time "switched on" INFO line, which would change what Lightning's log-asserting tests see.
"""

from __future__ import annotations

import inspect
import os
import sys

import pytest

VARIABLE = "SERIALIZED_RESTORE_SUITE"
OURS = "ours"
# the names the launcher sets, the modules that define the classes included (some of Lightning's tests import them
# from there): checked once set
NAMES = {
    "Trainer": ("lightning", "lightning.pytorch", "lightning.pytorch.trainer", "lightning.pytorch.trainer.trainer"),
    "Fabric": ("lightning", "lightning.fabric", "lightning.fabric.fabric"),
}
_swapped = False


def swap_in() -> None:
    """Give ``serialized_restore.lightning``'s ``Trainer`` and ``Fabric`` every name in ``NAMES`` (the launcher's),
    defaulting to ``serialized_checkpoint_loading=True``; once per process."""
    global _swapped
    if _swapped:
        return
    import serialized_restore.lightning as ours
    from serialized_restore._launcher.switch import switch_on

    # SERIALIZED_RESTORE=1's default on our classes, under the launcher's names, without its "switched on" line: the
    # tests see Lightning's logs and nothing more
    switch_on(ours.__name__, "1", launched=False, announce=False)
    _swapped = True


def _check() -> None:
    """Fail the session at once if a name does not lead to our class or the default is not the one set."""
    import serialized_restore.lightning as ours

    for name, modules in NAMES.items():
        cls = getattr(ours, name)
        for module in modules:
            if getattr(sys.modules[module], name) is not cls:
                raise pytest.UsageError(f"{module}.{name} is not {cls.__module__}.{name}")
        default = inspect.signature(cls.__init__).parameters["serialized_checkpoint_loading"].default
        if default is not True:
            raise pytest.UsageError(f"{name}(serialized_checkpoint_loading=...) defaults to {default!r}, not True")


def pytest_configure(config: pytest.Config) -> None:
    """Swap the classes in when the variable asks for it (before any test module is collected)."""
    value = os.environ.get(VARIABLE, "")
    if value not in ("", OURS):
        raise pytest.UsageError(f"{VARIABLE}={value!r}: expected {OURS!r} or unset")
    if value == OURS:
        swap_in()
        _check()


def pytest_report_header(config: pytest.Config) -> str:
    """Say which classes the session runs with."""
    if os.environ.get(VARIABLE) == OURS:
        classes = "serialized_restore.lightning's (serialized_checkpoint_loading=True)"
        return f"{VARIABLE}={OURS}: Trainer and Fabric are {classes}"
    return f"{VARIABLE} unset: Trainer and Fabric are Lightning's own"
