"""Imported at startup in every process ``serialized-restore run`` starts (``docs/launcher.md``): registers an import
hook and imports nothing else, then imports the ``sitecustomize`` it shadows, if any."""

from __future__ import annotations

import os
import sys
import warnings

TYPE_CHECKING = False  # not ``typing.TYPE_CHECKING``: importing ``typing`` at every start would cost every process
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

_VARIABLE = "SERIALIZED_RESTORE"
# the Lightning packages, and the project's module for each (which imports the package before it has run itself)
_WATCHED = {"lightning", "pytorch_lightning", "lightning_fabric"}
_WATCHED |= {"serialized_restore.lightning", "serialized_restore.pytorch_lightning", "serialized_restore.fabric"}
_HERE = os.path.dirname(os.path.realpath(__file__))


class _LightningImportHook:
    """A meta path finder that calls ``serialized_restore._launcher.switch.switch_on`` once a watched module has run."""

    def __init__(self, raw: str, launched: bool) -> None:
        self.raw = raw
        self.launched = launched

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> ModuleSpec | None:
        if name not in _WATCHED:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        loader = getattr(spec, "loader", None)
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec  # nothing to run after (a namespace package), or a loader shared by every module it loads
        upstream = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            del loader.exec_module  # the loader is as it was, whatever happens next
            upstream(module)
            try:
                from serialized_restore._launcher.switch import switch_on
            except ModuleNotFoundError as err:
                if err.name != "serialized_restore":
                    raise
                if self in sys.meta_path:  # warn once
                    sys.meta_path.remove(self)
                    warnings.warn(
                        f"{_VARIABLE} is set but `serialized_restore` is not installed for {sys.executable}: {name}"
                        " runs as upstream in this process.",
                        stacklevel=2,
                    )
            else:
                switch_on(name, self.raw, self.launched)

        # on the loader instance the import system calls, so the module's ``__loader__`` and spec stay upstream's
        loader.exec_module = exec_module
        return spec


def _start() -> None:
    raw = os.environ.get(_VARIABLE, "")
    if raw.strip() not in ("", "0"):
        launched = _HERE in (os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
        sys.meta_path.insert(0, _LightningImportHook(raw, launched))
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
