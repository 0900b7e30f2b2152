#!/usr/bin/env bash
# Run the tests against one torch release, in a virtual environment that sees this environment's packages
# (transformers, the package itself, the test tools) with only torch replaced.
#   bash scripts/check_torch.sh 2.6.0                   # the oldest torch pyproject.toml admits (CI: a subset)
#   bash scripts/check_torch.sh 2.11.0 tests/attention  # the GPU image's torch, one folder
# PyPI's Linux torch wheels are CUDA builds: the first run downloads a few GB (the CUDA libraries), no GPU needed.
# Extra arguments go to pytest (another test selection instead of the whole suite).
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: scripts/check_torch.sh VERSION [pytest args...]}"
shift
venv="${TORCH_VENV_DIR:-.venv-torch}/${version}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv --system-site-packages "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "torch==${version}"
fi
installed="$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
[ "$installed" = "$version" ] || { echo "expected torch $version in $venv, found $installed" >&2; exit 1; }
tests=(tests)
if [ "$#" -gt 0 ]; then tests=("$@"); fi
echo "torch $installed: ${tests[*]}"
"$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}"
