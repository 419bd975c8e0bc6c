"""Why `sparsify finetune`'s held-out ratio (finetuned/original perplexity) and `sparsify eval`'s differ.

    python eval/quality/ppl_gap.py --original smollm2-135m-gguf --finetuned RUN/model --tokens TOKFOLDER \
        --text general=general.txt --text docs=docs.txt [--max-tokens N] [--out DIR]

Scores both models (fp32, the finetuned FFN forced dense) on each domain under several measures:
  folder-W        the token folder's heldout-NAME.bin (the text as training saw it: paragraph by paragraph, with
                  the break at the end of each before f6e0665, in front since), non-overlapping W+1-token windows,
                  every whole window: finetune's `evaluate`, in fp32;
  folder-W-bf16   the same under bf16 autocast (CUDA, or --bf16), as finetune runs the student;
  folder-W-bf16w  the same with bf16 weights (CUDA, or --bf16), as finetune runs the teacher;
  natural-W       the text file tokenised in one go (as `sparsify eval` does), the same windows;
  natural-sliding-S  `sparsify eval`'s measure itself (perplexity.text_pass, window S, moved by S/2), in fp32
                  and (CUDA, or --bf16: -bf16w) in bf16 weights, as `sparsify eval --dtype auto` runs on CUDA;
plus the per-position NLL inside the windows of folder-W and natural-W, and how the folder's tokens differ
from the natural tokenisation of the same text. Without --finetuned only the original is scored.
Writes gap.json and gap.md to --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sparsify.evaluation.evaluate import provenance  # noqa: E402
from sparsify.evaluation.loading import ffn_backend_of, load_model, parse_models, pick_device  # noqa: E402
from sparsify.evaluation.perplexity import model_window, text_pass, tokenize_text  # noqa: E402
from sparsify.train.data import EvalStream, tokenizer_fingerprint  # noqa: E402

EDGES = (0, 128, 512, 1024, 2048)  # per-position buckets inside a window: [0,128), [128,512), ...


def window_nll(model, stream: EvalStream, max_tokens: int | None, bf16: bool, batch: int) -> dict:
    """Non-overlapping windows of `stream` (its first n, all whole ones without max_tokens), as finetune's
    evaluate serves them; mean NLL overall and per position bucket."""
    import torch
    import torch.nn.functional as F

    L = stream.length
    n = stream.n if not max_tokens else max(1, min(stream.n, max_tokens // L))
    sums = torch.zeros(L, dtype=torch.float64)  # [L] NLL summed over windows, per position
    for first in range(0, n, batch):
        rows = [stream.tokens[j * L: j * L + L + 1] for j in range(first, min(first + batch, n))]
        ids = torch.from_numpy(np.stack(rows).astype(np.int64)).to(model.device)  # [B, L+1]
        with torch.inference_mode(), torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits  # [B, L, V]
        nll = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
        sums += nll.view(len(rows), L).sum(0).double().cpu()
    edges = [e for e in EDGES if e < L] + [L]
    buckets = {f"[{a},{b})": float(sums[a:b].sum()) / ((b - a) * n) for a, b in zip(edges, edges[1:])}
    return {"tokens": n * L, "windows": n, "nll": float(sums.sum()) / (n * L), "buckets": buckets}


def stream_of(tokens: np.ndarray, length: int) -> EvalStream:
    """A token array served like data.EvalStream.open serves a .bin file."""
    length = min(length, len(tokens) - 1)
    return EvalStream(tokens, length, (len(tokens) - 1) // length, "natural tokens", "")


def token_stats(tok, folder: np.ndarray, natural: list[int], text: str) -> dict:
    """Token counts of the folder stream vs the natural tokenisation; whitespace-only tokens in each; the share
    of folder tokens that are not a token of the folder's own text tokenised in one go (byte-level BPE: tokens
    aligned by their byte spans), with the most common ones."""
    folder = [int(t) for t in folder]
    blank = {i for i in set(folder) | set(natural) if not tok.decode([i]).strip()}
    decoded = tok.decode(folder)
    stats = {"folder_tokens": len(folder), "natural_tokens": len(natural), "folder_chars": len(decoded),
             "natural_chars": len(text), "folder_blank_tokens": sum(t in blank for t in folder),
             "natural_blank_tokens": sum(t in blank for t in natural), "folder_tokens_differing": None}
    a = tok.convert_ids_to_tokens(folder)
    b = tok.convert_ids_to_tokens(tokenize_text(tok, decoded, None)[0])
    if "".join(a) != "".join(b):  # not byte-level: pieces do not spell the bytes
        return stats
    spans = lambda ps: list(zip(np.cumsum([0] + [len(p) for p in ps[:-1]]).tolist(), np.cumsum([len(p) for p in ps]).tolist()))  # noqa: E731
    theirs = set(spans(b))
    odd = [p for p, s in zip(a, spans(a)) if s not in theirs]
    stats["folder_tokens_differing"] = len(odd) / len(a)
    stats["most_common_differing"] = [[tok.convert_tokens_to_string([p]), k] for p, k in collections.Counter(odd).most_common(5)]
    return stats


def score(spec, args, texts: dict[str, Path], meta: dict, device: str, stats: dict) -> dict:
    """Every measure on every domain for one model: {domain: {measure: result}}."""
    import torch

    model, tok = load_model(spec, device, "fp32")
    if ffn_backend_of(model) is not None:  # a stock model (the original) has no switch
        model.set_ffn_backend("dense")
    if tokenizer_fingerprint(tok) != meta.get("tokenizer"):
        print(f"warning: {spec.name}'s tokenizer is not the one {args.tokens} was prepared with", file=sys.stderr)
    W, S, out = model_window(model, args.window), model_window(model, args.sliding), {}
    batch = args.batch if device.startswith("cuda") else 1
    bf16 = device.startswith("cuda") or args.bf16
    inputs = {name: (path.read_text(encoding="utf-8", errors="replace"),  # as perplexity.texts_section reads it
                     EvalStream.open(Path(args.tokens) / f"heldout-{name}.bin", np.dtype(meta["dtype"]), W,
                                     f"held-out domain {name!r}", "pass a token folder prepared with it"))
              for name, path in texts.items()}
    for name, (text, folder) in inputs.items():
        natural = tokenize_text(tok, text, None)[0]
        if name not in stats:
            stats[name] = token_stats(tok, folder.tokens, natural, text)
        r = out[name] = {f"folder-{W}": window_nll(model, folder, args.max_tokens, False, batch)}
        if bf16:
            r[f"folder-{W}-bf16"] = window_nll(model, folder, args.max_tokens, True, batch)
        r[f"natural-{W}"] = window_nll(model, stream_of(np.asarray(natural), W), args.max_tokens, False, batch)
        if not args.no_sliding:
            r[f"natural-sliding-{S}"] = text_pass(model, tok, text, S, args.max_tokens, None)
    if bf16:  # bf16 weights: finetune's teacher, and `sparsify eval --dtype auto` on CUDA
        model.to(torch.bfloat16)
        for name, (text, folder) in inputs.items():
            out[name][f"folder-{W}-bf16w"] = window_nll(model, folder, args.max_tokens, False, batch)
            if not args.no_sliding:
                out[name][f"natural-sliding-{S}-bf16w"] = text_pass(model, tok, text, S, args.max_tokens, None)
    for name, r in out.items():
        for measure, v in r.items():
            print(f"{spec.name} {name} {measure}: ppl {math.exp(v['nll']):.3f} on {v['tokens']} tokens", file=sys.stderr)
    del model
    return out


def tables(scores: dict, stats: dict) -> tuple[list[dict], list[dict]]:
    """(domain x measure rows, domain x measure x position bucket rows), ratio = finetuned / original ppl."""
    orig, ft = scores["original"], scores.get("finetuned")
    rows, buckets = [], []
    for name, measures in orig.items():
        for m, o in measures.items():
            f = ft[name][m] if ft else None
            rows.append({"domain": name, "measure": m, "tokens": o["tokens"], "original": math.exp(o["nll"]),
                         "finetuned": math.exp(f["nll"]) if f else None,
                         "ratio": math.exp(f["nll"] - o["nll"]) if f else None})
            for b, nll in o.get("buckets", {}).items():
                fb = f["buckets"][b] if f else None
                buckets.append({"domain": name, "measure": m, "positions": b, "original": math.exp(nll),
                                "finetuned": math.exp(fb) if f else None, "ratio": math.exp(fb - nll) if f else None})
        logged = [m for m in measures if m.startswith("folder-") and m.endswith("-bf16w")]
        if ft and logged:  # as finetune logs it: the teacher in bf16 weights, the student under bf16 autocast
            o, f = measures[logged[0]], ft[name][logged[0][:-1]]
            rows.append({"domain": name, "measure": "as-logged: original bf16w / finetuned bf16 autocast",
                         "tokens": o["tokens"], "original": math.exp(o["nll"]), "finetuned": math.exp(f["nll"]),
                         "ratio": math.exp(f["nll"] - o["nll"])})
    return rows, buckets


def markdown(rows: list[dict], buckets: list[dict], stats: dict) -> str:
    num = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    md = ["# Perplexity gap: finetune's held-out measure vs sparsify eval's", "",
          "| domain | measure | tokens | original ppl | finetuned ppl | ratio |", "|---|---|---:|---:|---:|---:|"]
    md += [f"| {r['domain']} | {r['measure']} | {r['tokens']} | {num(r['original'])} | {num(r['finetuned'])} | "
           f"{num(r['ratio'], 4)} |" for r in rows]
    md += ["", "Per position inside the window (ppl of the positions' mean NLL):", "",
           "| domain | measure | positions | original | finetuned | ratio |", "|---|---|---|---:|---:|---:|"]
    md += [f"| {b['domain']} | {b['measure']} | {b['positions']} | {num(b['original'])} | {num(b['finetuned'])} | "
           f"{num(b['ratio'], 4)} |" for b in buckets]
    md += ["", "Tokens of the folder stream vs the text tokenised in one go:", "",
           "| domain | folder tokens | natural tokens | folder chars | natural chars | blank-only tokens folder / "
           "natural | folder tokens differing | most common |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    md += [f"| {n} | {s['folder_tokens']} | {s['natural_tokens']} | {s['folder_chars']} | {s['natural_chars']} | "
           f"{s['folder_blank_tokens']} / {s['natural_blank_tokens']} | {num(s['folder_tokens_differing'], 4)} | "
           f"{', '.join(f'{t!r} x{k}' for t, k in s.get('most_common_differing', []))} |" for n, s in stats.items()]
    return "\n".join(md) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--original", required=True, help="the original model: .gguf, folder, Hub id or smollm2-135m-gguf")
    p.add_argument("--finetuned", default=None, help="the finetuned model folder (left out: score the original only)")
    p.add_argument("--tokens", required=True, help="token folder with meta.json and heldout-NAME.bin")
    p.add_argument("--text", action="append", required=True, metavar="NAME=FILE",
                   help="a domain's held-out text, the concatenation of the files heldout-NAME.bin was prepared from")
    p.add_argument("--max-tokens", type=int, default=None, help="at most N scored tokens per domain and measure")
    p.add_argument("--window", type=int, default=2048, help="non-overlapping window (finetune's train.seq_len)")
    p.add_argument("--sliding", type=int, default=1024, help="sparsify eval's --window")
    p.add_argument("--no-sliding", action="store_true", help="skip the natural-sliding measure")
    p.add_argument("--batch", type=int, default=8, help="windows per forward on CUDA (1 on CPU)")
    p.add_argument("--bf16", action="store_true", help="the bf16 measures on CPU too (they always run on CUDA)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--out", default="ppl-gap", help="output folder for gap.json and gap.md")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    texts = {n: Path(f) for n, _, f in (t.partition("=") for t in args.text)}
    meta = json.loads((Path(args.tokens) / "meta.json").read_text())
    device = pick_device(args.device)
    names = ["original"] + ["finetuned"] * bool(args.finetuned)
    specs = parse_models([f"{n}={s}" for n, s in zip(names, (args.original, args.finetuned))])
    stats: dict = {}
    scores = {spec.name: score(spec, args, texts, meta, device, stats) for spec in specs}
    rows, buckets = tables(scores, stats)
    report = {"provenance": provenance(device), "settings": vars(args), "table": rows, "buckets": buckets,
              "token_stats": stats, "scores": scores}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gap.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gap.md").write_text(markdown(rows, buckets, stats))
    print(markdown(rows, buckets, stats))
    return report


if __name__ == "__main__":
    main()
