#!/usr/bin/env bash
# GPU check: every restore path on GPU against upstream, in one bounded run (benchmarks/gpu_check.py says what it
# runs and checks). On a GPU node:
#   bash benchmarks/gpu_check.sh --require-gpu --out DIR   # exits 2, saying why, where no CUDA device is usable
#   bash benchmarks/gpu_check.sh --docs                    # also write docs/gpu_check.md
# Without --require-gpu it prints one line and exits 0 where no CUDA device is visible. Arguments go to
# benchmarks/gpu_check.py (--help lists them). PYTHON chooses the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
