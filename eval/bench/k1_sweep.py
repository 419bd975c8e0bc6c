"""K1 sweep: the TMA-tiled gate kernel (`_k1_tma`) over block shapes, against the cuBLAS gate GEMM and the
plain-tiled K1 (`_k1_tiled`, its fallback), timed interleaved in one run.

Usage on the H200 (eval/device/device_env.sh makes `sparsify.kernels` importable):
  cd repo && source eval/device/device_env.sh
  PYTHONPATH=$PWD python eval/bench/k1_sweep.py --out $OUT/k1
CPU dry run (Triton interpreter, tiny shapes):  python eval/bench/k1_sweep.py --smoke --out /tmp/k1

Per case (skewed pattern, bf16; honest sparsity as in bench_kernels.py) it
  1. checks every config packs what the tiled K1 packs (counts and columns equal, values within one 16-bit
     rounding step), and records mismatches instead of timing a wrong kernel;
  2. times gate (F.linear), k1_tiled (autotuned) and every config interleaved;
  3. times the whole FFN: dense, variant tiled and variant tma with this case's fastest config, interleaved.
Config names: bm{BLOCK_M}k{BLOCK_K}n{NSUB}w{warps}s{stages}. The result files of the sweep that chose the
TMA K1 (eval/results/kernels-h200-r6/, where it is called r6 and the tiled K1 r5) also name epilogue
ranks, persistent loops and a no-store diagnostic ("r0", "p1", "-pack0"): knobs removed from the kernel
after the round (kernels/NOTES.md).
Writes DIR/k1-sweep.json and prints a table per case.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "eval" / "bench"))

from sparsify.kernels import twell_updown as tu  # noqa: E402  (K2 and twell_ffn_triton)

from bench_kernels import env_info, make_layer, set_sparsity  # noqa: E402
from timing import Clock, interleaved, med, paired  # noqa: E402

# (BLOCK_M, BLOCK_K, NSUB, num_warps, num_stages); the first is the default (K1_TMA_TUNE[0]): 128 x 256 tiles
CONFIGS = [(128, 64, 2, 8, 4), (128, 64, 2, 8, 3), (128, 128, 1, 8, 3), (64, 64, 1, 4, 4), (64, 128, 1, 4, 3)]
CASES = [(2048, 8192, 16384, 0.99), (2048, 8192, 16384, 0.995), (4096, 14336, 16384, 0.99),
         (4096, 14336, 16384, 0.995)]
SMOKE_CONFIGS = [(32, 32, 1, 4, 2), (32, 32, 2, 4, 2)]
SMOKE_CASES = [(32, 256, 40, 0.9)]


def name(c) -> str:
    bm, bk, nsub, w, st = c
    return f"bm{bm}k{bk}n{nsub}w{w}s{st}"


def as_kwargs(c) -> dict:
    bm, bk, nsub, w, st = c
    return dict(BLOCK_M=bm, BLOCK_K=bk, NSUB=nsub, num_warps=w, num_stages=st)


def same_packing(a, b, x, w_gate) -> str | None:
    """None if b packs what a packs (counts, columns; values within one bf16 step plus the fp32
    accumulation-order bound), else why not.

    Both kernels sum d products in fp32 in different orders, so their sums may differ by up to
    2 (d - 1) 2^-24 sum_k |x_k w_k| before rounding to 16 bits: an absolute error, which a relative
    tolerance alone misses on small gate values left by cancellation (one CI run drew a 1.2e-4 entry)."""
    if not torch.equal(a.cnt, b.cnt):
        return f"counts differ in {int((a.cnt != b.cnt).sum())} (row, tile)s"
    keep = torch.arange(a.slots, device=a.cnt.device).view(1, 1, -1) < a.cnt.clamp(max=a.slots).unsqueeze(-1)
    if not torch.equal(a.ent[keep] & 0xFFFF, b.ent[keep] & 0xFFFF):
        return "columns differ"
    va, vb = a.values()[keep].float(), b.values()[keep].float()
    rows = torch.arange(a.cnt.shape[0], device=a.cnt.device).view(-1, 1, 1).expand_as(keep)[keep]
    abs_dot = (x.float().abs() @ w_gate.float().abs().t())[rows, a.columns()[keep].long()]
    bad = int(((va - vb).abs() > 2**-7 * va.abs() + x.shape[1] * 2**-23 * abs_dot).sum())
    return f"{bad} values differ by more than one bf16 step plus the fp32 accumulation bound" if bad else None


def run_case(d, f, m, sparsity, configs, clock, tt, ffn_dense, budget_ms, device, dtype) -> dict:
    x, w_gate, w_up, w_down, w_down_t = skewed_case(d, f, m, sparsity, device, dtype)
    row = {"d": d, "F": f, "M": m, "sparsity": sparsity, "errors": {}, "mismatch": {}}
    base = tt.gate_pack(x, w_gate, variant="tiled")
    row["measured_zeros"] = 1 - base.cnt.long().sum().item() / (m * f)
    k1 = {"gate": lambda: torch.nn.functional.linear(x, w_gate),
          "k1_tiled": lambda: tt.gate_pack(x, w_gate, variant="tiled")}
    row["regs_spills"] = {}
    for c in configs:
        kw = as_kwargs(c)
        try:
            got = tt.gate_pack(x, w_gate, variant="tma", **kw)
            kern = tt._gate_pack_tma(x, w_gate, got.cnt.clone(), torch.empty_like(got.ent), got.entries,
                                     {**tt.K1_TMA_DEFAULT, **kw})
            if hasattr(kern, "n_spills"):
                row["regs_spills"][name(c)] = (kern.n_regs, kern.n_spills)
            why = same_packing(base, got, x, w_gate)
        except Exception as e:  # noqa: BLE001 - compile/launch failure of one config
            row["errors"][name(c)] = f"{type(e).__name__}: {e}"[:300]
            continue
        if why:
            row["mismatch"][name(c)] = why
            continue
        k1[name(c)] = lambda kw=kw: tt.gate_pack(x, w_gate, variant="tma", **kw)
    t = interleaved(k1, clock, row["errors"], budget_ms=budget_ms)
    row["k1_ms"] = {k: med(v) for k, v in t.items()}
    row["k1_over_gate"] = {k: paired(t, k, "gate") for k in t}
    full = [k for k in t if k.startswith("bm")]
    best = min(full, key=lambda k: row["k1_ms"][k]) if full else None
    row["best_tma"] = best
    ffn = {"dense": lambda: ffn_dense(x, w_gate, w_up, w_down),
           "tiled": lambda: tu.twell_ffn_triton(x, w_gate, w_up, w_down_t, variant="tiled")}
    if best:
        kw = as_kwargs(next(c for c in configs if name(c) == best))

        def tma():
            packed = tt.gate_pack(x, w_gate, variant="tma", **kw)
            return tu.updown(x, packed, w_gate, w_up, w_down_t, compact=True)

        ref = ffn_dense(x.float(), w_gate.float(), w_up.float(), w_down.float())
        row["err_tma"] = (tma().float() - ref).abs().max().item()
        row["err_tiled"] = (ffn["tiled"]().float() - ref).abs().max().item()
        ffn["tma"] = tma
        ffn["k2_c"] = lambda: tu.updown(x, base, w_gate, w_up, w_down_t, compact=True)
    row["ffn_ms"], row["x_vs_dense"] = time_vs_dense(ffn, clock, budget_ms, row["errors"])
    return row


def time_vs_dense(fns: dict, clock, budget_ms: float, errors: dict) -> tuple[dict, dict]:
    """Median ms of each fn (interleaved rounds) and dense / fn paired ratios (fns holds "dense")."""
    t = interleaved(fns, clock, errors, budget_ms=budget_ms)
    return {k: med(v) for k, v in t.items()}, {k: paired(t, "dense", k) for k in t if k != "dense"}


def report(row) -> str:
    lines = [f"## {row['d']}x{row['F']} M={row['M']} {row['sparsity']:.1%} skewed "
             f"(measured zeros {row['measured_zeros']:.4f})",
             "| K1 | ms | / cuBLAS gate | (registers, spills) |", "|---|---|---|---|"]
    for k, v in sorted(row["k1_ms"].items(), key=lambda kv: kv[1]):
        lines.append(f"| {k} | {v:.3f} | {row['k1_over_gate'][k]:.2f} | {row['regs_spills'].get(k, '')} |")
    lines += ["", "| FFN | ms | dense / this |", "|---|---|---|"]
    for k, v in row["ffn_ms"].items():
        lines.append(f"| {k} | {v:.3f} | {row['x_vs_dense'].get(k) or 1.0:.2f}x |")
    lines.append(f"best TMA K1 config: {row['best_tma']}; mismatches: {row['mismatch'] or 'none'}; "
                 f"errors: {list(row['errors']) or 'none'}")
    return "\n".join(lines)


def skewed_case(d, f, m, sparsity, device, dtype) -> tuple:
    """x [M, d] (x[:, 0] = 1) and an FFN layer whose gate has `sparsity` zeros, skewed (bench_kernels)."""
    w_gate, w_up, w_down = make_layer(d, f, device, dtype)
    set_sparsity(w_gate, sparsity, "skewed")
    x = torch.randn(m, d, device=device, generator=torch.Generator(device=device).manual_seed(1)).to(dtype)
    x[:, 0] = 1
    return x, w_gate, w_up, w_down, w_down.t().contiguous()


def sweep_main(doc: str, json_name: str, cases: list, smoke_cases: list, run_one) -> int:
    """Shared command line of the sweeps: run_one(case, ctx) -> (row, printed report) per case."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help=f"folder for {json_name}")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in the Triton interpreter (CPU)")
    ap.add_argument("--budget-s", type=float, default=5.0, help="timing budget per interleaved set")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    from sparsify.kernels import twell_triton as tt
    from sparsify.kernels.twell_reference import ffn_dense

    ctx = {"tt": tt, "ffn_dense": ffn_dense, "clock": Clock(cuda),
           "budget_ms": args.budget_s * 1e3, "device": "cuda" if cuda else "cpu",
           "dtype": torch.bfloat16 if cuda else torch.float16, "smoke": not cuda}
    rows = []
    for case in cases if cuda else smoke_cases:
        row, text = run_one(case, ctx)
        rows.append(row)
        print(text, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / json_name).write_text(json.dumps({"env": env_info(), "rows": rows}, indent=1))
    return 0


def main() -> int:
    def one(case, ctx):
        configs = SMOKE_CONFIGS if ctx["smoke"] else CONFIGS
        row = run_case(*case, configs, ctx["clock"], ctx["tt"], ctx["ffn_dense"], ctx["budget_ms"], ctx["device"],
                       ctx["dtype"])
        return row, report(row)

    return sweep_main(__doc__, "k1-sweep.json", CASES, SMOKE_CASES, one)


if __name__ == "__main__":
    sys.exit(main())
