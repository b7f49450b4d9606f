#!/usr/bin/env bash
# CI step: a core subset of the suite on each supported Lightning release and on Lightning's master snapshot, each in a
# small venv of its own over .venv's packages (the same torch, nothing downloaded twice). Aim: under 6 minutes on 2
# cores. Arguments: the releases to run (default: all of RELEASES).
#
# Each venv (.venv/lightning/<release>/, created once, kept while its stamp matches) has no pip and no packages of its
# own but Lightning: a .pth line puts .venv's site-packages after its own, so its `lightning`, `lightning_fabric` and
# `pytorch_lightning` shadow .venv's in this process and in every process the tests start (they run sys.executable).
# A release's Lightning comes from requirements/lightning-<release>.txt, installed with --no-deps; master from the
# snapshot (../shared/upstream/lightning-master-*.tar.gz, or $LIGHTNING_MASTER_SNAPSHOT), installed editable as
# Lightning's own CI does for `lightning` (PACKAGE_NAME=lightning), plus `lightning_fabric` and `pytorch_lightning`
# built from the same tree (PACKAGE_NAME=fabric, pytorch), so that both flavours are master's.
#
# 2.6 is the release .venv has (requirements/ci.txt): scripts/test.sh runs the whole suite on it, so CI leaves it out
# here (`bash scripts/lightning_matrix.sh 2.6` runs the subset on it too).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
started=$SECONDS
RELEASES=(2.4 2.5 master)
[ "$#" -gt 0 ] && RELEASES=("$@")
# the core subset: exact resume (fit, both flavours; validate, test and predict), a rank failing (first, middle or
# last; in either stage), fabric.load (both flavours), the private Lightning names, the compatibility decisions
TESTS=(
  "tests/test_restore.py::test_fit_resume_is_bit_identical[True]"
  "tests/test_restore.py::test_fit_resume_is_bit_identical[lightning-flavour]"
  "tests/test_restore.py::test_evaluation_entry_points"
  "tests/test_failures.py::test_an_exception_on_one_rank_is_raised_on_every_rank"
  "tests/test_fabric.py::test_load_equals_upstream_and_keeps_nothing_backed_by_the_file"
  tests/test_private_names.py
  tests/test_versions.py
)

step() { printf '\n== lightning matrix: %s (%ds)\n' "$1" "$((SECONDS - started))"; }
fail() {
  echo "lightning matrix FAILED: $1" >&2
  exit 1
}
# pip's notes on index locations this machine lacks are noise here; its errors still fail the step
quiet_pip() { "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }; }

if [ -z "${SERIALIZED_RESTORE_BASE_PYTHON:-}" ]; then
  # shellcheck disable=SC1091
  source scripts/env.sh
  SERIALIZED_RESTORE_BASE_PYTHON="$ROOT/.venv/bin/python"
fi
BASE_PY="$SERIALIZED_RESTORE_BASE_PYTHON"
MATRIX="${SERIALIZED_RESTORE_MATRIX_DIR:-$ROOT/.venv/lightning}"
BASE_SITE="$("$BASE_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

master_snapshot() {
  if [ -z "${LIGHTNING_MASTER_SNAPSHOT:-}" ]; then
    mapfile -t found < <(ls ../shared/upstream/lightning-master-*.tar.gz 2>/dev/null)
    [ "${#found[@]}" -eq 1 ] || fail "expected one ../shared/upstream/lightning-master-*.tar.gz, found ${#found[@]}"
    LIGHTNING_MASTER_SNAPSHOT="$ROOT/${found[0]}"
  fi
  echo "$LIGHTNING_MASTER_SNAPSHOT"
}

# create (once) the venv of release $1 in $MATRIX/$1
make_venv() {
  local release="$1" dir="$MATRIX/$1" inputs stamp site py
  if [ "$release" = master ]; then
    inputs="$(master_snapshot)"
    inputs="$inputs $(sha1sum < "$inputs")"
  else
    [ -f "requirements/lightning-$release.txt" ] || fail "no requirements/lightning-$release.txt for release $release"
    inputs="$(cat "requirements/lightning-$release.txt")"
  fi
  stamp="$dir/.stamp-$(echo "$inputs $BASE_SITE" | sha1sum | cut -c1-12)"
  [ -f "$stamp" ] && return
  step "$release: creating its venv in $dir"
  rm -rf "$dir"
  "$BASE_PY" -m venv --without-pip "$dir"
  py="$dir/bin/python"
  site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$BASE_SITE" > "$site/_base_venv.pth"
  # pip comes from .venv; --ignore-installed: install here, whatever .venv has (pip never touches .venv)
  local pip=("$py" -m pip install --quiet --no-deps --ignore-installed)
  if [ "$release" = master ]; then
    mkdir -p "$dir/src"
    tar -xzf "$(master_snapshot)" -C "$dir/src"
    local tree="$dir/src/lightning-master"
    # setuptools from .venv: nothing to download
    (cd "$tree" && PACKAGE_NAME=lightning quiet_pip "${pip[@]}" --no-build-isolation -e .) \
      || fail "could not install the master snapshot (lightning)"
    for package in fabric pytorch; do
      (cd "$tree" && PACKAGE_NAME=$package quiet_pip "${pip[@]}" --no-build-isolation .) \
        || fail "could not install the master snapshot ($package)"
    done
  else
    quiet_pip "${pip[@]}" -r "requirements/lightning-$release.txt" || fail "could not install Lightning $release"
  fi
  touch "$stamp"
}

# every Lightning package comes from the venv of release $1, in its python and in a process that python starts
check_shadowing() {
  "$MATRIX/$1/bin/python" - "$MATRIX/$1" <<'EOF' || fail "$1: a Lightning package does not come from its venv"
import subprocess
import sys

CHECK = """
import importlib, os, sys
for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric"):
    where = os.path.realpath(importlib.import_module(name).__file__)
    if not where.startswith(os.path.realpath(sys.argv[1]) + os.sep):
        sys.exit(f"{name} comes from {where}, not from {sys.argv[1]}")
import lightning, pytorch_lightning, torch
print("lightning", lightning.__version__, "pytorch_lightning", pytorch_lightning.__version__, "torch", torch.__version__)
"""
exec(CHECK)
subprocess.run([sys.executable, "-c", CHECK, sys.argv[1]], check=True)
EOF
}

for release in "${RELEASES[@]}"; do
  make_venv "$release"
  step "$release: Lightning packages"
  check_shadowing "$release"
  step "$release: ${#TESTS[@]} test selections"
  "$MATRIX/$release/bin/python" -m pytest -n 2 --timeout=300 -q --color=no -p no:cacheprovider "${TESTS[@]}" \
    || fail "the core subset fails on Lightning $release"
done
step "passed (${RELEASES[*]})"
