"""Generates the upstream series, ``upstream/series/NN-<slug>.patch``, from ``upstream/prs/NN-<slug>/tree``.

Each ``prs/NN-<slug>/tree/<path>`` holds the full contents, after that pull request, of a file it adds or changes
(``<path>`` relative to the root of Lightning's master snapshot). The tree of PR NN is the pristine snapshot overlaid
with the trees of PRs 01..NN in order; the patch of PR NN is ``git diff`` of the tree of PR NN-1 -> the tree of PR NN.

Usage::

    python upstream/make_patch.py             # (re)write upstream/series/*.patch
    python upstream/make_patch.py --check     # fail, printing what differs, if a committed patch is stale
    python upstream/make_patch.py --tree DIR [--upto N]   # write the snapshot + PRs 01..N (default: all) to DIR

The snapshot is ``../shared/upstream/lightning-master-*.tar.gz`` relative to the repository root, or the tarball
named by ``$LIGHTNING_MASTER_SNAPSHOT``. A tree file identical to what it overlays is refused: every file of a PR
must be a real change.
"""

from __future__ import annotations

import argparse
import difflib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

UPSTREAM = Path(__file__).resolve().parent
ROOT = UPSTREAM.parent
SNAPSHOT_ENV = "LIGHTNING_MASTER_SNAPSHOT"
PREFIX = "lightning-master/"


class SeriesError(Exception):
    """The PR trees cannot make a series (no snapshot, a file that changes nothing)."""


def find_snapshot() -> Path:
    """The master snapshot tarball: ``$LIGHTNING_MASTER_SNAPSHOT`` or the one under ``../shared/upstream/``."""
    if os.environ.get(SNAPSHOT_ENV):
        return Path(os.environ[SNAPSHOT_ENV])
    found = sorted((ROOT.parent / "shared" / "upstream").glob("lightning-master-*.tar.gz"))
    if len(found) != 1:
        raise SeriesError(
            f"found {len(found)} ../shared/upstream/lightning-master-*.tar.gz, not one: set ${SNAPSHOT_ENV}"
        )
    return found[0]


def list_prs(prs_dir: Path) -> list[Path]:
    """The PR folders ``NN-<slug>`` in series order."""
    return sorted(p for p in prs_dir.iterdir() if p.is_dir() and p.name[:2].isdigit())


def tree_files(pr: Path) -> dict[str, bytes]:
    """What a PR's ``tree/`` holds: snapshot-relative path -> contents."""
    tree = pr / "tree"
    return {p.relative_to(tree).as_posix(): p.read_bytes() for p in sorted(tree.rglob("*")) if p.is_file()}


def read_snapshot(snapshot: Path, paths: set[str]) -> dict[str, bytes]:
    """The snapshot's contents of those of ``paths`` it has (a path it lacks is a file the series adds)."""
    wanted = {PREFIX + p for p in paths}
    found: dict[str, bytes] = {}
    with tarfile.open(snapshot) as tar:
        for member in tar:
            if member.isfile() and member.name in wanted:
                extracted = tar.extractfile(member)
                assert extracted is not None
                found[member.name[len(PREFIX) :]] = extracted.read()
    return found


def git_diff(before: dict[str, bytes | None], after: dict[str, bytes]) -> str:
    """``git diff`` of ``before`` (None: absent) -> ``after``, made by git itself so that ``git apply`` takes it."""
    with tempfile.TemporaryDirectory() as work:
        git = ["git", "-C", work, "-c", "core.autocrlf=false", "-c", "core.safecrlf=false"]
        subprocess.run([*git, "init", "--quiet"], check=True)
        trees = []
        for state in (before, after):
            for path, content in state.items():
                if content is not None:
                    Path(work, path).parent.mkdir(parents=True, exist_ok=True)
                    Path(work, path).write_bytes(content)
            subprocess.run([*git, "add", "--all"], check=True)
            tree = subprocess.run([*git, "write-tree"], check=True, capture_output=True, text=True)
            trees.append(tree.stdout.strip())
        # fixed options, so that neither the user's git configuration nor git's abbreviation changes a patch
        diff = [*git, "diff", "--no-color", "--no-ext-diff", "--no-renames", "--full-index", "--binary"]
        diff += ["--src-prefix=a/", "--dst-prefix=b/", *trees]
        return subprocess.run(diff, check=True, capture_output=True, text=True).stdout


def generate(snapshot: Path, prs_dir: Path) -> dict[str, str]:
    """Every PR's patch, in order: ``NN-<slug>.patch`` -> text."""
    prs = list_prs(prs_dir)
    trees = {pr.name: tree_files(pr) for pr in prs}
    current: dict[str, bytes | None] = dict.fromkeys(set().union(*trees.values()) if trees else set())
    current.update(read_snapshot(snapshot, set(current)))
    patches: dict[str, str] = {}
    for pr in prs:
        files = trees[pr.name]
        if not files:
            raise SeriesError(f"{pr.name}: tree/ holds no file")
        unchanged = sorted(path for path, content in files.items() if current[path] == content)
        if unchanged:
            raise SeriesError(f"{pr.name}: tree/ files identical to what they overlay (not a change): {unchanged}")
        patches[f"{pr.name}.patch"] = git_diff({path: current[path] for path in files}, files)
        current.update(files)
    return patches


def write_tree(snapshot: Path, prs_dir: Path, out: Path, upto: int | None) -> None:
    """Unpack the snapshot into ``out`` and overlay PRs 01..``upto`` (all when None)."""
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(snapshot) as tar:
        for member in tar:
            if member.name.startswith(PREFIX) and member.isfile():
                member.name = member.name[len(PREFIX) :]
                if hasattr(tarfile, "data_filter"):  # no links out of `out`, no special files (Python 3.9.17+)
                    tar.extract(member, out, filter="data")
                else:
                    tar.extract(member, out)
    for pr in list_prs(prs_dir)[:upto]:
        for path, content in tree_files(pr).items():
            (out / path).parent.mkdir(parents=True, exist_ok=True)
            (out / path).write_bytes(content)


def check(generated: dict[str, str], series_dir: Path) -> list[str]:
    """What differs between the committed ``series/`` and ``generated`` (empty when they agree)."""
    committed = {p.name: p.read_text() for p in series_dir.glob("*.patch")} if series_dir.is_dir() else {}
    problems = [f"series/{name}: missing" for name in sorted(set(generated) - set(committed))]
    problems += [f"series/{name}: no PR makes it" for name in sorted(set(committed) - set(generated))]
    for name in sorted(set(generated) & set(committed)):
        if generated[name] != committed[name]:
            diff = difflib.unified_diff(
                committed[name].splitlines(keepends=True),
                generated[name].splitlines(keepends=True),
                f"series/{name} (committed)",
                f"series/{name} (generated)",
            )
            problems.append(f"series/{name}: stale\n{''.join(list(diff)[:80])}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if a committed patch differs from the generated")
    parser.add_argument("--tree", type=Path, help="write the snapshot overlaid with the PRs to this folder")
    parser.add_argument("--upto", type=int, help="with --tree: the number of PRs to overlay (default: all)")
    parser.add_argument("--snapshot", type=Path, help=f"the master tarball (default: ${SNAPSHOT_ENV} or ../shared)")
    args = parser.parse_args(argv)
    prs_dir, series_dir = UPSTREAM / "prs", UPSTREAM / "series"
    try:
        snapshot = args.snapshot or find_snapshot()
        if args.tree:
            write_tree(snapshot, prs_dir, args.tree, args.upto)
            return 0
        patches = generate(snapshot, prs_dir)
    except SeriesError as err:
        print(f"make_patch: {err}", file=sys.stderr)
        return 1
    if args.check:
        problems = check(patches, series_dir)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print("make_patch --check: run `python upstream/make_patch.py` and commit series/", file=sys.stderr)
        return 1 if problems else 0
    series_dir.mkdir(exist_ok=True)
    for stale in series_dir.glob("*.patch"):
        if stale.name not in patches:
            stale.unlink()
    for name, text in patches.items():
        (series_dir / name).write_text(text)
        print(f"wrote upstream/series/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
