# Sourced by the other scripts: create (once) and activate .venv with the pinned requirements.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
STAMP=".venv/.requirements-$(sha1sum requirements/ci.txt setup.py | sha1sum | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -r requirements/ci.txt
  .venv/bin/python -m pip install --quiet --no-deps -e .
  rm -f .venv/.requirements-*
  touch "$STAMP"
fi
# shellcheck disable=SC1091
source .venv/bin/activate
