#!/usr/bin/env bash
# Run tests against one release of transformers or torch, in a virtual environment that sees this environment's
# packages (the package itself, the test tools, the other library) with only that one replaced.
#   bash scripts/check_release.sh transformers 5.22.2         # inside the tested range (CI: the oldest)
#   bash scripts/check_release.sh transformers 5.26.0 tests   # a new release, every test: green before the pin moves
#   bash scripts/check_release.sh torch 2.6.0                 # the oldest torch pyproject.toml admits (CI)
# Without test arguments it runs the tests that break first on that library: for transformers the integration
# (family matrix, equivalence, batches, sampling, windowed MTP, cache contract), for torch the attention and the
# integration. PyPI's Linux torch wheels are CUDA builds: a torch check downloads a few GB, and runs on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/check_release.sh transformers|torch VERSION [pytest args...]"
package="${1:?$usage}"
version="${2:?$usage}"
shift 2
case "$package" in
  transformers)
    tests=(tests/test_compat.py tests/test_family_matrix.py tests/test_generate_equivalence.py
      tests/test_concurrent_calls.py tests/generation/test_batched.py tests/generation/test_sampling.py
      tests/generation/test_windowed_mtp.py tests/cache/test_cache_contract.py) ;;
  torch) tests=(tests/attention tests/test_generate_equivalence.py tests/test_family_matrix.py) ;;
  *) echo "$usage (got '$package')" >&2; exit 2 ;;
esac
if [ "$#" -gt 0 ]; then tests=("$@"); fi
venv="${RELEASE_VENV_DIR:-.venv-releases}/${package}-${version}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv --system-site-packages "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${package}==${version}"
fi
installed="$("$venv/bin/python" -c "import $package; print($package.__version__.split('+')[0])")"
[ "$installed" = "$version" ] || { echo "expected $package $version in $venv, found $installed" >&2; exit 1; }
echo "$package $installed: ${tests[*]}"
"$venv/bin/python" -m pytest -q -n auto -p no:cacheprovider "${tests[@]}"
