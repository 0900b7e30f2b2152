#!/usr/bin/env bash
# What a lent GPU machine needs that a fresh checkout lacks, made here on CPU before the device time starts:
#   .whl/      the wheels the CUDA image lacks (its transformers is older than the supported range), installed there
#              with --no-deps into /tmp/site (docs/gpu.md, "Install"); git-excluded, carried by the device tool
#   data/far   the far-context target's token streams (docs/training.md), for scripts/far_pair.py
# Each is made only when missing; delete it to make it again. Needs pip's package index (no hub access).
# `rehearse` then runs the GPU scripts' --cpu-smoke as the device command runs them: Python 3.12, the image's
# torch (2.11, a CUDA wheel run on CPU) and transformers (5.17) under the carried wheels in a --target folder on
# PYTHONPATH, the package from the tree. A wheel missing from the list fails here, not in device time.
#
#   bash scripts/gpu_prepare.sh            # wheels and data
#   bash scripts/gpu_prepare.sh wheels     # or: data, rehearse (a few minutes; the venv is made once)
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
  transformers==5.25.0 huggingface_hub==2.4.0 kernels==0.19.1 peft==0.21.2 httpx2==2.16.2 httpcore2==2.16.2
  hf-xet==1.8.0 regex==2026.5.9 click==8.5.1 tomlkit truststore anyio==4.16.0 idna==3.20
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 # the trainer's data (the image has no datasets)
)

wheels() {
  if compgen -G ".whl/*.whl" >/dev/null; then
    echo ".whl: present ($(ls .whl | wc -l) wheels), kept"
    return
  fi
  mkdir -p .git/info && grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >>.git/info/exclude
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
  echo ".whl: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1)"
}

data() {
  if [ -d data/far ]; then
    echo "data/far: present, kept"
    return
  fi
  [ -d data/corpus ] || python scripts/prepare_corpus.py --out data/corpus
  python scripts/train_far_target.py prepare --corpus data/corpus --data data/far
  echo "data/far: $(du -sh data/far | cut -f1)"
}

# the device image's packages, as its `pip list` read (the rest of what it holds, unpinned)
IMAGE=(
  torch==2.11.0 transformers==5.17.0 huggingface_hub==1.33.0 tokenizers==0.23.2 safetensors==0.8.0
  accelerate==1.15.0 numpy==2.5.2 pandas pyarrow xxhash fsspec requests aiohttp filelock httpx pyyaml tqdm
)

smoke() { # NAME COMMAND...: its output to $out/NAME.log, shown when it fails
  local name="$1"
  shift
  "$@" >"$out/$name.log" 2>&1 || {
    tail -n 40 "$out/$name.log"
    echo "rehearse: $name failed (log: $out/$name.log)" >&2
    exit 1
  }
  echo "rehearse: $name passed"
}

rehearse() {
  wheels && data
  local python312="${PYTHON312:-python3.12}"
  "$python312" --version >/dev/null 2>&1 || {
    echo "rehearse needs Python 3.12 (the image's): python3.12 on PATH, or PYTHON312=/path/to/python3.12" >&2
    exit 1
  }
  local venv="${RELEASE_VENV_DIR:-.venv-releases}/gpu-image" python site
  python="$venv/bin/python"
  if [ ! -x "$python" ]; then
    "$python312" -m venv "$venv"
    "$python" -m pip install -q --disable-pip-version-check "${IMAGE[@]}"
  fi
  site="$(mktemp -d)" out="$(mktemp -d)"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site:$PWD"
  smoke gpu_check "$python" scripts/gpu_check.py --cpu-smoke --out "$out/check"
  smoke gpu_round "$python" scripts/gpu_round.py --cpu-smoke --out "$out/round" --commit rehearsal
  smoke far_pair "$python" scripts/far_pair.py run --cpu-smoke --data data/far --out "$out/far" \
    --work "$out/far_work" --commit rehearsal
}

case "${1:-all}" in
  wheels) wheels ;;
  data) data ;;
  rehearse) rehearse ;;
  all) wheels && data ;;
  *)
    echo "usage: bash scripts/gpu_prepare.sh [wheels|data|rehearse]" >&2
    exit 2
    ;;
esac
