"""Grouped-query attention in decode steps: transformers' repeat_kv against the KV heads attended as they are
(kernels/fast_decode.py decode_sdpa, GQA_DECODE "fold" or "enable_gqa"), side by side in one run, on CUDA.

1. The attention call alone, per shape B:Hq:Hkv:L:D (one query token, a boolean padding mask over L cached
   positions), each mode captured in a CUDA graph and timed in interleaved rounds (decode_capture.time_graphs);
   each mode's output is checked against repeat_kv's.
2. A whole decode step: greedy generate() of random-init models of a real shape (no weights needed: the speed of
   a step does not depend on them) through the fast decode loop (static cache, CUDA graph, --compile as
   `sparsify gendata` runs it), one model per mode with the same weights, rounds interleaved; decode tokens/s =
   batch x steps / decode seconds (prefill excluded), and whether each mode's tokens equal stock sdpa's.

    source eval/device/device_env.sh
    PYTHONPATH=$PWD python eval/bench/bench_gqa_decode.py --out $OUT/gqa --batch-sizes 1,8,256,1024,2048 --compile

Measured before it was written (one H200, torch 2.11, transformers 5.17, eager, ad hoc): SmolLM2-135M shape,
batch 1024, 512 cached positions: repeat_kv + SDPA 1.63 ms per layer, fold 0.22 ms, enable_gqa 0.12 ms; the
whole step's GPU time 54 ms with repeat_kv (76% of it the copies), 7 ms with enable_gqa.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from timing import loop_ms  # eval/bench/timing.py (this script's folder is on sys.path)

# what --overwrite may replace: this script's own results folder (or an empty one)
RESULTS = ("this script's results folder (gqa-decode.json)", lambda d: (d / "gqa-decode.json").is_file())

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {  # config fields of the models whose decode steps are timed (random weights)
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}
MODES = ("repeat_kv", "fold", "enable_gqa")
STEP_MODES = ("sdpa", "fold", "enable_gqa")  # sdpa: transformers' own (repeat_kv under compile; 5.2x folds eagerly)
DEV = "cuda"  # --smoke: "cpu" (the flow on a tiny shape, graphs emulated, timings meaningless)


def attention_table(shapes: list[str]) -> list[dict]:
    from transformers.integrations.sdpa_attention import repeat_kv

    from sparsify.kernels import fast_decode as fd
    from sparsify.kernels.decode_capture import capture_call, time_graphs

    rows = []
    for shape in shapes:
        b, hq, hkv, length, d = (int(x) for x in shape.split(":"))
        g = torch.Generator(device=DEV).manual_seed(0)
        dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
        q = torch.randn(b, hq, 1, d, device=DEV, dtype=dtype, generator=g)
        k = torch.randn(b, hkv, length, d, device=DEV, dtype=dtype, generator=g)
        v = torch.randn_like(k)
        mask = torch.ones(b, 1, 1, length, dtype=torch.bool, device=DEV)
        mask[:, ..., length * 3 // 5:] = False  # positions not written yet

        class M(torch.nn.Module):
            num_key_value_groups, is_causal = hq // hkv, True

        def run(mode):
            if mode == "repeat_kv":
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, repeat_kv(k, hq // hkv), repeat_kv(v, hq // hkv), attn_mask=mask)
                return out.transpose(1, 2)
            fd.GQA_DECODE = mode
            return fd.decode_sdpa(M(), q, k, v, mask)[0]

        graphs, outs = [], []
        for mode in MODES:
            graph, out = capture_call(lambda m=mode: run(m), lambda: None, DEV == "cuda")
            graphs.append(graph)
            outs.append(out if DEV == "cuda" else run(mode))  # (emulated: the call itself)
        fd.GQA_DECODE = "fold"
        ms = time_graphs(graphs, lambda: None) if DEV == "cuda" else [_cpu_ms(gr) for gr in graphs]
        err = [float((o.float() - outs[0].float()).abs().max()) for o in outs]
        rows.append({"shape": shape, **{f"{m}_ms": t for m, t in zip(MODES, ms)},
                     **{f"{m}_x": ms[0] / t for m, t in zip(MODES, ms)},
                     **{f"{m}_maxdiff": e for m, e in zip(MODES, err)}})
        print(f"attention {shape}: " + "  ".join(f"{m} {t:.4f} ms ({ms[0] / t:.2f}x)" for m, t in zip(MODES, ms)),
              flush=True)
    return rows


def step_table(shape: str, layers: int | None, batches: list[int], prompt: int, new: int, rounds: int,
               compile: bool) -> list[dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparsify.kernels import fast_decode as fd

    fields = dict(SHAPES[shape], max_position_embeddings=4096)
    if layers:
        fields["num_hidden_layers"] = layers
    torch.manual_seed(0)
    base = LlamaForCausalLM._from_config(LlamaConfig(**fields), attn_implementation="sdpa",
                                         dtype=torch.bfloat16 if DEV == "cuda" else torch.float32).to(DEV).eval()
    models = {}
    for mode in STEP_MODES:  # the same weights, one model (and one FastDecode, its graphs) per mode
        m = LlamaForCausalLM._from_config(base.config, attn_implementation="sdpa", dtype=base.dtype).to(DEV)
        m.load_state_dict(base.state_dict())
        fast = fd.enable_fast_decode(m.eval(), compile=compile)
        if mode == "sdpa":
            m.set_attn_implementation("sdpa")  # transformers' own (repeat_kv under compile; 5.2x folds eagerly)
        fast.timing = True
        fast.cpu_emulation = DEV == "cpu"
        models[mode] = m
    del base
    rows = []
    for batch in batches:
        ids = torch.randint(10, fields["vocab_size"], (batch, prompt), device=DEV,
                            generator=torch.Generator(device=DEV).manual_seed(batch))
        rates = {m: [] for m in STEP_MODES}
        tokens, warm = {}, {}
        for r in range(rounds + 1):  # round 0: compile and capture (timed apart)
            for mode in (STEP_MODES if r % 2 == 0 else tuple(reversed(STEP_MODES))):
                fd.GQA_DECODE = mode if mode != "sdpa" else fd.GQA_DECODE  # (read at compile / capture only)
                m = models[mode]
                t0 = time.perf_counter()
                with torch.inference_mode():
                    out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                     min_new_tokens=new, do_sample=False, pad_token_id=0)
                if DEV == "cuda":
                    torch.cuda.synchronize()
                last = m._fast_decode.last
                if r == 0:
                    warm[mode], tokens[mode] = time.perf_counter() - t0, out
                else:
                    rates[mode].append(batch * last["steps"] / last["decode_s"])
        fd.GQA_DECODE = "fold"
        med = {m: sorted(v)[len(v) // 2] for m, v in rates.items()}
        row = {"shape": shape, "layers": fields["num_hidden_layers"], "batch": batch, "prompt": prompt, "new": new,
               "compile": compile, **{f"{m}_tok_s": med[m] for m in STEP_MODES},
               **{f"{m}_x": med[m] / med["sdpa"] for m in STEP_MODES},
               **{f"{m}_same_tokens": bool(torch.equal(tokens[m], tokens["sdpa"])) for m in STEP_MODES},
               **{f"{m}_first_call_s": warm[m] for m in STEP_MODES}}
        rows.append(row)
        print(f"step {shape} x{fields['num_hidden_layers']} batch {batch}: " + "  ".join(
            f"{m} {med[m]:,.0f} tok/s ({row[f'{m}_x']:.2f}x{'' if row[f'{m}_same_tokens'] else ', other tokens'})"
            for m in STEP_MODES), flush=True)
    return rows


def _cpu_ms(graph, n: int = 3) -> float:
    return loop_ms(graph.replay, n, False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gqa-decode.json / .md (must not exist)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out (when the run has ended)")
    p.add_argument("--attention-shapes", default="1:9:3:512:64,1024:9:3:512:64,2048:9:3:512:64,1:32:8:1024:128,"
                   "8:32:8:1024:128,64:32:8:1024:128", help="B:Hq:Hkv:L:D list for the attention table")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m", help="model shape for the step table")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (say so when reporting)")
    p.add_argument("--batch-sizes", default="1,8,256,1024")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=448, help="greedy tokens per call (cache: prompt + these)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (as sparsify gendata)")
    p.add_argument("--no-step", action="store_true", help="the attention table only")
    p.add_argument("--smoke", action="store_true", help="CPU dry run of the flow: tiny shapes, fp32, graphs "
                   "emulated (timings meaningless)")
    a = p.parse_args(argv)
    global DEV
    if a.smoke:
        DEV = "cpu"
        SHAPES["tiny"] = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        a.shape, a.attention_shapes, a.batch_sizes, a.prompt, a.new_tokens, a.rounds = \
            "tiny", "2:4:2:16:8", "1,3", 5, 6, 1
    elif not torch.cuda.is_available():
        print("bench_gqa_decode needs CUDA (the CPU tests are tests/kernels/test_decode_attention.py)", file=sys.stderr)
        return 2
    import transformers

    from sparsify.errors import SparsifyError
    from sparsify.folder.atomic import atomic_dir, check_output

    try:
        check_output(a.out, a.overwrite, flag="--out", kind=RESULTS)  # before the work: the results are written whole at the end
    except SparsifyError as e:
        print(e, file=sys.stderr)
        return 2

    meta = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke)", "torch": torch.__version__,
            "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(meta, flush=True)
    attention = attention_table([s for s in a.attention_shapes.split(",") if s])
    steps = [] if a.no_step else step_table(a.shape, a.layers, [int(b) for b in a.batch_sizes.split(",")],
                                            a.prompt, a.new_tokens, a.rounds, a.compile)
    results = {"meta": meta, "attention": attention, "steps": steps}
    lines = [str(meta), "", "| B:Hq:Hkv:L:D | " + " | ".join(f"{m} ms" for m in MODES) + " | fold x | enable_gqa x |",
             "|---" * (len(MODES) + 3) + "|"]
    lines += [f"| {r['shape']} | " + " | ".join(f"{r[f'{m}_ms']:.4f}" for m in MODES)
              + f" | {r['fold_x']:.2f}x | {r['enable_gqa_x']:.2f}x |" for r in attention]
    if steps:
        lines += ["", "| shape | layers | batch | compile | " + " | ".join(f"{m} tok/s" for m in STEP_MODES)
                  + " | fold x | enable_gqa x | same tokens (fold, enable_gqa) |", "|---" * (len(STEP_MODES) + 7) + "|"]
        lines += [f"| {r['shape']} | {r['layers']} | {r['batch']} | {r['compile']} | "
                  + " | ".join(f"{r[f'{m}_tok_s']:,.0f}" for m in STEP_MODES)
                  + f" | {r['fold_x']:.2f}x | {r['enable_gqa_x']:.2f}x | {r['fold_same_tokens']}, "
                  f"{r['enable_gqa_same_tokens']} |" for r in steps]
    with atomic_dir(a.out, a.overwrite, flag="--out", kind=RESULTS) as out:
        (out / "gqa-decode.json").write_text(json.dumps(results, indent=1))
        (out / "gqa-decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
