"""The exact gate screen for decode (kernels/gate_screen.py): pass fractions (CPU) and FFN speed (CUDA graphs).

CPU mode (pure torch, no kernel): for each screen variant, the fraction of (token, row) pairs the screen passes
against the fraction really active, at M = 1 (per token) and M = 8 (union over 8 tokens: a column is read when any
row passes), the extra memory, and the implied bytes of a decode FFN at M = 1 / 8 (screen copy + passed rows of
W_gate + active rows of W_up and W_down^T) against today's TwELL (all of W_gate + active rows) and dense (3 F d),
i.e. the roofline speed-up bound vs dense. Cases:
  synthetic: eval/bench_kernels.py's make_layer + set_sparsity(skewed, 0.957) (the decode benchmark's layers: a
    bias channel 0 with x[:, 0] = 1), bf16, --tokens random inputs, on the three shapes;
  real: the SmolLM2-135M ReLU conversion (--model, fp32 weights cast to bf16), MLP inputs captured with hooks over
    --real-tokens tokens of held-out text (--data); the exact channels are chosen on the first half of the tokens
    and every fraction is measured on the second half.
  PYTHONPATH=$PWD python eval/bench_screen.py --cpu --out eval/results/gate-screen-cpu
  (tiny: --cpu --shapes 64x256 --tokens 16 --no-real)
CUDA mode (H200): dense / today's twell (twell_ffn_triton) / screened twell (twell_ffn_screened, each screen
variant) FFN at M = 1, 8 on the three shapes at 0.957 zeros, timed side by side under CUDA graphs in interleaved
rounds (eval/bench_decode.py's time_graphs: ratios are medians of per-round paired ratios), with the screen's
measured pass fraction per case:
  source eval/device_env.sh; PYTHONPATH=$PWD python eval/bench_screen.py --cuda --out $OUT/screen
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "eval"))

from sparsify.kernels import gate_screen as gs  # noqa: E402

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


def cuda_mode(shapes, ms, budget_s: float) -> list[dict]:
    from bench_decode import check, paired, time_graphs

    from sparsify.kernels import twell_updown as tu
    from sparsify.kernels.twell_reference import ffn_dense

    rows = []
    deadline = time.time() + budget_s
    n_cases = len(shapes) * len(ms)
    for d, f in shapes:
        layer = make_layer(d, f, "cuda", torch.bfloat16)
        set_sparsity(layer[0], ZEROS, "skewed")
        w_gate, w_up, w_down = layer
        w_down_t = w_down.t().contiguous()
        gen = torch.Generator(device="cuda").manual_seed(1)
        calib = torch.randn(64, d, device="cuda", generator=gen).to(torch.bfloat16)
        calib[:, 0] = 1.0
        screens = {}
        for vn in CUDA_VARIANTS:
            kind, group, k = VARIANTS[vn]
            screens[vn] = gs.screen_weights(w_gate, kind, group, gs.outlier_columns(w_gate, k, calib) if k else None)
        for m in ms:
            x = torch.randn(m, d, device="cuda", generator=gen).to(torch.bfloat16)
            x[:, 0] = 1.0
            row = {"d": d, "F": f, "M": m, "zeros": ZEROS, "errors": {}}
            act = gs.active_mask(x, w_gate)
            row["active_cols"] = act.any(0).float().mean().item()
            fns = {"dense": lambda: ffn_dense(x, w_gate, w_up, w_down), "dense_b": lambda: ffn_dense(x, w_gate, w_up, w_down),
                   "twell": lambda: tu.twell_ffn_triton(x, w_gate, w_up, w_down_t)}
            for vn, sw in screens.items():
                fns[f"screen:{vn}"] = lambda sw=sw: gs.twell_ffn_screened(x, w_gate, w_up, w_down_t, sw)
                _, pas, _ = gs.gate_pack_screened(x, w_gate, sw, return_pass=True)
                row.setdefault("pass_cols", {})[vn] = pas.any(0).float().mean().item()
                row.setdefault("screen_bytes", {})[vn] = sw.nbytes()
                assert not (act & ~pas).any(), f"{vn}: the kernel's screen dropped an active row"
            ref = ffn_dense(x.float(), w_gate.float(), w_up.float(), w_down.float())
            fns = check(fns, ref, row)
            budget = 1000 * 0.6 * max(1.0, deadline - time.time()) / max(1, n_cases - len(rows))
            t, calls = time_graphs(fns, budget, row["errors"])
            row["ms"] = {k: sorted(v)[len(v) // 2] for k, v in t.items()}
            row["x"] = {k: paired(t, "dense", k) for k in t if k != "dense"}
            print(f"{d}x{f} M={m}: " + ", ".join(f"{k} {v:.2f}x" for k, v in row["x"].items() if v)
                  + " | pass " + ", ".join(f"{k} {v:.3f}" for k, v in row["pass_cols"].items())
                  + f" | active {row['active_cols']:.3f}", flush=True)
            rows.append(row)
        del layer, w_gate, w_up, w_down, w_down_t, screens
        torch.cuda.empty_cache()
    return rows


def cuda_table(rows: list[dict]) -> list[str]:
    names = ["dense_b", "twell"] + [f"screen:{v}" for v in CUDA_VARIANTS]
    out = ["| d x F | M | active cols | " + " | ".join(names) + " | pass (per variant) |",
           "|---|---|---|" + "---|" * len(names) + "---|"]
    for r in rows:
        cells = [f"{r['x'].get(n):.2f}x" if r["x"].get(n) else "-" for n in names]
        out.append(f"| {r['d']}x{r['F']} | {r['M']} | {r['active_cols']:.3f} | " + " | ".join(cells) + " | "
                   + ", ".join(f"{k} {v:.3f}" for k, v in r["pass_cols"].items()) + " |")
    return out


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
        if not torch.cuda.is_available():
            print("--cuda needs a CUDA GPU", file=sys.stderr)
            return 2
        rows = cuda_mode(shapes, [int(m) for m in args.ms.split(",")], args.budget_s)
        lines = cuda_table(rows)
    meta["total_s"] = round(time.time() - t0, 1)
    (args.out / "screen.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    (args.out / "screen.md").write_text("\n".join([str(meta["env"]), "", *lines]) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
