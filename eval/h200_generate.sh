#!/usr/bin/env bash
# End-to-end generation speed on an H200 (issue 10): synthetic Llama-3.2-1B / Llama-3.1-8B at 90% zeros and
# the real SmolLM2-135M, dense vs sparse, static cache + CUDA graphs on both sides, same run.
#
#   bash eval/h200_generate.sh tests                 GPU tests of the fast decode path and the kernels
#   bash eval/h200_generate.sh synth NAME CONFIG ZEROS [bench args...]
#        e.g. synth llama-1b eval/configs/llama-3.2-1b.json 0.9 --batch 1,8,32 --prompt 128,512,2048
#   bash eval/h200_generate.sh pending               one call (< 10 min) of what the last CPU-only session built
#        and could not time: GPU tests of the chunked decode K2 (routed from d = 8192) and the fast decode
#        path, the chunked K2's config sweep, a kernel profile of the packed training FFN, the 1B at batch
#        1 and 8 and a SmolLM2-135M-shaped synth at 95.8% zeros (the default recipe's) with the step check
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

pending() {
  timeout 150 python3 -m pytest -q -m gpu tests/test_modeling_gpu.py \
    tests/test_kernels.py -k "chunked or modeling or fast or compiled" > "$RESULTS/gpu-tests-pending.log" 2>&1
  echo "gpu tests rc $?"; tail -3 "$RESULTS/gpu-tests-pending.log"
  timeout 140 python3 eval/bench_decode.py --no-grid --sweep-chunked --sweep-budget-s 90 --out "$RESULTS/chunked" \
    > "$RESULTS/chunked.log" 2>&1; echo "chunked sweep rc $?"
  timeout 90 python3 eval/bench_train_ffn.py --part op --no-sweep --zeros 0.9 --profile --rounds 5 \
    --out "$RESULTS/train-ffn-profile.json" > "$RESULTS/train-ffn-profile.log" 2>&1; echo "train profile rc $?"
  timeout 130 bash "$0" synth llama-1b eval/configs/llama-3.2-1b.json 0.9 --batch 1,8 --prompt 512 --regimes compiled
  timeout 60 bash "$0" synth smollm2 eval/configs/smollm2-135m.json 0.958 --batch 1 --prompt 512 --regimes compiled
  grep "^sweep" "$RESULTS/chunked.log"
}

cmd=${1:-}
shift || true
case "$cmd" in
  tests) tests ;;
  synth) synth "$@" ;;
  pending) pending ;;
  *) echo "usage: $0 tests | synth NAME CONFIG ZEROS [bench args] | pending" >&2; exit 2 ;;
esac
