#!/usr/bin/env bash
# End-to-end generation speed on an H200 (issue 10): synthetic Llama-3.2-1B / Llama-3.1-8B at 90% zeros and
# the real SmolLM2-135M, dense vs sparse, static cache + CUDA graphs on both sides, same run.
#
#   bash eval/h200_generate.sh tests                 GPU tests of the fast decode path and the kernels
#   bash eval/h200_generate.sh synth NAME CONFIG ZEROS [bench args...]
#        e.g. synth llama-1b eval/configs/llama-3.2-1b.json 0.9 --batch 1,8,32 --prompt 128,512,2048
#   results go to $OUT (the device tool's folder) or eval/results/generate-h200/ (RESULTS=...)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# pyproject maps kernels/ to sparsify.kernels; without an install a symlink does the same (device copy only)
python3 -c "import sparsify.kernels" 2>/dev/null || ln -sfn ../kernels sparsify/kernels
RESULTS=${RESULTS:-${OUT:-eval/results/generate-h200}}
mkdir -p "$RESULTS"
WORK=${WORK:-/tmp/sparsify-generate}

tests() {
  python3 -m pytest -q -m gpu tests/test_modeling_gpu.py tests/test_kernels.py 2>&1 | tee "$RESULTS/gpu-tests.log" | tail -5
}

synth() {
  local name=$1 config=$2 zeros=$3
  shift 3
  [ -d "$WORK/$name" ] || python3 -m sparsify synth "$config" -o "$WORK/$name" --zeros "$zeros" -q
  python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['sparsify']['synthetic']; print('zeros per layer', s['zeros_per_layer'])" "$WORK/$name/config.json"
  python3 -m sparsify bench "$name=$WORK/$name" --out "$RESULTS/bench-$name" "$@"
  tail -n 12 "$RESULTS/bench-$name/report.md"
}

cmd=${1:-}
shift || true
case "$cmd" in
  tests) tests ;;
  synth) synth "$@" ;;
  *) echo "usage: $0 tests | synth NAME CONFIG ZEROS [bench args]" >&2; exit 2 ;;
esac
