#!/usr/bin/env bash
# CI step: Lightning's own tests (release 2.6.5's, ../shared/lightning-tests/, or $LIGHTNING_TESTS_TARBALL) on the
# pinned Lightning 2.6 in .venv, once with Lightning's Trainer and Fabric ("upstream") and once with the project's
# ("ours": scripts/lightning_suite/plugin.py swaps serialized_restore.lightning's classes in under every name the tests
# import them from, defaulting to serialized_checkpoint_loading=True). Fails, listing them with the essentials of
# their failure, if tests that pass upstream do not pass ours. The comparison is between passing sets: some tests fail
# with upstream's classes too here (extras not installed, no network), in the same environment.
#
# Each side runs from a fresh extraction of the tests into a temporary folder (removed at exit), with pytest-xdist
# (-n 2) and a timeout per test, and writes a junit XML report. The tests' own requirements that .venv lacks
# (scripts/lightning_suite/requirements.txt) go to .venv/lightning-suite, on the suite's PYTHONPATH only.
#
#   bash scripts/lightning_suite.sh               both sides, ours compared with upstream's run of the same call
#   bash scripts/lightning_suite.sh --ours-only   ours only, compared with the recorded set (RECORDED below)
#   bash scripts/lightning_suite.sh --record      upstream's side only: (re)writes the recorded set
# RECORDED: scripts/lightning_suite/upstream-passed-2.6.txt. Other options: --out DIR keeps each side's junit XML,
# pytest log and passing set in DIR; --timeout S per test (default 300).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
SUITE="$ROOT/scripts/lightning_suite"
PASSED="$SUITE/upstream-passed-2.6.txt"
DEPS="$ROOT/.venv/lightning-suite"
TARBALL="${LIGHTNING_TESTS_TARBALL:-../shared/lightning-tests/lightning-2.6.5-tests.tar.gz}"
MODE=both
OUT=""
TIMEOUT=300
# the selection, relative to the tests' folder: the checkpoint tests, then the wider set of the issue
SELECTION=(
  tests_pytorch/trainer/connectors/test_checkpoint_connector.py
  tests_pytorch/models/test_restore.py
  tests_pytorch/checkpointing
  tests_pytorch/loops
  tests_pytorch/callbacks
  tests_pytorch/trainer/connectors
  tests_pytorch/trainer/test_trainer.py
  tests_pytorch/models/test_hooks.py
  tests_pytorch/core/test_datamodules.py
  "tests_pytorch/strategies/test_ddp*.py"
  tests_pytorch/strategies/test_fsdp.py
  tests_fabric/test_fabric.py
  "tests_fabric/strategies/test_ddp*.py"
  "tests_fabric/strategies/test_fsdp*.py"
)
IGNORED=(tests_pytorch/checkpointing/test_legacy_checkpoints.py)

fail() {
  echo "lightning suite FAILED: $1" >&2
  exit 1
}
while [ "$#" -gt 0 ]; do
  case "$1" in
    --ours-only) MODE=ours ;;
    --record) MODE=record ;;
    --out | --timeout)
      [ "$#" -ge 2 ] || fail "$1 needs a value"
      if [ "$1" = --out ]; then OUT="$2"; else TIMEOUT="$2"; fi
      shift
      ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' && exit 0 ;;
    *) fail "unknown option $1 (see --help)" ;;
  esac
  shift
done
[ -f "$TARBALL" ] || fail "no tests tarball at $TARBALL"
TARBALL="$(cd "$(dirname "$TARBALL")" && pwd)/$(basename "$TARBALL")"

# shellcheck disable=SC1091
source scripts/env.sh
unset SERIALIZED_RESTORE SERIALIZED_RESTORE_SUITE # the upstream side runs Lightning's classes, unchanged

# the tests are a release's (2.6.5 in the tarball's name); the Lightning they run against must be of the same 2.6 line
TESTS_RELEASE="$(basename "$TARBALL" | sed -n 's/^lightning-\([0-9.]*[0-9]\)-tests\.tar\.gz$/\1/p')"
INSTALLED="$(python -c 'import lightning; print(lightning.__version__)')"
[ "${TESTS_RELEASE%.*}" = "${INSTALLED%.*}" ] \
  || fail "the tests are Lightning ${TESTS_RELEASE:-?}'s, the installed Lightning is $INSTALLED: not the same release"
# the tests' own requirements, once (kept while the stamp matches)
stamp="$DEPS/.stamp-$(sha1sum < "$SUITE/requirements.txt" | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  rm -rf "$DEPS"
  # pip's notes on index locations this machine lacks are noise here; its errors still fail the step
  python -m pip install --quiet --no-deps --target "$DEPS" -r "$SUITE/requirements.txt" 2>&1 \
    | { grep -v '^WARNING: Location' || true; }
  touch "$stamp"
fi
ENVIRONMENT="tests of Lightning $TESTS_RELEASE on lightning $INSTALLED"
VERSIONS="$(python -c 'import sys, torch; print("torch", torch.__version__, "python", sys.version.split()[0])')"
echo "lightning suite: $ENVIRONMENT, $VERSIONS"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
[ -n "$OUT" ] && mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
RESULTS="${OUT:-$WORK/results}"
mkdir -p "$RESULTS"

# run the selection with side $1's classes (upstream, ours) from a fresh extraction; writes $RESULTS/$1.{xml,log,txt}
run_side() {
  local side="$1" tree="$WORK/$1" started=$SECONDS rc=0
  mkdir -p "$tree"
  tar -xzf "$TARBALL" -C "$tree"
  local variable=""
  [ "$side" = ours ] && variable=ours
  echo "== $side: ${#SELECTION[@]} selections, -n 2, --timeout $TIMEOUT"
  (
    cd "$tree/tests"
    # shellcheck disable=SC2068  # the globs of SELECTION expand here, in the tests' folder
    SERIALIZED_RESTORE_SUITE="$variable" PYTHONPATH="$ROOT/scripts:$DEPS${PYTHONPATH:+:$PYTHONPATH}" \
      python -m pytest ${SELECTION[@]} "${IGNORED[@]/#/--ignore=}" -n 2 --timeout="$TIMEOUT" \
      -o addopts= -o junit_family=xunit1 -p no:cacheprovider -p lightning_suite.plugin \
      -q --color=no --disable-warnings -rN --junitxml="$RESULTS/$side.xml"
  ) > "$RESULTS/$side.log" 2>&1 || rc=$?
  # 0: all passed, 1: some failed; anything else (interrupted, usage or internal error) means no usable result
  [ "$rc" -le 1 ] || { tail -n 30 "$RESULTS/$side.log" >&2; fail "pytest exited with $rc on the $side side"; }
  python "$SUITE/compare.py" passed "$RESULTS/$side.xml" > "$RESULTS/$side.txt" \
    || fail "test files of the selection could not be collected on the $side side (above)"
  summary="$(tail -n 1 "$RESULTS/$side.log" | sed 's/^=* *//; s/ *=*$//')"
  echo "   $side: $summary; $(wc -l < "$RESULTS/$side.txt") passed (no teardown error); $((SECONDS - started))s in all"
}

case "$MODE" in
  record)
    run_side upstream
    { echo "# $ENVIRONMENT: the tests of the selection in scripts/lightning_suite.sh that pass"
      echo "# with Lightning's own Trainer and Fabric. Written by \`bash scripts/lightning_suite.sh --record\`."
      cat "$RESULTS/upstream.txt"; } > "$PASSED"
    echo "lightning suite: recorded $(wc -l < "$RESULTS/upstream.txt") passing tests in ${PASSED#"$ROOT"/}"
    exit 0
    ;;
  ours)
    [ -f "$PASSED" ] || fail "no recorded set ${PASSED#"$ROOT"/}: run with --record"
    recorded="$(head -n 1 "$PASSED" | cut -d: -f1 | cut -c3-)"
    [ "$recorded" = "$ENVIRONMENT" ] || fail "${PASSED#"$ROOT"/} is for $recorded, this is $ENVIRONMENT: run --record"
    grep -v '^#' "$PASSED" > "$RESULTS/upstream.txt"
    echo "== upstream: the recorded set, ${PASSED#"$ROOT"/}"
    ;;
  both) run_side upstream ;;
esac
run_side ours
python "$SUITE/compare.py" compare "$RESULTS/upstream.txt" "$RESULTS/ours.txt" "$RESULTS/ours.xml" \
  || fail "tests that pass with Lightning's classes do not pass with the project's (listed above)"
echo "lightning suite: passed (every test that passes upstream passes ours)"
