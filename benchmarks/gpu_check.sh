#!/usr/bin/env bash
# GPU check: a restore on GPU, upstream Lightning vs serialized_checkpoint_loading=True, side by side (a few
# minutes). Prints one line and exits 0 where no CUDA device is visible, so CI runs it as it is.
#   bash benchmarks/gpu_check.sh            # measure, print the table (bench_output/gpu_check/report.md)
#   bash benchmarks/gpu_check.sh --docs     # also write docs/gpu_check.md
# Arguments go to benchmarks/gpu_check.py (--help lists them). PYTHON chooses the interpreter (default: python).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: skipped: no CUDA device is visible"
    exit 0
fi
exec "$PYTHON" benchmarks/gpu_check.py "$@"
