#!/usr/bin/env bash
# End-to-end generation speed on an H200 (issue 10): synthetic Llama-3.2-1B / Llama-3.1-8B at 90% zeros and
# the real SmolLM2-135M, dense vs sparse, static cache + CUDA graphs on both sides, same run.
#
#   bash eval/device/h200_generate.sh tests                 GPU tests of the fast decode path and the kernels
#   bash eval/device/h200_generate.sh synth NAME CONFIG ZEROS [bench args...]
#        e.g. synth llama-1b eval/configs/llama-3.2-1b.json 0.9 --batch 1,8,32 --prompt 128,512,2048
#   bash eval/device/h200_generate.sh pending               one call (< 10 min) of what this session built and has not timed:
#        GPU tests of the packed training kernels and of the chunked decode K2 (now also at M = 1),
#        the training FFN op bench with its block sweep, the SmolLM2-shaped finetune step (dense vs packed)
#        and the decode FFN grid at 90% zeros (M = 1, 8, 32 on the three target shapes)
#   bash eval/device/h200_generate.sh e2e                   end to end: synth Llama-3.1-8B at batch 1 and a SmolLM2-135M-
#        shaped synth at 95.8% zeros (the default recipe's) with the step check, compiled regime
#   bash eval/device/h200_generate.sh recipe-zeros          synth 1B (batch 1, 8) and 8B (batch 1) folders at the default
#        recipe's 95.7% zeros, 512-token prompt, compiled (~300 s)
#   bash eval/device/h200_generate.sh overhead              GPU tests outside the kernel files, a SmolLM2-shaped folder at
#        95.7% benched batch 1 and 8, and eval/bench/bench_auto_overhead.py on it (eager auto vs dense) (~400 s)
#   bash eval/device/h200_generate.sh decode-parts          where the decode FFN's time goes at 95.7% zeros: the cuBLAS gate
#        GEMV, each decode K1 config, the chunked K2, and the FFN per K1 config (bench_decode.py --sweep-k1, ~2 min)
#   results go to $OUT (the device tool's folder) or eval/results/generate-h200/ (RESULTS=...)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
source eval/device/device_env.sh  # sparsify.kernels importable without installing the repo
RESULTS=${RESULTS:-${OUT:-eval/results/generate-h200}}
mkdir -p "$RESULTS"
WORK=${WORK:-/tmp/sparsify-generate}

tests() {
  python3 -m pytest -q -m gpu tests/kernels 2>&1 | tee "$RESULTS/gpu-tests.log" | tail -5
}

synth() {
  local name=$1 config=$2 zeros=$3
  shift 3
  [ -d "$WORK/$name" ] || python3 -m sparsify synth "$config" -o "$WORK/$name" --zeros "$zeros" -q
  python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['sparsify']['synthetic']; print('zeros per layer', s['zeros_per_layer'])" "$WORK/$name/config.json"
  python3 -m sparsify bench "$name=$WORK/$name" --out "$RESULTS/bench-$name" --overwrite "$@"
  tail -n 12 "$RESULTS/bench-$name/report.md"
}

pending() {
  timeout 110 python3 -m pytest -q -m gpu tests/train/test_packed_ffn.py tests/kernels/test_twell_updown.py \
    -k "never_syncs or chunked" > "$RESULTS/gpu-tests-pending.log" 2>&1
  echo "gpu tests rc $?"; tail -2 "$RESULTS/gpu-tests-pending.log"
  timeout 170 python3 eval/bench/bench_train_ffn.py --part op --zeros 0.9,0.99 --rounds 7 \
    --out "$RESULTS/train-ffn-op.json" > "$RESULTS/train-ffn-op.log" 2>&1; echo "train op rc $?"
  grep -A6 "^TABLE" "$RESULTS/train-ffn-op.log"; grep "^sweep" "$RESULTS/train-ffn-op.log"
  timeout 190 python3 eval/bench/bench_train_ffn.py --part model --steps 6 \
    --out "$RESULTS/train-ffn-model.json" > "$RESULTS/train-ffn-model.log" 2>&1; echo "train model rc $?"
  grep -A4 "^TABLE" "$RESULTS/train-ffn-model.log"
  timeout 100 python3 eval/bench/bench_decode.py --shapes 8192x28672,4096x14336,2048x8192 --ms 1,8,32 --zeros 0.9 \
    --budget-s 75 --out "$RESULTS/decode-grid" > "$RESULTS/decode-grid.log" 2>&1; echo "decode grid rc $?"
  grep "^| [0-9]" "$RESULTS/decode-grid/decode-bench.md" | cut -c1-160
}

e2e() {
  timeout 330 bash "$0" synth llama-8b eval/configs/llama-3.1-8b.json 0.9 --batch 1 --prompt 512 --regimes compiled
  timeout 150 bash "$0" synth smollm2 eval/configs/smollm2-135m.json 0.958 --batch 1 --prompt 512 --regimes compiled
}

recipe_zeros() {  # ~300 s measured (2026-12-02): random-id prompts (a synth folder is calibrated on them)
  timeout 200 bash "$0" synth llama-1b-0957 eval/configs/llama-3.2-1b.json 0.957 --batch 1,8 --prompt 512 --regimes compiled
  timeout 250 bash "$0" synth llama-8b-0957 eval/configs/llama-3.1-8b.json 0.957 --batch 1 --prompt 512 --regimes compiled
}

overhead() {  # what auto costs where it decided dense: GPU tests of the modules, a SmolLM2-shaped folder end to
  # end, and eager prefill / decode calls (eval/bench/bench_auto_overhead.py: dense vs auto vs auto without its grant)
  timeout 200 python3 -m pytest -q -m gpu tests --ignore=tests/kernels/test_twell_triton.py \
    --ignore=tests/kernels/test_twell_updown.py > "$RESULTS/gpu-tests-modules.log" 2>&1
  echo "gpu tests (modules, fast decode, dispatcher) rc $?"; tail -3 "$RESULTS/gpu-tests-modules.log"
  timeout 150 bash "$0" synth smollm2-0957 eval/configs/smollm2-135m.json 0.957 --batch 1,8 --prompt 512 --regimes compiled
  for b in 1 8; do
    timeout 90 python3 eval/bench/bench_auto_overhead.py "smollm2-0957=$WORK/smollm2-0957" --batch $b \
      --out "$RESULTS/auto-overhead-b$b" 2>&1 | tail -4
  done
}

decode_parts() {
  timeout 200 python3 eval/bench/bench_decode.py --no-grid --sweep-k1 --sweep-budget-s 100 --out "$RESULTS/decode-parts" \
    > "$RESULTS/decode-parts.log" 2>&1; echo "decode parts rc $?"
  grep "^sweep" "$RESULTS/decode-parts.log"
}

cmd=${1:-}
shift || true
case "$cmd" in
  tests) tests ;;
  synth) synth "$@" ;;
  pending) pending ;;
  e2e) e2e ;;
  recipe-zeros) recipe_zeros ;;
  overhead) overhead ;;
  decode-parts) decode_parts ;;
  *) echo "usage: $0 tests | synth NAME CONFIG ZEROS [bench args] | pending | e2e | recipe-zeros | overhead | decode-parts" >&2; exit 2 ;;
esac
