"""Benchmark TwELL kernels against the dense cuBLAS FFN in the same run.

Usage on the H200 (eval/device/device_env.sh makes `sparsify.kernels` importable):
  cd repo && source eval/device/device_env.sh
  PYTHONPATH=$PWD PYTHONUNBUFFERED=1 python eval/bench/bench_kernels.py --tests --out $OUT/kernels
CPU dry run of every code path (Triton interpreter, tiny grid):  python eval/bench/bench_kernels.py --smoke --out /tmp/b

What runs:
  --tests  pytest -m gpu tests/kernels first (time-limited; a failure does not stop the bench).
  grid     d x F in {576x1536, 2048x8192, 4096x14336}, M in {1, 16, 256, 4096, 16384}, 95/98/99/99.5%
           zeros, uniform and skewed patterns. For each case these functions are timed INTERLEAVED
           (every round times each once, in a rotating order; medians over rounds; ratios are medians
           of the per-round paired ratios):
             dense, dense_b  the dense torch FFN (twice: dense / dense_b is the same-run noise)
             auto            twell_ffn(backend="auto") (public API, dispatcher included)
             twell_tma       the default (variant "tma"): K1 with 128 x 256 TMA tiles and a
                             slot-major epilogue, K2 reading per-row compacted entry lists
             twell_tiled     variant "tiled" (the plain-tiled pointer-load K1, compacted K2): the default's
                             fallback (at M <= 16 both run the tiled K1: twell_tiled is then not timed)
             k1, k1_tma, gate  K1 alone (tiled, TMA-tiled) and the cuBLAS gate GEMM F.linear(x, W_gate)
             k2, k2_c        K2 alone on the tiled K1's packed gate, plain and compacted (gather GB/s from its time)
           (the variants removed over the benchmark rounds: kernels/NOTES.md)
           For M <= 256 the same for graph replays (10 calls per CUDA graph: GPU time without Python).
           One measurement = a loop of n back-to-back calls between two CUDA events (L2 not flushed:
           eager launch-bound sizes then measure what a model pays per call).
  Repetitions (n, rounds) adapt to --budget-s so the whole grid always runs; a failing function is
  recorded in the row (key "errors") and dropped from that case, the others are still timed.
Writes DIR/kernels-bench.json (every row with environment info) and DIR/kernels-bench.md, and prints
the target table (TARGETS) last, with the time each section took.

Honest sparsity: x[:, 0] = 1 and W_gate[:, 0] = -b_j. With Gaussian x, g_j = x W_gate[j]^T is
N(0, |W_gate[j, 1:]|^2) so b_j = |W_gate[j, 1:]| * ndtri(1 - p_j) makes neuron j active with
probability p_j. uniform: p_j = 1 - sparsity; skewed: 30% dead, Zipf (1 / rank) on the rest, capped
at 0.9, scaled so the mean is 1 - sparsity. The GEMMs stay real.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sparsify.kernels import twell_updown as tu  # noqa: E402  (K2 and twell_ffn_triton)
from sparsify.kernels.dispatch import CudaClock  # noqa: E402

from timing import Clock, interleaved, med, paired  # noqa: E402,F401  (eval/bench/timing.py)

SHAPES = [(576, 1536), (2048, 8192), (4096, 14336)]
MS = [1, 16, 256, 4096, 16384]
SPARSITIES = [0.95, 0.98, 0.99, 0.995]
PATTERNS = ["uniform", "skewed"]
GRAPH_M = 256  # up to this M, also time CUDA-graph replays
GRAPH_CALLS = 10


def neuron_probs(f: int, sparsity: float, pattern: str, gen: torch.Generator) -> torch.Tensor:
    """[F] probability that each neuron is active, mean 1 - sparsity."""
    target = 1.0 - sparsity
    if pattern == "uniform":
        return torch.full((f,), target)
    perm = torch.randperm(f, generator=gen)
    alive = perm[int(0.3 * f):]
    zipf = 1.0 / torch.arange(1, alive.numel() + 1, dtype=torch.float64)
    lo, hi = 0.0, 1e6
    for _ in range(100):  # bisection on the scale so that mean(min(s * zipf, 0.9)) = target
        s = (lo + hi) / 2
        if (s * zipf).clamp(max=0.9).sum().item() / f < target:
            lo = s
        else:
            hi = s
    p = torch.zeros(f, dtype=torch.float64)
    p[alive] = (s * zipf).clamp(max=0.9)
    return p.float()


def set_sparsity(w_gate: torch.Tensor, sparsity: float, pattern: str, seed: int = 0) -> None:
    """Write the bias column W_gate[:, 0] in place so neuron j fires with probability p_j."""
    gen = torch.Generator().manual_seed(seed)
    p = neuron_probs(w_gate.shape[0], sparsity, pattern, gen).to(w_gate.device)
    norm = w_gate[:, 1:].float().norm(dim=1)  # [F]
    z = torch.special.ndtri((1.0 - p).clamp(1e-9, 1 - 1e-9).double()).float()
    bias = torch.where(p > 0, norm * z, torch.full_like(norm, 1e4))
    w_gate[:, 0] = (-bias).to(w_gate.dtype)


def git_commit() -> str:
    """$GIT_COMMIT, else the checkout's HEAD ("unknown" on a device copy without .git)."""
    commit = os.environ.get("GIT_COMMIT")
    if commit:
        return commit
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001 - the device copy may have no .git
        return "unknown"


def env_info() -> dict:
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}


# ------------------------------------------------------------------------------------------- timing
def print_tables(header: str, row_lines, more_lines, tail: str) -> None:
    """The end of a bench run: the row table, the summary lines, then the totals and where the JSON is."""
    print("\n" + header)
    for line in row_lines:
        print(line)
    print()
    for line in more_lines:
        print(line)
    print(tail)


def as_graph(fn, calls: int = GRAPH_CALLS):
    """A CUDA graph of `calls` calls of fn (GPU time, no Python), captured as auto's calibration does."""
    graph = CudaClock.capture(fn, calls)
    torch.cuda.synchronize()
    return graph


MAX_ROUNDS = 25  # --max-rounds: the cap on interleaved rounds per case (the budget binds below it)


# ------------------------------------------------------------------------------------------- cases
def make_layer(d: int, f: int, device: str, dtype) -> tuple:
    gen = torch.Generator(device=device).manual_seed(0)
    w_gate = (torch.randn(f, d, device=device, generator=gen) / d**0.5).to(dtype)
    w_up = (torch.randn(f, d, device=device, generator=gen) / d**0.5).to(dtype)
    w_down = (torch.randn(d, f, device=device, generator=gen) / f**0.5).to(dtype)
    return w_gate, w_up, w_down


def case_fns(x, w_gate, w_up, w_down, w_down_t, tt, twell_ops, ffn_dense) -> dict:
    """Every function timed for one case (closures over the case's tensors)."""
    pk5 = tt.gate_pack(x, w_gate)
    fns = {
        "dense": lambda: ffn_dense(x, w_gate, w_up, w_down),
        "auto": lambda: twell_ops.twell_ffn(x, w_gate, w_up, w_down, backend="auto"),
        "twell_tma": lambda: tu.twell_ffn_triton(x, w_gate, w_up, w_down_t, variant="tma"),
        "twell_tiled": lambda: tu.twell_ffn_triton(x, w_gate, w_up, w_down_t, variant="tiled"),
        "dense_b": lambda: ffn_dense(x, w_gate, w_up, w_down),
        "k1": lambda: tt.gate_pack(x, w_gate),
        "k1_tma": lambda: tt.gate_pack(x, w_gate, variant="tma"),
        "gate": lambda: torch.nn.functional.linear(x, w_gate),
        "k2": lambda: tu.updown(x, pk5, w_gate, w_up, w_down_t),
        "k2_c": lambda: tu.updown(x, pk5, w_gate, w_up, w_down_t, compact=True),
    }
    if x.shape[0] <= 16:  # decode tiles: "tma" runs the tiled K1
        fns.pop("twell_tiled")
    if tu.k2_config(x.shape[0], x.shape[1])["SPLIT"] > 1:  # K2 split over programs: no compaction
        fns.pop("k2_c")
    return fns


def case_stats(x, w_gate, w_up, w_down, w_down_t, tt, ffn_dense) -> dict:
    """Sparsity actually produced, overflow, and the error of both variants vs the fp32 oracle."""
    m, d = x.shape
    f = w_gate.shape[0]
    packed = tt.gate_pack(x, w_gate)
    cnt = packed.cnt.long()
    ovf = packed.overflowed()
    per_tok = cnt.sum(1).float()
    ref = ffn_dense(x.float(), w_gate.float(), w_up.float(), w_down.float())
    out = {"measured_zeros": 1 - cnt.sum().item() / (m * f), "nnz_mean": per_tok.mean().item(),
           "nnz_max": per_tok.max().item(), "overflow_tiles": int(ovf.sum()), "entries": packed.entries,
           "gathered_bytes": int(torch.where(ovf, 0, cnt).sum()) * 2 * d * x.element_size(),
           "err_plain": (ffn_dense(x, w_gate, w_up, w_down).float() - ref).abs().max().item()}
    for name, variant in (("err_twell_tiled", "tiled"), ("err_twell_tma", "tma")):
        try:
            out[name] = (tu.twell_ffn_triton(x, w_gate, w_up, w_down_t, variant=variant).float() - ref).abs().max().item()
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"[:200]
    return out


def summarize(t: dict, prefix: str = "") -> dict:
    """Medians and same-run ratios of one interleaved set (prefix "graph_" for graph replays)."""
    row = {f"{prefix}{k}_ms": med(v) for k, v in t.items()}
    for name in ("auto", "twell_tma", "twell_tiled"):
        r = paired(t, "dense", name)
        if r is not None:
            row[f"{prefix}x_{name}"] = r  # dense / name: > 1 means faster than dense
    noise = [a / b for a, b in zip(t.get("dense", []), t.get("dense_b", []))]
    if noise:
        row[f"{prefix}noise_med"] = med(noise)
        row[f"{prefix}noise_lo"], row[f"{prefix}noise_hi"] = min(noise), max(noise)
    for k1 in ("k1", "k1_tma"):
        r = paired(t, k1, "gate")
        if r is not None:
            row[f"{prefix}{k1}_over_gate"] = r
    return row


def run_case(x, layer, w_down_t, sparsity, pattern, ctx) -> dict:
    tt, twell_ops, ffn_dense, clock, budget_ms = ctx["tt"], ctx["ops"], ctx["dense"], ctx["clock"], ctx["budget"]()
    w_gate, w_up, w_down = layer
    set_sparsity(w_gate, sparsity, pattern)  # in place: the dispatcher sees a new layer (version bump)
    w_down._twell_down_t = None
    m, d = x.shape
    row = {"d": d, "F": w_gate.shape[0], "M": m, "sparsity": sparsity, "pattern": pattern, "dtype": str(x.dtype)}
    errors: dict = {}
    try:
        row.update(case_stats(x, w_gate, w_up, w_down, w_down_t, tt, ffn_dense))
        fns = case_fns(x, w_gate, w_up, w_down, w_down_t, tt, twell_ops, ffn_dense)
    except Exception as e:  # noqa: BLE001 - the packer failed: keep the default variant and dense
        errors["setup"] = f"{type(e).__name__}: {e}"[:400]
        fns = {"dense": lambda: ffn_dense(x, w_gate, w_up, w_down),
               "dense_b": lambda: ffn_dense(x, w_gate, w_up, w_down),
               "twell_tma": lambda: tu.twell_ffn_triton(x, w_gate, w_up, w_down_t, variant="tma"),
               "auto": lambda: twell_ops.twell_ffn(x, w_gate, w_up, w_down, backend="auto")}
    graph_on = clock.cuda and m <= GRAPH_M
    t = interleaved(fns, clock, errors, budget_ms=budget_ms * (0.6 if graph_on else 1.0), max_rounds=MAX_ROUNDS)
    row.update(summarize(t))
    row["auto_backend"] = twell_ops.last_backend()
    row["k1_config"] = tt.k1_best_config(d, w_gate.shape[0], m)
    row["k1_tma_config"] = tt.k1_best_config(d, w_gate.shape[0], m, variant="tma")
    for k in ("k2", "k2_c"):
        if f"{k}_ms" in row and "gathered_bytes" in row:
            row[f"{k}_GBps"] = row["gathered_bytes"] / row[f"{k}_ms"] / 1e6
    if graph_on:
        row.update(graph_case(fns, clock, budget_ms * 0.4, errors))
    if errors:
        row["errors"] = errors
    return row


def graph_case(fns: dict, clock: Clock, budget_ms: float, errors: dict) -> dict:
    """The same functions replayed from CUDA graphs (decode and small prefill run this way in practice)."""
    graphs = {}
    for k in ("dense", "dense_b", "auto", "twell_tma", "twell_tiled"):
        if k in fns:
            try:
                graphs[k] = as_graph(fns[k]).replay
            except Exception as e:  # noqa: BLE001
                errors[f"graph_{k}"] = f"{type(e).__name__}: {e}"[:400]
    t = interleaved(graphs, clock, errors, budget_ms=budget_ms, per_call={k: GRAPH_CALLS for k in graphs},
                    max_rounds=MAX_ROUNDS)
    out = summarize(t, "graph_")
    del graphs
    return out


# --------------------------------------------------------------------------------------- reporting
def fmt_row(r: dict) -> str:
    head = f"{r['d']}x{r['F']} M={r['M']:<5} {r['sparsity']*100:.1f}% {r['pattern']:<7}"

    def x(key, graph=""):
        v = r.get(f"{graph}x_{key}")
        return "-" if v is None else f"{v:.2f}x"

    def ms(key):
        v = r.get(f"{key}_ms")
        return "-" if v is None else f"{v:.4f}"

    cells = [head, ms("dense"), f"{ms('twell_tma')} ({x('twell_tma')})", f"{ms('twell_tiled')} ({x('twell_tiled')})",
             f"{x('auto')} {r.get('auto_backend')}",
             f"{r.get('noise_lo', 0):.2f}-{r.get('noise_hi', 0):.2f}" if "noise_lo" in r else "-",
             f"{ms('k1_tma')}/{ms('k1')}/{ms('gate')}",
             "/".join(f"{r.get(k + '_over_gate', float('nan')):.2f}" for k in ("k1_tma", "k1")),
             f"{r.get('k2_GBps', 0):.0f}/{r.get('k2_c_GBps', 0):.0f}",
             f"{r.get('nnz_mean', 0):.1f} ({r.get('nnz_max', 0):.0f})", str(r.get("overflow_tiles", "-")),
             f"{x('twell_tma', 'graph_')}/{x('twell_tiled', 'graph_')}/{x('auto', 'graph_')}" if "graph_dense_ms" in r else "-"]
    if "errors" in r:
        cells.append("ERR " + "; ".join(f"{k}: {v[:80]}" for k, v in r["errors"].items()))
    return "| " + " | ".join(cells) + " |"


HEADER = ("| case | dense ms | twell tma ms (x) | twell tiled ms (x) | "
          "auto x (path) | dense/dense noise | K1 tma/tiled/cuBLAS gate ms | K1/gate tma/tiled | "
          "K2 GB/s plain/compact | nnz/tok (max) | ovf | graph x tma/tiled/auto |\n" + "|---" * 12 + "|")


def find(rows, d, f, m, s, pattern="skewed"):
    for r in rows:
        if (r["d"], r["F"], r["M"], r["sparsity"], r["pattern"]) == (d, f, m, s, pattern):
            return r
    return None


def targets(rows: list[dict]) -> list[str]:
    """The issue's target rows and the auto worst case, as printed lines."""
    lines = ["TARGETS (skewed; ratios = dense / x from interleaved rounds of the same run; > 1 is faster)"]
    for d, f, m, s, goal in [(2048, 8192, 16384, 0.995, 1.6), (2048, 8192, 16384, 0.99, 1.3),
                             (4096, 14336, 16384, 0.995, 1.4), (2048, 8192, 1, 0.99, 2.0)]:
        r = find(rows, d, f, m, s)
        if r is None:
            continue
        g = (f" | graph tma {r.get('graph_x_twell_tma', float('nan')):.2f}x tiled {r.get('graph_x_twell_tiled', float('nan')):.2f}x"
             if "graph_dense_ms" in r else "")
        lines.append(f"{d}x{f} M={m} {s*100:.1f}% target >= {goal}x: eager tma {r.get('x_twell_tma', float('nan')):.2f}x "
                     f"tiled {r.get('x_twell_tiled', float('nan')):.2f}x "
                     f"auto {r.get('x_auto', float('nan')):.2f}x "
                     f"(dense {r.get('dense_ms', float('nan')):.4f} ms){g}")
    for d, f in [(2048, 8192), (4096, 14336)]:
        r = find(rows, d, f, 16384, 0.99)
        if r is not None:
            lines.append(f"K1 / cuBLAS gate {d}x{f} M=16384 99% (target <= 1.10): tma {r.get('k1_tma_over_gate', float('nan')):.2f} "
                         f"tiled {r.get('k1_over_gate', float('nan')):.2f} "
                         f"(gate {r.get('gate_ms', float('nan')):.4f} ms; picked tma {r.get('k1_tma_config')} / tiled "
                         f"{r.get('k1_config')}); K2 gather GB/s plain {r.get('k2_GBps', 0):.0f} compact "
                         f"{r.get('k2_c_GBps', 0):.0f}")
    lines += auto_lines(rows)
    return lines


def auto_lines(rows: list[dict]) -> list[str]:
    out = []
    for prefix, what in (("", "eager"), ("graph_", "graph")):
        rs = [r for r in rows if f"{prefix}x_auto" in r]
        if not rs:
            continue
        worst = min(rs, key=lambda r: r[f"{prefix}x_auto"])
        noise = [abs(1 - r[f"{prefix}noise_med"]) for r in rs if f"{prefix}noise_med" in r]
        bad = [r for r in rs if r[f"{prefix}x_auto"] < 0.97]
        out.append(f"auto vs dense {what} (target >= 0.97 everywhere): worst {worst[f'{prefix}x_auto']:.3f}x at "
                   f"{worst['d']}x{worst['F']} M={worst['M']} {worst['sparsity']} {worst['pattern']} "
                   f"({worst.get('auto_backend')}); {len(bad)} of {len(rs)} cases below 0.97; dense/dense "
                   f"median |1 - ratio|: max {max(noise, default=0):.3f}, median {med(noise) if noise else 0:.3f}")
    return out


def write(out_dir: Path, rows: list[dict], meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "kernels-bench.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    tmp.replace(out_dir / "kernels-bench.json")
    text = "\n".join([HEADER, *map(fmt_row, rows), "", *targets(rows)]) + "\n"
    (out_dir / "kernels-bench.md").write_text(text)


# -------------------------------------------------------------------------------------------- main
def run_tests(timeout_s: int) -> dict:
    t0 = time.time()
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/kernels"]
    try:
        res = subprocess.run(cmd, cwd=ROOT, timeout=timeout_s, capture_output=True, text=True)
        tail, rc = (res.stdout + res.stderr)[-6000:], res.returncode
    except subprocess.TimeoutExpired as e:
        tail, rc = f"timed out after {timeout_s} s\n" + str(e.stdout or "")[-3000:], "timeout"
    print(tail, flush=True)
    print(f"GPU tests exit code {rc} ({time.time() - t0:.0f} s)", flush=True)
    return {"rc": rc, "seconds": time.time() - t0, "tail": tail[-2000:]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "eval/results")))
    p.add_argument("--tests", action="store_true", help="run the GPU correctness tests first")
    p.add_argument("--tests-timeout-s", type=int, default=130, help="stop the GPU tests after this")
    p.add_argument("--budget-s", type=float, default=270, help="wall time for everything; repetitions adapt")
    p.add_argument("--max-rounds", type=int, default=MAX_ROUNDS,
                   help="cap on interleaved rounds per case; raise it to spend the whole --budget-s on "
                        "fewer-noise medians (launch-bound cases vary by several %% round to round)")
    p.add_argument("--smoke", action="store_true", help="tiny grid that runs on CPU (interpreter) too")
    p.add_argument("--shapes", default=",".join(f"{d}x{f}" for d, f in SHAPES))
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--sparsities", default=",".join(map(str, SPARSITIES)))
    p.add_argument("--patterns", default=",".join(PATTERNS))
    args = p.parse_args(argv)
    if args.smoke:
        args.shapes, args.ms, args.sparsities, args.patterns = "32x128", "1,20", "0.9", "skewed"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    global MAX_ROUNDS
    MAX_ROUNDS = args.max_rounds
    start = time.time()
    sections, meta = {}, {}
    if args.tests:
        meta["tests"] = run_tests(args.tests_timeout_s)
        sections["gpu tests"] = time.time() - start
    from sparsify.kernels import twell_ops, twell_triton as tt
    from sparsify.kernels.twell_reference import ffn_dense

    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        print("no CUDA GPU: set TRITON_INTERPRET=1 (with --smoke) for a CPU dry run", file=sys.stderr)
        return 2
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    meta["env"] = env_info()
    print(meta["env"], flush=True)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    sps = [float(s) for s in args.sparsities.split(",")]
    pats = args.patterns.split(",")
    total = len(shapes) * len(ms) * len(sps) * len(pats)
    done = [0]
    deadline = start + args.budget_s

    def budget_ms() -> float:  # per case: an even share of what is left, 40% kept for compile/warm-up
        left = max(0.0, deadline - time.time())
        return 1000 * 0.6 * left / max(1, total - done[0]) if cuda else 1.0

    ctx = {"tt": tt, "ops": twell_ops, "dense": ffn_dense, "clock": Clock(cuda), "budget": budget_ms}
    rows: list[dict] = []
    for d, f in shapes:
        t0 = time.time()
        layer = make_layer(d, f, dev, dt)
        w_down_t = twell_ops.transpose_down(layer[2])
        gen = torch.Generator(device=dev).manual_seed(1)
        for m in ms:
            x = torch.randn(m, d, device=dev, generator=gen).to(dt)
            x[:, 0] = 1.0
            for s in sps:
                for pattern in pats:
                    try:
                        row = run_case(x, layer, w_down_t, s, pattern, ctx)
                    except Exception as e:  # noqa: BLE001 - one case must not lose the others
                        row = {"d": d, "F": f, "M": m, "sparsity": s, "pattern": pattern,
                               "errors": {"case": f"{type(e).__name__}: {e}"[:400]}}
                    rows.append({**meta["env"], **row})
                    done[0] += 1
                    print(fmt_row(row), flush=True)
            del x
        sections[f"grid {d}x{f}"] = time.time() - t0
        meta["sections_s"] = sections
        write(args.out, rows, meta)
        del layer, w_down_t
        if cuda:
            torch.cuda.empty_cache()
    print_tables(HEADER, map(fmt_row, rows), targets(rows),
                 "section times: " + ", ".join(f"{k} {v:.0f} s" for k, v in sections.items()) +
                 f"; total {time.time() - start:.0f} s; JSON: {args.out / 'kernels-bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
