"""Imported by Python at startup in every process of a job that ``serialized-restore run`` starts.

The launcher puts this directory first on ``PYTHONPATH`` (as ``opentelemetry-instrument`` and ``ddtrace-run`` do), so
every Python process of the job, and every process those start (Lightning's launchers, ``torchrun``, ``mp.spawn``),
runs this module before the program. With ``SERIALIZED_RESTORE`` set it registers an import hook and imports
nothing else: a process that never imports Lightning is unchanged. When a process has imported ``lightning``,
``pytorch_lightning`` or ``lightning_fabric``, the hook lets the package load as usual and then calls
``serialized_restore._launch.switch_on``; it also watches the project's module for that package, which imports the
package itself (``switch_on`` waits for whichever of the two finishes last). Then the ``sitecustomize`` this module
shadows, if any, is imported, as Python would have imported it.
"""

from __future__ import annotations

import os
import sys
import warnings

TYPE_CHECKING = False  # not ``typing.TYPE_CHECKING``: importing ``typing`` at every start would cost every process
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

_VARIABLE = "SERIALIZED_RESTORE"
_WATCHED = (
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "serialized_restore.lightning",
    "serialized_restore.pytorch_lightning",
    "serialized_restore.fabric",
)
_HERE = os.path.dirname(os.path.realpath(__file__))


class _LightningImportHook:
    """A meta path finder that finds the watched modules with the finders after it and switches the option on once
    such a module has been executed (a Lightning package's ``Trainer`` and ``Fabric`` exist, the program has not seen
    them yet)."""

    def __init__(self, raw: str, how: str) -> None:
        self.raw, self.how = raw, how
        self.pending = set(_WATCHED)

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> ModuleSpec | None:
        if name not in self.pending:
            return None
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is not self and find is not None:
                spec = find(name, path, target)
                if spec is not None:
                    break
        loader: Any = spec.loader if spec is not None else None
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec  # nothing to run after (a namespace package), or a loader shared by every module it loads
        upstream = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            del loader.exec_module  # the loader is as it was, whatever happens next
            upstream(module)
            self._switch_on(name)

        # on the loader instance the import system calls, so the module's ``__loader__`` and spec stay upstream's
        loader.exec_module = exec_module
        return spec

    def _switch_on(self, name: str) -> None:
        try:
            from serialized_restore._launch import switch_on
        except ModuleNotFoundError as err:
            if err.name != "serialized_restore":
                raise
            warnings.warn(
                f"{_VARIABLE} is set but `serialized_restore` is not installed for {sys.executable}: {name} runs as"
                " upstream in this process.",
                stacklevel=3,
            )
            done: tuple[str, ...] = _WATCHED
        else:
            done = switch_on(name, self.raw, self.how)
        self.pending.difference_update(done)
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)


def _start() -> None:
    raw = os.environ.get(_VARIABLE, "")
    if raw.strip() not in ("", "0"):
        launched = _HERE in (os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
        sys.meta_path.insert(0, _LightningImportHook(raw, "launcher" if launched else "variable"))
    # chain to the sitecustomize this one shadows: leave the path as it would be without this directory
    sys.path[:] = [p for p in sys.path if not p or os.path.realpath(p) != _HERE]
    this = sys.modules.pop("sitecustomize")
    try:
        import sitecustomize  # noqa: F401
    except ModuleNotFoundError as err:
        # none other: the import system that is importing this module expects to find it where it left it
        sys.modules["sitecustomize"] = this
        if err.name != "sitecustomize":
            raise


if __name__ == "sitecustomize":
    _start()
