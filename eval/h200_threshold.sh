#!/usr/bin/env bash
# The threshold frontier (issue 30) on one lease of an H200, on top of eval/h200_long.sh (stage, sweep, detach, wait,
# cloze): threshold runs of recipes/smollm2-135m.yaml side by side, then what the zeros buy in decode speed, gendata's
# rate, the cloze task, and one frontier table over these runs and the recorded L1 ones.
#
# From the repository root on the GPU machine, one call each (a call sends at most 64 MiB: the bundle in 3 parts,
# made on the CPU machine from the recipe's token folder, the GGUF and the gguf wheel; see ood-frontier-h200/README):
#   bash eval/h200_long.sh stage .carry/p1          (carry .carry/p1), then p2, then p3
#   bash eval/h200_threshold.sh sweep               the ARMS below, detached, SLOTS at a time (default: all)
#   bash eval/h200_threshold.sh gpu-tests           the GPU tests of the thresholded kernel paths (beside the sweep)
#   bash eval/h200_long.sh wait 540; PACK=$OUT bash eval/h200_threshold.sh pack    until the sweep ends; metrics so far
#   PACK=$OUT bash eval/h200_threshold.sh after     decode speed per zeros level, gendata tokens/s, cloze, frontier
# Knobs: ARMS ("name=override ...;..."), TOKENS (default 20M each), ZEROS (decode levels), GEN_TOKENS / GEN_BATCH.
set -euo pipefail
WORK=${WORK:-/tmp/sparsify-long}
OUT_DIR=${RESULTS:-$WORK/results}
WARM="sparsity.method=threshold sparsity.warmup_target=0.85 sparsity.warmup_tokens=6_000_000"
# (the first lease ran thr / thr_exact / thr_neuron / thr_nowarm / thr_093 with the straight-through gradient as the
# default: exact won, and is the default now; l1 is the default recipe on the same schedule)
# Default: three 20M-token arms (thr, thr_neuron, l1 on the same schedule) and thr at 100M tokens, all side by side
# (160M tokens: ~14 min of one H200 at ~190k tokens/s shared, 235k alone); ARMS2 the next ones when time is left.
ARMS=${ARMS:-"thr=$WARM;thr_neuron=$WARM sparsity.threshold=neuron;l1=sparsity.method=l1;\
thr_100M=$WARM train.max_tokens=100_000_000 train.eval_every=610"}
ARMS2="thr_093=$WARM sparsity.target=0.93;thr_warm90=sparsity.method=threshold sparsity.warmup_target=0.90 \
sparsity.warmup_tokens=6_000_000"
[ "${ARMS}" = 2 ] && ARMS=$ARMS2
export TOKENS=${TOKENS:-20_000_000} EVAL_EVERY=${EVAL_EVERY:-305}

case "${1:-}" in
  sweep)
    n=$(awk -F';' '{print NF}' <<< "$ARMS")
    SLOTS=${SLOTS:-$n} SWEEP=$ARMS EXTRA="train.batch_size=8 train.grad_accum=2 ${EXTRA:-}" \
        bash eval/h200_long.sh detach sweep
    ;;
  gpu-tests)
    source eval/device_env.sh
    mkdir -p "$OUT_DIR"  # the thresholded paths first (-k), then every GPU test (TESTS_K="")
    PYTHONPATH=$PWD:$WORK/pydeps timeout "${TESTS_S:-300}" python -m pytest -q -ra -m gpu tests \
        ${TESTS_K-"-k" "threshold or theta"} 2>&1 | tee "$OUT_DIR/gpu-tests${TESTS_K+-all}.log" | tail -25
    ;;
  after)
    source eval/device_env.sh
    export PYTHONPATH=$PWD:$WORK/pydeps HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    mkdir -p "$OUT_DIR"
    python eval/bench_decode.py --zeros "${ZEROS:-0.85,0.9,0.93,0.955}" --ms 1,8 --no-split --budget-s 100 \
        --shapes 2048x8192,4096x14336,8192x28672 --out "$OUT_DIR/zeros-speed" 2>&1 | tail -12 || echo "bench_decode failed"
    rm -rf "$WORK/gen"
    GEN_TOKENS=${GEN_TOKENS:-3_000_000} GEN_BATCH=${GEN_BATCH:-1024} bash eval/h200_long.sh gendata 2>&1 | tail -12 \
        | tee "$OUT_DIR/gendata.log" || echo "gendata failed"
    cp "$WORK/gen/gendata.json" "$OUT_DIR/" 2>/dev/null || true
    bash eval/h200_long.sh cloze || true
    python eval/frontier.py "$OUT_DIR"/sweep/*/ --out "$OUT_DIR/frontier" --cloze "$OUT_DIR/cloze/cloze.json" \
        --speed "$OUT_DIR/zeros-speed/decode-bench.json" \
        --recorded eval/results/threshold-frontier-h200/recorded-l1-20M.json 2>&1 | tail -30 || true
    if [ -n "${PACK:-}" ]; then tar -cJf "$PACK/results.tar.xz" -C "$OUT_DIR" . && ls -la "$PACK"; fi
    ;;
  pack)  # the runs' metrics and recipes so far (a wait call can end the lease): $PACK/partial.tar.xz
    (cd "$WORK" && find sweep results -maxdepth 3 \( -name metrics.jsonl -o -name recipe.yaml -o -name '*.log' \) -print0 \
        | tar -cJf "${PACK:?set PACK=DIR}/partial.tar.xz" --null -T -) && ls -la "$PACK"
    ;;
  *) echo "usage: $0 sweep | gpu-tests | after | pack" >&2; exit 2 ;;
esac
