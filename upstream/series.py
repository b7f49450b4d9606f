"""The upstream series, ``upstream/series/NN-<slug>.patch``: apply it to Lightning's master snapshot, edit, refresh.

The patches are the source of truth. This script works as ``quilt`` does, on a scratch work tree that is a git
repository with one commit per applied pull request (the commit's subject is the patch's name)::

    python upstream/series.py apply DIR [--upto N]   # snapshot -> DIR, then PRs 01..N (default: all), one commit each
    python upstream/series.py refresh DIR            # write the top PR's patch from DIR's working tree (like
                                                     #   `quilt refresh`): all changes since the PR below it
    python upstream/series.py push DIR               # apply the next PR on top (hunks that do not apply: .rej
                                                     #   files to merge by hand, then refresh), then refresh it
    python upstream/series.py check                  # each patch applies in order, in the form `refresh` writes

To change PR 02 of four: ``apply DIR --upto 2``, edit files in DIR, ``refresh DIR``, then ``push DIR`` twice (each push
rewrites the pushed patch, so its context follows the change below it). The snapshot is
``../shared/upstream/lightning-master-*.tar.gz`` relative to the repository root, or ``$LIGHTNING_MASTER_SNAPSHOT``.
Master's own files that the snapshot leaves out but the series needs (``base/``, listed in ``base.txt`` with their git
blob ids at the snapshot's commit) are laid over it, so the base is master as far as the series reaches.
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
SERIES = UPSTREAM / "series"
BASE_FILES = UPSTREAM / "base"
BASE_LIST = UPSTREAM / "base.txt"
SNAPSHOT_ENV = "LIGHTNING_MASTER_SNAPSHOT"
PREFIX = "lightning-master/"
BASE = "master"  # the subject of the scratch tree's first commit: the pristine snapshot
# fixed options, so that neither the user's git configuration nor git's abbreviation changes a patch
DIFF = ["diff", "--no-color", "--no-ext-diff", "--no-renames", "--full-index", "--binary"]
DIFF += ["--src-prefix=a/", "--dst-prefix=b/"]


class SeriesError(Exception):
    """The series cannot be applied or refreshed (no snapshot, a patch that does not apply, a foreign tree)."""


def find_snapshot() -> Path:
    """The master snapshot tarball: ``$LIGHTNING_MASTER_SNAPSHOT`` or the one under ``../shared/upstream/``."""
    if os.environ.get(SNAPSHOT_ENV):
        return Path(os.environ[SNAPSHOT_ENV])
    found = sorted((UPSTREAM.parent.parent / "shared" / "upstream").glob("lightning-master-*.tar.gz"))
    if len(found) != 1:
        raise SeriesError(
            f"found {len(found)} ../shared/upstream/lightning-master-*.tar.gz, not one: set ${SNAPSHOT_ENV}"
        )
    return found[0]


def list_patches(series: Path) -> list[Path]:
    """The patches ``NN-<slug>.patch`` in series order."""
    return sorted(p for p in series.glob("*.patch") if p.name[:2].isdigit())


def _git(tree: Path, *args: str, stdin: bytes | None = None) -> str:
    command = ["git", "-C", str(tree), "-c", "core.autocrlf=false", "-c", "core.safecrlf=false"]
    command += ["-c", "user.name=series", "-c", "user.email=series@localhost", "-c", "commit.gpgsign=false"]
    done = subprocess.run([*command, *args], input=stdin, capture_output=True)
    if done.returncode != 0:
        raise SeriesError(f"git {' '.join(args[:2])} in {tree}: {done.stderr.decode().strip()}")
    return done.stdout.decode()


def _commit(tree: Path, subject: str, amend: bool = False) -> None:
    _git(tree, "add", "--all")
    _git(tree, "commit", "--quiet", "--allow-empty", "--no-verify", *(["--amend"] if amend else []), "-m", subject)


def applied(tree: Path) -> list[str]:
    """The names of the PRs applied in the scratch tree ``tree``, bottom first."""
    subjects = _git(tree, "log", "--reverse", "--format=%s").split("\n")[:-1]
    if not subjects or subjects[0] != BASE:
        raise SeriesError(f"{tree} is not a scratch tree made by `series.py apply`")
    return subjects[1:]


def unpack(snapshot: Path, tree: Path) -> None:
    """The pristine snapshot into ``tree`` with master's files of ``base/`` laid over it, committed as ``master``."""
    tree.mkdir(parents=True, exist_ok=True)
    if any(tree.iterdir()):
        raise SeriesError(f"{tree} is not empty")
    with tarfile.open(snapshot) as tar:
        for member in tar:
            if member.name.startswith(PREFIX) and member.isfile():
                member.name = member.name[len(PREFIX) :]
                tar.extract(member, tree, filter="data")  # no links out of `tree`, no special files
    _git(tree, "init", "--quiet")
    for line in BASE_LIST.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        blob, name = line.split(" ", 1)
        if (tree / name).exists():
            raise SeriesError(f"base/{name} is in the snapshot already: remove it from base/ and base.txt")
        if _git(tree, "hash-object", str(BASE_FILES / name)).strip() != blob:
            raise SeriesError(f"base/{name} is not master's file {blob} (base.txt)")
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_bytes((BASE_FILES / name).read_bytes())
    _commit(tree, BASE)


def push(tree: Path, series: Path = SERIES) -> str:
    """Applies the next patch of ``series`` on top of ``tree`` and commits it; returns its name."""
    patches = list_patches(series)
    done = applied(tree)
    if len(done) >= len(patches):
        raise SeriesError("every patch is applied")
    patch = patches[len(done)]
    if _git(tree, "status", "--porcelain"):
        raise SeriesError(f"{tree} has changes that are not refreshed into {done[-1] if done else 'a patch'}")
    try:
        _git(tree, "apply", "--index", str(patch))
    except SeriesError:
        try:
            # the hunks that apply are applied, the others written to `<file>.rej`
            _git(tree, "apply", "--reject", str(patch))
        except SeriesError as err:
            _commit(tree, patch.stem)
            rejected = sorted(str(p.relative_to(tree)) for p in tree.rglob("*.rej"))
            raise SeriesError(
                f"{patch.name} applied in part: merge {', '.join(rejected)} by hand, delete them, then refresh"
            ) from err
    _commit(tree, patch.stem)
    return patch.stem


def diff_of_top(tree: Path) -> tuple[str, str]:
    """The name of the top PR of ``tree`` and the diff of its working tree against the PR below it."""
    done = applied(tree)
    if not done:
        raise SeriesError(f"no patch is applied in {tree}")
    rejected = sorted(str(p.relative_to(tree)) for p in tree.rglob("*.rej"))
    if rejected:
        raise SeriesError(f"merge and delete the rejected hunks first: {', '.join(rejected)}")
    _git(tree, "add", "--all")
    return done[-1], _git(tree, *DIFF, "--cached", "HEAD~1")


def refresh(tree: Path, series: Path = SERIES) -> Path:
    """Writes the top PR's patch from ``tree`` (everything changed since the PR below it) and amends its commit."""
    name, text = diff_of_top(tree)
    if not text:
        raise SeriesError(f"{name} changes nothing")
    _commit(tree, name, amend=True)
    path = series / f"{name}.patch"
    path.write_text(text)
    return path


def apply(snapshot: Path, tree: Path, upto: int | None = None, series: Path = SERIES) -> list[str]:
    """A scratch tree at ``tree``: the snapshot, then PRs 01..``upto`` (all when None), one commit each."""
    unpack(snapshot, tree)
    return [push(tree, series) for _ in list_patches(series)[:upto]]


def check(snapshot: Path, series: Path = SERIES) -> list[str]:
    """What is wrong with ``series``: a patch that does not apply on the ones before it, or one not in the form
    ``refresh`` writes (hand-edited, or its context moved by a change below it). Empty when all is well."""
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as work:
        tree = Path(work, "tree")
        unpack(snapshot, tree)
        for patch in list_patches(series):
            try:
                _git(tree, "apply", "--index", str(patch))
            except SeriesError as err:
                return [*problems, f"series/{patch.name}: does not apply on the patches before it: {err}"]
            _commit(tree, patch.stem)
            written = _git(tree, *DIFF, "HEAD~1", "HEAD")
            committed = patch.read_text()
            if written != committed:
                diff = difflib.unified_diff(
                    committed.splitlines(keepends=True), written.splitlines(keepends=True), "committed", "refreshed"
                )
                problems.append(f"series/{patch.name}: not as `refresh` writes it\n{''.join(list(diff)[:60])}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["apply", "refresh", "push", "check"])
    parser.add_argument("tree", type=Path, nargs="?", help="the scratch work tree (apply, refresh, push)")
    parser.add_argument("--upto", type=int, help="apply: the number of PRs to apply (default: all)")
    parser.add_argument("--snapshot", type=Path, help=f"the master tarball (default: ${SNAPSHOT_ENV} or ../shared)")
    args = parser.parse_args(argv)
    if args.command != "check" and args.tree is None:
        parser.error(f"{args.command} needs the scratch tree")
    try:
        if args.command == "apply":
            names = apply(args.snapshot or find_snapshot(), args.tree, args.upto)
            print(f"{args.tree}: master + {', '.join(names) or 'no PR'}")
        elif args.command == "push":
            name = push(args.tree)
            print(f"applied {name}; wrote {refresh(args.tree).relative_to(UPSTREAM)}")
        elif args.command == "refresh":
            print(f"wrote {refresh(args.tree).relative_to(UPSTREAM)}")
        else:
            problems = check(args.snapshot or find_snapshot())
            for problem in problems:
                print(problem, file=sys.stderr)
            return 1 if problems else 0
    except SeriesError as err:
        print(f"series: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
