#!/usr/bin/env bash
# What a lent GPU machine needs that a fresh checkout lacks, made here on CPU before the device time starts:
#   .whl/      the wheels the CUDA image lacks (its transformers is older than the supported range), installed there
#              with --no-deps into /tmp/site (docs/gpu.md, "Install"); git-excluded, carried by the device tool
#   data/far   the far-context target's token streams (docs/training.md), for scripts/far_pair.py
# Each is made only when missing; delete it to make it again. Needs pip's package index (no hub access).
#
#   bash scripts/gpu_prepare.sh            # both
#   bash scripts/gpu_prepare.sh wheels     # or: data
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

case "${1:-all}" in
  wheels) wheels ;;
  data) data ;;
  all) wheels && data ;;
  *)
    echo "usage: bash scripts/gpu_prepare.sh [wheels|data]" >&2
    exit 2
    ;;
esac
