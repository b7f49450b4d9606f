"""The package's layout keeps the limits ``docs/design.md`` states: no file over 400 lines, no chain of the package's
own imports longer than 8 modules, no import going up a layer, and no module importing another's private names. Read
from the source, never run."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "serialized_restore"
MAX_LINES = 400
MAX_CHAIN = 8
# the layers, bottom first (docs/design.md, *The map*): a module imports only from its own layer or those below
_BASE = ("_files", "_host", "settings", "_coordination.placement", "_lightning.names", "_lightning.versions")
_BASE += ("_lightning.strategies", "_launcher.hook")
LAYERS = (_BASE, ("_coordination",), ("_restore",), ("_lightning",), ("",))


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, modules: dict[str, Path]) -> dict[str, set[str]]:
    """The package's modules ``name`` imports (anywhere in it, ``TYPE_CHECKING`` blocks and functions included), each
    with the names it takes from it."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(modules[name].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in modules:  # a module of a package
                    found.setdefault(f"{node.module}.{alias.name}", set())
                elif node.module in modules:
                    found.setdefault(node.module, set()).add(alias.name)
        elif isinstance(node, ast.Import):
            found.update({alias.name: set() for alias in node.names if alias.name in modules})
    found.pop(name, None)
    return found


def test_no_package_file_is_over_the_limit() -> None:
    """Every file of the package has at most 400 lines."""
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_no_import_chain_is_longer_than_eight_modules() -> None:
    """The longest chain of the package's own imports (a module, one it imports, one that one imports, ...) has at most
    8 modules, and no module imports itself through others."""
    modules = _modules()
    graph = {name: set(_imports(name, modules)) for name in modules}

    @functools.cache
    def chain(name: str, seen: frozenset[str] = frozenset()) -> tuple[str, ...]:
        assert name not in seen, f"an import cycle through {name}"
        return (name, *max((chain(d, seen | {name}) for d in graph[name]), key=len, default=()))

    longest = max((chain(name) for name in modules), key=len)
    assert len(longest) <= MAX_CHAIN, " -> ".join(longest)


def _layer(name: str) -> int:
    """The layer of module ``name``: the first whose prefixes it falls under (``""``: anything)."""
    relative = name.removeprefix("serialized_restore").removeprefix(".")
    for index, prefixes in enumerate(LAYERS):
        if any(relative == p or relative.startswith(f"{p}.") or not p for p in prefixes):
            return index
    raise AssertionError(name)


def test_no_import_goes_up_a_layer() -> None:
    """What the package knows of files, settings and Lightning's names is at the bottom; the coordination above it,
    then the restore, then the Lightning mixins, then the public modules, the forecast and the launcher: no module
    imports from a layer above its own."""
    modules = _modules()
    upward = {
        (name, imported) for name in modules for imported in _imports(name, modules) if _layer(imported) > _layer(name)
    }
    assert upward == set()


def test_no_module_imports_another_modules_private_names() -> None:
    """What a module keeps to itself (a ``_name``) is imported by no other module of the package."""
    modules = _modules()
    private = {
        (name, imported, taken)
        for name in modules
        for imported, names in _imports(name, modules).items()
        for taken in names
        if taken.startswith("_") and not taken.startswith("__")
    }
    assert private == set()
