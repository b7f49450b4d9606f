#!/usr/bin/env bash
# Runs the test suite in a pinned virtual environment (created on first use). Extra arguments go to pytest.
# Three workers on two cores: most tests spend part of their time waiting on their job's processes (a turn timeout,
# a rank's start), and a third worker fills those waits.
source "$(dirname "$0")/env.sh"
exec python -m pytest -n 3 --dist worksteal --timeout=300 -q --color=no "$@"
