"""Sparse decode on the CPU (issue 43): the backend table's CPU row (kernels/cpu_sparse.py) against dense, one run.

    python eval/bench/bench_cpu_decode.py [--threads 2] [--zeros 0.957] [--out DIR] [--synth-dir DIR]

Three sections, ratios side by side (> 1: faster than dense), every pair timed in paired rounds (each round times
both once as a loop of calls, the order alternating; a ratio is the median of the rounds' ratios):
1. The FFN alone at M = 1 (bf16, `--zeros` of the gate values <= 0, weights of 576x1536, 2048x8192, 4096x14336):
   dense_rows against the ("cpu", "twell") row. The tokens cycle through a pool of inputs, each with its own
   active neurons (as decode steps have), so the active rows are not the same cached ones call after call.
2. `auto` against dense (FFNRuntime.run, backend "auto" / "dense") at M = 1 .. 2048 on those shapes, auto warmed
   (its calibration done) before the rounds; auto's decision per M is printed beside the ratio.
3. generate() end to end: `--new` new tokens after a `--prompt`-token prompt, greedy, batch 1, backend "dense" vs
   "auto" (the folder's default) on `sparsify synth` folders (SmolLM2-135M; Llama-3.2-1B cut to 4 layers), made
   under --synth-dir if missing; the greedy tokens of both are compared (identical, or where they first differ),
   in bf16 (the folders' dtype) and fp32 (`--dtypes`); the same with the layers outside the FFNs packed
   (what a folder's first generate() on the CPU in bf16 does by default: `model.pack_cpu_linears()`), in the same
   rounds; each real folder of `--folder` (a prompt of real text) with
   llama.cpp's decode of each `--gguf` file in the same rounds; and where each decode step's time goes (FFN,
   attention, LM head, the rest), from forward hooks.
The FFN section also times the dense FFN on packed weights (cpu_sparse.pack / gemm), so that what packing gives and
what the zeros give are told apart.
torch.set_num_threads(--threads) before anything runs. Writes DIR/cpu-decode.json and DIR/report.md with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

from sparsify.kernels.cpu_sparse import gemm, pack, sparse_rows
from sparsify.kernels.ffn_runtime import BACKEND_TABLE, FFNRuntime, dense_rows
from timing import Clock, interleaved, med, paired  # eval/bench/timing.py (this script's folder is on sys.path)

REPO = Path(__file__).resolve().parents[2]
SHAPES = ((576, 1536), (2048, 8192), (4096, 14336))
MS = (1, 2, 4, 8, 16, 64, 256, 2048)
SYNTH = (("smollm2-135m", "eval/configs/smollm2-135m.json", None), ("llama-3.2-1b-4l", "eval/configs/llama-3.2-1b.json", 4))
POOL = 32  # distinct inputs the calls cycle through
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def ffn_case(d: int, f: int, zeros: float, rows: int, seed: int = 0):
    """x [rows, d] (bf16) and bf16 weights whose gate is <= 0 on `zeros` of the (row, neuron) pairs: x[:, 0] = 1
    and W_gate[:, 0] a bias at the zeros-quantile of the gate without it (each row its own active neurons)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=gen)
    w_gate = torch.randn(f, d, generator=gen) / d**0.5
    w_up = torch.randn(f, d, generator=gen) / d**0.5
    w_down = torch.randn(d, f, generator=gen) / f**0.5
    x[:, 0] = 1.0
    w_gate[:, 0] = 0.0
    g = (x[:256] @ w_gate.t()).flatten()
    w_gate[:, 0] = -float(torch.quantile(g[torch.randperm(g.numel(), generator=gen)[:1 << 20]], zeros))
    return [t.to(torch.bfloat16) for t in (x, w_gate, w_up, w_down)]


def cycling(fn, pool: list):
    """fn(one input of the pool), the next one each call."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(pool)
        return fn(pool[state["i"]])
    return call


def ffn_m1(zeros: float, budget_ms: float, shapes=SHAPES) -> list[dict]:
    rows, clock = [], Clock(False)
    for d, f in shapes:
        x, wg, wu, wd = ffn_case(d, f, zeros, POOL)
        rt = FFNRuntime("dense")
        sparse_row = sparse_rows
        pool = [x[i:i + 1] for i in range(POOL)]
        pg, pu, pd = pack(wg), pack(wu), pack(wd)

        def dense_packed(xi):  # the dense FFN on all three weights packed: what packing alone gives
            return gemm(torch.relu(gemm(xi, wg, pg)) * gemm(xi, wu, pu), wd, pd)
        fns = {"dense": cycling(lambda xi: dense_rows(rt.dispatcher, xi, wg, wu, wd), pool),
               "sparse": cycling(lambda xi: sparse_row(rt.dispatcher, xi, wg, wu, wd), pool),
               "dense_packed": cycling(dense_packed, pool)}
        errors: dict = {}
        t = interleaved(fns, clock, errors, budget_ms=budget_ms, target_ms=50.0, warm=2, min_rounds=7)
        density = float((torch.nn.functional.linear(x, wg) > 0).float().mean())
        rows.append({"shape": f"{d}x{f}", "active": density, "dense_ms": med(t["dense"]),
                     "sparse_ms": med(t["sparse"]), "speedup": 1 / paired(t, "sparse", "dense"),
                     "dense_packed_ms": med(t["dense_packed"]),
                     "speedup_vs_dense_packed": 1 / paired(t, "sparse", "dense_packed"),
                     "rounds": len(t["dense"]), "errors": errors})
        print(f"FFN M=1 {d}x{f}: active {density:.3f}  dense {med(t['dense']):.3f} ms  sparse "
              f"{med(t['sparse']):.3f} ms  sparse/dense speed {rows[-1]['speedup']:.2f}x  (dense on packed weights "
              f"{med(t['dense_packed']):.3f} ms: sparse {rows[-1]['speedup_vs_dense_packed']:.2f}x of it)", flush=True)
    return rows


def auto_vs_dense(zeros: float, ms: tuple[int, ...], budget_ms: float, shapes=SHAPES) -> list[dict]:
    rows, clock = [], Clock(False)
    for d, f in shapes:
        x, wg, wu, wd = ffn_case(d, f, zeros, max(ms) * 2)
        rt = FFNRuntime("auto")
        for m in ms:
            pool = [x[i * m:(i + 1) * m] for i in range(min(POOL, x.shape[0] // m))]
            for xi in pool[:2]:
                rt.run(xi, wg, wu, wd, backend="auto")  # calibration (timing both paths) happens here
            fns = {"dense": cycling(lambda xi: rt.run(xi, wg, wu, wd, backend="dense"), pool),
                   "auto": cycling(lambda xi: rt.run(xi, wg, wu, wd, backend="auto"), pool)}
            errors: dict = {}
            t = interleaved(fns, clock, errors, budget_ms=budget_ms, target_ms=50.0, warm=1, min_rounds=5)
            decision = rt.dispatcher.decisions(wg).get(1 << max(0, (m - 1).bit_length()), {})
            rows.append({"shape": f"{d}x{f}", "m": m, "dense_ms": med(t["dense"]), "auto_ms": med(t["auto"]),
                         "speedup": 1 / paired(t, "auto", "dense"), "decision": decision.get("eager"),
                         "why": decision.get("rule") or decision.get("ratio"), "rounds": len(t["dense"]),
                         "errors": errors})
            print(f"auto {d}x{f} M={m}: dense {med(t['dense']):.3f} ms  auto {med(t['auto']):.3f} ms  "
                  f"auto/dense speed {rows[-1]['speedup']:.2f}x  (auto chose {rows[-1]['decision']})", flush=True)
    return rows


def synth_folder(root: Path, name: str, config: str, layers: int | None, zeros: float) -> Path:
    out = root / f"{name}-z{zeros}"
    if not (out / "config.json").is_file():
        cmd = [sys.executable, "-m", "sparsify", "synth", str(REPO / config), "-o", str(out), "--zeros", str(zeros),
               "--device", "cpu", "-q", *(["--layers", str(layers)] if layers else [])]
        subprocess.run(cmd, check=True)
    return out


def first_difference(a: torch.Tensor, b: torch.Tensor, prompt: int) -> str:
    diff = (a != b).any(0).nonzero()
    return "identical" if len(diff) == 0 else f"first difference at new token {int(diff[0]) - prompt + 1}"


def generate_e2e(root: Path, zeros: float, prompt: int, new: int, rounds: int, dtypes: list[str],
                 folders: list[str] = (), ggufs: list[str] = (), folder_dtype: str = "bf16") -> list[dict]:
    """The synth models in each dtype of `dtypes`, then each real folder of `folders` in `folder_dtype` with a
    prompt of real text (sparsify/corpus/python-howto-heldout.txt, which no recipe trains on), timed in the same
    rounds as llama.cpp's decode of each GGUF file of `ggufs` (same prompt ids, same number of new tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = []
    for (name, config, layers), dtype in [(s, t) for t in dtypes for s in SYNTH]:
        folder = synth_folder(root, name, config, layers, zeros)
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=DTYPES[dtype]).eval()
        vocab = model.get_input_embeddings().weight.shape[0]
        ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(1))
        rows.append(e2e_row(name, dtype, model, ids, new, rounds)[0])
        del model
    for folder in folders:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=DTYPES[folder_dtype]).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        text = (REPO / "sparsify/corpus/python-howto-heldout.txt").read_text()
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :prompt]
        others = llama_cpp_contenders(ggufs, ids, new, torch.get_num_threads())
        path = Path(folder).resolve()
        row, tokens = e2e_row(f"{path.parent.name}/{path.name}", folder_dtype, model, ids, new, rounds, others)
        row["text"] = {"prompt": tokenizer.decode(ids[0]),
                       **{b: tokenizer.decode(tokens[b][0, ids.shape[1]:]) for b in tokens}}
        row["zeros_in_config"] = (model.config.to_dict().get("sparsify") or {}).get("sparsity")
        rows.append(row)
        del model
    return rows


def e2e_row(name: str, dtype: str, model, ids: torch.Tensor, new: int, rounds: int,
            others: dict | None = None) -> tuple[dict, dict]:
    """generate() of `model` with the dense and the auto FFN backend, and each of `others` (name -> a callable
    that generates `new` tokens after `ids` and returns them: llama.cpp), in paired rounds (the order reversing
    every round; a ratio is the median of the rounds' dense time / its time); the greedy tokens of dense and auto
    compared; then one more generate() of each backend under step_parts' hooks (where a step's time goes).
    Returns the report's row and each contender's tokens."""
    prompt = ids.shape[1]

    def gen(backend: str):
        model.set_ffn_backend(backend)
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False, pad_token_id=0)

    model.pack_cpu_linears()  # the layers outside the FFNs that packing switches (switched per call below)
    linears = [m for m in model.modules() if type(m).__name__ == "PackedLinear"]  # (the folder's own copy's class)
    packed_class = type(linears[0])
    model.pack_cpu_linears(False)

    def packed(on: bool, backend: str):
        for m in linears:  # (their packed copies stay in m.__dict__ between calls: made once, in the warm-up)
            m.__class__ = packed_class if on else nn.Linear
        try:
            return gen(backend)
        finally:
            for m in linears:
                m.__class__ = nn.Linear

    contenders = {"dense": lambda: gen("dense"), "auto": lambda: gen("auto"),
                  "dense+packed": lambda: packed(True, "dense"), "auto+packed": lambda: packed(True, "auto"),
                  **(others or {})}
    tokens = {b: contenders[b]() for b in ("auto", *contenders)}  # warm-up (auto calibrates, layers pack here)
    times: dict[str, list[float]] = {b: [] for b in contenders}
    varied = {b: 0 for b in contenders if b.startswith("auto")}  # auto's calls whose tokens were not the warm-up's
    for r in range(rounds):
        for b in list(contenders) if r % 2 == 0 else reversed(list(contenders)):
            start = time.perf_counter()
            out = contenders[b]()
            times[b].append(time.perf_counter() - start)
            if b in varied:  # (a layer's answer may change at a refresh where the two rows time alike: in bf16 the
                varied[b] += not torch.equal(out, tokens[b])  # sparse row rounds otherwise, as it sums fewer terms)
            elif b not in (others or {}) and not torch.equal(out, tokens[b]):
                raise RuntimeError(f"{name}: greedy tokens of {b} changed between calls")
    same = first_difference(tokens["auto"], tokens["dense"], prompt)
    if not torch.equal(tokens["dense+packed"], tokens["dense"]):  # (auto+packed: auto's own answers, timed anew)
        raise RuntimeError(f"{name}: packing changed the greedy tokens of dense")
    layers_on = [m.auto_decisions() for m in model.ffn_runtime.layers]
    sparse_m1 = sum(1 for dec in layers_on if (dec.get(1) or {}).get("eager") == "twell")
    ratio = {b: med([d / t for d, t in zip(times["dense"], times[b])]) for b in contenders if b != "dense"}
    parts = {b: step_parts(model, ids, new, b) for b in ("dense", "auto")}
    for m in linears:
        m.__class__ = packed_class
    parts.update({f"{b}+packed": step_parts(model, ids, new, b) for b in ("dense", "auto")})
    for m in linears:
        m.__class__ = nn.Linear
    print(f"generate {name} {dtype}: dense {med(times['dense']):.2f} s  auto {med(times['auto']):.2f} s  "
          f"auto/dense speed {ratio['auto']:.2f}x  greedy tokens: {same} (auto's calls with other tokens than "
          f"its first: {varied})  (M=1 sparse in {sparse_m1} of "
          f"{len(layers_on)} layers)", flush=True)
    for b in [b for b in contenders if b not in ("dense", "auto")]:
        print(f"  {b}: {med(times[b]):.2f} s, {ratio[b]:.2f}x the speed of dense", flush=True)
    for b, p in parts.items():
        print(f"  decode step, {b}: {p['step']:.2f} ms = FFN {p['ffn']:.2f} + attention {p['attention']:.2f} + "
              f"LM head {p['lm_head']:.2f} + rest {p['rest']:.2f}", flush=True)
    row = {"model": name, "dtype": dtype, "prompt": prompt, "new_tokens": new, "dense_s": med(times["dense"]),
           "auto_s": med(times["auto"]), "speedup": ratio["auto"], "greedy_tokens": same,
           "auto_calls_with_other_tokens": {b: f"{n} of {rounds}" for b, n in varied.items()},
           "layers_sparse_at_m1": f"{sparse_m1} of {len(layers_on)}", "rounds": rounds, "step_ms": parts,
           "packed": {b: {"s": med(times[b]), "speed_vs_dense": ratio[b]} for b in ("dense+packed", "auto+packed")},
           "auto_packed_vs_dense_packed": med([d / a for d, a in zip(times["dense+packed"], times["auto+packed"])]),
           "others": {b: {"s": med(times[b]), "speed_vs_dense": ratio[b]} for b in others or {}},
           "decisions": layers_on}
    return row, tokens


def llama_cpp_contenders(ggufs: list[str], ids: torch.Tensor, new: int, threads: int) -> dict:
    """llama.cpp (llama-cpp-python) on each GGUF file: name -> a callable that decodes `new` greedy tokens after
    the prompt `ids` (prefill included, the KV cache reset first, as generate() starts afresh) and returns
    [1, prompt + new] ids. `threads` for both its decode and its prompt batch."""
    if not ggufs:
        return {}
    from llama_cpp import Llama

    out = {}
    for path in ggufs:
        llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=ids.shape[1] + new + 16,
                    n_batch=512, verbose=False)

        def decode(llm=llm):
            llm.reset()
            got = []
            for tok in llm.generate(ids[0].tolist(), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
                got.append(tok)
                if len(got) == new:
                    break
            return torch.cat([ids, torch.tensor([got])], 1)
        out[f"llama.cpp {Path(path).name}"] = decode
    return out


def step_parts(model, ids: torch.Tensor, new: int, backend: str) -> dict:
    """Where one decode step's wall time goes (M = 1 steps only, the prompt's forward left out): the FFNs (every
    layer's mlp), the attention blocks (self_attn), the LM head, and the rest of the step (norms, residuals, the
    embedding, transformers' generate() loop, the cache). Forward hooks read time.perf_counter around each module
    (the CPU runs synchronously); their own cost falls in "rest". ms per generated token."""
    parts = {"ffn": 0.0, "attention": 0.0, "lm_head": 0.0, "step": 0.0}
    state = {"decode": False, "steps": 0, "t0": 0.0}
    started: dict[int, float] = {}

    def pre(module, args, kwargs):
        started[id(module)] = time.perf_counter()

    def post(part):
        def hook(module, args, kwargs, out):
            if state["decode"]:
                parts[part] += time.perf_counter() - started[id(module)]
        return hook

    def model_pre(module, args, kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        state["decode"] = x is not None and x.shape[-1] == 1
        state["t0"] = time.perf_counter()

    def model_post(module, args, kwargs, out):
        if state["decode"]:
            parts["step"] += time.perf_counter() - state["t0"]
            state["steps"] += 1
        state["decode"] = False

    handles = [model.register_forward_pre_hook(model_pre, with_kwargs=True),
               model.register_forward_hook(model_post, with_kwargs=True)]
    for name, module in model.named_modules():
        part = ("ffn" if name.endswith(".mlp") else "attention" if name.endswith(".self_attn")
                else "lm_head" if name == "lm_head" else None)
        if part:
            handles += [module.register_forward_pre_hook(pre, with_kwargs=True),
                        module.register_forward_hook(post(part), with_kwargs=True)]
    model.set_ffn_backend(backend)
    start = time.perf_counter()
    try:
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
    finally:
        for h in handles:
            h.remove()
    total = time.perf_counter() - start
    per = 1e3 / max(1, state["steps"])
    out = {k: v * per for k, v in parts.items()}
    out["rest"] = out["step"] - out["ffn"] - out["attention"] - out["lm_head"]
    out["decode_steps"] = state["steps"]
    out["generate_s"] = total
    return out


def provenance(threads: int) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=REPO).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"torch": torch.__version__, "threads": threads, "cpu": cpu, "cores": os.cpu_count(),
            "commit": commit + ("+dirty" if dirty else ""), "load_avg_at_start": os.getloadavg()}


def varying(row: dict) -> str:
    """The report's note on auto's calls whose greedy tokens were not its first call's (none: nothing)."""
    odd = {b: n for b, n in row.get("auto_calls_with_other_tokens", {}).items() if not n.startswith("0 ")}
    return "".join(f"; {b}: other tokens in {n} calls" for b, n in odd.items())


def ours(row: dict) -> float:
    """generate()'s time as a folder runs by default: auto, packed in bf16 (the first CPU generate() packs)."""
    return row["packed"]["auto+packed"]["s"] if row["dtype"] == "bf16" else row["auto_s"]


def markdown(report: dict) -> str:
    p = report["provenance"]
    lines = [f"# CPU sparse decode: {p['cpu']}, {p['threads']} threads, torch {p['torch']}, commit {p['commit']}", "",
             "Ratios are dense time / sparse (or auto) time: > 1 means faster than dense.", "",
             "| FFN, M = 1, bf16 | active | dense ms | sparse ms | sparse vs dense | dense, weights packed, ms | "
             "sparse vs it |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {100 * r['active']:.1f}% | {r['dense_ms']:.3f} | {r['sparse_ms']:.3f} | "
              f"**{r['speedup']:.2f}x** | {r['dense_packed_ms']:.3f} | {r['speedup_vs_dense_packed']:.2f}x |"
              for r in report["ffn_m1"]]
    lines += ["", "| auto vs dense | M | dense ms | auto ms | auto vs dense | auto chose |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['m']} | {r['dense_ms']:.3f} | {r['auto_ms']:.3f} | {r['speedup']:.2f}x | "
              f"{r['decision']} |" for r in report["auto"]]
    lines += ["", "| generate() | dtype | prompt + new | dense s | auto s | auto vs dense | greedy tokens | M=1 sparse |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['dtype']} | {r['prompt']} + {r['new_tokens']} | {r['dense_s']:.2f} | {r['auto_s']:.2f} | "
              f"**{r['speedup']:.2f}x** | {r['greedy_tokens']}{varying(r)} | {r['layers_sparse_at_m1']} |" for r in report["generate"]]
    lines += ["", "With the layers outside the FFNs packed (attention projections, LM head: what a folder's first generate() "
              "on the CPU in bf16 does by default, model.pack_cpu_linears()), same rounds; speed vs dense = against the "
              "unpacked dense model (stock transformers' step):", "",
              "| model | dtype | dense+packed s | vs dense | auto+packed s | vs dense | auto+packed vs dense+packed |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['dtype']} | {r['packed']['dense+packed']['s']:.2f} | "
              f"{r['packed']['dense+packed']['speed_vs_dense']:.2f}x | {r['packed']['auto+packed']['s']:.2f} | "
              f"**{r['packed']['auto+packed']['speed_vs_dense']:.2f}x** | {r['auto_packed_vs_dense_packed']:.2f}x |"
              for r in report["generate"]]
    others = [(r, b, o) for r in report["generate"] for b, o in r.get("others", {}).items()]
    if others:
        lines += ["", "Beside them in the same rounds (same prompt ids, same number of new tokens, prefill included):", "",
                  "| model | contender | s | speed vs our dense | ours (auto, packed in bf16) vs it |", "|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {b} | {o['s']:.2f} | {o['speed_vs_dense']:.2f}x | "
                  f"**{o['s'] / ours(r):.2f}x** |" for r, b, o in others]
    lines += ["", "Where a decode step's time goes (ms per generated token, forward hooks around each module; rest = "
              "norms, residuals, embedding, the cache, generate()'s loop, the hooks themselves):", "",
              "| model | dtype | FFN backend | step | FFN | attention | LM head | rest |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['dtype']} | {b} | {p['step']:.2f} | {p['ffn']:.2f} | {p['attention']:.2f} | "
              f"{p['lm_head']:.2f} | {p['rest']:.2f} |" for r in report["generate"] for b, p in r["step_ms"].items()]
    for r in report["generate"]:
        if "text" in r:
            lines += ["", f"{r['model']} (zeros {r['zeros_in_config']}), greedy text after the prompt "
                      f"{r['text']['prompt'][-120:]!r}:", "", f"- dense: {r['text']['dense']!r}",
                      f"- auto: {r['text']['auto']!r}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--zeros", type=float, default=0.957, help="fraction of zeros in the FFN activations")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="token counts of the auto section")
    ap.add_argument("--budget-ms", type=float, default=3000.0, help="timing budget per pair (rounds fill it)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5, help="paired generate() rounds per model")
    ap.add_argument("--dtypes", default="bf16,fp32", help="generate()'s model dtypes (bf16: the folders' own; fp32 too by "
                    "default: its greedy tokens part ways from dense far later than bf16's)")
    ap.add_argument("--synth-dir", default=str(Path(tempfile.gettempdir()) / "sparsify-cpu-decode-synth"),
                    help="where the synth folders are (made if missing)")
    ap.add_argument("--folder", action="append", default=[], help="a real sparsify folder for the generate() section "
                    "(repeatable; in --folder-dtype, a prompt of real text); --dtypes '' leaves the synth models out")
    ap.add_argument("--folder-dtype", default="bf16", choices=tuple(DTYPES), help="the --folder models' dtype")
    ap.add_argument("--gguf", action="append", default=[], help="a GGUF file that llama.cpp (pip install "
                    "llama-cpp-python) decodes in the same rounds as each --folder (repeatable)")
    ap.add_argument("--sections", default="ffn,auto,generate")
    ap.add_argument("--shapes", default=",".join(f"{d}x{f}" for d, f in SHAPES), help="d x F of the FFN sections")
    ap.add_argument("--out", default=None, help="folder for cpu-decode.json and report.md")
    args = ap.parse_args()
    if BACKEND_TABLE[("cpu", "twell")] is not sparse_rows:
        raise SystemExit("the CPU row is Triton's interpreter here (TRITON_INTERPRET=1): unset it to time the CPU row")
    torch.set_num_threads(args.threads)
    sections = set(args.sections.split(","))
    report = {"provenance": provenance(args.threads), "settings": vars(args)}
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}, commit {report['provenance']['commit']}, "
          f"load average {report['provenance']['load_avg_at_start']}", flush=True)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    report["ffn_m1"] = ffn_m1(args.zeros, args.budget_ms, shapes) if "ffn" in sections else []
    ms = tuple(int(m) for m in args.ms.split(","))
    report["auto"] = auto_vs_dense(args.zeros, ms, args.budget_ms, shapes) if "auto" in sections else []
    report["generate"] = (generate_e2e(Path(args.synth_dir), args.zeros, args.prompt, args.new, args.rounds,
                                       [d for d in args.dtypes.split(",") if d], args.folder, args.gguf,
                                       args.folder_dtype)
                          if "generate" in sections else [])
    report["provenance"]["load_avg_at_end"] = os.getloadavg()
    print(markdown(report))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "cpu-decode.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        (out / "report.md").write_text(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
