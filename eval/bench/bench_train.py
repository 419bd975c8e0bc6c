"""Benchmark: the dense training path of `sparsify finetune` (no teacher) on SmolLM2-135M shapes, variants side by side.

Each variant is one `sparsify finetune` child process (the real command, bf16, torch.compile, seq_len 2048) over
the same token folder and the same random-init SmolLM2-135M-shaped ReLU model (speed does not depend on the
weights); tokens/s and MFU are the medians of the logged windows after WARM steps (compile and the profiled
steps excluded). MFU counts (6 N_linear + 12 L d T) FLOPs per token against 989 TFLOP/s (H200/H100 bf16
dense), as `sparsify finetune` logs it. Target (issue 4): >= 35% on the H200.

    python eval/bench/bench_train.py --tokens TOKENS_DIR --tokenizer TOKENIZER_DIR --out DIR \
        [--steps 50] [--variants "flash:train.attention=flash" "cudnn:train.attention=cudnn" ...]

TOKENIZER_DIR: any folder with the SmolLM2 tokenizer files (tokenizer.json ...). Full logs, metrics and the
profiles land in DIR; a table is printed last and written to DIR/summary.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WARM = 20  # logged windows ending at or before this step are excluded (compile, profiler)

SMOLLM2_135M = {  # config.json of HuggingFaceTB/SmolLM2-135M (architecture fields), ReLU already swapped in
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "hidden_act": "relu",
    "tie_word_embeddings": True, "rope_theta": 100000.0, "bos_token_id": 1, "eos_token_id": 2,
    "attention_bias": False, "mlp_bias": False,
}

DEFAULT_VARIANTS = [
    "flash:train.attention=flash train.profile_steps=5",
    "cudnn:train.attention=cudnn train.profile_steps=5",
    "cudnn-b32:train.attention=cudnn train.batch_size=32",
    "cudnn-noreinit:train.attention=cudnn sparsity.reinit_dead=false",
]


def random_model(folder: Path, tokenizer: Path) -> Path:
    """A random-init SmolLM2-135M-shaped ReLU model folder (fp32 safetensors) with the given tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(tmp)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def run_variant(name: str, overrides: list[str], model: Path, tokens: Path, out: Path, steps: int) -> dict:
    run_dir = out / name
    cmd = [sys.executable, "-m", "sparsify", "finetune", "--no-progress", str(REPO / "recipes" / "smollm2-135m.yaml"),
           f"model.source={model}", f"data.train=[{tokens}]", f"output.dir={run_dir}", "output.overwrite=true",
           "output.plots=false", "distill.kd=0", f"train.max_steps={steps}", "train.max_tokens=none",
           "train.log_every=10", "train.save_every=0", "train.eval_batches=1", "train.compile=true",
           # the recipe's mixture weights, held-out domains and per-layer targets belong to its own text and model
           "data.weights=[]", "data.heldout={}", "data.ood=[]", "sparsity.method=l1", "sparsity.target=none", *overrides]
    tic = time.perf_counter()
    log = (out / f"{name}.log").open("w")
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    row = {"variant": name, "overrides": " ".join(overrides), "wall_s": round(time.perf_counter() - tic, 1),
           "returncode": proc.returncode}
    metrics = run_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        row["error"] = (out / f"{name}.log").read_text()[-1500:]
        return row
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    steady = [m for m in lines if "tokens_per_s" in m and m["step"] > WARM]
    row.update(tokens_per_s=statistics.median(m["tokens_per_s"] for m in steady),
               mfu=statistics.median(m["mfu"] for m in steady) if "mfu" in steady[0] else None,
               windows=len(steady))
    if (run_dir / "profile.txt").is_file():
        shutil.copy(run_dir / "profile.txt", out / f"{name}.profile.txt")
        row["profile"] = f"{name}.profile.txt"
    return row


def conditions() -> dict:
    import torch
    import transformers

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout
    return {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
            "torch": torch.__version__, "transformers": transformers.__version__, "commit": commit.strip(),
            "model": "SmolLM2-135M shapes, random init, ReLU", "seq_len": 2048,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=Path, required=True, help="token folder (sparsify.train.data.prepare_data output)")
    p.add_argument("--tokenizer", type=Path, required=True, help="folder with the SmolLM2 tokenizer files")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help='"name:override override ..."')
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = random_model(args.out / "model-random", args.tokenizer)
    rows = []
    for spec in args.variants:
        name, _, overrides = spec.partition(":")
        rows.append(run_variant(name, overrides.split(), model, args.tokens, args.out, args.steps))
        print(json.dumps(rows[-1]), flush=True)
    summary = {"conditions": conditions(), "steps": args.steps, "warm_steps_excluded": WARM, "runs": rows}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = [f"# Dense training path, {summary['conditions']['gpu']}", "",
          f"torch {summary['conditions']['torch']}, transformers {summary['conditions']['transformers']}, commit "
          f"{summary['conditions']['commit']}; SmolLM2-135M shapes, seq_len 2048, bf16, torch.compile, no teacher; "
          f"medians of the logged windows after step {WARM}.", "",
          "| variant | overrides | tokens/s | MFU | wall s |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['variant']} | {r['overrides']} | failed (rc {r['returncode']}) | - | {r['wall_s']} |")
        else:
            mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
            md.append(f"| {r['variant']} | {r['overrides']} | {r['tokens_per_s']:,.0f} | {mfu} | {r['wall_s']} |")
    (args.out / "summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
