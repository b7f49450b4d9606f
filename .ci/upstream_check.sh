#!/usr/bin/env bash
# CI step: the upstream patch is what the add-on is.
#
# Downloads the lightning sdist of the version pinned in requirements/ci.txt, checks that upstream/*.patch is what
# upstream/make_patch.py produces from the package now, applies the patch to the fresh sdist, installs the patched
# tree into a throwaway virtual environment without the add-on, lints the files the patch touches with Lightning's
# ruff and mypy (upstream/lint-requirements.txt) and configuration (the sdist's pyproject.toml), and runs the patch's own
# tests and the core restore tests of tests/test_restore.py against the patched `lightning.pytorch.Trainer`. An
# unreachable package index fails the step; nothing is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
PYTHON="${PYTHON:-python3}"

# the core restore tests, run with `"trainer": "ours"` resolved to the patched Trainer (tests/helpers/job.py); the
# reference runs ("trainer": "upstream") use the unpatched pytorch-lightning of requirements/ci.txt
CORE_TESTS=(
  "tests/test_restore.py::test_fit_resume_is_bit_identical"
  "tests/test_restore.py::test_hooks_see_what_upstream_hooks_see"
  "tests/test_restore.py::test_default_off_behaves_as_upstream"
  "tests/test_restore.py::test_evaluation_entry_points[validate]"
  "tests/test_restore.py::test_turns_never_exceed_k_per_node[3-1]"
  "tests/test_restore.py::test_special_paths_best_last_hpc"
  "tests/test_restore.py::test_auto_chooses_k_per_node_from_available_memory"
)
PATCH_TESTS="tests/tests_pytorch/trainer/connectors/test_serialized_checkpoint_loading.py"

step() { printf '\n== upstream check: %s (%ds)\n' "$1" "$((SECONDS - started))"; }
fail() {
  echo "upstream check FAILED: $1" >&2
  exit 1
}

VERSION="$(sed -n 's/^lightning==\([^ #]*\).*/\1/p' requirements/ci.txt)"
[ -n "$VERSION" ] || fail "requirements/ci.txt pins no lightning==<version>"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/upstream-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

step "throwaway virtual environment"
"$PYTHON" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
# every pin of requirements/ci.txt except lightning, which the patched tree provides, and what only benchmarks use
grep -v -E '^[[:space:]]*(#|$)|^(lightning|matplotlib)==' requirements/ci.txt > "$WORK/requirements.txt"
"$VPY" -m pip install --quiet --no-compile -r "$WORK/requirements.txt" || fail "could not install requirements/ci.txt"

step "download the lightning==$VERSION sdist"
if ! "$VPY" -m pip download --no-binary :all: --no-deps "lightning==$VERSION" -d "$WORK/sdist" >"$WORK/download.log" 2>&1; then
  cat "$WORK/download.log" >&2
  fail "could not download the lightning==$VERSION sdist from the package index"
fi
SDIST="$WORK/sdist/lightning-$VERSION.tar.gz"
[ -f "$SDIST" ] || fail "pip download produced no $SDIST"

step "upstream/*.patch is what upstream/make_patch.py produces from the package"
"$VPY" upstream/make_patch.py --check --sdist "$SDIST"

step "git apply to the fresh sdist"
mkdir "$WORK/src"
tar -xzf "$SDIST" -C "$WORK/src"
TREE="$WORK/src/lightning-$VERSION"
# a repository of its own, so that git applies every path even when the work dir lies inside another checkout
git -C "$TREE" init --quiet
git -C "$TREE" apply --check "$PWD/upstream/serialized-checkpoint-loading.patch"
git -C "$TREE" apply "$PWD/upstream/serialized-checkpoint-loading.patch"
rm -rf "$TREE/.git"

step "Lightning's ruff and its configuration on the files the patch touches"
"$VPY" -m pip install --quiet --no-compile -r upstream/lint-requirements.txt || fail "could not install Lightning's ruff"
mapfile -t TOUCHED < <(sed -n 's|^+++ b/\(.*\.py\)$|\1|p' upstream/serialized-checkpoint-loading.patch)
[ "${#TOUCHED[@]}" -gt 0 ] || fail "the patch touches no Python file"
(cd "$TREE" && "$WORK/venv/bin/ruff" check --config pyproject.toml --no-cache "${TOUCHED[@]}") \
  || fail "Lightning's ruff rules flag the patched files"
(cd "$TREE" && "$WORK/venv/bin/ruff" format --config pyproject.toml --no-cache --check "${TOUCHED[@]}") \
  || fail "Lightning's ruff format would change the patched files"

step "install the patched tree"
"$VPY" -m pip install --quiet --no-compile "$TREE" || fail "could not install the patched lightning tree"
(
  cd "$WORK"
  "$VPY" - <<'EOF'
import importlib.util
import inspect

import lightning.pytorch

assert "serialized_checkpoint_loading" in inspect.signature(lightning.pytorch.Trainer.__init__).parameters, (
    "the installed lightning is not the patched one"
)
assert importlib.util.find_spec("serialized_restore") is None, "serialized_restore must not be installed"
print(f"patched lightning {lightning.pytorch.__version__} at {lightning.pytorch.__file__}; no serialized_restore")
EOF
)

step "Lightning's mypy and its configuration on the modules the patch touches"
# Lightning's CI type-checks src/lightning with the mypy of its requirements/typing.txt and the [tool.mypy] section of
# pyproject.toml; here only the touched modules' findings count (--follow-imports=silent: the rest of Lightning is
# read for types, its own findings under this torch are not this patch's; as there, mypy installs the stub packages
# it is missing, into the throwaway environment)
mapfile -t TOUCHED_SRC < <(printf '%s\n' "${TOUCHED[@]}" | grep '^src/')
(cd "$TREE" && "$VPY" -m mypy --config-file pyproject.toml --follow-imports=silent \
  --cache-dir "$WORK/mypy-cache" "${TOUCHED_SRC[@]}") \
  || fail "Lightning's mypy settings flag the patched modules"

step "the patch's own tests ($PATCH_TESTS)"
(cd "$TREE" && "$VPY" -m pytest -q --color=no -p no:cacheprovider --timeout=300 "$PATCH_TESTS")

step "core restore tests against the patched lightning.pytorch.Trainer"
mkdir -p "$WORK/pytest"
SERIALIZED_RESTORE_TRAINER=patched-upstream "$VPY" -m pytest -q --color=no -p no:cacheprovider -n 2 --timeout=400 \
  --basetemp="$WORK/pytest/base" "${CORE_TESTS[@]}"

step "passed"
