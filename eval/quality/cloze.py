"""Cloze accuracy without lm-eval: lm-eval's `loglikelihood` acc (is the target the greedy continuation?) and
perplexity, computed the way lm-eval's HF model computes them, for machines without lm_eval (the GPU machines).

    python eval/quality/cloze.py original=smollm2-135m-gguf run=RUN/model [--data eval/tasks/cloze_austen.jsonl] \
        [--limit N] [--device cuda] [--out DIR] [-q]

The data is a task's jsonl ({"context": ..., "target": ...} per line, as eval/tasks/ holds). Each item is scored
as lm-eval's HFLM scores it: trailing spaces of the context move to the target, the pair is tokenised whole and
the context's own tokens split off, no BOS is added, the last token is not fed and a pair longer than the
model's positions loses its first tokens. acc is 1 when every target
token is the argmax, its stderr is the sample standard error of a proportion (lm-eval's); perplexity is
exp(-mean log-likelihood of the target) over items (lm-eval's `perplexity` aggregation). A sparsify model runs its
FFN dense (the numbers, not the speed, are the point). `tests/evaluation/test_accuracy.py` checks the numbers
against lm-eval itself on a tiny model. Writes cloze.json to --out and prints a table. One forward per item: on
CPU a progress bar per model shows how far it is, and --limit N scores the first N items only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from sparsify.errors import SparsifyError
from sparsify.evaluation.accuracy import proportion_stderr
from sparsify.evaluation.loading import ffn_backend, load_model, parse_models, pick_device

DEFAULT = Path(__file__).resolve().parents[1] / "tasks" / "cloze_austen.jsonl"


def encode_pair(tok, context: str, target: str) -> tuple[list[int], list[int]]:
    """lm-eval HFLM._encode_pair: (context ids, target ids), the pair tokenised as one string."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, target = context[:-spaces], context[-spaces:] + target
    whole = tok.encode(context + target, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def max_length(model) -> int:
    """lm-eval HFLM.max_length for a model config that states its positions (else lm-eval's default 2048)."""
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        if hasattr(model.config, attr):
            return getattr(model.config, attr)
    return 2048


@torch.no_grad()
def score(model, tok, items: list[dict], device: str, bar: str | None = None) -> dict:
    """{"acc", "acc_stderr", "perplexity", "n"} of one model over the cloze items (one item per forward); with
    `bar`, a progress bar of that title."""
    from tqdm.auto import tqdm

    greedy, loglik = [], []
    length = max_length(model)
    for item in tqdm(items, desc=bar, unit="item", disable=bar is None):
        ctx, cont = encode_pair(tok, item["context"], item["target"])
        ids = torch.tensor([(ctx + cont)[-(length + 1):][:-1]], device=device)  # lm-eval cuts from the left
        logp = torch.log_softmax(model(ids).logits[0, -len(cont):].float(), dim=-1)
        want = torch.tensor(cont, device=device)
        greedy.append(bool((logp.argmax(-1) == want).all()))
        loglik.append(float(logp.gather(1, want[:, None]).sum()))
    n = len(items)
    acc = sum(greedy) / n
    return {"acc": acc, "acc_stderr": proportion_stderr(acc, n), "perplexity": math.exp(-sum(loglik) / n), "n": n}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="[NAME=]PATH: a model folder, a .gguf file or smollm2-135m-gguf")
    p.add_argument("--data", type=Path, default=DEFAULT, help=f"cloze items, jsonl (default {DEFAULT})")
    p.add_argument("--limit", type=int, default=None, help="score the first N items only (default: all)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights (default float32)")
    p.add_argument("--out", type=Path, default=None, help="write cloze.json here")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit {args.limit}: must be a positive number of items (default: all).")
    if not args.data.is_file():
        p.error(f"--data {args.data}: no such file; pass a cloze jsonl such as {DEFAULT}.")
    items = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()][: args.limit]
    if not items:
        sys.exit(f"{args.data}: no cloze items")
    try:
        device = pick_device(args.device)
        specs = parse_models(args.models)
        rows = {}
        for spec in specs:
            model, tok = load_model(spec, device, args.dtype)
            with ffn_backend(model, "dense"):
                rows[spec.name] = score(model, tok, items, device, None if args.quiet else f"cloze {spec.name}")
            del model
    except SparsifyError as e:
        p.error(str(e))
    base = next(iter(rows.values()))
    print(f"cloze {args.data.name}: {len(items)} items, {args.dtype} weights on {device}")
    print("| model | acc | stderr | acc - first | perplexity |\n|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['acc']:.4f} | {r['acc_stderr']:.4f} | {100 * (r['acc'] - base['acc']):+.1f} pts | "
              f"{r['perplexity']:.3f} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cloze.json").write_text(json.dumps({"data": str(args.data), "items": len(items),
                                                         "dtype": args.dtype, "models": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
