"""`sparsify gendata`'s sampling speed: the new path against the old one, side by side in one run, the new one per
grouped-query decode-attention mode (kernels/fast_decode.py GQA_DECODE).

- new: what gendata runs now. One-token prompts (an unpadded batch) sampled by the fast decode sampling loop
  (kernels/fast_decode.py: the whole step, forward + temperature + top-p + draw, replayed from one CUDA graph);
  rows go on past EOS and are split into documents there, so every sampled token counts. Measured once per
  --gqa-modes entry ("fold": the query heads folded onto the KV heads, gendata's default; "enable_gqa": SDPA's own
  grouped-query kernel; "crop": kernels/decode_attention.py, which reads only the cache blocks the mask keeps),
  each on a freshly loaded model with GQA_DECODE set to that mode before the model is loaded,
  compiled or captured (the constant is read at compile and capture time; torch.compile's caches are reset between
  modes, so no mode replays or reuses another mode's graph or compiled step); GQA_DECODE is "fold" again after.
- old: what gendata ran before: transformers' generate() loop (logits processors, top-p sort, multinomial in
  Python, only the forward replayed from a graph); each row counts its tokens before its first EOS and the batch
  runs until every row has one (or --seq-len). Run once per --old-batch-sizes entry, not per mode, always with
  GQA_DECODE "fold" (on the fold model when "fold" is among the modes, else on a model of its own).

The next GPU lease (one H200; not timed yet: eval/device/h200_threshold.sh gendata-bench runs it with a 480 s limit):

    python eval/bench/bench_gendata.py --batch-sizes 1024,2048,4096 --gqa-modes fold,enable_gqa --old-batch-sizes "" \
        --out eval/results/gendata-bench-h200

(--old-batch-sizes 1024 adds the old path at batch 1024, a few minutes more; "" skips it.)

Per batch size, path and mode: one warm-up batch (torch.compile, graph capture; timed apart), then --batches timed
batches, each seeded as gendata seeds batch k; tokens/s = counted tokens / seconds of the timed batches. The new
path is also checked: its first timed batch sampled again with the same seed gives the same tokens, and the rows
of a batch differ (most documents distinct: each replay draws new noise). Writes gendata-bench.json (each row with
its `gqa` mode; meta["per_gqa"]: each mode's model, its load, compile and attention) and gendata-bench.md to --out
and prints the table (one line per batch size and mode; ratio = new / old tokens/s where both ran, the old path's
one measurement repeated on each mode's line). The target: new >= 100,000 tokens/s at batch 1024 (gendata measured
~15,900 with the old path, batch 1024, --seq-len 512, temperature 0.8, top-p 0.95).

    python eval/bench/bench_gendata.py --cpu --tiny --out /tmp/gb   # smoke: a two-layer random Llama (tests/tiny.py)
                                                               # on CPU, the graph flow emulated (cpu_emulation)
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
GQA_MODES = ("fold", "enable_gqa", "crop")  # kernels/fast_decode.py GQA_DECODE values


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
    """gendata's batch as it is now (its own sample_batch); (tokens counted, the documents' ids)."""
    from sparsify.train.gendata import sample_batch

    docs = sample_batch(model, tok, s, [""] * s.batch_size, device)
    return sum(d["tokens"] for d in docs), [d["ids"] for d in docs]


def run_path(name: str, model, tok, s, device: str, batches: int) -> dict:
    """One path at one batch size: a warm-up batch, then `batches` timed ones (gendata's per-batch seeds)."""
    from sparsify.kernels import fast_decode as fd

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
    row["gqa"] = fd.GQA_DECODE  # the mode in force when the batches ran (read back, not the loop's variable)
    fast.loop = True
    return row


def tiny_folder() -> str:
    sys.path.insert(0, str(ROOT))  # tests/tiny.py: a real tokenizer and a two-layer Llama, no downloads
    from tests.tiny import tiny_model_folder

    return str(tiny_model_folder(Path(tempfile.mkdtemp()) / "tiny"))


def table(rows: list[dict]) -> str:
    """One line per batch size and GQA mode of the new path (a batch size the old path ran alone: one line, gqa
    "-"); the old path, run once per batch size, is repeated on each mode's line."""
    lines = ["| batch | gqa | new tokens/s | old tokens/s | new / old | new warm-up s | old warm-up s | "
             "old counted share |", "|---|---|---|---|---|---|---|---|"]
    for b in sorted({r["batch"] for r in rows}):
        old = next((r for r in rows if r["batch"] == b and r["path"] == "old"), None)
        news = [r for r in rows if r["batch"] == b and r["path"] == "new"] or [None]
        for new in news:
            ratio = f"{new['tokens_per_s'] / old['tokens_per_s']:.2f}x" if new and old else "-"
            cell = lambda r, k, f="{:,.0f}": f.format(r[k]) if r and r.get(k) is not None else "-"  # noqa: E731
            lines.append(f"| {b} | {new['gqa'] if new else '-'} | {cell(new, 'tokens_per_s')} | "
                         f"{cell(old, 'tokens_per_s')} | {ratio} | {cell(new, 'warmup_s', '{:.1f}')} | "
                         f"{cell(old, 'warmup_s', '{:.1f}')} | {cell(old, 'counted_share', '{:.2f}')} |")
    lines.append("\n(gqa: the new path's GQA_DECODE mode; the old path ran once per batch size, with \"fold\")")
    return "\n".join(lines) + "\n"


def sizes_arg(text: str) -> list[int]:
    """A comma-separated list of batch sizes; "" is none."""
    try:
        return [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of batch sizes: {text!r}") from None


def modes_arg(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in GQA_MODES]
    if not modes or bad or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"{text!r}: one or more of {', '.join(GQA_MODES)}, each once")
    return modes


def measure(mode: str, model_arg: str, sizes: list[int], old_sizes: list[int], a, seq_len: int,
            device: str) -> tuple[list[dict], dict]:
    """One GQA mode on a model of its own: GQA_DECODE set before the model is loaded (and so before its decode
    step is compiled or captured), the new path at `sizes` (none: the old path alone), the old path at
    `old_sizes` right after the new one at each batch size; GQA_DECODE back to "fold" in the end, whatever
    happens. Returns the rows and this model's meta."""
    from sparsify.kernels import fast_decode as fd
    from sparsify.train import gendata as gd

    fd.GQA_DECODE = mode
    model = tok = fast = None
    try:
        if device == "cuda":
            torch.compiler.reset()  # no compiled step (nor a graph of one) carried over from another mode's model
            torch.cuda.reset_peak_memory_stats()
        base = gd.GenSettings(model_arg, 1, seq_len, a.temperature, a.top_p, None, (sizes or old_sizes)[0], a.seed)
        tic = time.perf_counter()
        model, tok = gd.load_sampler(base, device, False)  # on CUDA: enable_fast_decode(compile=True), as gendata does
        load_s = time.perf_counter() - tic
        fast = fd.enable_fast_decode(model)
        fast.cpu_emulation = a.cpu
        rows = []
        for b in sizes or old_sizes:
            s = gd.GenSettings(model_arg, 1, seq_len, a.temperature, a.top_p, None, b, a.seed)
            for name in [p for p, on in (("new", b in sizes), ("old", b in old_sizes)) if on]:
                rows.append(run_path(name, model, tok, s, device, a.batches))
                r = rows[-1]
                print(f"batch {b} {name} gqa={r['gqa']}: {r['tokens_per_s']:,.0f} tokens/s ({r['tokens']:,} tokens "
                      f"counted of {r['sampled']:,} sampled in {r['seconds']:.1f} s; warm-up {r['warmup_s']:.1f} s)",
                      flush=True)
                if device == "cuda":
                    torch.cuda.empty_cache()
        meta = {"load_s": round(load_s, 1), "attention": fast.attention, "loops": fast.loops,  # (this model's)
                "captures": fast.captures, "compile": fast.compile,
                "compile_error": fast.compile_error, "step_checks": fast.step_checks,
                "max_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None}
        return rows, meta
    finally:
        fd.GQA_DECODE = "fold"
        model = tok = fast = None  # freed (with its FastDecode: graphs, cache) before the next mode's model loads
        if device == "cuda":
            torch.compiler.reset()  # (dynamo's caches may hold the compiled step and so the model)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-gguf", help="gendata's model argument (default: embedded SmolLM2)")
    p.add_argument("--batch-sizes", type=sizes_arg, default=None,
                   help="comma-separated (default 256,1024,2048; --tiny: 2,4)")
    p.add_argument("--old-batch-sizes", type=sizes_arg, default=None,
                   help="batch sizes (of --batch-sizes) the old path also runs at (default: all; \"\": none; it is "
                        "the slow one)")
    p.add_argument("--gqa-modes", type=modes_arg, default=["fold"],
                   help="comma-separated GQA_DECODE modes the new path runs in, each on a model of its own: fold, "
                        "enable_gqa, crop (default fold, what gendata uses)")
    p.add_argument("--seq-len", type=int, default=None, help="new tokens per row (default 512; --tiny: 12)")
    p.add_argument("--batches", type=int, default=2, help="timed batches per path and batch size (default 2)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="run on CPU, the graph flow emulated (smoke)")
    p.add_argument("--tiny", action="store_true", help="a two-layer random Llama instead of --model (smoke)")
    p.add_argument("--out", required=True, help="folder for gendata-bench.json / .md")
    a = p.parse_args()

    device = "cpu" if a.cpu else "cuda"
    sizes = a.batch_sizes if a.batch_sizes is not None else ([2, 4] if a.tiny else [256, 1024, 2048])
    if not sizes:
        p.error("--batch-sizes: at least one batch size")
    old_sizes = sizes if a.old_batch_sizes is None else a.old_batch_sizes
    if set(old_sizes) - set(sizes):
        p.error(f"--old-batch-sizes: {sorted(set(old_sizes) - set(sizes))} not among --batch-sizes")
    seq_len = a.seq_len or (12 if a.tiny else 512)
    model_arg = tiny_folder() if a.tiny else a.model
    rows, per_gqa = [], {}
    # the old path with GQA_DECODE "fold" (as before --gqa-modes): beside the fold model's new path, or alone
    plan = [(m, sizes, old_sizes if m == "fold" else []) for m in a.gqa_modes]
    if old_sizes and "fold" not in a.gqa_modes:
        plan.append(("fold", [], old_sizes))

    def save() -> None:  # after every GQA mode: a run cut by its caller's timeout keeps the modes it finished
        first = next(iter(per_gqa.values()))
        meta = {"model": "tiny" if a.tiny else a.model,
                "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
                "seq_len": seq_len, "temperature": a.temperature, "top_p": a.top_p,
                "batches": a.batches, "gqa_modes": a.gqa_modes,
                # load_s: the first model's (per_gqa: each one's); compile / errors / step checks: over all models
                "load_s": first["load_s"], "compile": all(m["compile"] for m in per_gqa.values()),
                "compile_error": next(
                    (f"{k}: {m['compile_error']}" for k, m in per_gqa.items() if m["compile_error"]), None),
                "step_checks": [{"gqa": k, **c} for k, m in per_gqa.items() for c in m["step_checks"]],
                "max_memory_gib": max((m["max_memory_gib"] for m in per_gqa.values()), default=None)
                if device == "cuda" else None, "per_gqa": per_gqa}
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gendata-bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        md = (f"# gendata sampling: new (graph sampling loop) vs old (transformers' loop)\n\n{json.dumps(meta)}\n\n"
              f"{table(rows)}")
        (out / "gendata-bench.md").write_text(md)

    for mode, new_sizes, old_here in plan:
        got, meta_mode = measure(mode, model_arg, new_sizes, old_here, a, seq_len, device)
        rows += got
        per_gqa[mode if new_sizes else f"{mode} (old path only)"] = meta_mode
        save()
    print(table(rows))
    bad = [r for r in rows if r["path"] == "new" and (not r.get("same_seed_same_tokens", True)
                                                      or not r.get("rows_differ", True) or not r["served_by_graph_loop"])]
    if bad:
        print(f"CHECK FAILED (new path: not served by the loop, or seed / row checks): {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
