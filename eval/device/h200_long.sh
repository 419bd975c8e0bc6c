#!/usr/bin/env bash
# The long conversion run (recipes/smollm2-135m.yaml: docs + general mixture, per-layer target sparsity,
# distillation) on one lease of a GPU machine: DDP over all its GPUs, chained through checkpoints in $WORK
# (outside the repo copy, so it survives between the 10-minute calls while the machine stays warm).
#
# Usage, from the repository root on the GPU machine:
#   bash eval/device/h200_long.sh stage DIR...  copy carried inputs into $WORK/in (a carried path is gone from the tree
#                                        at the next call): GGUF split parts gguf.part.*, wheels (gguf), the
#                                        token folder tok/ (train.bin.xz or train.bin split as train.bin.xz.*,
#                                        meta.json, validation.bin, heldout-*.bin), heldout.tar.xz (the held-out
#                                        text files, for sparsify eval); or all of these as one tar split in parts,
#                                        bundle.tar.part.* (one part per call: a call sends at most 64 MiB)
#   bash eval/device/h200_long.sh train         start, or resume, the run; stops after LEG_S seconds (default 530) or at
#                                        its token budget, whichever comes first; prints the last logged steps
#   bash eval/device/h200_long.sh sweep         short experiment runs side by side (SLOTS at a time) from the same inputs:
#                                        SWEEP="name=OVERRIDE OVERRIDE;name2=..." (each run gets TOKENS, default
#                                        40_000_000, and the recipe's other keys); a run cut at LEG_S checkpoints
#                                        and the next sweep call resumes it; each finished run's cloze into
#                                        cloze-NAME/ (SWEEP_CLOZE=0: none); then frontier.md/.png over the runs'
#                                        last evaluations in sweep/, with their cloze
#   bash eval/device/h200_long.sh gendata       text sampled from the original model into $WORK/gen (GEN_TOKENS, default 6M)
#   bash eval/device/h200_long.sh prepare       a token folder from the carried raw text (text.tar.xz of data/) and EXTRA
#                                        overrides (e.g. a gendata share) into $WORK/prep-$NAME/data; the train and
#                                        sweep modes read TOK=that folder (default $WORK/tok)
#   bash eval/device/h200_long.sh levers        one lease's lever runs from the carried raw text, chained (run it detached):
#                                        gendata alone on the GPU while the recipe's token folder is prepared on
#                                        the CPU, then the LEVERS runs one at a time on it (default "lr1e3=train.lr=
#                                        1e-3") while a folder of docs, general and the gendata text is prepared
#                                        beside them, then the GEN_LEVERS runs on that folder, whose data.weights
#                                        (three: docs, general, gendata) set the share (default "gen25=
#                                        data.weights=[0.25,0.5,0.25]"); each run TOKENS (default 100M) with
#                                        EVAL_EVERY (default 610) into $WORK/sweep/NAME, one run at a time on GPU 0
#                                        (SLOTS=1: a lever's speed is not shared with another run); then cloze
#   bash eval/device/h200_long.sh cloze         the cloze task (eval/quality/cloze.py: lm-eval's acc, without lm_eval) on the
#                                        original and every finished sweep run; frontier.md gains its columns
#   bash eval/device/h200_long.sh detach MODE   MODE (train, sweep, ...) in its own process session from a copy of the tree:
#                                        it runs on across calls while the machine is held (LEG_S default 1 day);
#   bash eval/device/h200_long.sh wait [S]      in the next calls, waits up to S seconds (default 540) for it to end; copies
#                                        the runs' metrics so far into $RESULTS (PACK=$OUT: they come back every call)
#   bash eval/device/h200_long.sh finish        after the run or sweep: sparsify bench (generate speed, sparse vs dense
#                                        FFN), eval/quality/ppl_gap.py (the finetune log's measure vs sparsify eval's),
#                                        sparsify eval original vs the fine-tuned models on the held-out text,
#                                        and eval/bench/bench_train_ffn.py with BENCH_FFN=1
# Knobs: EXTRA (recipe overrides for every leg, e.g. train.max_tokens=200_000_000), GPUS (default: all), SLOTS
# (sweep runs at a time, default GPUS: more share a GPU), TOKENS and EVAL_EVERY (sweep), FINISH / BENCH_MODEL
# (finish: "name=folder ..." to evaluate, the one to bench), BENCH_BATCH / BENCH_PROMPT / BENCH_REGIMES. Measured on one H200: four 16M-token sweep runs side
# by side take ~450 s; sparsify eval takes ~50 s per model on all 407k held-out tokens (~28 s more to load the
# GGUF), so name few models in FINISH (all ten sweep models did not fit a 280 s limit).
# Results go to $RESULTS (default $WORK/results, kept between calls): train.log, metrics.jsonl, recipe.yaml, plots,
# sweep/, eval/, gap/ and bench/; PACK=DIR writes all of them as DIR/results.tar.xz when the call ends (a device
# call returns at most 8 files).
set -euo pipefail
T0=$(date +%s)  # the sweep's deadline counts from here: setup (inputs) is part of LEG_S
WORK=${WORK:-/tmp/sparsify-long}
OUT=${RESULTS:-$WORK/results}  # kept between calls; PACK=DIR puts all of it into DIR/results.tar.xz at the end
mkdir -p "$WORK/in" "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor  # a resumed leg reuses the compiled kernels
export PYTHONPATH="$PWD:$WORK/pydeps:${PYTHONPATH:-}"
source eval/device/device_env.sh  # sparsify.kernels importable without installing the repo
GPUS=${GPUS:-$(python -c "import torch; print(max(1, torch.cuda.device_count()))")}
RUN=$WORK/run

inputs() {  # the carried inputs, assembled once: GGUF, wheels, token folder, held-out text, converted model
    if ls "$WORK"/in/bundle.tar.part.* >/dev/null 2>&1 && [ ! -e "$WORK/in/.bundle-done" ]; then  # all of it, in parts
        cat "$WORK"/in/bundle.tar.part.* | tar -x -C "$WORK/in" \
            || { echo "the bundle parts in $WORK/in do not make a whole tar: stage every part" >&2; exit 2; }
        touch "$WORK/in/.bundle-done"
    fi
    if [ ! -f "$WORK/smollm2.gguf" ]; then
        cat "$WORK"/in/gguf.part.* > "$WORK/smollm2.gguf.part" && mv "$WORK/smollm2.gguf.part" "$WORK/smollm2.gguf"
    fi
    if [ ! -e "$WORK/pydeps/.done" ] && ls "$WORK"/in/*.whl >/dev/null 2>&1; then
        python -m pip install -q --no-deps --no-index --target "$WORK/pydeps" "$WORK"/in/*.whl && touch "$WORK/pydeps/.done"
    fi
    if ls "$WORK"/in/text.tar.xz.part.* >/dev/null 2>&1 && [ ! -f "$WORK/in/text.tar.xz" ]; then  # staged in parts
        cat "$WORK"/in/text.tar.xz.part.* > "$WORK/in/text.tar.xz.tmp" && mv "$WORK/in/text.tar.xz.tmp" "$WORK/in/text.tar.xz"
    fi
    if [ -f "$WORK/in/text.tar.xz" ] && [ ! -d "$WORK/text" ]; then  # the recipe's raw text (data/...), for prepare
        mkdir -p "$WORK/text.part" && tar -xJf "$WORK/in/text.tar.xz" -C "$WORK/text.part" && mv "$WORK/text.part" "$WORK/text"
    fi
    if [ -d "$WORK/text/data" ] && [ ! -e data ]; then ln -s "$WORK/text/data" data; fi  # the recipe's relative paths
    if [ ! -f "$WORK/tok/train.bin" ] && [ -d "$WORK/in/tok" ]; then
        mkdir -p "$WORK/tok"
        cp "$WORK"/in/tok/meta.json "$WORK"/in/tok/*.bin "$WORK/tok/" 2>/dev/null || true
        [ -f "$WORK/tok/train.bin" ] || { cat "$WORK"/in/tok/train.bin.xz* | xz -dc -T0 > "$WORK/tok/train.bin.part" \
            && mv "$WORK/tok/train.bin.part" "$WORK/tok/train.bin"; }
    fi
    if [ ! -d "$WORK/heldout" ] && [ -f "$WORK/in/heldout.tar.xz" ]; then
        mkdir -p "$WORK/heldout.part" && tar -xJf "$WORK/in/heldout.tar.xz" -C "$WORK/heldout.part" \
            && mv "$WORK/heldout.part" "$WORK/heldout"
    fi
    if [ ! -f "$WORK/converted/config.json" ]; then
        python -m sparsify convert "$WORK/smollm2.gguf" -o "$WORK/converted" --overwrite -q 2>&1 | tail -2
    fi
}

heldout_args() {  # a token folder prepared from the recipe carries its held-out domains (heldout-NAME.bin): keep the
    # recipe's data.heldout / data.ood then (their entries must match the folder's); an older folder has none: drop them
    python -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1])).get('heldout') else 1)" \
        "${TOK:-$WORK/tok}/meta.json" \
        || echo "data.heldout={} data.ood=[]"
}

summary() {  # the last training lines and every evaluation so far
    python - "$RUN/metrics.jsonl" <<'EOF'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
train = [l for l in lines if "sparsity" in l]
for l in train[-3:]:
    z = l["per_layer"]["zeros"]
    c = l["per_layer"].get("l1_coef", [l["l1_coef"]])
    print(f"step {l['step']} tokens {l['tokens']/1e6:.1f}M tok/s {l['tokens_per_s']:,.0f} loss {l['loss']:.3f} "
          f"zeros {l['sparsity']:.2%} (min {min(z):.2%} layer {z.index(min(z))}) coef {min(c):.3g}..{max(c):.3g}")
for l in (l for l in lines if "val_loss" in l):
    dom = " ".join(f"{k} {d['ppl']:.2f} ({d.get('ratio', float('nan')):.3f}x)" for k, d in l.get("heldout", {}).items())
    print(f"eval step {l['step']} tokens {l['tokens']/1e6:.1f}M val {l['val_ppl']:.2f} "
          f"({l.get('val_ppl_ratio', float('nan')):.3f}x) {dom}")
EOF
}

case "${1:-}" in
  inputs)  # assemble the staged parts now (GGUF, wheels, token folder, held-out text, converted model): for a
    # mode that reads them without training first (h200_threshold.sh gendata-bench)
    inputs
    ;;
  stage)
    shift
    for d in "$@"; do cp -r "$d"/. "$WORK/in/"; done
    ls -la "$WORK/in"  # (and tok/ when a part carried it loose; a missing one is no failure: the next call chains)
    if [ -d "$WORK/in/tok" ]; then ls -la "$WORK/in/tok"; fi
    ;;
  train)
    inputs
    resume=""
    ls "$RUN"/checkpoints/step-*/state.pt >/dev/null 2>&1 && resume="--resume"
    set +e
    timeout -s TERM -k 30 "${LEG_S:-530}" torchrun --standalone --nproc_per_node="$GPUS" -m sparsify finetune \
        --no-progress $resume recipes/smollm2-135m.yaml model.source="$WORK/converted" "data.train=[${TOK:-$WORK/tok}]" \
        $(heldout_args) output.dir="$RUN" output.keep_checkpoints_when_done=true ${EXTRA:-} >> "$OUT/train.log" 2>&1
    rc=$?
    set -e
    echo "leg exit status $rc ($([ $rc = 124 ] && echo 'stopped at LEG_S; resume with another train call' || echo done))"
    grep -E "Error|error:|Traceback" "$OUT/train.log" | tail -5 || true
    cp "$RUN"/metrics.jsonl "$RUN"/recipe.yaml "$OUT/" 2>/dev/null || true
    cp "$RUN"/*.png "$RUN"/model/sparsity.json "$OUT/" 2>/dev/null || true
    summary
    ;;
  sweep)
    inputs
    IFS=';' read -ra runs <<< "${SWEEP:?set SWEEP=\"name=override ...;name2=...\"}"
    slots=${SLOTS:-$GPUS}  # runs at a time; several share a GPU (time-sliced), slot s on GPU s % GPUS
    end=$(( T0 + ${LEG_S:-530} ))  # this call's deadline from its start, for all its runs together
    read -ra extra <<< "${EXTRA:-}"  # words, never file patterns: train.freeze=['*.self_attn.*']
    read -ra held <<< "$(heldout_args)"
    sweep_cloze() {  # the finished run's cloze in its slot, unless scored (SWEEP_CLOZE=0: never; up to CLOZE_S,
        # 240 s): lease 5's runs ended with 2 minutes of device time left and a separate cloze call did not fit
        if [ "${SWEEP_CLOZE:-1}" = 1 ] && [ -f "$dir/model/config.json" ] && [ ! -f "$OUT/cloze-$name/cloze.json" ]; then
            CUDA_VISIBLE_DEVICES=$((s % GPUS)) timeout "${CLOZE_S:-240}" python eval/quality/cloze.py -q \
                original="$WORK/smollm2.gguf" "$name=$dir/model" --out "$OUT/cloze-$name" >> "$OUT/sweep-$name.log" 2>&1 \
                || echo "$name: cloze failed or cut (see sweep-$name.log)"
        fi
    }
    for ((s = 0; s < slots; s++)); do
        (for ((i = s; i < ${#runs[@]}; i += slots)); do
            name=${runs[i]%%=*}; read -ra overrides <<< "${runs[i]#*=}"
            dir=$WORK/sweep/$name
            if [ -f "$dir/model/config.json" ]; then sweep_cloze; continue; fi  # finished in an earlier call
            again=""
            ls "$dir"/checkpoints/step-*/state.pt >/dev/null 2>&1 && again="--resume"
            left=$(( end - $(date +%s) ))
            if [ "$left" -lt "${MIN_LEFT_S:-120}" ]; then echo "$name: not started ($left s left; next sweep call)"; continue; fi
            # SIGTERM at the deadline: the run checkpoints the step it is at; the next sweep call resumes it
            CUDA_VISIBLE_DEVICES=$((s % GPUS)) timeout -s TERM -k 60 "$left" python -m sparsify finetune \
                --no-progress $again recipes/smollm2-135m.yaml model.source="$WORK/converted" "data.train=[${TOK:-$WORK/tok}]" \
                "${held[@]}" output.dir="$dir" output.overwrite=true train.max_tokens="${TOKENS:-40_000_000}" \
                train.eval_every="${EVAL_EVERY:-0}" train.save_every=0 "${overrides[@]}" "${extra[@]}" \
                >> "$OUT/sweep-$name.log" 2>&1 \
                || { rc=$?; [ $rc = 124 ] && echo "$name: stopped at the deadline, checkpointed (the next sweep call resumes it)" \
                     || echo "$name: exit $rc (see sweep-$name.log)"; }
            mkdir -p "$OUT/sweep/$name" && cp "$dir"/metrics.jsonl "$dir"/recipe.yaml "$OUT/sweep/$name/" 2>/dev/null || true
            cp "$dir"/model/sparsity.json "$dir"/sparsity.png "$dir"/ood.png "$OUT/sweep/$name/" 2>/dev/null || true
            sweep_cloze
        done) &
    done
    wait
    cloze=()
    for f in "$OUT"/cloze/cloze.json "$OUT"/cloze-*/cloze.json; do [ -f "$f" ] && cloze+=(--cloze "$f"); done
    python eval/quality/frontier.py "$OUT"/sweep/*/ --out "$OUT/sweep" "${cloze[@]}" || true  # the table: run, zeros, ratios
    ;;
  gendata)  # text sampled from the original model (a data.train entry): GEN_TOKENS (default 6M) into $WORK/gen
    inputs
    [ -f "$WORK/gen/gendata.json" ] || python -m sparsify gendata "$WORK/smollm2.gguf" -o "$WORK/gen" \
        --tokens "${GEN_TOKENS:-6_000_000}" --seq-len "${GEN_SEQ:-512}" --batch-size "${GEN_BATCH:-128}" -q
    cat "$WORK/gen/gendata.json"
    ;;
  prepare)  # a token folder from the recipe's data (carried raw text: text.tar.xz) + EXTRA overrides, say a
    # gendata share: EXTRA="data.train=[data/docs/train/*.txt,data/general/train/*.txt,/tmp/sparsify-long/gen]
    # data.weights=[0.25,0.5,0.25]" (no spaces inside an override), into $WORK/prep-$NAME/data: the train and
    # sweep modes read it as TOK=$WORK/prep-$NAME/data
    inputs
    read -ra extra <<< "${EXTRA:-}"
    python -m sparsify finetune --no-progress --prepare-data recipes/smollm2-135m.yaml model.source="$WORK/converted" \
        output.dir="$WORK/prep-${NAME:-mix}" "${extra[@]}" 2>&1 | tail -3 || echo "prepare failed"
    ;;
  levers)  # see the header; every step skips what an earlier call finished, so it can be started again
    inputs
    [ -d "$WORK/text/data" ] || { echo "levers prepares from the raw text: stage text.tar.xz (data/ as tar.xz)" >&2; exit 2; }
    export -n PACK  # (the steps below are this script again: only this call packs)
    export LEG_S=${LEG_S:-86400} TOKENS=${TOKENS:-100_000_000} EVAL_EVERY=${EVAL_EVERY:-610} SLOTS=1
    base=$WORK/prep-base/data gen=$WORK/prep-gen/data
    # gendata alone on the GPU (its gendata.json is then gendata's own rate) while the recipe's token folder is
    # tokenised on the CPU; then the gendata mixture is tokenised in the background while the LEVERS runs train
    (bash "$0" gendata > "$OUT/gendata.log" 2>&1 || echo "gendata failed (see $OUT/gendata.log): no GEN_LEVERS runs") &
    gen_pid=$!
    [ -f "$base/meta.json" ] || NAME=base EXTRA="" bash "$0" prepare > "$OUT/prepare-base.log" 2>&1
    [ -f "$base/meta.json" ] || { echo "preparing the token folder failed: $OUT/prepare-base.log" >&2; exit 1; }
    wait "$gen_pid"
    if [ -f "$WORK/gen/gendata.json" ] && [ ! -f "$gen/meta.json" ]; then
        # docs, general and gendata (weights are a training-time choice: each GEN_LEVERS run gives its own three)
        NAME=gen EXTRA="data.train=[data/docs/train/*.txt,data/general/train/*.txt,$WORK/gen] data.weights=[]" \
            bash "$0" prepare > "$OUT/prepare-gen.log" 2>&1 &
    fi
    TOK=$base SWEEP=${LEVERS:-lr1e3=train.lr=1e-3} bash "$0" sweep
    wait
    [ -f "$WORK/gen/gendata.json" ] || { bash "$0" cloze; exit 1; }
    [ -f "$gen/meta.json" ] || { echo "preparing the gendata mixture failed: $OUT/prepare-gen.log" >&2; exit 1; }
    TOK=$gen SWEEP=${GEN_LEVERS:-gen25=data.weights=[0.25,0.5,0.25]} bash "$0" sweep
    bash "$0" cloze  # the original and every finished run; frontier.md gains the column
    ;;
  cloze)  # eval/quality/cloze.py (lm-eval's cloze acc without lm_eval) on the original and every finished sweep run
    inputs
    models="original=$WORK/smollm2.gguf"
    for d in "$WORK"/sweep/*/model; do
        [ -f "$d/config.json" ] && models="$models $(basename "$(dirname "$d")")=$d"
    done
    python eval/quality/cloze.py $models --out "$OUT/cloze" 2>&1 | tail -12 || echo "cloze failed"
    [ -d "$OUT/sweep" ] && python eval/quality/frontier.py "$OUT"/sweep/*/ --out "$OUT/sweep" --cloze "$OUT/cloze/cloze.json" \
        >/dev/null || true
    ;;
  finish)
    inputs
    # the models to evaluate: FINISH="name=folder ..." (default: the long run's, else every finished sweep run)
    models=${FINISH:-}
    [ -z "$models" ] && [ -f "$RUN/model/config.json" ] && models="finetuned=$RUN/model"
    if [ -z "$models" ]; then
        for d in "$WORK"/sweep/*/model; do [ -f "$d/config.json" ] && models="$models $(basename "$(dirname "$d")")=$d"; done
    fi
    models=${models# }
    [ -n "$models" ] || { echo "no finished run in $RUN or $WORK/sweep (run train or sweep first)"; exit 2; }
    texts=$(ls "$WORK"/heldout/*.txt 2>/dev/null || true)
    bench=${BENCH_MODEL:-${models%% *}}
    # shortest first, so a call cut at its limit keeps the rest; each step writes under $OUT as it ends
    # prompts from held-out text (a real model's sparsity depends on the text; random ids are not text)
    general=$(ls "$WORK"/heldout/general.txt 2>/dev/null || true)
    python -m sparsify bench "$bench" --batch "${BENCH_BATCH:-1,8,32}" --prompt "${BENCH_PROMPT:-512}" \
        --regimes "${BENCH_REGIMES:-compiled}" ${general:+--text "$general"} --new-tokens 256 --out "$OUT/bench" --overwrite -q \
        2>&1 | tail -15 || echo "bench failed"
    if [ -f eval/quality/ppl_gap.py ] && [ -n "$texts" ]; then
        python eval/quality/ppl_gap.py --original "$WORK/smollm2.gguf" --finetuned "${bench#*=}" --tokens "${TOK:-$WORK/tok}" \
            --text general="$WORK/heldout/general.txt" --text docs="$WORK/heldout/docs.txt" --out "$OUT/gap" 2>&1 \
            | tail -20 || echo "ppl_gap failed"
    fi
    python -m sparsify eval original="$WORK/smollm2.gguf" $models --tasks none \
        ${texts:+--text $texts} --text-tokens 0 --out "$OUT/eval" --overwrite -q 2>&1 | tail -14 || echo "eval failed"
    if [ "${BENCH_FFN:-0}" = 1 ] && [ -f eval/bench/bench_train_ffn.py ]; then
        python eval/bench/bench_train_ffn.py --out "$OUT/train_ffn" 2>&1 | tail -25 || echo "bench_train_ffn failed"
    fi
    ;;
  detach)  # run another mode in its own process session, from a copy of this tree (a later call's tree may differ),
    # so that it runs on across calls while the machine is held: no checkpoint / resume (and recompile) per leg
    shift
    mode=${1:?usage: detach MODE (train, sweep, gendata, ...)}
    if [ -f "$WORK/detached.pid" ] && [ ! -f "$WORK/detached.rc" ]; then
        echo "a detached run is going on (pid $(cat "$WORK/detached.pid"); it writes $WORK/detached.rc when it ends):" \
             "wait for it" >&2
        exit 2
    fi
    rm -rf "$WORK/tree" "$WORK/detached.rc" && mkdir -p "$WORK/tree"
    tar -c --exclude=./.git --exclude=./.venv --exclude=./.carry --exclude=./.whl --exclude=./data -f - . \
        | tar -x -C "$WORK/tree"
    cd "$WORK/tree"
    # the session leader records its own pid, runs the mode, then records its exit status (what `wait` reads)
    LEG_S=${LEG_S:-86400} setsid nohup bash -c 'echo $$ > "$0/detached.pid"; bash eval/device/h200_long.sh "$@";
        echo $? > "$0/detached.rc"' "$WORK" "$@" > "$WORK/detached.log" 2>&1 < /dev/null &
    sleep 1
    echo "detached: $mode (pid $(cat "$WORK/detached.pid" 2>/dev/null)), log $WORK/detached.log; then: bash $0 wait SECONDS"
    ;;
  wait)  # until the detached run ends (it writes detached.rc), or S seconds (default 540) pass; prints its log's end
    [ -f "$WORK/detached.pid" ] || { echo "no detached run in $WORK (start one with: $0 detach MODE)" >&2; exit 2; }
    deadline=$(( $(date +%s) + ${2:-540} ))
    while [ ! -f "$WORK/detached.rc" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
    if [ -f "$WORK/detached.rc" ]; then echo "detached run ended, exit status $(cat "$WORK/detached.rc")"
    else echo "still running (pid $(cat "$WORK/detached.pid"))"; fi
    tail -n 20 "$WORK/detached.log" 2>/dev/null || true
    # the runs so far into $OUT (PACK=DIR brings them back with this call: a machine that goes back between
    # calls takes only what no call brought back)
    for d in "$WORK"/sweep/*/; do
        [ -f "$d/metrics.jsonl" ] || continue
        mkdir -p "$OUT/sweep/$(basename "$d")" && cp "$d"/metrics.jsonl "$d"/recipe.yaml "$OUT/sweep/$(basename "$d")/" 2>/dev/null || true
    done
    [ -f "$WORK/gen/gendata.json" ] && cp "$WORK/gen/gendata.json" "$OUT/" || true
    ;;
  *) echo "usage: $0 stage DIR... | inputs | train | sweep | gendata | prepare | levers | cloze | finish | detach MODE | wait [S]" >&2
     exit 2 ;;
esac
if [ -n "${PACK:-}" ]; then tar -cJf "$PACK/results.tar.xz" -C "$OUT" . && ls -la "$PACK"; fi
