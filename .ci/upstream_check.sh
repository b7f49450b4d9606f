#!/usr/bin/env bash
# CI step: the upstream patch is what the add-on is.
#
# Downloads the lightning sdist of the version pinned in requirements/ci.txt, checks that upstream/series/ (the pull
# requests, in order) and the docs patch are what upstream/make_patch.py produces from the package now, then applies
# the series to the fresh sdist one step at a time, installed (editable) into a throwaway virtual environment without
# the add-on. After each step: Lightning's ruff and mypy (upstream/lint-requirements.txt) with its configuration (the
# sdist's pyproject.toml) on every file the series has touched so far, and the series' tests as of that step. The
# core restore tests of tests/test_restore.py run against the patched `lightning.pytorch.Trainer` after the first step
# (the core alone) and after the last. An unreachable package index fails the step; nothing is skipped.
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
)
# and, once the whole series is applied, the tests of the later steps' features
SERIES_TESTS=(
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

step "upstream/series and the docs patch are what upstream/make_patch.py produces from the package"
"$VPY" upstream/make_patch.py --check --sdist "$SDIST"

mkdir "$WORK/src"
tar -xzf "$SDIST" -C "$WORK/src"
TREE="$WORK/src/lightning-$VERSION"
# a repository of its own, so that git applies every path even when the work dir lies inside another checkout
git -C "$TREE" init --quiet
"$VPY" -m pip install --quiet --no-compile -r upstream/lint-requirements.txt || fail "could not install Lightning's ruff"

mapfile -t SERIES < <(ls upstream/series/*.patch | sort -V)
[ "${#SERIES[@]}" -gt 0 ] || fail "upstream/series holds no patch"
for index in "${!SERIES[@]}"; do
  PATCH="${SERIES[$index]}"
  NAME="$(basename "$PATCH" .patch)"
  step "$NAME: git apply on top of the previous steps"
  git -C "$TREE" apply --check "$PWD/$PATCH" || fail "$NAME does not apply on top of the previous steps"
  git -C "$TREE" apply "$PWD/$PATCH"

  # every Python file the series has touched so far: a step must leave the earlier steps' files clean too
  mapfile -t TOUCHED < <(cat "${SERIES[@]:0:$((index + 1))}" | sed -n 's|^+++ b/\(.*\.py\)$|\1|p' | sort -u)
  [ "${#TOUCHED[@]}" -gt 0 ] || fail "the series touches no Python file"
  step "$NAME: Lightning's ruff and its configuration on the files the series touches"
  (cd "$TREE" && "$WORK/venv/bin/ruff" check --config pyproject.toml --no-cache "${TOUCHED[@]}") \
    || fail "Lightning's ruff rules flag the files of $NAME"
  (cd "$TREE" && "$WORK/venv/bin/ruff" format --config pyproject.toml --no-cache --check "${TOUCHED[@]}") \
    || fail "Lightning's ruff format would change the files of $NAME"

  if [ "$index" -eq 0 ]; then
    step "install the patched tree (editable: the later steps apply in place)"
    "$VPY" -m pip install --quiet --no-compile -e "$TREE" || fail "could not install the patched lightning tree"
    (
      cd "$WORK"
      "$VPY" - <<'PY'
import importlib.util
import inspect

import lightning.pytorch

assert "serialized_checkpoint_loading" in inspect.signature(lightning.pytorch.Trainer.__init__).parameters, (
    "the installed lightning is not the patched one"
)
assert importlib.util.find_spec("serialized_restore") is None, "serialized_restore must not be installed"
print(f"patched lightning {lightning.pytorch.__version__} at {lightning.pytorch.__file__}; no serialized_restore")
PY
    )
  fi

  # Lightning's CI type-checks src/lightning with the mypy of its requirements/typing.txt and the [tool.mypy] section
  # of pyproject.toml; here only the touched modules' findings count (--follow-imports=silent: the rest of Lightning
  # is read for types, its own findings under this torch are not this patch's; as there, mypy installs the stub
  # packages it is missing, into the throwaway environment)
  mapfile -t TOUCHED_SRC < <(printf '%s\n' "${TOUCHED[@]}" | grep '^src/')
  step "$NAME: Lightning's mypy and its configuration on the modules the series touches"
  (cd "$TREE" && "$VPY" -m mypy --config-file pyproject.toml --follow-imports=silent \
    --cache-dir "$WORK/mypy-cache" "${TOUCHED_SRC[@]}") \
    || fail "Lightning's mypy settings flag the modules of $NAME"

  step "$NAME: the tests of the series so far ($PATCH_TESTS)"
  (cd "$TREE" && "$VPY" -m pytest -q --color=no -p no:cacheprovider --timeout=300 "$PATCH_TESTS") \
    || fail "the tests of $NAME fail"

  if [ "$index" -eq 0 ]; then
    step "$NAME: core restore tests against the patched lightning.pytorch.Trainer"
    mkdir -p "$WORK/pytest"
    SERIALIZED_RESTORE_TRAINER=patched-upstream "$VPY" -m pytest -q --color=no -p no:cacheprovider -n 2 \
      --timeout=400 --basetemp="$WORK/pytest/core" "${CORE_TESTS[@]}" || fail "the core tests fail against $NAME"
  fi
done

step "the whole series: core restore tests against the patched lightning.pytorch.Trainer"
SERIALIZED_RESTORE_TRAINER=patched-upstream "$VPY" -m pytest -q --color=no -p no:cacheprovider -n 2 --timeout=400 \
  --basetemp="$WORK/pytest/series" "${CORE_TESTS[@]}" "${SERIES_TESTS[@]}" || fail "the core tests fail against the series"

step "passed"
