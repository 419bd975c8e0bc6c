"""The exact gate screen for decode (eval/research/gate_screen.py): pass fractions (CPU) and FFN speed (CUDA graphs).

CPU mode (pure torch, no kernel): for each screen variant, the fraction of (token, row) pairs the screen passes
against the fraction really active, at M = 1 (per token) and M = 8 (union over 8 tokens: a column is read when any
row passes), the extra memory, and the implied bytes of a decode FFN at M = 1 / 8 (screen copy + passed rows of
W_gate + active rows of W_up and W_down^T) against today's TwELL (all of W_gate + active rows) and dense (3 F d),
i.e. the roofline speed-up bound vs dense. Cases:
  synthetic: eval/bench/bench_kernels.py's make_layer + set_sparsity(skewed, 0.957) (the decode benchmark's layers: a
    bias channel 0 with x[:, 0] = 1), bf16, --tokens random inputs, on the three shapes;
  real: the SmolLM2-135M ReLU conversion (--model, fp32 weights cast to bf16), MLP inputs captured with hooks over
    --real-tokens tokens of held-out text (--data); the exact channels are chosen on the first half of the tokens
    and every fraction is measured on the second half.
  PYTHONPATH=$PWD python eval/research/bench_screen.py --cpu --out eval/results/gate-screen-cpu
  (tiny: --cpu --shapes 64x256 --tokens 16 --no-real)
CUDA mode (H200): dense / today's twell (twell_ffn_triton) / screened twell (twell_ffn_screened, each screen
variant) FFN at M = 1, 8 on the three shapes at 0.957 zeros, timed side by side under CUDA graphs in interleaved
rounds (eval/bench/bench_decode.py's time_graphs: ratios are medians of per-round paired ratios), with the screen's
measured pass fraction per case:
  source eval/device/device_env.sh; PYTHONPATH=$PWD python eval/research/bench_screen.py --cuda --out $OUT/screen --budget-s 420
  The same run sweeps the screened K1's launch parameters (SWEEP: BK1 / BK2 / CP / CVT / warps / stages, per M
  bucket, on the variants of SWEEP_VARIANTS) beside each variant's default: a second table with every config's
  ratio to dense and to twell, the best per case and variant in bold (--no-sweep: defaults only).
  CPU dry run of that code path: TRITON_INTERPRET=1 python eval/research/bench_screen.py --cuda --smoke --out /tmp/scr
Writes DIR/screen.json and DIR/screen.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "eval" / "bench"))  # bench_kernels, bench_decode, timing (gate_screen: this folder, on it already)

import gate_screen as gs  # noqa: E402

from bench_kernels import env_info, make_layer, set_sparsity  # noqa: E402

SHAPES = [(2048, 8192), (4096, 14336), (8192, 28672)]
ZEROS = 0.957
MODEL = Path("/work/main/runs/prep/converted")
DATA = Path("/work/main/runs/prep/data/heldout-general.bin")
# screen variants: name -> (kind, group, exact channels k); rigorous bounds measured for each (gate_screen terms)
VARIANTS = {"int8-row": ("int8", None, 0), "int8-row+ex": ("int8", None, 4), "int8-g128": ("int8", 128, 0),
            "int8-g128+ex": ("int8", 128, 4), "fp8-row": ("fp8", None, 0), "fp8-row+ex": ("fp8", None, 4),
            "fp8-g128+ex": ("fp8", 128, 4)}
BOUNDS_ROW = ("cs", "holder", "min")
BOUNDS_GROUP = ("cs", "group", "group_min")
LOSSY_Z = (4.0, 6.0)  # the statistical (lossy) radius z R ||x'|| / sqrt(d), measured on the +ex int8 row screen


def kernel_bound(sw) -> str:
    return "min" if sw.n_groups == 1 else "group_min"


def union_frac(mask: torch.Tensor, m: int) -> float:
    """Fraction of columns passed (or active) by some row, over consecutive batches of m rows."""
    n = mask.shape[0] // m * m
    return mask[:n].view(-1, m, mask.shape[1]).any(1).float().mean().item()


def ffn_bytes(f: int, d: int, screen_bytes: float, pass_cols: float, act_cols: float, m: int) -> dict:
    """Bytes of one decode FFN (bf16 weights): dense 3 F d 2; today F d 2 + 2 act F d 2 (act: the fraction of
    rows read by K2: per-row active at M = 1, and a bound for M > 1 taking the union); screened screen + pass F d 2
    + the same K2 bytes. x, outputs, packed words are ignored (KB)."""
    w = f * d * 2
    k2 = 2 * act_cols * w
    out = {"dense": 3 * w, "today": w + k2, "screened": screen_bytes + pass_cols * w + k2}
    out["bound_today_x"] = out["dense"] / out["today"]
    out["bound_screened_x"] = out["dense"] / out["screened"]
    return out


def measure(name: str, x: torch.Tensor, w_gate: torch.Tensor, calib: torch.Tensor, extra: dict | None = None,
            layer: tuple | None = None) -> dict:
    """Every variant's pass fractions on inputs x [N, d] (bf16) for W_gate [F, d] (bf16); exact channels from
    calib [N', d]. layer = (w_up, w_down) fp32: the lossy variants' FFN output error."""
    f, d = w_gate.shape
    act = gs.active_mask(x, w_gate)  # [N, F]
    a1, a8 = act.float().mean().item(), union_frac(act, 8)
    row = {"case": name, "d": d, "F": f, "tokens": x.shape[0], "active": a1, "active_union8": a8, "variants": {},
           **(extra or {})}
    for vname, (kind, group, k) in VARIANTS.items():
        t0 = time.time()
        ex = gs.outlier_columns(w_gate, k, calib) if k else None
        sw = gs.screen_weights(w_gate, kind, group, ex)
        terms = gs.screen_terms(x, sw)
        v = {"exact_cols": None if ex is None else ex.tolist(), "bytes": sw.nbytes(), "bounds": {}}
        for b in (BOUNDS_ROW if group is None else BOUNDS_GROUP):
            mask = gs.screen_mask(terms, None, x.dtype, b)
            dropped = int((act & ~mask).sum())
            assert dropped == 0, f"{name} {vname} {b}: {dropped} active rows dropped by a rigorous bound"
            p1, p8 = mask.float().mean().item(), union_frac(mask, 8)
            v["bounds"][b] = {"pass": p1, "pass_union8": p8,
                              "m1": ffn_bytes(f, d, sw.nbytes()["total"], p1, a1, 1),
                              "m8": ffn_bytes(f, d, sw.nbytes()["total"], p8, a8, 8)}
        # how the radius compares with the gate's spread: median over (token, row) of radius / std_token(g)
        kb = kernel_bound(sw)
        rad = (terms[kb] + terms["round"]).float()
        g = x.float() @ w_gate.float().t()
        spread = g.std(0).clamp_min(1e-30)  # [F] per row over tokens
        v["radius_over_gate_std_median"] = (rad / spread).median().item()
        v["round_share_median"] = (terms["round"] / (terms[kb] + terms["round"])).float().median().item()
        if vname == "int8-row+ex":
            v["lossy"] = {}
            for z in LOSSY_Z:
                mask = gs.screen_mask(terms, None, x.dtype, "cs", z=z, d_eff=d - (k or 0))
                missed = act & ~mask
                lz = {"pass": mask.float().mean().item(), "pass_union8": union_frac(mask, 8),
                      "dropped_active_frac": missed.float().sum().item() / max(1, int(act.sum())),
                      "tokens_with_drop": missed.any(1).float().mean().item()}
                if layer is not None:  # FFN output error of the lossy screen (dropped rows' h = 0), fp32
                    wu, wd = layer
                    h = torch.relu(g) * (x.float() @ wu.t())
                    y = h @ wd.t()
                    y_l = (h * mask) @ wd.t()
                    rel = ((y_l - y).norm(dim=1) / y.norm(dim=1).clamp_min(1e-30))
                    lz["ffn_rel_err_max"], lz["ffn_rel_err_mean"] = rel.max().item(), rel.mean().item()
                v["lossy"][f"z{z:g}"] = lz
        v["s"] = round(time.time() - t0, 1)
        row["variants"][vname] = v
        print(f"  {name} {vname}: " + ", ".join(f"{b} {r['pass']:.3f}/{r['pass_union8']:.3f}" for b, r in v["bounds"].items())
              + f" (active {a1:.3f}/{a8:.3f}) {v['s']} s", flush=True)
        del sw, terms
    return row


def synthetic(shapes, tokens: int) -> list[dict]:
    rows = []
    for d, f in shapes:
        w_gate, w_up, w_down = make_layer(d, f, "cpu", torch.bfloat16)
        set_sparsity(w_gate, ZEROS, "skewed")
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(2 * tokens, d, generator=gen).to(torch.bfloat16)
        x[:, 0] = 1.0
        layer = (w_up.float(), w_down.float()) if d * f <= 4096 * 14336 else None
        rows.append(measure(f"synth {d}x{f}", x[tokens:], w_gate, x[:tokens], {"zeros_target": ZEROS}, layer))
        del w_gate, w_up, w_down, layer
    return rows


def real(model_dir: Path, data: Path, n_tokens: int, layers: str) -> list[dict]:
    import numpy as np
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    toks = torch.from_numpy(np.fromfile(data, dtype=np.uint16)[: n_tokens].astype(np.int64))
    caps: dict[int, list] = {}
    hooks = [layer.mlp.register_forward_pre_hook(lambda mod, args, i=i: caps.setdefault(i, []).append(args[0].detach()))
             for i, layer in enumerate(model.model.layers)]
    seq = 256
    with torch.no_grad():
        for s in range(0, len(toks) // seq * seq, seq):
            model(toks[s:s + seq].view(1, -1))
    for h in hooks:
        h.remove()
    which = range(len(model.model.layers)) if layers == "all" else [int(i) for i in layers.split(",")]
    rows = []
    for i in which:
        x = torch.cat([c.reshape(-1, c.shape[-1]) for c in caps[i]]).to(torch.bfloat16)
        half = x.shape[0] // 2
        mlp = model.model.layers[i].mlp
        w_gate = mlp.gate_proj.weight.detach().to(torch.bfloat16)
        layer = (mlp.up_proj.weight.detach().to(torch.bfloat16).float(), mlp.down_proj.weight.detach().to(torch.bfloat16).float())
        rows.append(measure(f"smollm2 layer {i}", x[half:], w_gate, x[:half], {"layer": i}, layer))
    return rows


def table(rows: list[dict]) -> list[str]:
    """Markdown: per case and variant, the kernel's bound (and Cauchy-Schwarz), pass vs active, bytes, bounds."""
    out = ["| case | variant | active M=1 | pass M=1 (kernel bound) | pass M=1 (CS) | active U8 | pass U8 | extra bytes vs bf16 W_gate "
           "| radius / gate std | bound x today M=1 | bound x screened M=1 | bound x today M=8 | bound x screened M=8 |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for vn, v in r["variants"].items():
            kb = "min" if "row" in vn else "group_min"
            b = v["bounds"][kb]
            out.append(f"| {r['case']} | {vn} | {r['active']:.3f} | {b['pass']:.3f} | {v['bounds']['cs']['pass']:.3f} | "
                       f"{r['active_union8']:.3f} | {b['pass_union8']:.3f} | {v['bytes']['vs_bf16_w_gate']:.3f} | "
                       f"{v['radius_over_gate_std_median']:.2f} | {b['m1']['bound_today_x']:.2f} | "
                       f"{b['m1']['bound_screened_x']:.2f} | {b['m8']['bound_today_x']:.2f} | {b['m8']['bound_screened_x']:.2f} |")
    lossy = ["", "Lossy radius (OFF by default; z R ||x'|| / sqrt(d) on int8-row+ex): pass M=1 / dropped active rows / "
             "tokens with a drop / FFN rel err (max, mean)", "| case | z | pass | dropped | tokens | rel err max | mean |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        for zn, lz in r["variants"].get("int8-row+ex", {}).get("lossy", {}).items():
            lossy.append(f"| {r['case']} | {zn} | {lz['pass']:.3f} | {lz['dropped_active_frac']:.2e} | {lz['tokens_with_drop']:.3f} | "
                         f"{lz.get('ffn_rel_err_max', float('nan')):.2e} | {lz.get('ffn_rel_err_mean', float('nan')):.2e} |")
    return out + lossy


# ------------------------------------------------------------------------------------------------ CUDA mode
CUDA_VARIANTS = ("int8-row+ex", "int8-g128+ex", "fp8-row+ex", "int8-row")
# The screened K1's launch sweep (gate_pack_screened overrides, gate_screen.SCREEN_KEYS), per M bucket (1: the
# GEMV-shaped kernel, 8: tl.dot), beside each variant's default ("def"). "*" marks configs whose exact gates sum in
# another order than today's K1 (valid, not bitwise twell's). Grouped screens keep BK1 = the group.
SWEEP = {
    1: {"bk1=512": dict(BK1=512), "bk1=512,w8": dict(BK1=512, num_warps=8), "w8": dict(num_warps=8),
        "cp4": dict(CP=4), "cp16": dict(CP=16), "s2": dict(num_stages=2), "s4": dict(num_stages=4),
        "cvt0": dict(CVT=0), "*bk2=512,cp4": dict(BK2=512, CP=4), "*bk2=1024,cp4,w8": dict(BK2=1024, CP=4, num_warps=8),
        "*bk1=512,bk2=1024,cp2,w8": dict(BK1=512, BK2=1024, CP=2, num_warps=8)},
    8: {"bk1=256": dict(BK1=256), "w8": dict(num_warps=8), "s4": dict(num_stages=4), "cvt0": dict(CVT=0),
        "*cp16": dict(CP=16), "*cp16,bk2=256": dict(CP=16, BK2=256), "*cp16,bk1=256,bk2=256,w8":
        dict(CP=16, BK1=256, BK2=256, num_warps=8)},
}
SWEEP_VARIANTS = {1: ("int8-row+ex", "fp8-row+ex", "int8-g128+ex"), 8: ("int8-row+ex", "int8-g128+ex")}


def sweep_configs(vn: str, m: int, sweep: bool, smoke: bool = False) -> dict:
    """{config name: overrides} timed for variant vn at M = m: the default, plus SWEEP's where it applies (smoke:
    its first and last only, on int8-row+ex)."""
    out = {"def": {}}
    if smoke:
        sw8 = SWEEP[min(SWEEP, key=lambda b: abs(b - m))]
        keys = list(sw8)
        return {**out, **({keys[0]: sw8[keys[0]], keys[-1]: sw8[keys[-1]]} if sweep and vn == "int8-row+ex" else {})}
    if sweep and vn in SWEEP_VARIANTS.get(min(SWEEP, key=lambda b: abs(b - m)), ()):
        grouped = VARIANTS[vn][1] is not None
        out.update({k: v for k, v in SWEEP[min(SWEEP, key=lambda b: abs(b - m))].items()
                    if not (grouped and "BK1" in v)})
    return out


def cuda_mode(shapes, ms, budget_s: float, sweep: bool = True, smoke: bool = False) -> list[dict]:
    """Per (shape, M): dense, today's twell and every screened variant (its default launch and, with sweep, the
    SWEEP configs) checked against the fp32 reference, then timed side by side under CUDA graphs (smoke: the
    interpreter on CPU, fp32, eager timing: the code path only)."""
    from bench_decode import check, time_eager, time_graphs
    from timing import paired

    from sparsify.kernels import twell_updown as tu
    from sparsify.kernels.twell_reference import ffn_dense

    dev, dt = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    rows = []
    deadline = time.time() + budget_s
    n_cases = len(shapes) * len(ms)
    for d, f in shapes:
        layer = make_layer(d, f, dev, dt)
        set_sparsity(layer[0], ZEROS, "skewed")
        w_gate, w_up, w_down = layer
        w_down_t = w_down.t().contiguous()
        gen = torch.Generator(device=dev).manual_seed(1)
        calib = torch.randn(64, d, device=dev, generator=gen).to(dt)
        calib[:, 0] = 1.0
        screens = {}
        for vn in CUDA_VARIANTS:
            kind, group, k = VARIANTS[vn]
            screens[vn] = gs.screen_weights(w_gate, kind, group if group is None else min(group, d // 2),
                                            gs.outlier_columns(w_gate, k, calib) if k else None)
        for m in ms:
            x = torch.randn(m, d, device=dev, generator=gen).to(dt)
            x[:, 0] = 1.0
            row = {"d": d, "F": f, "M": m, "zeros": ZEROS, "errors": {}, "configs": {}}
            act = gs.active_mask(x, w_gate)
            row["active_cols"] = act.any(0).float().mean().item()
            fns = {"dense": lambda: ffn_dense(x, w_gate, w_up, w_down), "dense_b": lambda: ffn_dense(x, w_gate, w_up, w_down),
                   "twell": lambda: tu.twell_ffn_triton(x, w_gate, w_up, w_down_t)}
            for vn, sw in screens.items():
                for cn, over in sweep_configs(vn, m, sweep, smoke).items():
                    name = f"screen:{vn}" if cn == "def" else f"screen:{vn}@{cn}"
                    try:
                        _, pas, _ = gs.gate_pack_screened(x, w_gate, sw, return_pass=True, **over)
                    except Exception as e:  # noqa: BLE001 - a config that does not compile must not lose the case
                        row["errors"][name] = f"{type(e).__name__}: {e}"[:300]
                        continue
                    assert not (act & ~pas).any(), f"{name}: the kernel's screen dropped an active row"
                    if cn == "def":
                        row.setdefault("pass_cols", {})[vn] = pas.any(0).float().mean().item()
                        row.setdefault("screen_bytes", {})[vn] = sw.nbytes()
                    row["configs"][name] = {"variant": vn, "config": cn, "overrides": over}
                    fns[name] = lambda sw=sw, over=over: gs.twell_ffn_screened(x, w_gate, w_up, w_down_t, sw, **over)
            ref = ffn_dense(x.float(), w_gate.float(), w_up.float(), w_down.float())
            fns = check(fns, ref, row)
            budget = 1000 * 0.6 * max(1.0, deadline - time.time()) / max(1, n_cases - len(rows))
            t = time_eager(fns, 1) if smoke else time_graphs(fns, budget, row["errors"])[0]
            row["ms"] = {k: sorted(v)[len(v) // 2] for k, v in t.items()}
            row["x"] = {k: paired(t, "dense", k) for k in t if k != "dense"}
            row["best"] = best_configs(row)
            print(f"{d}x{f} M={m}: " + ", ".join(f"{k} {v:.2f}x" for k, v in row["x"].items() if v)
                  + " | pass " + ", ".join(f"{k} {v:.3f}" for k, v in row.get("pass_cols", {}).items())
                  + f" | active {row['active_cols']:.3f} | best " + ", ".join(f"{k}: {v}" for k, v in row["best"].items()),
                  flush=True)
            rows.append(row)
        del layer, w_gate, w_up, w_down, w_down_t, screens
        if not smoke:
            torch.cuda.empty_cache()
    return rows


def best_configs(row: dict) -> dict:
    """{variant: name of its fastest timed config} of one case."""
    best = {}
    for name, c in row["configs"].items():
        v = row["x"].get(name)
        if v and (c["variant"] not in best or v > row["x"][best[c["variant"]]]):
            best[c["variant"]] = name
    return best


def cuda_table(rows: list[dict]) -> list[str]:
    names = ["dense_b", "twell"] + [f"screen:{v}" for v in CUDA_VARIANTS]
    out = ["| d x F | M | active cols | " + " | ".join(names) + " | pass (per variant) |",
           "|---|---|---|" + "---|" * len(names) + "---|"]
    for r in rows:
        cells = [f"{r['x'].get(n):.2f}x" if r["x"].get(n) else "-" for n in names]
        out.append(f"| {r['d']}x{r['F']} | {r['M']} | {r['active_cols']:.3f} | " + " | ".join(cells) + " | "
                   + ", ".join(f"{k} {v:.3f}" for k, v in r.get("pass_cols", {}).items()) + " |")
    out += ["", "Launch sweep of the screened K1 (x dense; ms per FFN; * = another summation order than twell's K1; "
            "best per case and variant in bold)",
            "| d x F | M | variant | config | x dense | ms | vs twell |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        tw = r["x"].get("twell")
        for name, c in r["configs"].items():
            v = r["x"].get(name)
            if not v:
                out.append(f"| {r['d']}x{r['F']} | {r['M']} | {c['variant']} | {c['config']} | - | - | - |")
                continue
            b = "**" if r["best"].get(c["variant"]) == name else ""
            out.append(f"| {r['d']}x{r['F']} | {r['M']} | {c['variant']} | {b}{c['config']}{b} | {b}{v:.2f}x{b} | "
                       f"{r['ms'][name]:.4f} | {v / tw if tw else float('nan'):.2f} |")
    out += ["", "Best per case: " + "; ".join(
        f"{r['d']}x{r['F']} M={r['M']}: " + ", ".join(f"{n.split(':', 1)[1]} {r['x'][n]:.2f}x" for n in r["best"].values())
        for r in rows)]
    return out


def parser_default_shapes() -> str:
    return ",".join(f"{d}x{f}" for d, f in SHAPES)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--cpu", action="store_true", help="pass fractions (pure torch)")
    mode.add_argument("--cuda", action="store_true", help="FFN timings under CUDA graphs (H200)")
    p.add_argument("--shapes", default=",".join(f"{d}x{f}" for d, f in SHAPES))
    p.add_argument("--ms", default="1,8")
    p.add_argument("--tokens", type=int, default=256, help="synthetic: inputs measured (as many more calibrate)")
    p.add_argument("--no-real", action="store_true")
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--real-tokens", type=int, default=1024)
    p.add_argument("--layers", default="all", help="real model layers: all or a comma list")
    p.add_argument("--budget-s", type=float, default=240)
    p.add_argument("--no-sweep", action="store_true", help="--cuda: each screen variant's default launch only")
    p.add_argument("--smoke", action="store_true",
                   help="with --cuda: the CUDA mode's code path on CPU (TRITON_INTERPRET=1, fp32, tiny shape, eager timing)")
    args = p.parse_args(argv)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",") if s]
    meta = {"env": env_info(), "args": {k: str(v) for k, v in vars(args).items()},
            "transformers": __import__("transformers").__version__}
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cpu:
        rows = synthetic(shapes, args.tokens)
        if not args.no_real:
            rows += real(args.model, args.data, args.real_tokens, args.layers)
        lines = table(rows)
    else:
        if args.smoke:
            shapes = [(64, 128)] if args.shapes == parser_default_shapes() else shapes
        elif not torch.cuda.is_available():
            print("--cuda needs a CUDA GPU", file=sys.stderr)
            return 2
        rows = cuda_mode(shapes, [int(m) for m in args.ms.split(",")], args.budget_s, not args.no_sweep, args.smoke)
        lines = cuda_table(rows)
    meta["total_s"] = round(time.time() - t0, 1)
    (args.out / "screen.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    (args.out / "screen.md").write_text("\n".join([str(meta["env"]), "", *lines]) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
