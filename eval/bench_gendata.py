"""`sparsify gendata`'s sampling speed: the new path against the old one, side by side in one run.

- new: what gendata runs now. One-token prompts (an unpadded batch) sampled by the fast decode sampling loop
  (kernels/fast_decode.py: the whole step, forward + temperature + top-p + draw, replayed from one CUDA graph);
  rows go on past EOS and are split into documents there, so every sampled token counts.
- old: what gendata ran before: transformers' generate() loop (logits processors, top-p sort, multinomial in
  Python, only the forward replayed from a graph); each row counts its tokens before its first EOS and the batch
  runs until every row has one (or --seq-len).

The next GPU lease (one H200; about 6 minutes, most of it the old path and the compiles):

    python eval/bench_gendata.py --batch-sizes 256,1024,2048 --old-batch-sizes 1024 --out eval/results/gendata-bench-h200

Per batch size and path: one warm-up batch (torch.compile, graph capture; timed apart), then --batches timed
batches, each seeded as gendata seeds batch k; tokens/s = counted tokens / seconds of the timed batches. The new
path is also checked: its first timed batch sampled again with the same seed gives the same tokens, and the rows
of a batch differ (most documents distinct: each replay draws new noise). Writes gendata-bench.json and gendata-bench.md to --out and
prints the table (ratio = new / old tokens/s where both ran). The target: new >= 100,000 tokens/s at batch 1024
(gendata measured ~15,900 with the old path, batch 1024, --seq-len 512, temperature 0.8, top-p 0.95).

    python eval/bench_gendata.py --cpu --tiny --out /tmp/gb   # smoke: a two-layer random Llama (tests/tiny.py)
                                                               # on CPU, the graph flow emulated (cpu_emulation)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def old_batch(model, tok, s, device: str) -> tuple[int, list]:
    """The old gendata batch: transformers' loop (fast.loop off), rows stop at EOS; (tokens counted, ids)."""
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.full((s.batch_size, 1), start, dtype=torch.long, device=device)
    with torch.inference_mode():
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                             temperature=s.temperature, top_p=s.top_p, top_k=0, max_new_tokens=s.seq_len,
                             min_new_tokens=1, eos_token_id=tok.eos_token_id, pad_token_id=pad)
    rows = gen[:, 1:].tolist()
    return sum(r.index(tok.eos_token_id) if tok.eos_token_id in r else len(r) for r in rows), rows


def new_batch(model, tok, s, device: str) -> tuple[int, list]:
    """gendata's batch as it is now (its own _sample_batch); (tokens counted, the documents' ids)."""
    from sparsify.train.gendata import _sample_batch

    docs = _sample_batch(model, tok, s, [""] * s.batch_size, device)
    return sum(d["tokens"] for d in docs), [d["ids"] for d in docs]


def run_path(name: str, model, tok, s, device: str, batches: int) -> dict:
    """One path at one batch size: a warm-up batch, then `batches` timed ones (gendata's per-batch seeds)."""
    fast = model._fast_decode
    fast.loop = name == "new"  # off: every generate() call takes transformers' loop (forward still replayed)
    sample = new_batch if name == "new" else old_batch
    loops = fast.loops
    row = {"path": name, "batch": s.batch_size}
    for k in range(batches + 1):
        torch.manual_seed(s.seed * 1_000_003 + k)
        sync(device)
        tic = time.perf_counter()
        counted, ids = sample(model, tok, s, device)
        sync(device)
        sec = time.perf_counter() - tic
        if k == 0:
            row.update(warmup_s=round(sec, 2), warmup_tokens=counted)
            row.update(tokens=0, seconds=0.0, sampled=0)
            continue
        row["tokens"] += counted
        row["seconds"] += sec
        row["sampled"] += s.batch_size * s.seq_len
        if k == 1 and name == "new":
            torch.manual_seed(s.seed * 1_000_003 + k)
            row["same_seed_same_tokens"] = sample(model, tok, s, device)[1] == ids
            docs = [tuple(d) for d in ids]  # (documents, not rows: rows split at EOS)
            row["rows_differ"] = len(set(docs)) > len(docs) // 2
    row["seconds"] = round(row["seconds"], 3)
    row["tokens_per_s"] = round(row["tokens"] / row["seconds"], 1) if row["seconds"] else None
    row["counted_share"] = round(row["tokens"] / row["sampled"], 4) if row["sampled"] else None
    row["served_by_graph_loop"] = fast.loops - loops
    fast.loop = True
    return row


def tiny_folder() -> str:
    sys.path.insert(0, str(ROOT))  # tests/tiny.py: a real tokenizer and a two-layer Llama, no downloads
    from tests.tiny import tiny_model_folder

    return str(tiny_model_folder(Path(tempfile.mkdtemp()) / "tiny"))


def table(rows: list[dict]) -> str:
    lines = ["| batch | new tokens/s | old tokens/s | new / old | new warm-up s | old warm-up s | old counted share |",
             "|---|---|---|---|---|---|---|"]
    for b in sorted({r["batch"] for r in rows}):
        new = next((r for r in rows if r["batch"] == b and r["path"] == "new"), None)
        old = next((r for r in rows if r["batch"] == b and r["path"] == "old"), None)
        ratio = f"{new['tokens_per_s'] / old['tokens_per_s']:.2f}x" if new and old else "-"
        cell = lambda r, k, f="{:,.0f}": f.format(r[k]) if r and r.get(k) is not None else "-"  # noqa: E731
        lines.append(f"| {b} | {cell(new, 'tokens_per_s')} | {cell(old, 'tokens_per_s')} | {ratio} | "
                     f"{cell(new, 'warmup_s', '{:.1f}')} | {cell(old, 'warmup_s', '{:.1f}')} | "
                     f"{cell(old, 'counted_share', '{:.2f}')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-gguf", help="gendata's model argument (default: embedded SmolLM2)")
    p.add_argument("--batch-sizes", default=None, help="comma-separated (default 256,1024,2048; --tiny: 2,4)")
    p.add_argument("--old-batch-sizes", default=None,
                   help="batch sizes the old path also runs at (default: all; it is the slow one)")
    p.add_argument("--seq-len", type=int, default=None, help="new tokens per row (default 512; --tiny: 12)")
    p.add_argument("--batches", type=int, default=2, help="timed batches per path and batch size (default 2)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="run on CPU, the graph flow emulated (smoke)")
    p.add_argument("--tiny", action="store_true", help="a two-layer random Llama instead of --model (smoke)")
    p.add_argument("--out", required=True, help="folder for gendata-bench.json / .md")
    a = p.parse_args()

    from sparsify.kernels.fast_decode import enable_fast_decode
    from sparsify.train import gendata as gd

    device = "cpu" if a.cpu else "cuda"
    sizes = [int(b) for b in (a.batch_sizes or ("2,4" if a.tiny else "256,1024,2048")).split(",")]
    old_sizes = sizes if a.old_batch_sizes is None else [int(b) for b in a.old_batch_sizes.split(",")]
    seq_len = a.seq_len or (12 if a.tiny else 512)
    model_arg = tiny_folder() if a.tiny else a.model
    base = gd.GenSettings(model_arg, 1, seq_len, a.temperature, a.top_p, None, sizes[0], a.seed)
    tic = time.perf_counter()
    model, tok = gd._load(base, device, False)  # on CUDA: enable_fast_decode(compile=True), as gendata does
    load_s = time.perf_counter() - tic
    fast = enable_fast_decode(model)
    fast.cpu_emulation = a.cpu
    rows = []
    for b in sizes:
        s = gd.GenSettings(model_arg, 1, seq_len, a.temperature, a.top_p, None, b, a.seed)
        for name in ("new", "old") if b in old_sizes else ("new",):
            rows.append(run_path(name, model, tok, s, device, a.batches))
            r = rows[-1]
            print(f"batch {b} {name}: {r['tokens_per_s']:,.0f} tokens/s ({r['tokens']:,} tokens counted of "
                  f"{r['sampled']:,} sampled in {r['seconds']:.1f} s; warm-up {r['warmup_s']:.1f} s)", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
    meta = {"model": "tiny" if a.tiny else a.model, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__, "seq_len": seq_len, "temperature": a.temperature, "top_p": a.top_p,
            "batches": a.batches, "load_s": round(load_s, 1), "compile": fast.compile,
            "compile_error": fast.compile_error, "step_checks": fast.step_checks,
            "max_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gendata-bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    md = f"# gendata sampling: new (graph sampling loop) vs old (transformers' loop)\n\n{json.dumps(meta)}\n\n{table(rows)}"
    (out / "gendata-bench.md").write_text(md)
    print(table(rows))
    bad = [r for r in rows if r["path"] == "new" and (not r.get("same_seed_same_tokens", True)
                                                      or not r.get("rows_differ", True) or not r["served_by_graph_loop"])]
    if bad:
        print(f"CHECK FAILED (new path: not served by the loop, or seed / row checks): {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
