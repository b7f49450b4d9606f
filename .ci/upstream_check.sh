#!/usr/bin/env bash
# CI step: the upstream series (upstream/series/*.patch, the source of truth) applies to Lightning's master snapshot in
# order, and passes Lightning's own lint and each pull request's tests there, within master's own torch range.
#
# 1. upstream/series.py check against the snapshot (../shared/upstream/lightning-master-*.tar.gz, or
#    $LIGHTNING_MASTER_SNAPSHOT) with master's files of upstream/base/ laid over it (each checked against its git blob
#    id in upstream/base.txt): each patch applies on the ones before it, in the form `series.py refresh` writes.
# 2. A throwaway venv with the newest torch master allows (requirements/pytorch/base.txt: torch <2.10, so 2.9.1, the
#    pin of master's requirements/typing.txt too), the snapshot installed editable as Lightning's CI does, master's
#    pytest and pytest-timeout pins, and Lightning's ruff and mypy (upstream/lint-requirements.txt). PyPI serves torch
#    2.9.1 for Linux as its CUDA build: measured 148 s and 6.6 GB for a cold install on a 2-core machine.
# 3. For each patch in order: git apply --check, apply; ruff check + format --check and mypy (master's pyproject.toml)
#    on every Python file the series has touched so far; that PR's tests (the files it adds or changes under
#    tests/tests_pytorch/ and tests/tests_fabric/, each suite in a pytest run of its own as Lightning runs them), then
#    each `RunIf(standalone=True)` test the PR adds in a pytest run of its own with PL_RUN_STANDALONE_TESTS=1, as
#    Lightning's standalone script runs them (they launch their own processes; master's ones in the same files need
#    GPUs).
# 4. Each independent PR (INDEPENDENT below) applies alone to pristine master, and its tests pass there.
# 5. The oldest torch master supports (torch >=2.1.0, so 2.1.2, with numpy <2 as master's test requirements pin it for
#    Python < 3.12): a second venv runs the tests of the PRs in OLDEST_TORCH_PRS on the whole series, standalone ones
#    included. Measured 90 s and 4.6 GB for a cold install. UPSTREAM_CHECK_OLDEST_TORCH=0 skips this step.
# Aim: under 15 minutes on 2 cores with a warm pip cache.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
PYTHON="${PYTHON:-python3}"
TEST_TIMEOUT=300
NEWEST_TORCH=2.9.1
OLDEST_TORCH=2.1.2
# the pull requests whose tests also run on the oldest torch: all of them (03's standalone FSDP test skips there: FSDP
# on CPU needs torch 2.4; its mapped read runs)
OLDEST_TORCH_PRS=(01-mmap 02-partial-restore 03-fsdp-full-state)
# the pull requests a maintainer may merge without the ones before them (03 builds on 01)
INDEPENDENT=(01-mmap 02-partial-restore)

# pip's notes on index locations this machine lacks are noise here; its errors still fail the step
quiet_pip() { "$VPY" -m pip install --quiet --no-compile "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }; }
step() { printf '\n== upstream check: %s (%ds)\n' "$1" "$((SECONDS - started))"; }
fail() {
  echo "upstream check FAILED: $1" >&2
  exit 1
}

if [ -z "${LIGHTNING_MASTER_SNAPSHOT:-}" ]; then
  mapfile -t found < <(ls ../shared/upstream/lightning-master-*.tar.gz 2>/dev/null)
  [ "${#found[@]}" -eq 1 ] || fail "expected one ../shared/upstream/lightning-master-*.tar.gz, found ${#found[@]}"
  LIGHTNING_MASTER_SNAPSHOT="$PWD/${found[0]}"
fi
export LIGHTNING_MASTER_SNAPSHOT
WORK="$(mktemp -d "${TMPDIR:-/tmp}/upstream-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

step "upstream/series applies in order, each patch as upstream/series.py refresh writes it ($LIGHTNING_MASTER_SNAPSHOT)"
"$PYTHON" upstream/series.py check || fail "upstream/series: see above (upstream/series.py apply, edit, refresh)"
mapfile -t SERIES < <(ls upstream/series/*.patch | sort)
[ "${#SERIES[@]}" -gt 0 ] || fail "upstream/series holds no patch"

# a fresh master tree (the snapshot with upstream/base/), a git repository of its own so that git apply takes every
# path even inside another checkout
unpack() {
  "$PYTHON" upstream/series.py apply "$1/lightning-master" --upto 0 > /dev/null
}
unpack "$WORK/series"
TREE="$WORK/series/lightning-master"

step "throwaway venv: torch $NEWEST_TORCH, master installed editable, its pytest pins, Lightning's ruff and mypy"
"$PYTHON" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
grep -E '^(pytest|pytest-timeout) ' "$TREE/requirements/pytorch/test.txt" | sed 's/ //g' > "$WORK/test-pins.txt"
[ "$(wc -l < "$WORK/test-pins.txt")" -eq 2 ] || fail "master's requirements/pytorch/test.txt pins no pytest/pytest-timeout"
quiet_pip "torch==$NEWEST_TORCH" -r "$WORK/test-pins.txt" -r upstream/lint-requirements.txt \
  || fail "could not install torch, pytest, ruff and mypy"
(cd "$TREE" && PACKAGE_NAME=lightning quiet_pip -e .) \
  || fail "could not install the master snapshot"
"$VPY" -c "import torch; assert torch.__version__.split('+')[0] == '$NEWEST_TORCH', torch.__version__" \
  || fail "the venv's torch is not $NEWEST_TORCH"

# the test files a patch adds or changes under tests/tests_pytorch/ or tests/tests_fabric/, relative to tests/ (where Lightning runs pytest)
tests_of() { sed -n -E 's@^\+\+\+ b/tests/(tests_(pytorch|fabric)/.*\.py)$@\1@p' "$@" | sort -u; }
pytest_in() {
  local tree="$1"
  shift
  (cd "$tree/tests" && "$VPY" -m pytest -q --color=no -p no:cacheprovider --timeout="$TEST_TIMEOUT" "$@")
}
# the test functions a patch adds
tests_added_by() { sed -n -E 's/^\+def (test_[A-Za-z0-9_]+)\(.*/\1/p' "$1" | sort -u; }
# the tests of the files given, each suite in a run of its own; then each standalone test the patch adds (those of
# master in the same files need GPUs) in a run of its own
run_tests() {
  local tree="$1" name="$2" patch="$3" suite files standalone added
  shift 3
  mapfile -t added < <(tests_added_by "$patch")
  for suite in tests_pytorch tests_fabric; do
    mapfile -t files < <(printf '%s\n' "$@" | grep "^$suite/" || true)
    [ "${#files[@]}" -gt 0 ] || continue
    pytest_in "$tree" "${files[@]}" || fail "the tests of $name fail ($suite)"
    # `RunIf(standalone=True)` tests are skipped above; Lightning's conftest keeps only them under this variable.
    # pytest names them relative to the tree (its rootdir), and runs here in tests/
    mapfile -t standalone < <(PL_RUN_STANDALONE_TESTS=1 pytest_in "$tree" --collect-only "${files[@]}" \
      | sed -n 's@^tests/\(tests_.*::.*\)$@\1@p' | grep -E "::($(IFS='|'; echo "${added[*]:-none}"))(\[|$)" || true)
    for test in "${standalone[@]}"; do
      PL_RUN_STANDALONE_TESTS=1 pytest_in "$tree" "$test" || fail "the standalone test $test of $name fails"
    done
  done
}

for index in "${!SERIES[@]}"; do
  PATCH="$PWD/${SERIES[$index]}"
  NAME="$(basename "$PATCH" .patch)"
  step "$NAME: git apply on top of the previous pull requests"
  git -C "$TREE" apply --check "$PATCH" || fail "$NAME does not apply on top of the previous pull requests"
  git -C "$TREE" apply "$PATCH"

  # a pull request must leave the earlier ones' files clean too
  mapfile -t TOUCHED < <(cat "${SERIES[@]:0:$((index + 1))}" | sed -n 's|^+++ b/\(.*\.py\)$|\1|p' | sort -u)
  mapfile -t TOUCHED_SRC < <(printf '%s\n' "${TOUCHED[@]}" | grep '^src/' || true)
  if [ "${#TOUCHED[@]}" -gt 0 ]; then
    step "$NAME: ruff check and format --check (master's pyproject.toml) on ${#TOUCHED[@]} files"
    (cd "$TREE" && "$WORK/venv/bin/ruff" check --config pyproject.toml --no-cache "${TOUCHED[@]}") \
      || fail "ruff flags the files of the series up to $NAME"
    (cd "$TREE" && "$WORK/venv/bin/ruff" format --config pyproject.toml --no-cache --check "${TOUCHED[@]}") \
      || fail "ruff format would change the files of the series up to $NAME"
  fi
  if [ "${#TOUCHED_SRC[@]}" -gt 0 ]; then
    # only the touched modules' findings count (--follow-imports=silent): the rest of Lightning is read for types;
    # as in Lightning's CI (install_types), mypy installs the stub packages it lacks into the throwaway venv
    step "$NAME: mypy (master's pyproject.toml) on ${#TOUCHED_SRC[@]} modules"
    (cd "$TREE" && "$VPY" -m mypy --config-file pyproject.toml --follow-imports=silent \
      --cache-dir "$WORK/mypy-cache" "${TOUCHED_SRC[@]}") || fail "mypy flags the modules of the series up to $NAME"
  fi

  mapfile -t TESTS < <(tests_of "$PATCH")
  [ "${#TESTS[@]}" -gt 0 ] || fail "$NAME changes no test under tests/tests_pytorch/ or tests/tests_fabric/"
  step "$NAME: its tests (${TESTS[*]})"
  run_tests "$TREE" "$NAME" "$PATCH" "${TESTS[@]}"
done

for NAME in "${INDEPENDENT[@]}"; do
  PATCH="$PWD/upstream/series/$NAME.patch"
  [ -f "$PATCH" ] || fail "INDEPENDENT names $NAME, but upstream/series/$NAME.patch does not exist"
  step "$NAME alone on pristine master: git apply and its tests"
  unpack "$WORK/alone-$NAME"
  ALONE="$WORK/alone-$NAME/lightning-master"
  git -C "$ALONE" apply --check "$PATCH" || fail "$NAME does not apply alone to master"
  git -C "$ALONE" apply "$PATCH"
  mapfile -t TESTS < <(tests_of "$PATCH")
  # the venv's lightning is the series tree; this tree's src/ comes first on the path
  PYTHONPATH="$ALONE/src" run_tests "$ALONE" "$NAME (alone)" "$PATCH" "${TESTS[@]}"
done

if [ "${UPSTREAM_CHECK_OLDEST_TORCH:-1}" != 0 ]; then
  step "a second venv: torch $OLDEST_TORCH (the oldest master supports), the snapshot with the whole series"
  NEWEST_VPY="$VPY"
  "$PYTHON" -m venv "$WORK/venv-oldest"
  VPY="$WORK/venv-oldest/bin/python"
  quiet_pip "torch==$OLDEST_TORCH" "numpy<2" -r "$WORK/test-pins.txt" || fail "could not install torch $OLDEST_TORCH"
  (cd "$TREE" && PACKAGE_NAME=lightning quiet_pip -e . "torch==$OLDEST_TORCH" "numpy<2") \
    || fail "could not install the series tree with torch $OLDEST_TORCH"
  for NAME in "${OLDEST_TORCH_PRS[@]}"; do
    mapfile -t TESTS < <(tests_of "upstream/series/$NAME.patch")
    step "$NAME: its tests on torch $OLDEST_TORCH (${TESTS[*]})"
    run_tests "$TREE" "$NAME (torch $OLDEST_TORCH)" "upstream/series/$NAME.patch" "${TESTS[@]}"
  done
  VPY="$NEWEST_VPY"
fi

step "passed"
