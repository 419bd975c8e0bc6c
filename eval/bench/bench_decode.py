"""Decode FFN benchmark (M = 1..32 rows): the TwELL decode path (K1 + split or chunked K2) against dense cuBLAS.

Usage on the H200 (eval/device/device_env.sh makes `sparsify.kernels` importable):
  cd repo && source eval/device/device_env.sh
  PYTHONPATH=$PWD PYTHONUNBUFFERED=1 python eval/bench/bench_decode.py --out $OUT/decode   (~3.5 min)
Registers and spills of the sm_90 builds of the two decode K2s (no GPU needed: Triton compiles for sm_90
and ptxas -v reports; run it on the H200 too for its Triton version):
  python eval/bench/bench_decode.py --compile-report --out /tmp/dec
CPU dry run of every code path (Triton interpreter, tiny shape, fp32, eager timing):
  TRITON_INTERPRET=1 python eval/bench/bench_decode.py --smoke --out /tmp/dec

Grid: d x F in {576x1536, 2048x8192, 4096x14336, 8192x28672}, M in {1, 2, 4, 8, 16, 32}, zeros 0.85 /
0.90 / 0.95 / 0.99, skewed pattern with honest sparsity (eval/bench/bench_kernels.py: make_layer + set_sparsity),
bf16. Per case:
  1. correctness of every function against ffn_dense on the fp32-upcast tensors: rel err = max |err| /
     max |ref|, which must be <= 2 x the plain bf16 dense FFN's rel err + 1e-3 (the tests' bf16 rule);
     a function that fails is reported ("bad") and not timed.
  2. timing: each function is captured in a CUDA graph of `calls` calls (2..20, ~2 ms per replay from an
     eager estimate); the graphs are replayed in interleaved rounds (rotating order), each measurement a
     loop of `reps` replays between CUDA events; medians per call; ratios are medians of the per-round
     paired ratios dense / x (> 1: faster than dense).
       dense, dense_b  ffn_dense (3 cuBLAS GEMMs + relu * mul); dense / dense_b is the same-run noise
       split           K1 + the split _k2_updown at every d (the TMA K1, which falls back to the tiled one at M <= 16;
                       compacted K2 above M = 16)
       chunked         K1 (32-column decode tiles) + updown_decode_chunked (no d-length registers), M <= 16
       routed          twell_ffn_triton: what twell_ffn(backend="twell") and auto's twell path run
       fused           twell_ffn_decode_fused (M = 1 only): K1's GEMV and K2 in one launch, not routed yet
  3. measured zeros and the union U of neurons active in some row.
--sweep-chunked: updown_decode_chunked's E, d chunk, warps and SPLIT on six cases at 90% zeros, beside dense
and the split K2. --no-grid runs only the sweep:
  PYTHONPATH=$PWD python eval/bench/bench_decode.py --no-grid --sweep-chunked --out $OUT/chunked
--sweep-k1: where the decode FFN's time goes at 95.7% zeros (M = 1 on the three large shapes, M = 8 at
4096 x 14336). Beside dense, each case times the parts alone ("part:" names: no output check, they are not
FFNs): the cuBLAS gate GEMV on the same W_gate (F.linear, the rate K1 could reach: both read all of W_gate),
the decode K1 (gate_pack with decode tiles) under K1_DECODE's block shapes, warps and stages (and the
GEMV-shaped K1, variant "gemv", at M = 1), and the chunked
K2 on a packed input; then the whole FFN with each K1 config (that K1 + the chunked K2). The table line per
case gives every K1 config's rate as cuBLAS gate GEMV time / K1 time:
  PYTHONPATH=$PWD python eval/bench/bench_decode.py --no-grid --sweep-k1 --out $OUT/k1dec
--sweep-fused: twell_ffn_decode_fused (K1's GEMV and K2 in one launch) under FUSED's launch configs at M = 1 on
the three large shapes, 95.7% zeros, beside the routed K1 + K2 and the cuBLAS gate GEMV alone:
  PYTHONPATH=$PWD python eval/bench/bench_decode.py --no-grid --sweep-fused --out $OUT/fused
Writes DIR/decode-bench.json and DIR/decode-bench.md; prints the ratio tables last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "eval" / "bench"))

from sparsify.kernels import twell_updown as tu  # noqa: E402  (K2 and twell_ffn_triton)

from bench_kernels import as_graph, env_info, make_layer, print_tables, set_sparsity  # noqa: E402
from timing import loop_ms, med, paired, rounds_of  # noqa: E402

SHAPES = [(576, 1536), (2048, 8192), (4096, 14336), (8192, 28672)]
MS = [1, 2, 4, 8, 16, 32]
ZEROS = [0.85, 0.90, 0.95, 0.99]
FNS = ("dense", "dense_b", "split", "chunked", "routed")
GRAPH_MS = 2.0  # target GPU time of one graph replay (calls per graph follow from it)
MAX_CALLS = 20
# --sweep-chunked: cases and updown_decode_chunked configs (SPLIT None = its default, ~4 programs per SM)
CHUNKED_CASES = [(8192, 28672, 1, 0.9), (8192, 28672, 8, 0.9), (4096, 14336, 1, 0.9), (4096, 14336, 8, 0.9),
                 (2048, 8192, 1, 0.9), (2048, 8192, 8, 0.9)]
CHUNKED = {"c-default": {}, "c-E8": {"E": 8}, "c-E16": {"E": 16}, "c-BD512": {"BD": 512}, "c-BD2048": {"BD": 2048},
           "c-w8": {"num_warps": 8}, "c-E8w8": {"E": 8, "num_warps": 8}, "c-E16w8BD512": {"E": 16, "num_warps": 8, "BD": 512},
           "c-SPLIT64": {"SPLIT": 64}, "c-SPLIT128": {"SPLIT": 128}, "c-SPLIT256": {"SPLIT": 256}, "c-E8SPLIT256": {"E": 8, "SPLIT": 256}}
# --sweep-k1: cases and decode K1 configs (k1_config's M <= 16 entry, BLOCK_M 16 / T 32 / S 32, overridden)
K1_CASES = [(4096, 14336, 1, 0.957), (2048, 8192, 1, 0.957), (8192, 28672, 1, 0.957), (4096, 14336, 8, 0.957)]
K1_DECODE = {"k1": {}, "k1-k64": {"BLOCK_K": 64}, "k1-k256": {"BLOCK_K": 256}, "k1-w2": {"num_warps": 2},
             "k1-w8": {"num_warps": 8}, "k1-s2": {"num_stages": 2}, "k1-s6": {"num_stages": 6},
             "k1-k256w8": {"BLOCK_K": 256, "num_warps": 8}, "k1-k256s3": {"BLOCK_K": 256, "num_stages": 3},
             "k1-k64w2s6": {"BLOCK_K": 64, "num_warps": 2, "num_stages": 6},
             # the GEMV-shaped K1 (variant "gemv", BLOCK_K 256 unless given: M = 1 only, the tiled K1 at M = 8)
             "k1-gemv": {"variant": "gemv"}, "k1-gemv-k128": {"variant": "gemv", "BLOCK_K": 128},
             "k1-gemv-w8": {"variant": "gemv", "num_warps": 8},
             "k1-gemv-k64s6": {"variant": "gemv", "BLOCK_K": 64, "num_stages": 6}}
# --sweep-fused: twell_ffn_decode_fused's launch (FUSED_DEFAULT overridden) at M = 1, 95.7% zeros, beside the routed
# K1 + K2 (what auto runs) and the cuBLAS gate GEMV alone (the rate its W_gate stream could reach)
FUSED_CASES = [(4096, 14336, 1, 0.957), (2048, 8192, 1, 0.957), (8192, 28672, 1, 0.957)]
# Round 1 (lease 5, eval/results/decode-fused-h200/): fewer, larger atomic adds won every time (E2 < E4 < E8,
# BD512 < BD1024 < BD2048), 8 warps, BLOCK_K 128 alone, E2 and BD512 lost everywhere; best per shape E8 (2048x8192,
# 2.51x vs routed 2.21x), BD2048 (4096x14336, 1.91x vs 2.00x), T64k128 (8192x28672, 2.10x vs 2.35x). Round 2
# combines the winners ([E, BD] tiles of 16k fp32 at most, at 4 warps and for two of them at 8 too).
FUSED = {"f-default": {}, "f-E8": {"E": 8}, "f-BD2048": {"BD": 2048}, "f-T64k128": {"T": 64, "BLOCK_K": 128},
         "f-E8BD2048": {"E": 8, "BD": 2048}, "f-E8BD2048w8": {"E": 8, "BD": 2048, "num_warps": 8},
         "f-E16": {"E": 16}, "f-E16w8": {"E": 16, "num_warps": 8}, "f-T16E8BD2048": {"T": 16, "E": 8, "BD": 2048},
         "f-T64k128E8BD2048": {"T": 64, "BLOCK_K": 128, "E": 8, "BD": 2048},
         "f-T16w2E8": {"T": 16, "num_warps": 2, "E": 8}, "f-E8s4": {"E": 8, "num_stages": 4}}
PART = "part:"  # a sweep function that is a piece of the FFN: timed, not checked against the FFN's output

# ----------------------------------------------------------------------------------------- functions
def split_path(tt, x, w_gate, w_up, w_down_t):
    """K1 + the split _k2_updown at every d (chunked=False), compacted above M = 16."""
    packed = tt.gate_pack(x, w_gate, variant="tma")
    return tu.updown(x, packed, w_gate, w_up, w_down_t, compact=True, chunked=False)


def case_fns(tt, ffn_dense, x, w_gate, w_up, w_down, w_down_t, split: bool = True) -> dict:
    fns = {"dense": lambda: ffn_dense(x, w_gate, w_up, w_down),
           "dense_b": lambda: ffn_dense(x, w_gate, w_up, w_down),
           "routed": lambda: tu.twell_ffn_triton(x, w_gate, w_up, w_down_t)}
    if split:
        fns["split"] = lambda: split_path(tt, x, w_gate, w_up, w_down_t)
    if x.shape[0] <= 16:  # decode tiles (T = S = 32) up to M = 16: the chunked K2's precondition
        fns["chunked"] = lambda: tu.updown_decode_chunked(x, tt.gate_pack(x, w_gate), w_up, w_down_t)
    if x.shape[0] == 1:  # K1's GEMV and K2 in one launch (not routed yet): each row streams W_gate once
        fns["fused"] = lambda: tu.twell_ffn_decode_fused(x, w_gate, w_up, w_down_t)
    return fns


def check(fns: dict, ref: torch.Tensor, row: dict) -> dict:
    """Rel err of each fn vs the fp32 reference; drops (and records) the ones beyond the bf16 rule."""
    scale = ref.abs().max().item() or 1.0
    errs = {k: (fn().float() - ref).abs().max().item() / scale for k, fn in fns.items()}
    bound = 2 * errs["dense"] + 1e-3
    row["rel_err"], row["bound"] = errs, bound
    bad = {k: v for k, v in errs.items() if not v <= bound}  # NaN fails too
    if bad:
        row["bad"] = bad
    return {k: fn for k, fn in fns.items() if k not in bad}


# ------------------------------------------------------------------------------------------- timing
def time_graphs(fns: dict, budget_ms: float, errors: dict, max_rounds: int = 60) -> tuple[dict, dict]:
    """{name: [ms per call, one per round]} of CUDA-graph replays in interleaved rounds; {name: calls}."""
    graphs, calls, reps = {}, {}, {}
    for k, fn in fns.items():
        try:
            est = max(loop_ms(fn, 3, True), 1e-3)  # eager: launch overhead included, so calls err low
            calls[k] = max(2, min(MAX_CALLS, int(GRAPH_MS / est)))
            graphs[k] = as_graph(fn, calls[k])
            one = max(loop_ms(graphs[k].replay, 1, True), 1e-3)
            reps[k] = max(1, min(8, math.ceil(1.0 / one)))  # >= ~1 ms per measurement: a replay's launch gap < 1%
        except Exception as e:  # noqa: BLE001 - one function failing must not lose the case
            errors[k] = f"{type(e).__name__}: {e}"[:300]
    if not graphs:
        return {}, calls
    round_ms = sum(reps[k] * loop_ms(g.replay, 1, True) for k, g in graphs.items())
    rounds = int(max(5, min(max_rounds, budget_ms / max(round_ms, 1e-3))))
    out = rounds_of({k: (lambda k=k: loop_ms(graphs[k].replay, reps[k], True) / calls[k]) for k in graphs}, rounds)
    del graphs
    return out, calls


def time_eager(fns: dict, rounds: int = 2) -> dict:
    """CPU (interpreter) stand-in: the wall clock per call, interleaved."""
    return rounds_of({k: (lambda fn=fn: loop_ms(fn, 1, False)) for k, fn in fns.items()}, rounds)


# --------------------------------------------------------------------------------------------- cases
def run_case(ctx, layer32, x, layer, w_down_t, zeros) -> dict:
    tt, ffn_dense, cuda = ctx["tt"], ctx["ffn_dense"], ctx["cuda"]
    w_gate, w_up, w_down = layer
    m, d = x.shape
    f = w_gate.shape[0]
    row = {"d": d, "F": f, "M": m, "zeros": zeros, "pattern": "skewed", "dtype": str(x.dtype), "errors": {}}
    wg32, wu32, wd32 = layer32
    xf = x.float()
    g = xf @ wg32.t()  # [M, F]
    union = int((g > 0).any(0).sum())
    row.update(measured_zeros=1 - (g > 0).float().mean().item(), union=union, union_frac=union / f)
    row["bytes_dense"] = 3 * f * d * x.element_size()
    ref = ffn_dense(xf, wg32, wu32, wd32)
    fns = case_fns(tt, ffn_dense, x, w_gate, w_up, w_down, w_down_t, split=not ctx["no_split"])
    try:
        fns = check(fns, ref, row)
    except Exception as e:  # noqa: BLE001 - a function that raises: record it, keep the others
        row["errors"]["check"] = f"{type(e).__name__}: {e}"[:300]
        good = {}
        for k, fn in fns.items():
            try:
                fn()
                good[k] = fn
            except Exception as e2:  # noqa: BLE001
                row["errors"][k] = f"{type(e2).__name__}: {e2}"[:300]
        fns = check(good, ref, row) if "dense" in good else {}
    if cuda:
        t, calls = time_graphs(fns, ctx["budget"](), row["errors"], ctx["max_rounds"])
        row["calls_per_graph"] = calls
    else:
        t = time_eager(fns)
    row["timing"] = "CUDA graphs" if cuda else "eager, Triton interpreter"
    row["ms"] = {k: med(v) for k, v in t.items()}
    row["x"] = {k: paired(t, "dense", k) for k in t if k not in ("dense",)}  # dense / k
    noise = [a / b for a, b in zip(t.get("dense", []), t.get("dense_b", []))]
    if noise:
        row["noise"] = [min(noise), med(noise), max(noise)]
    if "dense" in row["ms"] and cuda:
        row["GBps_dense"] = row["bytes_dense"] / row["ms"]["dense"] / 1e6
    if not row["errors"]:
        del row["errors"]
    return row


# --------------------------------------------------------------------------------------------- sweep
def chunked_variants(tt, x, layer, w_down_t) -> dict:
    """--sweep-chunked: K1 (decode tiles) + updown_decode_chunked over CHUNKED's configs, and the split
    K2 path beside them."""
    fns = {"split": lambda: split_path(tt, x, layer[0], layer[1], w_down_t)}
    for name, cfg in CHUNKED.items():
        fns[name] = lambda cfg=cfg: tu.updown_decode_chunked(x, tt.gate_pack(x, layer[0]), layer[1], w_down_t, **cfg)
    return fns


def k1_variants(tt, x, layer, w_down_t) -> dict:
    """--sweep-k1: the parts (cuBLAS gate GEMV, each decode K1 config, the chunked K2 on a packed input) and
    the FFN with each K1 config (+ the chunked K2)."""
    w_gate, w_up = layer[0], layer[1]
    packed = tt.gate_pack(x, w_gate)
    fns = {f"{PART}gate-gemv": lambda: torch.nn.functional.linear(x, w_gate),
           f"{PART}k2": lambda: tu.updown_decode_chunked(x, packed, w_up, w_down_t)}
    for name, cfg in K1_DECODE.items():
        fns[f"{PART}{name}"] = lambda cfg=cfg: tt.gate_pack(x, w_gate, **cfg)
        fns[name] = lambda cfg=cfg: tu.updown_decode_chunked(x, tt.gate_pack(x, w_gate, **cfg), w_up, w_down_t)
    return fns


def fused_variants(tt, x, layer, w_down_t) -> dict:
    """--sweep-fused: the fused decode FFN under FUSED's launches, the routed path (twell_ffn_triton: K1 + K2, or
    the fused FFN on a FUSED_ROUTE shape), K1 + K2 itself and the cuBLAS gate GEMV (a part)."""
    w_gate, w_up = layer[0], layer[1]
    fns = {f"{PART}gate-gemv": lambda: torch.nn.functional.linear(x, w_gate),
           "routed": lambda: tu.twell_ffn_triton(x, w_gate, w_up, w_down_t),
           "k1+k2": lambda: tu.twell_ffn_triton(x, w_gate, w_up, w_down_t, fused=False)}
    for name, cfg in FUSED.items():
        fns[name] = lambda cfg=cfg: tu.twell_ffn_decode_fused(x, w_gate, w_up, w_down_t, **cfg)
    return fns


def k1_rates(row: dict) -> dict:
    """cuBLAS gate GEMV time / K1 time per K1 config (1.0: K1 reads W_gate at cuBLAS's rate), from a row's ms."""
    gemv = row["ms"].get(f"{PART}gate-gemv")
    return {k[len(PART):]: gemv / v for k, v in row["ms"].items()
            if gemv and v and k.startswith(f"{PART}k1")}


def run_sweep(ctx, budget_s: float, cases: list, variants) -> list[dict]:
    """Each case: dense and variants(tt, x, layer, w_down_t) -> {name: fn}, checked, then timed under graphs."""
    tt, ffn_dense = ctx["tt"], ctx["ffn_dense"]
    rows, deadline = [], time.time() + budget_s
    dev, dt = ("cuda", torch.bfloat16) if ctx["cuda"] else ("cpu", torch.float32)
    for i, (d, f, m, zeros) in enumerate(cases):
        layer = make_layer(d, f, dev, dt)
        set_sparsity(layer[0], zeros, "skewed")
        w_down_t = layer[2].t().contiguous()
        x = torch.randn(m, d, device=dev).to(dt)
        x[:, 0] = 1.0
        ref = ffn_dense(x.float(), layer[0].float(), layer[1].float(), layer[2].float())
        row = {"d": d, "F": f, "M": m, "zeros": zeros, "rel_err": {}, "errors": {}}
        fns = {"dense": lambda: ffn_dense(x, *layer)}
        for name, fn in variants(tt, x, layer, w_down_t).items():
            try:
                if name.startswith(PART):
                    fn()  # (compiled once before the timing)
                else:
                    row["rel_err"][name] = (fn().float() - ref).abs().max().item() / ref.abs().max().item()
                fns[name] = fn
            except Exception as e:  # noqa: BLE001 - a config that does not compile
                row["errors"][name] = f"{type(e).__name__}: {e}"[:300]
        left = max(1.0, deadline - time.time()) / (len(cases) - i)
        t = time_graphs(fns, 1000 * 0.5 * left, row["errors"])[0] if ctx["cuda"] else time_eager(fns, 1)
        row["ms"] = {k: med(v) for k, v in t.items()}
        row["x"] = {k: paired(t, "dense", k) for k in t if k != "dense"}
        if any(k.startswith(f"{PART}k1") for k in row["ms"]):
            row["k1_rate"] = k1_rates(row)
            print(f"sweep {d}x{f} M={m}: K1 rate vs the cuBLAS gate GEMV: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in row["k1_rate"].items()), flush=True)
        rows.append(row)
        whole = [k for k in row["x"] if not k.startswith(PART)]  # (a part is not an FFN: never "best")
        best = max(whole, key=lambda k: row["x"][k] or 0) if whole else None
        print(f"sweep {d}x{f} M={m} {zeros:.0%}: " + ", ".join(f"{k} {v:.2f}x" for k, v in row["x"].items() if v)
              + f"; best {best}", flush=True)
        del layer, w_down_t, fns
        if ctx["cuda"]:
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------ compile report
def _ptxas_verbose(ptx: str) -> str | None:
    """ptxas -v on the PTX with the ptxas builds Triton ships (the first that accepts its PTX version)."""
    import triton

    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        for exe in ("ptxas", "ptxas-blackwell"):
            if not (bindir / exe).exists():
                continue
            res = subprocess.run([str(bindir / exe), "-v", "-arch=sm_90a", str(src), "-o", str(Path(tmp) / "k.cubin")],
                                 capture_output=True, text=True)
            if res.returncode == 0:
                return res.stderr
    return None


def compile_usage(fn, types: dict, constexprs: dict, num_warps: int, num_stages: int, div16: set) -> dict:
    """Compile fn for sm_90 (no GPU) and read registers, stack frame and spill bytes. Integer / pointer
    arguments in div16 get Triton's divisibility-by-16 attribute, as a real launch with such values
    would (that is what lets Triton vectorise the loads)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16 if n in fn.arg_names}
    t0 = time.time()
    kern = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})
    out = {"compile_s": round(time.time() - t0, 1)}
    text = _ptxas_verbose(kern.asm["ptx"]) or ""
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    r = re.search(r"Used (\d+) registers", text)
    if m and r:
        out.update(registers=int(r.group(1)), stack=int(m.group(1)), spill_stores=int(m.group(2)),
                   spill_loads=int(m.group(3)))
    else:
        out["ptxas"] = "no ptxas accepted the PTX"
    return out


def compile_report(out_dir: Path) -> list[dict]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("--compile-report compiles for the GPU: unset TRITON_INTERPRET")
    import triton

    from sparsify.kernels import twell_triton as tt

    rows = []
    ptr16 = {"x_ptr", "wg_ptr", "wu_ptr", "wdt_ptr", "g_ptr", "h_ptr", "out_ptr", "part_ptr", "cnt_ptr",
             "col_ptr", "val_ptr", "sj_ptr", "sg_ptr"}
    bf16 = {n: "*bf16" for n in ("x_ptr", "wg_ptr", "wu_ptr", "wdt_ptr", "g_ptr", "h_ptr")}
    for d, f in SHAPES:
        k2 = tu.k2_config(1, d)
        nt = -(-f // 32)
        types = {**bf16, "cnt_ptr": "*i32", "col_ptr": "*i32", "val_ptr": "*i32", "out_ptr": "*fp32",
                 "sj_ptr": "*i32", "sg_ptr": "*i32", "th_ptr": "*fp32"}
        const = dict(T=32, S=32, NT_PAD=triton.next_power_of_2(nt), BLOCK_D=triton.next_power_of_2(d), E=k2["E"],
                     SPLIT=k2["SPLIT"], ENT=1, COMPACT=False, HAS_THETA=False, RND=0)
        div = ptr16 | {n for n, v in (("D", d), ("F", f), ("NT", nt), ("stride_xm", d), ("stride_om", d)) if v % 16 == 0}
        row = {"d": d, "F": f, "kernel": "split K2 decode (_k2_updown, M <= 16)", "E": k2["E"],
               **compile_usage(tu._k2_updown, types, const, k2["num_warps"], 3, div)}
        rows.append(row)
        print(row, flush=True)
        chunk_types = {"x_ptr": "*bf16", "wu_ptr": "*bf16", "wdt_ptr": "*bf16", "cnt_ptr": "*i32", "col_ptr": "*i32",
                       "val_ptr": "*i32", "out_ptr": "*fp32", "hs_ptr": "*fp32", "js_ptr": "*i32"}
        cdiv = (ptr16 | {"hs_ptr", "js_ptr"}) | {n for n, v in (("D", d), ("NT", nt), ("KMAX", nt * 32),
                                                                ("stride_xm", d), ("stride_om", d)) if v % 16 == 0}
        row = {"d": d, "F": f, "kernel": "chunked K2 decode (_k2_dec_chunked, M <= 16)", "E": 4,
               **compile_usage(tu._k2_dec_chunked, chunk_types, dict(T=32, S=32, NT_PAD=triton.next_power_of_2(nt),
                               BD=min(1024, triton.next_power_of_2(d)), E=4, SPLIT=128, ENT=1), 4, 3, cdiv)}
        rows.append(row)
        print(row, flush=True)
        fcfg = tu.FUSED_DEFAULT
        fused_types = {**bf16, "th_ptr": "*fp32", "out_ptr": "*fp32"}
        fdiv = (ptr16 | {"th_ptr"}) | {n for n, v in (("D", d), ("F", f), ("stride_xm", d), ("stride_om", d))
                                       if v % 16 == 0}
        row = {"d": d, "F": f, "M": 1, "kernel": "fused decode FFN (_k12_decode, K1 GEMV + K2)", "E": fcfg["E"],
               **compile_usage(tu._k12_decode, fused_types, dict(
                   T=fcfg["T"], BLOCK_K=fcfg["BLOCK_K"], E=fcfg["E"], BD=min(fcfg["BD"], triton.next_power_of_2(d)),
                   EVEN_K=d % fcfg["BLOCK_K"] == 0, EVEN_N=f % fcfg["T"] == 0, HAS_THETA=False, RND=0, GQ=1),
                   fcfg["num_warps"], 3, fdiv)}
        rows.append(row)
        print(row, flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "decode-compile.json").write_text(json.dumps({"triton": triton.__version__, "rows": rows}, indent=1))
    lines = ["| kernel | d x F | M | registers | stack B | spill stores B | spill loads B |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['d']}x{r['F']} | {r.get('M', '1-16')} | {r.get('registers', '-')} | "
                     f"{r.get('stack', '-')} | {r.get('spill_stores', '-')} | {r.get('spill_loads', '-')} |")
    text = "\n".join(lines)
    (out_dir / "decode-compile.md").write_text(f"triton {triton.__version__}, sm_90\n\n{text}\n")
    print(text)
    return rows


# ----------------------------------------------------------------------------------------- reporting
def fmt(v, spec=".2f", suffix="x") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def row_line(r: dict) -> str:
    ms, x = r.get("ms", {}), r.get("x", {})
    cells = [f"{r['d']}x{r['F']}", str(r["M"]), f"{r['zeros']:.2f}", f"{r['measured_zeros']:.3f}",
             f"{r['union_frac']:.3f}", fmt(ms.get("dense"), ".4f", ""),
             *(f"{fmt(ms.get(k), '.4f', '')} ({fmt(x.get(k))})" for k in ("routed", "split", "chunked", "fused")),
             "-" if "noise" not in r else f"{r['noise'][0]:.2f}-{r['noise'][2]:.2f}",
             fmt(r.get("GBps_dense"), ".0f", ""),
             f"{r['rel_err'].get('routed', float('nan')):.1e} / {r['rel_err'].get('dense', float('nan')):.1e}"]
    bad = {**r.get("bad", {}), **r.get("errors", {})}
    if bad:
        cells.append("BAD " + "; ".join(f"{k}: {str(v)[:60]}" for k, v in bad.items()))
    return "| " + " | ".join(cells) + " |"


HEADER = ("| d x F | M | zeros | measured | union U/F | dense ms | routed ms (x) | split ms (x) | chunked ms (x) | "
          "fused ms (x) | dense/dense | dense GB/s | rel err routed / dense bf16 |\n" + "|---" * 13 + "|")


def ratio_tables(rows: list[dict]) -> list[str]:
    """dense / fn per (shape, zeros) x M, one table per function."""
    lines = []
    ms = sorted({r["M"] for r in rows})
    for fn in ("routed", "split", "chunked", "fused"):
        if not any(fn in r.get("x", {}) for r in rows):
            continue
        lines += [f"dense / {fn} ({rows[0].get('timing')}, skewed, {rows[0].get('dtype')}; > 1 = faster than dense)",
                  "| d x F | zeros | " + " | ".join(f"M={m}" for m in ms) + " |", "|---|---|" + "---|" * len(ms)]
        keys = sorted({(r["d"], r["F"], r["zeros"]) for r in rows})
        for d, f, z in keys:
            cells = []
            for m in ms:
                r = next((r for r in rows if (r["d"], r["F"], r["zeros"], r["M"]) == (d, f, z, m)), None)
                cells.append(fmt(None if r is None else r.get("x", {}).get(fn)))
            lines.append(f"| {d}x{f} | {z:.2f} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def write(out_dir: Path, rows: list[dict], meta: dict, sweep: list[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "decode-bench.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "rows": rows, "sweep": sweep}, indent=1, default=str))
    tmp.replace(out_dir / "decode-bench.json")
    text = [f"{meta.get('env')}", "", HEADER, *map(row_line, rows), "", *ratio_tables(rows)]
    for s in sweep:
        text.append(f"{s.get('sweep', 'sweep')} {s['d']}x{s['F']} M={s['M']} {s['zeros']:.2f}: " +
                    ", ".join(f"{k} {v:.2f}x" for k, v in s["x"].items() if v))
        if s.get("k1_rate"):
            text.append("  K1 rate vs the cuBLAS gate GEMV (1.0 = its rate): "
                        + ", ".join(f"{k} {v:.2f}" for k, v in s["k1_rate"].items())
                        + "; ms: " + ", ".join(f"{k} {v:.4f}" for k, v in s["ms"].items()))
    (out_dir / "decode-bench.md").write_text("\n".join(text) + "\n")


# -------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for decode-bench.json / .md")
    p.add_argument("--budget-s", type=float, default=180,
                   help="wall time of the grid, compiles included (cases past it run 5 rounds: ~30 s more)")
    p.add_argument("--max-rounds", type=int, default=60, help="cap on interleaved rounds per case")
    p.add_argument("--smoke", action="store_true", help="tiny shape, fp32, Triton interpreter on CPU")
    p.add_argument("--no-split", action="store_true", help="skip the split-K2 path")
    p.add_argument("--sweep-chunked", action="store_true",
                   help="then time updown_decode_chunked configs (CHUNKED) beside K1 + K2 on 6 cases")
    p.add_argument("--sweep-k1", action="store_true",
                   help="then time the decode K1 configs (K1_DECODE) and the FFN's parts on 4 cases at 95.7%% zeros")
    p.add_argument("--sweep-fused", action="store_true",
                   help="the fused decode FFN's launch configs at M = 1, 95.7%% zeros, beside the routed K1 + K2")
    p.add_argument("--sweep-budget-s", type=float, default=60, help="wall time of each sweep")
    p.add_argument("--no-grid", action="store_true", help="skip the grid (run only the sweeps asked for)")
    p.add_argument("--compile-report", action="store_true", help="only: registers/spills of the sm_90 builds")
    p.add_argument("--shapes", default=",".join(f"{d}x{f}" for d, f in SHAPES))
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--zeros", default=",".join(map(str, ZEROS)))
    args = p.parse_args(argv)
    if args.smoke:
        args.shapes, args.ms, args.zeros = "32x160", "1,20", "0.9"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_report:
        compile_report(args.out)
        return 0
    start = time.time()
    from sparsify.kernels import twell_triton as tt
    from sparsify.kernels.twell_reference import ffn_dense

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        print("no CUDA GPU: set TRITON_INTERPRET=1 (with --smoke) for a CPU dry run", file=sys.stderr)
        return 2
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    meta = {"env": env_info(), "args": {k: str(v) for k, v in vars(args).items()}, "sections_s": {}}
    print(meta["env"], flush=True)
    shapes = [] if args.no_grid else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    zs = [float(z) for z in args.zeros.split(",")]
    total, done = len(shapes) * len(ms) * len(zs), [0]
    deadline = start + args.budget_s

    def budget_ms() -> float:  # per case: an even share of what is left, 40% kept for compiles/captures
        return 1000 * 0.6 * max(0.0, deadline - time.time()) / max(1, total - done[0])

    ctx = {"tt": tt, "ffn_dense": ffn_dense, "cuda": cuda, "budget": budget_ms, "no_split": args.no_split,
           "max_rounds": args.max_rounds}
    rows: list[dict] = []
    for d, f in shapes:
        t0 = time.time()
        layer = make_layer(d, f, dev, dt)
        w_down_t = layer[2].t().contiguous()  # [F, d]
        wu32, wd32 = layer[1].float(), layer[2].float()
        gen = torch.Generator(device=dev).manual_seed(1)
        xs = {}
        for m in ms:
            x = torch.randn(m, d, device=dev, generator=gen).to(dt)
            x[:, 0] = 1.0  # the bias feature of the honest sparsity (set_sparsity)
            xs[m] = x
        for z in zs:
            set_sparsity(layer[0], z, "skewed")
            layer32 = (layer[0].float(), wu32, wd32)
            for m in ms:
                try:
                    row = run_case(ctx, layer32, xs[m], layer, w_down_t, z)
                except Exception as e:  # noqa: BLE001 - one case must not lose the others
                    row = {"d": d, "F": f, "M": m, "zeros": z, "measured_zeros": float("nan"),
                           "union_frac": float("nan"), "rel_err": {}, "errors": {"case": f"{type(e).__name__}: {e}"[:400]}}
                rows.append({**row})
                done[0] += 1
                print(row_line(row), flush=True)
            del layer32
        meta["sections_s"][f"{d}x{f}"] = round(time.time() - t0, 1)
        write(args.out, rows, meta, [])
        del layer, w_down_t, wu32, wd32, xs
        if cuda:
            torch.cuda.empty_cache()
    sweep = []
    sweeps = ((args.sweep_chunked, "sweep_chunked", CHUNKED_CASES, chunked_variants),
              (args.sweep_k1, "sweep_k1", K1_CASES, k1_variants),
              (args.sweep_fused, "sweep_fused", FUSED_CASES, fused_variants))
    for on, name, cases, variants in sweeps:
        if on and not cuda:  # the interpreter: one tiny case, so that the code path runs on CPU
            cases = [(32, 160, 1, 0.9)]
        if on:
            t0 = time.time()
            sweep += [{**r, "sweep": name} for r in run_sweep(ctx, args.sweep_budget_s, cases, variants)]
            meta["sections_s"][name] = round(time.time() - t0, 1)
    meta["total_s"] = round(time.time() - start, 1)
    write(args.out, rows, meta, sweep)
    print_tables(HEADER, map(row_line, rows), ratio_tables(rows),
                 f"sections: {meta['sections_s']}; total {meta['total_s']} s; JSON: {args.out / 'decode-bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
