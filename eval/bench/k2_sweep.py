"""K2 sweep: the compacted up/down kernel (the K2 of every twell_ffn_triton variant) over gather chunk sizes E and warps, timed interleaved.

Usage on the H200:  cd repo && source eval/device/device_env.sh && PYTHONPATH=$PWD python eval/bench/k2_sweep.py --out $OUT/k2
CPU dry run (Triton interpreter, tiny shapes):  python eval/bench/k2_sweep.py --smoke --out /tmp/k2

Per case (skewed, bf16, M = 16384, honest sparsity as in bench_kernels.py): one packing by the TMA K1, then
updown(compact=True) with each (E, num_warps), against the default config's output (max |difference|:
the same entries summed in another order) and timed interleaved with the dense FFN. Writes
DIR/k2-sweep.json and prints a table per case.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "eval" / "bench"))

from sparsify.kernels import twell_updown as tu  # noqa: E402  (K2 and twell_ffn_triton)

from k1_sweep import skewed_case, sweep_main, time_vs_dense  # noqa: E402

CONFIGS = [(4, 4), (4, 8), (8, 8), (8, 4), (2, 4), (16, 8)]  # (E, num_warps); (4, 4) is k2_config's
SMOKE_CONFIGS = [(4, 4), (8, 4)]
CASES = [(2048, 8192, 16384, 0.99), (2048, 8192, 16384, 0.995), (4096, 14336, 16384, 0.99),
         (4096, 14336, 16384, 0.995)]
SMOKE_CASES = [(32, 256, 24, 0.9)]


def run_case(d, f, m, sparsity, clock, tt, ffn_dense, budget_ms, device, dtype, configs=CONFIGS) -> dict:
    x, w_gate, w_up, w_down, w_down_t = skewed_case(d, f, m, sparsity, device, dtype)
    packed = tt.gate_pack(x, w_gate, variant="tma")
    base = tu.updown(x, packed, w_gate, w_up, w_down_t, compact=True).float()
    scale = base.abs().max().item()
    row = {"d": d, "F": f, "M": m, "sparsity": sparsity, "errors": {}, "max_diff": {}}
    fns = {"dense": lambda: ffn_dense(x, w_gate, w_up, w_down)}
    for e, w in configs:
        key = f"E{e}w{w}"
        try:
            got = tu.updown(x, packed, w_gate, w_up, w_down_t, compact=True, E=e, num_warps=w).float()
        except Exception as err:  # noqa: BLE001 - one config failing to compile must not stop the sweep
            row["errors"][key] = f"{type(err).__name__}: {err}"[:300]
            continue
        row["max_diff"][key] = (got - base).abs().max().item() / max(scale, 1e-30)
        fns[key] = lambda e=e, w=w: tu.updown(x, packed, w_gate, w_up, w_down_t, compact=True, E=e, num_warps=w)
    row["ms"], row["dense_over"] = time_vs_dense(fns, clock, budget_ms, row["errors"])
    return row


def report(row) -> str:
    lines = [f"## K2 compact {row['d']}x{row['F']} M={row['M']} {row['sparsity']:.1%} skewed (dense "
             f"{row['ms']['dense']:.3f} ms)", "| config | ms | dense / this | max diff / max |out| |", "|---|---|---|---|"]
    for k, v in sorted(row["ms"].items(), key=lambda kv: kv[1]):
        if k != "dense":
            lines.append(f"| {k} | {v:.3f} | {row['dense_over'][k]:.2f}x | {row['max_diff'].get(k, 0):.1e} |")
    if row["errors"]:
        lines.append(f"errors: {row['errors']}")
    return "\n".join(lines)


def main() -> int:
    def one(case, ctx):
        row = run_case(*case, ctx["clock"], ctx["tt"], ctx["ffn_dense"], ctx["budget_ms"], ctx["device"], ctx["dtype"],
                       SMOKE_CONFIGS if ctx["smoke"] else CONFIGS)
        return row, report(row)

    return sweep_main(__doc__, "k2-sweep.json", CASES, SMOKE_CASES, one)


if __name__ == "__main__":
    sys.exit(main())
