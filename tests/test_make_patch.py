"""The upstream series generator (``upstream/make_patch.py``) on a tiny snapshot: overlay order, ``--check``, refusals.

The real series is generated and checked against Lightning's master snapshot by ``.ci/upstream_check.sh``.
"""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
import tarfile
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


def write_snapshot(path: Path, files: dict[str, str]) -> Path:
    """A tarball laid out as the master snapshot (``lightning-master/<path>``)."""
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"lightning-master/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def write_pr(prs: Path, name: str, files: dict[str, str]) -> None:
    for path, text in files.items():
        target = prs / name / "tree" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


@pytest.fixture
def series(tmp_path: Path) -> tuple[Path, Path]:
    """A snapshot with one module and two PRs that change it in turn (02 also adds a file)."""
    snapshot = write_snapshot(tmp_path / "master.tar.gz", {"src/m.py": "a = 1\nb = 2\n", "README.md": "readme\n"})
    prs = tmp_path / "prs"
    write_pr(prs, "01-first", {"src/m.py": "a = 1\nb = 3\n"})
    write_pr(prs, "02-second", {"src/m.py": "a = 0\nb = 3\n", "tests/test_m.py": "def test(): ...\n"})
    return snapshot, prs


def test_each_patch_is_the_diff_from_the_previous_prs_tree(make_patch: Any, series: tuple[Path, Path]) -> None:
    """PR 02's patch is taken against the snapshot overlaid with PR 01, and applies after it with ``git apply``."""
    snapshot, prs = series
    patches = make_patch.generate(snapshot, prs)
    assert list(patches) == ["01-first.patch", "02-second.patch"]
    assert "-b = 2\n+b = 3\n" in patches["01-first.patch"]
    assert "-a = 1\n+a = 0\n" in patches["02-second.patch"] and "-b = 2" not in patches["02-second.patch"]
    assert "new file mode" in patches["02-second.patch"]

    applied = Path(snapshot.parent, "applied")
    make_patch.write_tree(snapshot, prs, applied, 0)
    subprocess.run(["git", "-C", str(applied), "init", "--quiet"], check=True)
    for text in patches.values():
        subprocess.run(["git", "-C", str(applied), "apply", "-"], input=text.encode(), check=True)
    overlaid = Path(snapshot.parent, "overlaid")
    make_patch.write_tree(snapshot, prs, overlaid, None)
    for path in ("src/m.py", "tests/test_m.py", "README.md"):
        assert (applied / path).read_text() == (overlaid / path).read_text()


def test_check_names_a_stale_or_missing_patch(make_patch: Any, series: tuple[Path, Path], tmp_path: Path) -> None:
    """``check`` passes on what was generated and reports, with a diff, a patch edited by hand or one missing."""
    snapshot, prs = series
    patches = make_patch.generate(snapshot, prs)
    committed = tmp_path / "series"
    committed.mkdir()
    for name, text in patches.items():
        (committed / name).write_text(text)
    assert make_patch.check(patches, committed) == []

    (committed / "01-first.patch").write_text(patches["01-first.patch"].replace("+b = 3", "+b = 4"))
    (committed / "02-second.patch").unlink()
    problems = make_patch.check(patches, committed)
    assert problems[0] == "series/02-second.patch: missing"
    assert problems[1].startswith("series/01-first.patch: stale") and "-+b = 4\n" in problems[1]


def test_a_tree_file_identical_to_its_base_is_refused(make_patch: Any, series: tuple[Path, Path]) -> None:
    """A file in a PR's tree that changes nothing (here: PR 03 repeats PR 02's module) is an error, not a no-op."""
    snapshot, prs = series
    write_pr(prs, "03-noop", {"src/m.py": "a = 0\nb = 3\n"})
    with pytest.raises(make_patch.SeriesError, match=r"03-noop: .*identical.*src/m\.py"):
        make_patch.generate(snapshot, prs)
