#!/usr/bin/env bash
# Run the integration-critical tests against one transformers release, in a virtual environment that sees this
# environment's packages (torch, the package itself, the test tools) with only transformers replaced.
#   bash scripts/check_transformers.sh 5.22.2           # a release inside the tested range (CI: the oldest)
#   bash scripts/check_transformers.sh 5.26.0           # a new release: green here before the pin admits it
# Extra arguments go to pytest (e.g. -x, or another test selection instead of the default one).
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: scripts/check_transformers.sh VERSION [pytest args...]}"
shift
venv="${TRANSFORMERS_VENV_DIR:-.venv-transformers}/${version}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv --system-site-packages "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "transformers==${version}"
fi
installed="$("$venv/bin/python" -c 'import transformers; print(transformers.__version__)')"
[ "$installed" = "$version" ] || { echo "expected transformers $version in $venv, found $installed" >&2; exit 1; }
tests=(tests/test_compat.py tests/test_family_matrix.py tests/test_generate_equivalence.py tests/test_concurrent_calls.py
  tests/generation/test_batched.py tests/generation/test_sampling.py tests/generation/test_windowed_mtp.py
  tests/cache/test_cache_contract.py)
if [ "$#" -gt 0 ]; then tests=("$@"); fi
echo "transformers $installed: ${tests[*]}"
"$venv/bin/python" -m pytest -q "${tests[@]}"
