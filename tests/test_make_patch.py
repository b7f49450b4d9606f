"""The upstream generator's rewrite of a package module into its Lightning copy (``upstream/make_patch.py``), and
its cut of a module to a step of the series.

The whole generator runs in ``.ci/upstream_check.sh`` against the pinned sdist; these tests pin down the rewrite of
the package's Lightning class lookups into direct imports, that the logic check refuses a copy whose code differs,
and how the ``# series:`` blocks cut a module (the last step being the package module itself).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

MAKE_PATCH = Path(__file__).resolve().parents[1] / "upstream" / "make_patch.py"


@pytest.fixture(scope="module")
def make_patch() -> Any:
    spec = importlib.util.spec_from_file_location("make_patch", MAKE_PATCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_patch"] = module
    spec.loader.exec_module(module)
    return module


SOURCE = textwrap.dedent(
    '''\
    """A module."""

    from __future__ import annotations

    import logging
    from typing import Any

    from serialized_restore._flavour import flavour_of
    from serialized_restore._turns import TurnSchedule


    class Connector:
        def __init__(self) -> None:
            flavour = flavour_of(self)
            self._log = logging.getLogger(f"{flavour.pytorch}.serialized_restore")

        def choose(self, strategy: Any) -> bool:
            """Which strategy."""
            flavour = flavour_of(self)
            ddp = flavour.import_("strategies", "DDPStrategy")
            io = flavour_of(strategy).import_("plugins.io.torch_io", "TorchCheckpointIO", fabric=True)
            return isinstance(strategy, ddp) and isinstance(strategy.checkpoint_io, io) and TurnSchedule is not None
    '''
)


def test_lookups_become_direct_imports_and_the_copy_keeps_the_logic(make_patch: Any) -> None:
    """Each lookup becomes the class, imported at the top of the function that uses it; the flavour's import, its
    assignments and its package name go; the logic check accepts the copy."""
    copy = make_patch.rewrite_module("_example", SOURCE, ["_example", "_turns"])
    body = copy.split('"""A module."""', 1)[1]
    assert "flavour" not in body
    assert 'logging.getLogger("lightning.pytorch.serialized_restore")' in body
    assert "from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO\n" in body
    assert "from lightning.pytorch.strategies import DDPStrategy\n" in body
    assert "ddp = DDPStrategy\n" in body and "io = TorchCheckpointIO\n" in body
    assert "from lightning.pytorch.trainer.connectors.serialized_restore.turns import TurnSchedule" in body
    # the imports open the function's body, after its docstring
    function = next(n for n in ast.walk(ast.parse(copy)) if isinstance(n, ast.FunctionDef) and n.name == "choose")
    assert [type(stmt).__name__ for stmt in function.body[:3]] == ["Expr", "ImportFrom", "ImportFrom"]


def test_a_copy_whose_code_differs_is_refused(make_patch: Any) -> None:
    """The logic check compares the package module with its copy, lookups read as the names they look up: a copy
    importing another class than the one looked up is refused."""
    copy = make_patch.rewrite_module("_example", SOURCE, ["_example", "_turns"])
    make_patch._check_same_logic("_example", SOURCE, copy)
    wrong = copy.replace("ddp = DDPStrategy", "ddp = SingleDeviceStrategy")
    with pytest.raises(make_patch.GenerationError, match="differs from the package's"):
        make_patch._check_same_logic("_example", SOURCE, wrong)


def test_a_lookup_without_literal_arguments_is_refused(make_patch: Any) -> None:
    """A lookup whose class name is computed cannot become an import: the generator stops, naming the module."""
    source = SOURCE.replace(
        'ddp = flavour.import_("strategies", "DDPStrategy")',
        'ddp = [flavour.import_("strategies", n) for n in ("DDPStrategy",)][0]',
    )
    with pytest.raises(make_patch.GenerationError, match=r"_example\.py: .*literal arguments"):
        make_patch.rewrite_module("_example", source, ["_example", "_turns"])


SERIES_SOURCE = textwrap.dedent(
    '''\
    """A module."""

    import os
    import sys

    from serialized_restore._remote import fetch

    LIMIT = 1


    def read(path):
        # series: mmap
        how = "mmap"
        # series: before mmap
        # how = "eager"
        # series: end
        # series: remote
        if "://" in path:
            path = fetch(path)
        # series: end
        return how, os.fspath(path)


    # series: mmap
    def mapped(path):
        # series: fsdp
        print(sys.argv)
        # series: end
        return path


    # series: end
    def last():
        return LIMIT
    '''
)


def _step(make_patch: Any, name: str) -> int:
    return make_patch.STEP_NAMES.index(name)


def test_a_step_keeps_the_blocks_of_the_steps_up_to_it(make_patch: Any) -> None:
    """Before its step a block is gone and its ``before`` part uncommented; from its step on the block stays and the
    ``before`` part goes; nested blocks follow their own step; markers never reach the output, imports a cut leaves
    unused go, and the blank lines where code went are what the formatter wants."""
    core = make_patch.cut(SERIES_SOURCE, _step(make_patch, "core"), "example.py")
    assert "series" not in core
    assert '    how = "eager"\n    return how, os.fspath(path)\n' in core
    assert "mapped" not in core and "fetch" not in core and "import sys" not in core
    assert "LIMIT = 1\n\n\ndef read(path):" in core
    assert "os.fspath(path)\n\n\ndef last():" in core

    mmap = make_patch.cut(SERIES_SOURCE, _step(make_patch, "mmap"), "example.py")
    assert '    how = "mmap"\n    return how' in mmap and "eager" not in mmap
    assert "def mapped(path):\n    return path\n\n\ndef last():" in mmap
    assert "import sys" not in mmap and "fetch" not in mmap

    remote = make_patch.cut(SERIES_SOURCE, _step(make_patch, "remote"), "example.py")
    assert "from serialized_restore._remote import fetch\n" in remote and "sys" not in remote

    last = make_patch.cut(SERIES_SOURCE, len(make_patch.STEPS) - 1, "example.py")
    # the last step is the module itself: the markers and the replaced code are comments
    assert ast.dump(ast.parse(last)) == ast.dump(ast.parse(SERIES_SOURCE))
    assert "series" not in last and "eager" not in last


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("# series: mmap\nx = 1\n", "not closed"),
        ("# series: mmmap\nx = 1\n# series: end\n", "no step 'mmmap'"),
        ("x = 1\n# series: before mmap\n# x = 2\n# series: end\n", "outside its block"),
        ("# series: mmap\nx = 1\n# series: before mmap\nx = 2\n# series: end\n", "must be commented out"),
        ("# series: fsdp\n# series: mmap\nx = 1\n# series: end\n# series: end\n", "inside one of a later step"),
        ("# series: core\nx = 1\n# series: end\n", "for the first step"),
    ],
)
def test_malformed_series_blocks_are_refused(make_patch: Any, text: str, message: str) -> None:
    with pytest.raises(make_patch.GenerationError, match=message):
        make_patch.cut(text, 0, "example.py")


def test_the_last_step_of_every_package_module_is_the_module_itself(make_patch: Any) -> None:
    """The series ends where the package is: cut at the last step, every module has the package module's code."""
    for path in sorted(make_patch.PACKAGE.glob("*.py")):
        source = path.read_text(encoding="utf-8")
        for step in range(len(make_patch.STEPS)):
            ast.parse(make_patch.cut(source, step, path.name))  # every step is valid Python
        last = make_patch.cut(source, len(make_patch.STEPS) - 1, path.name)
        assert ast.dump(ast.parse(last)) == ast.dump(ast.parse(source)), path.name
