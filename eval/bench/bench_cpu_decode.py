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
   in bf16 (the folders' dtype) and fp32 (`--dtypes`).
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

from sparsify.kernels.cpu_sparse import sparse_rows
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
        fns = {"dense": cycling(lambda xi: dense_rows(rt.dispatcher, xi, wg, wu, wd), pool),
               "sparse": cycling(lambda xi: sparse_row(rt.dispatcher, xi, wg, wu, wd), pool)}
        errors: dict = {}
        t = interleaved(fns, clock, errors, budget_ms=budget_ms, target_ms=50.0, warm=2, min_rounds=7)
        density = float((torch.nn.functional.linear(x, wg) > 0).float().mean())
        rows.append({"shape": f"{d}x{f}", "active": density, "dense_ms": med(t["dense"]),
                     "sparse_ms": med(t["sparse"]), "speedup": 1 / paired(t, "sparse", "dense"),
                     "rounds": len(t["dense"]), "errors": errors})
        print(f"FFN M=1 {d}x{f}: active {density:.3f}  dense {med(t['dense']):.3f} ms  sparse "
              f"{med(t['sparse']):.3f} ms  sparse/dense speed {rows[-1]['speedup']:.2f}x", flush=True)
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


def generate_e2e(root: Path, zeros: float, prompt: int, new: int, rounds: int, dtypes: list[str]) -> list[dict]:
    from transformers import AutoModelForCausalLM

    rows = []
    for (name, config, layers), dtype in [(s, t) for t in dtypes for s in SYNTH]:
        folder = synth_folder(root, name, config, layers, zeros)
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=DTYPES[dtype]).eval()
        vocab = model.get_input_embeddings().weight.shape[0]
        ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(1))

        def gen(backend: str):
            model.set_ffn_backend(backend)
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                     min_new_tokens=new, do_sample=False, pad_token_id=0)
            return time.perf_counter() - start, out

        tokens = {b: gen(b)[1] for b in ("auto", "dense")}  # warm-up (auto calibrates its buckets here)
        times: dict[str, list[float]] = {"dense": [], "auto": []}
        for r in range(rounds):
            for b in ("dense", "auto") if r % 2 == 0 else ("auto", "dense"):
                s, out = gen(b)
                times[b].append(s)
                if not torch.equal(out, tokens[b]):
                    raise RuntimeError(f"{name}: greedy tokens of {b} changed between calls")
        same = first_difference(tokens["auto"], tokens["dense"], prompt)
        layers_on = [m.auto_decisions() for m in model.ffn_runtime.layers]
        sparse_m1 = sum(1 for dec in layers_on if (dec.get(1) or {}).get("eager") == "twell")
        ratio = med([d / a for d, a in zip(times["dense"], times["auto"])])
        rows.append({"model": name, "dtype": dtype, "prompt": prompt, "new_tokens": new, "dense_s": med(times["dense"]),
                     "auto_s": med(times["auto"]), "speedup": ratio, "greedy_tokens": same,
                     "layers_sparse_at_m1": f"{sparse_m1} of {len(layers_on)}", "rounds": rounds,
                     "decisions": layers_on})
        print(f"generate {name} {dtype}: dense {med(times['dense']):.2f} s  auto {med(times['auto']):.2f} s  "
              f"auto/dense speed {ratio:.2f}x  greedy tokens: {same}  (M=1 sparse in {sparse_m1} of "
              f"{len(layers_on)} layers)", flush=True)
        del model
    return rows


def provenance(threads: int) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=REPO).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"torch": torch.__version__, "threads": threads, "cpu": cpu, "cores": os.cpu_count(),
            "commit": commit + ("+dirty" if dirty else ""), "load_avg_at_start": os.getloadavg()}


def markdown(report: dict) -> str:
    p = report["provenance"]
    lines = [f"# CPU sparse decode: {p['cpu']}, {p['threads']} threads, torch {p['torch']}, commit {p['commit']}", "",
             "Ratios are dense time / sparse (or auto) time: > 1 means faster than dense.", "",
             "| FFN, M = 1, bf16 | active | dense ms | sparse ms | sparse vs dense |", "|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {100 * r['active']:.1f}% | {r['dense_ms']:.3f} | {r['sparse_ms']:.3f} | "
              f"**{r['speedup']:.2f}x** |" for r in report["ffn_m1"]]
    lines += ["", "| auto vs dense | M | dense ms | auto ms | auto vs dense | auto chose |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['m']} | {r['dense_ms']:.3f} | {r['auto_ms']:.3f} | {r['speedup']:.2f}x | "
              f"{r['decision']} |" for r in report["auto"]]
    lines += ["", "| generate() | dtype | prompt + new | dense s | auto s | auto vs dense | greedy tokens | M=1 sparse |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['dtype']} | {r['prompt']} + {r['new_tokens']} | {r['dense_s']:.2f} | {r['auto_s']:.2f} | "
              f"**{r['speedup']:.2f}x** | {r['greedy_tokens']} | {r['layers_sparse_at_m1']} |" for r in report["generate"]]
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
                                       args.dtypes.split(","))
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
