#!/usr/bin/env bash
# The long conversion run (recipes/smollm2-135m.yaml: docs + general mixture, per-layer target sparsity,
# distillation) on one lease of a GPU machine: DDP over all its GPUs, chained through checkpoints in $WORK
# (outside the repo copy, so it survives between the 10-minute calls while the machine stays warm).
#
# Usage, from the repository root on the GPU machine:
#   bash eval/h200_long.sh stage DIR...  copy carried inputs into $WORK/in (a carried path is gone from the tree
#                                        at the next call): GGUF split parts gguf.part.*, wheels (gguf), the
#                                        token folder tok/ (train.bin.xz or train.bin split as train.bin.xz.*,
#                                        meta.json, validation.bin, heldout-*.bin), heldout.tar.xz (the held-out
#                                        text files, for sparsify eval)
#   bash eval/h200_long.sh train         start, or resume, the run; stops after LEG_S seconds (default 530) or at
#                                        its token budget, whichever comes first; prints the last logged steps
#   bash eval/h200_long.sh sweep         short experiment runs side by side, one per GPU at a time, from the same
#                                        inputs: SWEEP="name=OVERRIDE OVERRIDE;name2=..." (each run gets TOKENS,
#                                        default 40_000_000, and the recipe's other keys), then frontier.md/.png
#                                        over the runs' last evaluations in $OUT/sweep
#   bash eval/h200_long.sh finish        after the run: sparsify eval original vs fine-tuned on the held-out text,
#                                        sparsify bench (generate speed, sparse vs dense FFN), and
#                                        eval/bench_train_ffn.py when present (BENCH_FFN=0 skips it)
# Knobs: EXTRA (recipe overrides for every leg, e.g. train.max_tokens=200_000_000), GPUS (default: all).
# Results go to $OUT (default out/long): train.log, metrics.jsonl, recipe.yaml, plots, eval/ and bench/.
set -euo pipefail
WORK=${WORK:-/tmp/sparsify-long}
OUT=${OUT:-out/long}
mkdir -p "$WORK/in" "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor  # a resumed leg reuses the compiled kernels
export PYTHONPATH="$PWD:$WORK/pydeps:${PYTHONPATH:-}"
# pyproject maps kernels/ to sparsify.kernels; without an install a symlink does the same (device copy only)
python -c "import sparsify.kernels" 2>/dev/null || ln -sfn ../kernels sparsify/kernels
GPUS=${GPUS:-$(python -c "import torch; print(max(1, torch.cuda.device_count()))")}
RUN=$WORK/run

inputs() {  # the carried inputs, assembled once: GGUF, wheels, token folder, held-out text, converted model
    if [ ! -f "$WORK/smollm2.gguf" ]; then
        cat "$WORK"/in/gguf.part.* > "$WORK/smollm2.gguf.part" && mv "$WORK/smollm2.gguf.part" "$WORK/smollm2.gguf"
    fi
    if [ ! -e "$WORK/pydeps/.done" ] && ls "$WORK"/in/*.whl >/dev/null 2>&1; then
        python -m pip install -q --no-deps --no-index --target "$WORK/pydeps" "$WORK"/in/*.whl && touch "$WORK/pydeps/.done"
    fi
    if [ ! -f "$WORK/tok/train.bin" ]; then
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
  stage)
    shift
    for d in "$@"; do cp -r "$d"/. "$WORK/in/"; done
    ls -la "$WORK/in" "$WORK/in/tok" 2>/dev/null | tail -n +1
    ;;
  train)
    inputs
    resume=""
    ls "$RUN"/checkpoints/step-*/state.pt >/dev/null 2>&1 && resume="--resume"
    set +e
    timeout -s TERM -k 30 "${LEG_S:-530}" torchrun --standalone --nproc_per_node="$GPUS" -m sparsify finetune \
        --no-progress $resume recipes/smollm2-135m.yaml model.source="$WORK/converted" "data.train=[$WORK/tok]" \
        "data.heldout={}" output.dir="$RUN" ${EXTRA:-} >> "$OUT/train.log" 2>&1
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
    for ((g = 0; g < GPUS; g++)); do
        (for ((i = g; i < ${#runs[@]}; i += GPUS)); do
            name=${runs[i]%%=*}; overrides=${runs[i]#*=}
            dir=$WORK/sweep/$name
            CUDA_VISIBLE_DEVICES=$g timeout -s TERM "${LEG_S:-530}" python -m sparsify finetune --no-progress \
                recipes/smollm2-135m.yaml model.source="$WORK/converted" "data.train=[$WORK/tok]" "data.heldout={}" \
                output.dir="$dir" output.overwrite=true train.max_tokens="${TOKENS:-40_000_000}" train.eval_every=0 \
                train.save_every=0 $overrides ${EXTRA:-} > "$OUT/sweep-$name.log" 2>&1 \
                || echo "$name: exit $? (see sweep-$name.log)"
            mkdir -p "$OUT/sweep/$name" && cp "$dir"/metrics.jsonl "$dir"/recipe.yaml "$OUT/sweep/$name/" 2>/dev/null || true
        done) &
    done
    wait
    python eval/frontier.py "$OUT"/sweep/* --out "$OUT/sweep" || true
    ;;
  finish)
    inputs
    [ -f "$RUN/model/config.json" ] || { echo "no finished run in $RUN (run the train legs first)"; exit 2; }
    texts=$(ls "$WORK"/heldout/*.txt 2>/dev/null || true)
    python -m sparsify eval original="$WORK/smollm2.gguf" finetuned="$RUN/model" --tasks none \
        ${texts:+--text $texts} --text-tokens 0 --out "$OUT/eval" -q 2>&1 | tail -12 || echo "eval failed"
    python -m sparsify bench finetuned="$RUN/model" --batch "${BENCH_BATCH:-1,8,32}" --prompt "${BENCH_PROMPT:-512}" \
        --new-tokens 256 --out "$OUT/bench" -q 2>&1 | tail -15 || echo "bench failed"
    if [ "${BENCH_FFN:-1}" = 1 ] && [ -f eval/bench_train_ffn.py ]; then
        python eval/bench_train_ffn.py --out "$OUT/train_ffn" 2>&1 | tail -25 || echo "bench_train_ffn failed"
    fi
    ;;
  *) echo "usage: $0 stage DIR... | train | finish" >&2; exit 2 ;;
esac
