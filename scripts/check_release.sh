#!/usr/bin/env bash
# Run tests against one release of transformers or torch, in a virtual environment that sees this environment's
# packages (the package itself, the test tools, the other library) with only that one replaced.
#   bash scripts/check_release.sh transformers 5.22.2         # inside the tested range (CI: the oldest)
#   bash scripts/check_release.sh transformers 5.26.0 tests   # a new release, every test: green before the pin moves
#   bash scripts/check_release.sh torch 2.6.0                 # the oldest torch pyproject.toml admits (CI)
# Without test arguments it runs the tests that break first on that library: for transformers the integration
# (family matrix, equivalence, batches, sampling, windowed MTP, the device round and its compiled calls, a
# KV-sharing drafter's compiled step, cache contract), for torch the attention and the integration. The
# sampling test runs one of its settings (top-p, adaptive draft length): its statistics are the package's own,
# what a transformers release can break is the call through its logits processors, which that one makes.
# PyPI's Linux torch wheels are CUDA builds: a torch check downloads a few GB, and runs on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/check_release.sh transformers|torch VERSION [pytest args...]"
package="${1:?$usage}"
version="${2:?$usage}"
shift 2
case "$package" in
  transformers)
    tests=(tests/test_compat.py tests/test_family_matrix.py tests/test_generate_equivalence.py
      tests/test_concurrent_calls.py tests/generation/test_batched.py
      "tests/generation/test_sampling.py::test_sampling_keeps_target_distribution[sink_window-top_p-adaptive]"
      tests/generation/test_windowed_mtp.py tests/generation/test_prefilled.py tests/generation/test_inputs_embeds.py
      tests/generation/test_draft_prefix.py tests/generation/test_return_sequences.py
      tests/generation/test_multimodal_targets.py tests/generation/test_windowed_assistant.py
      tests/generation/test_other_tokenizer.py tests/generation/test_device_round.py
      tests/generation/test_compiled_call.py tests/cache/test_ring_sliding_layer.py
      "tests/generation/test_draft_steps.py::test_a_drafter_whose_layers_reuse_keys_compiles_one_graph_and_drafts_as_on_the_dynamic_storage"
      tests/cache/test_cache_contract.py) ;;
  torch) tests=(tests/attention tests/test_generate_equivalence.py tests/test_family_matrix.py) ;;
  *) echo "$usage (got '$package')" >&2; exit 2 ;;
esac
if [ "$#" -gt 0 ]; then tests=("$@"); fi
# Room for the install, downloads included: a torch release from PyPI is about 3 GB of downloads and 5 GB installed.
# Where the asked-for folder's disk is short, the environment goes to /dev/shm (memory-backed) for this run only.
case "$package" in torch) need_mb=9000 ;; *) need_mb=1500 ;; esac
free_mb() { mkdir -p "$1" && df -Pm "$1" | awk 'NR == 2 {print $4}'; }
root="${RELEASE_VENV_DIR:-.venv-releases}"
if [ ! -x "$root/${package}-${version}/bin/python" ] && [ "$(free_mb "$root")" -lt "$need_mb" ]; then
  if [ "$(free_mb /dev/shm 2>/dev/null || echo 0)" -ge "$need_mb" ]; then
    echo "$root has $(free_mb "$root") MB free, $package $version needs about $need_mb MB: installing in /dev/shm" >&2
    root="$(mktemp -d /dev/shm/check-release.XXXXXX)"
    trap 'rm -rf "$root"' EXIT
  else
    echo "error: $package $version needs about $need_mb MB to install; $root has $(free_mb "$root") MB free and" \
      "/dev/shm $(free_mb /dev/shm 2>/dev/null || echo 0) MB. Free some space or set RELEASE_VENV_DIR." >&2
    exit 1
  fi
fi
venv="$root/${package}-${version}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv --system-site-packages "$venv"
  # downloads go beside the environment and are not cached: a small disk holds them once, and only while installing
  TMPDIR="$root" "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir \
    "${package}==${version}"
fi
installed="$("$venv/bin/python" -c "import $package; print($package.__version__.split('+')[0])")"
[ "$installed" = "$version" ] || { echo "expected $package $version in $venv, found $installed" >&2; exit 1; }
echo "$package $installed: ${tests[*]}"
"$venv/bin/python" -m pytest -q -n auto -p no:cacheprovider "${tests[@]}"
