"""The start-up hook's parts that live in the package: the variable that switches the option on, the directory of
the bootstrap ``sitecustomize`` (``_bootstrap/``, which copies these names: ``tests/test_launch.py`` checks they agree),
and the ``.pth`` line through which the variable alone switches it on in an environment (:func:`hook`)."""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

VARIABLE = "SERIALIZED_RESTORE"
# the bootstrap's directory (its ``sitecustomize.py``): first on the path of every process ``serialized-restore run``
# starts
BOOTSTRAP = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "_bootstrap")
PTH = "serialized_restore.pth"  # the start-up line that lets the variable alone switch it on (``hook``)
# the Lightning packages, and the project's module for each: the bootstrap watches for their import
OURS = {
    "lightning": "serialized_restore.lightning",
    "pytorch_lightning": "serialized_restore.pytorch_lightning",
    "lightning_fabric": "serialized_restore.fabric",
}


def hook(install: bool) -> int:
    """``serialized-restore hook install|remove``: add or remove, in this environment's site-packages, the ``.pth``
    line through which ``SERIALIZED_RESTORE`` alone switches the option on (a wheel install ships it; an editable
    install does not)."""
    line = Path(BOOTSTRAP, PTH).read_text()
    target = Path(sysconfig.get_paths()["purelib"], PTH)
    present = target.read_text() if target.is_file() else None
    if present not in (None, line):
        print(f"serialized-restore hook: {target} exists and is not this package's: left as it is", file=sys.stderr)
        return 1
    if install and present is None:
        target.write_text(line)
    elif not install and present is not None:
        target.unlink()
    state = f"on: {VARIABLE} switches the option on" if install else f"off: {VARIABLE} does nothing"
    print(f"serialized-restore hook: {state} in every Python process of {sys.prefix} ({target})")
    return 0
