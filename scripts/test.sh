#!/usr/bin/env bash
# Runs the test suite in a pinned virtual environment (created on first use). Extra arguments go to pytest.
source "$(dirname "$0")/env.sh"
exec python -m pytest -n 2 --dist worksteal --timeout=300 -q --color=no "$@"
