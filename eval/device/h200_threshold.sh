#!/usr/bin/env bash
# The threshold frontier (issue 30) on one lease of an H200, on top of eval/device/h200_long.sh (stage, sweep, levers, detach,
# wait, cloze): threshold runs of recipes/smollm2-135m.yaml (its default method now), then what the zeros buy in decode
# speed, gendata's rate, the cloze task, and one frontier table over these runs and the recorded L1 ones.
#
# From the repository root on the GPU machine, one call each (a call sends at most 64 MiB: the inputs in 6 parts,
# made on the CPU machine by `bash eval/device/make_carry.sh`):
#   bash eval/device/h200_long.sh stage .carry/p1          (carry .carry/p1), then p2, p3, p4 (p5, p6: raw text, for levers)
#   bash eval/device/h200_threshold.sh gqa-bench           decode attention: transformers' repeat_kv vs the KV heads as they
#                                                   are (eval/bench/bench_gqa_decode.py; needs no staged input), ~2 min
#   bash eval/device/h200_threshold.sh gendata-bench       gendata's tokens/s alone on the GPU (eval/bench/bench_gendata.py) per GQA
#                                                   decode mode (GEN_BENCH_GQA, default fold,enable_gqa; or crop) and batch
#                                                   size (GEN_BENCH_BATCHES, default 1024,2048,4096), the old path
#                                                   only at GEN_BENCH_OLD's sizes (default none); after the sampler's
#                                                   GPU test (up to 240 s), the bench up to GEN_BENCH_S (480 s)
#   bash eval/device/h200_threshold.sh levers              detached: gendata (GEN_TOKENS) alone on the GPU, then the LEVERS
#                                                   runs, the gendata mixture tokenised beside them, then the
#                                                   GEN_LEVERS runs, then cloze
#   bash eval/device/h200_threshold.sh sweep               or: the ARMS below side by side, detached
#   bash eval/device/h200_threshold.sh gpu-tests           the GPU tests of the thresholded kernel paths (beside a run)
#   RESULTS=$OUT bash eval/device/h200_threshold.sh speed2  two GPUs, after the sweep: gendata-bench and the real model's
#                                                   bench on one, the fused decode sweep and e2e synth decode on the
#                                                   other (~9 min)
#   bash eval/device/h200_long.sh wait 540; PACK=$OUT bash eval/device/h200_threshold.sh pack    until it ends; metrics so far
#   PACK=$OUT bash eval/device/h200_threshold.sh after     cloze on every finished run, the frontier (ZEROS=...: decode speed
#                                                   per zeros level too; SPEED_AT=... gendata's rate)
# Knobs: ARMS ("name=override ...;...", or N for the set ARMSN below), TOKENS (default 20M each), LEVERS / GEN_LEVERS, GEN_TOKENS / GEN_BATCH, ZEROS.
set -euo pipefail
WORK=${WORK:-/tmp/sparsify-long}
OUT_DIR=${RESULTS:-$WORK/results}
WARM="sparsity.method=threshold sparsity.warmup_target=0.85 sparsity.warmup_tokens=6_000_000"
# (lease 1 ran thr / thr_exact / thr_neuron / thr_nowarm / thr_093 with the straight-through gradient as the default:
# exact won. Lease 2 ran thr, thr_neuron, l1 (sparsity.method=l1) at 20M and thr at 100M side by side: the threshold
# won at equal zeros, and is the recipe's default now; WARM repeats it for the record of each run's recipe.)
# Default ARMS: the frontier's lower zeros levels at 20M tokens (the user's choice of zeros for quality and speed);
# ARMS2: theta's target ramped from 85% over 6M tokens, a higher warm-up target, and the 100M-token arm again.
ARMS=${ARMS:-"thr_085=$WARM sparsity.target=0.85 sparsity.warmup_target=0.80;thr_090=$WARM sparsity.target=0.90;\
thr_093=$WARM sparsity.target=0.93"}
ARMS2="thr_ramp=$WARM sparsity.threshold_ramp=6_000_000;thr_warm90=$WARM sparsity.warmup_target=0.90;\
thr_100M=$WARM train.max_tokens=100_000_000 train.eval_every=610"
# ARMS3: what the weight decay pulls towards, at 100M tokens side by side (lease 4: 90% zeros read 1.255x, so most of
# the 95.5% recipe's 1.347x is the fine-tune's drift, not the zeros): the run's start (L2-SP), and no decay at all
ARMS3="thr_start_100M=$WARM train.weight_decay_to=start train.max_tokens=100_000_000 train.eval_every=610;\
thr_wd0_100M=$WARM train.weight_decay=0 train.max_tokens=100_000_000 train.eval_every=610"
# ARMS4: the recipe as shipped since lease 5 (the decay towards the start: 1.294x at 95.4%, cloze unmeasured) at
# 100M tokens again for its cloze, beside the same at 90% zeros (issue 30's ">= 90% at <= 1.20x"; 1.255x with the
# decay towards zero); cloze in each run's slot (h200_long.sh sweep)
ARMS4="rec_100M=$WARM train.max_tokens=100_000_000 train.eval_every=610;\
rec090_100M=$WARM sparsity.target=0.90 train.max_tokens=100_000_000 train.eval_every=610"
# ARMS5: ARMS4 and the decay's strength beside it (lease 5: towards the start at 0.1 beat none by 0.03x and towards zero
# by 0.05x; 0.3 pulls the undriven weights 3x harder, lr x wd summed over the run 1.5 against 0.5), at 95.5% and 90%:
# four 100M runs, for a lease of four GPUs (each alone on its own, ~14 min) or two (two side by side per GPU, ~23 min)
ARMS5="$ARMS4;\
wd3_100M=$WARM train.weight_decay=0.3 train.max_tokens=100_000_000 train.eval_every=610;\
wd3090_100M=$WARM train.weight_decay=0.3 sparsity.target=0.90 train.max_tokens=100_000_000 train.eval_every=610"
# ARMS6 (issue 41, one GPU, SLOTS=2): the objective. The logits of the original only (distill.ce=0: forward KL on
# every position, no cross-entropy on the mixture's own next tokens) at 100M tokens, the frontier point; beside it the
# recipe (CE + KL) and KL-only at 20M, for the comparison at equal zeros. With SLOTS=2, slot 0 runs ce1_20M then
# kl_20M, slot 1 kl_100M (two runs share the GPU until slot 0 is done; ~15 min on one H200)
ARMS6="ce1_20M=$WARM;kl_100M=$WARM distill.ce=0 train.max_tokens=100_000_000 train.eval_every=610;kl_20M=$WARM distill.ce=0"
# ARMS7 (issue 41, a short lease, SLOTS=3): the 20M comparison alone, side by side: the recipe (CE + KL), KL-only, and
# KL-only with the zeros allocated by each layer's measured sensitivity (the recipe's mean, 95.3%; every layer in [0.90, 0.99])
ARMS7="ce1_20M=$WARM;kl_20M=$WARM distill.ce=0;\
klsens_20M=$WARM distill.ce=0 sparsity.allocate=sensitivity"
# ARMS8 (issue 41, one GPU, SLOTS=2, ~22 min on one H200): the recipe's own frontier point again for its cloze (it
# has none), beside the floor it stands on under today's recipe (no sparsity pressure: ReLU swap, CE + KL, decay
# towards the start), both at 100M tokens
ARMS8="rec_100M=$WARM train.max_tokens=100_000_000 train.eval_every=610;\
floor_100M=sparsity.method=l1 sparsity.target=none sparsity.l1=0 train.max_tokens=100_000_000 train.eval_every=610"
# ARMS9 (issue 41, a short lease, SLOTS=3, ~10 min): 20M levers beside ARMS7's ce1_20M (1.538x): a little CE
# (distill.ce=0.1), the sensitivity allocation damped by a narrow range, and the decay towards the start at 0.3
ARMS9="ce01_20M=$WARM distill.ce=0.1;sens9397_20M=$WARM sparsity.allocate=sensitivity sparsity.allocate_range=[0.93,0.97];\
wd3_20M=$WARM train.weight_decay=0.3"
# ARMS10 (issue 41, one GPU, SLOTS=3, ~12 min on an H100): ARMS9 beside the recipe again on the same GPU (ce1_20M: the
# baseline, and how far two runs of one recipe on two GPUs differ), a stronger anchor (decay towards the start at 1.0)
# (two waves of runs on one 80 GB card: three runs of batch 8 fit beside each other)
ARMS10="ce1_20M=$WARM;$ARMS9;wd10_20M=$WARM train.weight_decay=1.0"
# ARMS11 (issue 41, SLOTS=3, after a lease lost ARMS10 midway: ce1_20M read 1.958x at 10M, as in the lease before
# (1.959x), so the recorded 1.538x at 20M stands as the baseline): the anchor's strength and the lr, side by side
ARMS11="wd3_20M=$WARM train.weight_decay=0.3;wd10_20M=$WARM train.weight_decay=1.0;lr1e3_20M=$WARM train.lr=1e-3"
# ARMS12 (issue 41, SLOTS=3, ~9 min on an H100): the issue's ce 1 / 0.1 / 0 comparison completed after the calibration
# fix (1bd2b54; ce01 sat at 82.9% zeros before it), beside the strongest anchor and the lower lr (wd3 lies between
# the recorded 0.1 and wd10)
ARMS12="ce01_20M=$WARM distill.ce=0.1;wd10_20M=$WARM train.weight_decay=1.0;lr1e3_20M=$WARM train.lr=1e-3"
# ARMS13 (issue 41, SLOTS=2, an estimated ~17 min on one H100): the one lever that helped at 20M (ARMS12: the decay towards the start
# at 1.0 read 1.507x against the recipe's 1.538x, better on every unseen domain) over the 100M schedule, against the
# recorded recipe at 100M (1.294x, lease 5), beside the trend's next step at 20M (3.0); cloze in each run's slot
WD10_100M="wd10_100M=$WARM train.weight_decay=1.0 train.max_tokens=100_000_000 train.eval_every=610"
ARMS13="$WD10_100M;wd30_20M=$WARM train.weight_decay=3.0"
# ARMS14 (issue 41, SLOTS=1, for a lease with under ~20 min left): ARMS13's 100M arm alone, the GPU to itself (on one
# H200 a run alone read 230k tokens/s against 98k each with two side by side)
ARMS14=$WD10_100M
if [[ "$ARMS" =~ ^[0-9]+$ ]]; then  # ARMS=N names the set ARMSN above
  named="ARMS$ARMS"
  [ -n "${!named:-}" ] || { echo "ARMS=$ARMS: no set $named in $0 (sets:" $(compgen -v | grep -E '^ARMS[0-9]+$')")" >&2
                            exit 2; }
  ARMS=${!named}
fi
export TOKENS=${TOKENS:-20_000_000} EVAL_EVERY=${EVAL_EVERY:-305}

case "${1:-}" in
  sweep)
    n=$(awk -F';' '{print NF}' <<< "$ARMS")
    SLOTS=${SLOTS:-$n} SWEEP=$ARMS EXTRA="train.batch_size=8 train.grad_accum=2 ${EXTRA:-}" \
        bash eval/device/h200_long.sh detach sweep
    ;;
  levers)  # the next lease's 100M-token levers, one run at a time on the GPU (h200_long.sh levers): gendata, thr at 90%
    # zeros (issue 30's ">= 90% at <= 1.20x"), then the default (95.5%) with a 25% share of gendata text
    LEVERS=${LEVERS:-"thr090_100M=sparsity.target=0.90"} \
    GEN_LEVERS=${GEN_LEVERS:-"gen25_100M=data.weights=[0.25,0.5,0.25]"} \
    GEN_TOKENS=${GEN_TOKENS:-12_000_000} GEN_BATCH=${GEN_BATCH:-1024} TOKENS=${LEVER_TOKENS:-100_000_000} \
    EVAL_EVERY=610 bash eval/device/h200_long.sh detach levers
    ;;
  gqa-bench)  # grouped-query decode attention, no staging needed (random weights): the attention call and the
    # uncompiled graph-loop step at batch 1, 8, 1024, transformers' sdpa vs fold vs enable_gqa (eval/bench/bench_gqa_decode.py)
    source eval/device/device_env.sh
    mkdir -p "$OUT_DIR"
    PYTHONPATH=$PWD timeout "${GQA_BENCH_S:-300}" python eval/bench/bench_gqa_decode.py --out "$OUT_DIR/gqa-$(date +%s)" \
        --batch-sizes "${GQA_BATCHES:-1,8,1024}" --prompt 32 --new-tokens 224 --rounds 2 2>&1 | tail -22
    ;;
  gendata-bench)  # gendata's tokens/s alone on the GPU: the graph-loop sampler against transformers' loop, after the
    # GPU test of that sampler (seeded, draws from the nucleus: tests/kernels/test_fast_decode_gpu.py)
    mkdir -p "$OUT_DIR"
    bash eval/device/h200_long.sh inputs > "$OUT_DIR/inputs.log" 2>&1 || { echo "assembling the staged parts failed (stage \
.carry/p1..p4 first): $OUT_DIR/inputs.log" >&2; exit 2; }
    source eval/device/device_env.sh
    if [ "${GEN_BENCH_TEST:-1}" = 1 ]; then  # (GEN_BENCH_TEST=0: not again; it passed in lease 5)
        PYTHONPATH=$PWD:$WORK/pydeps timeout 240 python -m pytest -q -ra -m gpu tests/kernels/test_fast_decode_gpu.py \
            2>&1 | tee "$OUT_DIR/gpu-tests-sampling.log" | tail -4
    fi
    # GEN_BENCH_OLD: batch sizes (of GEN_BENCH_BATCHES) the old path also runs at; empty (the default): it is skipped
    PYTHONPATH=$PWD:$WORK/pydeps HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 timeout "${GEN_BENCH_S:-480}" python \
        eval/bench/bench_gendata.py --model "$WORK/smollm2.gguf" --batch-sizes "${GEN_BENCH_BATCHES:-1024,2048,4096}" \
        --gqa-modes "${GEN_BENCH_GQA:-fold,enable_gqa}" --old-batch-sizes "${GEN_BENCH_OLD-}" \
        --out "$OUT_DIR/gendata-bench" 2>&1 | tail -22
    ;;
  speed2)  # after the sweep, on two GPUs at once (one call, < 10 min; results into $OUT_DIR, RESULTS=$OUT for the
    # device's folder). GPU 0: the crop attention's GPU test (90 s at most), gendata-bench (here GEN_BENCH_GQA
    # crop,enable_gqa,fold, GEN_BENCH_BATCHES 1024,2048, GEN_BENCH_S 340, not the sampler's test; it writes after each
    # mode, so a cut keeps the first ones), then `sparsify bench` on the real fine-tuned folder (SPEED_MODEL, default the sweep's rec_100M: issue 31's real model,
    # batch 1 and 8, held-out prompts). GPU 1: the fused decode FFN's sweep (M = 1, eval/bench/bench_decode.py --sweep-fused)
    # and end-to-end decode of synthetic 1B and 8B folders at 95.7% zeros (eval/device/h200_generate.sh recipe-zeros, ~300 s)
    mkdir -p "$OUT_DIR"
    export PYTHONPATH=$PWD:$WORK/pydeps HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    model=${SPEED_MODEL:-rec_100M=$WORK/sweep/rec_100M/model}
    (export CUDA_VISIBLE_DEVICES=0
     source eval/device/device_env.sh  # the crop attention's GPU test first: its speed counts only if its numbers are right
     timeout 90 python -m pytest -q -m gpu tests/kernels/test_decode_attention.py > "$OUT_DIR/gpu-tests-crop.log" 2>&1 \
         || echo "crop attention GPU test rc $?"
     GEN_BENCH_GQA=${GEN_BENCH_GQA:-crop,enable_gqa,fold} GEN_BENCH_BATCHES=${GEN_BENCH_BATCHES:-1024,2048} \
         GEN_BENCH_S=${GEN_BENCH_S:-340} GEN_BENCH_TEST=0 RESULTS=$OUT_DIR \
         bash "$0" gendata-bench > "$OUT_DIR/gendata-bench.log" 2>&1 || echo "gendata-bench rc $?"
     if [ -f "${model#*=}/config.json" ]; then
         timeout 150 python -m sparsify bench "$model" --batch 1,8 --prompt 512 --regimes compiled --new-tokens 256 \
             --text "$WORK/heldout/general.txt" --out "$OUT_DIR/bench-real" --overwrite -q > "$OUT_DIR/bench-real.log" \
             2>&1 || echo "real model's bench rc $?"
     else echo "no folder ${model#*=}: the real model's bench skipped" > "$OUT_DIR/bench-real.log"; fi) &
    (export CUDA_VISIBLE_DEVICES=1
     source eval/device/device_env.sh
     timeout 100 python eval/bench/bench_decode.py --no-grid --sweep-fused --sweep-budget-s 60 --out "$OUT_DIR/fused2" \
         > "$OUT_DIR/fused2.log" 2>&1 || echo "fused sweep rc $?"
     RESULTS=$OUT_DIR/generate timeout 440 bash eval/device/h200_generate.sh recipe-zeros > "$OUT_DIR/recipe-zeros.log" 2>&1 \
         || echo "recipe-zeros rc $?") &
    wait
    { tail -1 "$OUT_DIR/gpu-tests-crop.log"; grep "^sweep" "$OUT_DIR/fused2.log" | cut -c1-400
      tail -8 "$OUT_DIR/gendata-bench.log"; tail -12 "$OUT_DIR/bench-real.log"
      grep -h "x " "$OUT_DIR"/generate/bench-*/report.md | tail -12; } 2>/dev/null || true
    ;;
  gpu-tests)
    source eval/device/device_env.sh
    mkdir -p "$OUT_DIR"  # the thresholded paths first (-k), then every GPU test (TESTS_K="")
    PYTHONPATH=$PWD:$WORK/pydeps timeout "${TESTS_S:-300}" python -m pytest -q -ra -m gpu tests \
        ${TESTS_K-"-k" "threshold or theta"} 2>&1 | tee "$OUT_DIR/gpu-tests${TESTS_K+-all}.log" | tail -25
    ;;
  after)
    source eval/device/device_env.sh
    export PYTHONPATH=$PWD:$WORK/pydeps HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    mkdir -p "$OUT_DIR"
    speed=""  # decode speed per zeros level: measured in lease 2 (threshold-frontier-h200/lease2/zeros-speed.json)
    if [ -n "${ZEROS:-}" ]; then
        python eval/bench/bench_decode.py --zeros "$ZEROS" --ms 1,8 --no-split --budget-s 100 \
            --shapes 2048x8192,4096x14336,8192x28672 --out "$OUT_DIR/zeros-speed" 2>&1 | tail -12 || echo "bench_decode failed"
        speed="$OUT_DIR/zeros-speed/decode-bench.json"
    fi
    [ -f "$WORK/gen/gendata.json" ] && cp "$WORK/gen/gendata.json" "$OUT_DIR/"
    bash eval/device/h200_long.sh cloze || true
    # this lease's runs, lease 2's (their cloze: lease2/cloze.json) and the L1 default at 100M beside them
    python eval/quality/frontier.py "$OUT_DIR"/sweep/*/ eval/results/threshold-frontier-h200/lease2/runs/*/ \
        eval/results/ood-frontier-h200/runs/base-100M/ --out "$OUT_DIR/frontier" \
        --cloze eval/results/threshold-frontier-h200/lease2/cloze.json --cloze "$OUT_DIR/cloze/cloze.json" \
        --speed "${speed:-eval/results/threshold-frontier-h200/lease2/zeros-speed.json}" \
        --recorded eval/results/threshold-frontier-h200/lease2/recorded.json 2>&1 | tail -30 || true
    if [ -n "${PACK:-}" ]; then tar -cJf "$PACK/results.tar.xz" -C "$OUT_DIR" . && ls -la "$PACK"; fi
    ;;
  pack)  # the runs' metrics and recipes so far (a wait call can end the lease): $PACK/partial.tar.xz
    (cd "$WORK" && find sweep results -maxdepth 3 \( -name metrics.jsonl -o -name recipe.yaml -o -name '*.log' \) -print0 \
        | tar -cJf "${PACK:?set PACK=DIR}/partial.tar.xz" --null -T -) && ls -la "$PACK"
    ;;
  *) echo "usage: $0 sweep | levers | gqa-bench | gendata-bench | speed2 | gpu-tests | after | pack" >&2; exit 2 ;;
esac
