# Sourced by the other scripts: create (once) and activate .venv with the pinned requirements.
#
# torch comes from wherever pip resolves `torch==<pin>` on this machine. On a plain Linux machine that is PyPI's
# CUDA build (several GB); where a local wheel cache or pip configuration provides the CPU build, that one. To choose,
# set SERIALIZED_RESTORE_TORCH_INDEX_URL to an index that serves the build you want, for example the CPU-only one:
#
#   SERIALIZED_RESTORE_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/test.sh
#
# torch is then installed from that index first; the rest of requirements/ci.txt from the usual ones.
#
# The benchmark's plotting libraries (requirements/plots.txt) go to .venv/plots, on every .venv process's path through
# a .pth file, which the tests' jobs leave out (tests/helpers/site/sitecustomize.py says why).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TORCH_INDEX="${SERIALIZED_RESTORE_TORCH_INDEX_URL:-}"
INPUTS="$(cat requirements/ci.txt requirements/plots.txt setup.py; echo "$TORCH_INDEX")"
STAMP=".venv/.requirements-$(echo "$INPUTS" | sha1sum | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
  python3 -m venv --clear .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
  if [ -n "$TORCH_INDEX" ]; then
    .venv/bin/python -m pip install --quiet --index-url "$TORCH_INDEX" "$(grep -E '^torch==' requirements/ci.txt)"
  fi
  .venv/bin/python -m pip install --quiet -r requirements/ci.txt
  .venv/bin/python -m pip install --quiet --no-deps --target .venv/plots -r requirements/plots.txt
  echo "$ROOT/.venv/plots" > "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/plots.pth"
  .venv/bin/python -m pip install --quiet --no-deps -e .
  rm -f .venv/.requirements-*
  touch "$STAMP"
fi
# shellcheck disable=SC1091
source .venv/bin/activate
echo "environment: $(python -c 'import torch; print("torch", torch.__version__ + ", CUDA build:", torch.version.cuda or "no")')" >&2
