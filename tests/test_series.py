"""The upstream series tool (``upstream/series.py``) on a tiny snapshot: apply, refresh, push, check.

The real series is applied to Lightning's master snapshot and tested by ``.ci/upstream_check.sh``.
"""

from __future__ import annotations

import importlib.util
import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

SERIES_PY = Path(__file__).resolve().parents[1] / "upstream" / "series.py"
GIT = shutil.which("git")
pytestmark = pytest.mark.skipif(GIT is None, reason="needs git")


@pytest.fixture(scope="module")
def series_py() -> Any:
    spec = importlib.util.spec_from_file_location("upstream_series", SERIES_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["upstream_series"] = module
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


def git_diff(before: dict[str, str], after: dict[str, str], work: Path) -> str:
    """A patch made by git from two states of a few files (how a contributor would write the first version)."""
    work.mkdir()
    subprocess.run(["git", "-C", str(work), "init", "--quiet"], check=True)
    trees = []
    for state in (before, after):
        for old in work.glob("[!.]*"):
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        for name, text in state.items():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            (work / name).write_text(text)
        subprocess.run(["git", "-C", str(work), "add", "--all"], check=True)
        trees.append(subprocess.run(["git", "-C", str(work), "write-tree"], capture_output=True, text=True).stdout)
    diff = ["git", "-C", str(work), "diff", "--full-index", "--no-renames", "--src-prefix=a/", "--dst-prefix=b/"]
    return subprocess.run([*diff, *(tree.strip() for tree in trees)], capture_output=True, text=True).stdout


def blob_id(path: Path) -> str:
    return subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True, check=True).stdout.strip()


def tiny_base(series_py: Any, monkeypatch: pytest.MonkeyPatch, root: Path, files: dict[str, str]) -> None:
    """Point the tool at a ``base/`` of its own (the files laid over the snapshot) and a ``base.txt`` naming each."""
    lines = ["# the files under base/"]
    for name, text in files.items():
        (root / "base" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "base" / name).write_text(text)
        lines.append(f"{blob_id(root / 'base' / name)} {name}")
    (root / "base.txt").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(series_py, "BASE_FILES", root / "base")
    monkeypatch.setattr(series_py, "BASE_LIST", root / "base.txt")


@pytest.fixture
def setup(series_py: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A snapshot with one module and a series of two patches that change it in turn (02 also adds a file); no base
    files to lay over it."""
    tiny_base(series_py, monkeypatch, tmp_path, {})
    master = {"src/m.py": "a = 1\nb = 2\n", "README.md": "readme\n"}
    snapshot = write_snapshot(tmp_path / "master.tar.gz", master)
    first = {**master, "src/m.py": "a = 1\nb = 3\n"}
    second = {**first, "src/m.py": "a = 0\nb = 3\n", "tests/test_m.py": "def test(): ...\n"}
    series = tmp_path / "series"
    series.mkdir()
    (series / "01-first.patch").write_text(git_diff(master, first, tmp_path / "w1"))
    (series / "02-second.patch").write_text(git_diff(first, second, tmp_path / "w2"))
    return snapshot, series


def test_apply_commits_each_patch_on_the_ones_before(series_py: Any, setup: tuple[Path, Path], tmp_path: Path) -> None:
    """``apply`` makes a git work tree of the snapshot with one commit per patch, up to the one asked for."""
    snapshot, series = setup
    tree = tmp_path / "tree"
    assert series_py.apply(snapshot, tree, upto=1, series=series) == ["01-first"]
    assert series_py.applied(tree) == ["01-first"]
    assert (tree / "src/m.py").read_text() == "a = 1\nb = 3\n" and not (tree / "tests").exists()
    assert series_py.push(tree, series) == "02-second"
    assert (tree / "src/m.py").read_text() == "a = 0\nb = 3\n"
    assert (tree / "tests/test_m.py").exists()
    with pytest.raises(series_py.SeriesError, match="every patch is applied"):
        series_py.push(tree, series)


def test_refresh_writes_the_top_patch_and_push_carries_the_change_up(
    series_py: Any, setup: tuple[Path, Path], tmp_path: Path
) -> None:
    """An edit under PR 01 is written into 01's patch alone; pushing 02 again rewrites its context to follow it."""
    snapshot, series = setup
    tree = tmp_path / "tree"
    series_py.apply(snapshot, tree, upto=1, series=series)
    (tree / "src/m.py").write_text("a = 1\nb = 3\nc = 4\n")
    (tree / "src/new.py").write_text("x = 1\n")
    series_py.refresh(tree, series)
    first = (series / "01-first.patch").read_text()
    assert "+c = 4\n" in first and "+x = 1\n" in first and "-b = 2\n+b = 3\n" in first
    assert series_py.applied(tree) == ["01-first"]

    with pytest.raises(series_py.SeriesError, match="not refreshed"):
        (tree / "README.md").write_text("changed\n")
        series_py.push(tree, series)
    subprocess.run(["git", "-C", str(tree), "checkout", "README.md"], check=True)
    series_py.push(tree, series)
    series_py.refresh(tree, series)
    assert (tree / "src/m.py").read_text() == "a = 0\nb = 3\nc = 4\n"
    assert series_py.check(snapshot, series) == []


def test_check_reports_a_hand_edited_or_broken_patch(series_py: Any, setup: tuple[Path, Path]) -> None:
    """``check`` passes on a refreshed series and names a patch not in refresh's form or one that does not apply."""
    snapshot, series = setup
    assert series_py.check(snapshot, series) == []

    first = series / "01-first.patch"
    original = first.read_text()
    first.write_text(original.replace("@@ -1,2 +1,2 @@", "@@ -1,2 +1,2 @@ a = 1"))
    assert series_py.check(snapshot, series)[0].startswith("series/01-first.patch: ")

    first.write_text(original.replace("-b = 2", "-b = 9"))
    (problem,) = series_py.check(snapshot, series)
    assert problem.startswith("series/01-first.patch: does not apply")


def test_refresh_refuses_a_tree_it_did_not_make(series_py: Any, tmp_path: Path) -> None:
    """A git repository not made by ``apply`` is refused rather than written into a patch."""
    subprocess.run(["git", "-C", str(tmp_path), "init", "--quiet"], check=True)
    (tmp_path / "f").write_text("x\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "f"], check=True)
    env = ["-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "-C", str(tmp_path), *env, "commit", "--quiet", "-m", "other"], check=True)
    with pytest.raises(series_py.SeriesError, match="not a scratch tree"):
        series_py.refresh(tmp_path, tmp_path)


def test_unpack_lays_the_base_files_over_the_snapshot_after_checking_each(
    series_py: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Master's files the snapshot leaves out are laid over it in the ``master`` commit; a file that is not the one
    ``base.txt`` names, or one the snapshot already has, is refused."""
    snapshot = write_snapshot(tmp_path / "master.tar.gz", {"src/m.py": "a = 1\n"})
    tiny_base(series_py, monkeypatch, tmp_path, {"tests/helpers.py": "def helper(): ...\n"})
    tree = tmp_path / "tree"
    series_py.unpack(snapshot, tree)
    assert (tree / "tests/helpers.py").read_text() == "def helper(): ...\n"
    assert series_py._git(tree, "status", "--porcelain") == ""
    (tmp_path / "base/tests/helpers.py").write_text("def helper(): return 1\n")
    with pytest.raises(series_py.SeriesError, match="is not master's file"):
        series_py.unpack(snapshot, tmp_path / "tree2")
    tiny_base(series_py, monkeypatch, tmp_path, {"src/m.py": "a = 1\n"})
    with pytest.raises(series_py.SeriesError, match="in the snapshot already"):
        series_py.unpack(snapshot, tmp_path / "tree3")
