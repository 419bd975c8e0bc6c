"""Zeros vs quality kept, from finetune runs' metrics.jsonl: a table (frontier.md) and a plot (frontier.png).

    python eval/quality/frontier.py RUN_DIR_OR_METRICS [...] --out DIR [--trajectory]

One point per run (its last evaluation, with the zeros of the training step logged nearest before it): mean
zeros over layers, the least sparse layer, the headline `ood_ratio` (geometric mean over the out-of-distribution
domains, data.ood) and `id_ratio` (over the other held-out domains), and the perplexity ratio to the original
SiLU model on the validation text and on every held-out domain (data.heldout), as `sparsify finetune` logs them.
--cloze cloze.json (eval/quality/cloze.py over the same runs, named as the run folders, plus the original) adds the
cloze accuracy and its difference from the first model in that file (--cloze again for runs scored in another
file, e.g. an earlier lease's). With
--trajectory every evaluation of every run is a point too (a run's path through the plane: how quality comes
back as training goes on at the sparsity its target holds).

The choice it gives a user (issue 30): each run's method (`l1`, `threshold` with its mode, or the `no-L1` control:
its recipe.yaml says), --recorded JSON (points measured earlier whose runs are not at hand: a list of rows with
the same keys, plus "source"), and --speed decode-bench.json (eval/bench/bench_decode.py at several zeros levels): what
each measured zeros level buys in decode FFN speed, dense / sparse at M = 1 and 8 under CUDA graphs, per shape,
as a table of its own and a second panel (synthetic activation patterns at that level of zeros, not the runs').
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path


def points(metrics: Path, trajectory: bool) -> list[dict]:
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [m for m in lines if "sparsity" in m]
    evals = [m for m in lines if "val_loss" in m and m["step"] > 0]
    rows = []
    for e in evals if trajectory else evals[-1:]:
        before = [t for t in train if t["step"] <= e["step"]]
        if not before:
            continue
        t = before[-1]
        zeros = t["per_layer"]["zeros"]
        row = {"run": metrics.parent.name, "step": e["step"], "tokens": e["tokens"], "zeros": t["sparsity"],
               "min_layer_zeros": min(zeros), "min_layer": zeros.index(min(zeros)),
               "ood_ratio": e.get("ood_ratio"), "id_ratio": e.get("id_ratio"), "validation": e.get("val_ppl_ratio")}
        row.update({name: d.get("ratio") for name, d in e.get("heldout", {}).items()})
        row["method"] = method_of(metrics.parent)
        rows.append(row)
    return rows


def method_of(run_dir: Path) -> str:
    """`l1`, `threshold (layer|neuron, ste|exact)` or `no-L1` (the control), from the run's recipe.yaml."""
    try:
        import yaml

        sp = (yaml.safe_load((run_dir / "recipe.yaml").read_text()) or {}).get("sparsity", {})
    except (OSError, ImportError):
        return "?"
    if sp.get("method") == "threshold":
        return f"threshold ({sp.get('threshold', 'layer')}, {sp.get('threshold_grad', 'ste')})"
    return "no-L1" if sp.get("target") is None and not sp.get("l1") else "l1"


def speed_levels(bench: dict) -> list[dict]:
    """One row per (zeros level, M) of a decode-bench.json: the routed sparse FFN's speedup over dense per shape."""
    levels: dict[tuple, dict] = {}
    for r in bench["rows"]:
        x = (r.get("x") or {}).get("routed")
        if x is None:
            continue
        row = levels.setdefault((r["zeros"], r["M"]), {"zeros": r["zeros"], "M": r["M"], "measured": []})
        row[f"{r['d']}x{r['F']}"] = x
        row["measured"].append(r["measured_zeros"])
    return [levels[k] for k in sorted(levels)]


def add_cloze(rows: list[dict], models: dict) -> None:
    """cloze acc of each row's run (by folder name), and its difference from the first model of the file."""
    first = next(iter(models.values()))["acc"]
    for r in rows:
        if r["run"] in models:
            m = models[r["run"]]
            r.update(cloze=m["acc"], cloze_stderr=m["acc_stderr"], cloze_delta=m["acc"] - first)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders (OUTPUT of sparsify finetune) or metrics.jsonl files")
    p.add_argument("--out", required=True, help="folder for frontier.md, frontier.json, frontier.png")
    p.add_argument("--trajectory", action="store_true", help="every evaluation of a run is a point")
    p.add_argument("--cloze", type=Path, action="append", default=[],
                   help="cloze.json of eval/quality/cloze.py over the same runs (adds acc columns); again for runs scored in "
                        "another file (a run named in several: the last file's score)")
    p.add_argument("--recorded", type=Path, action="append", default=[],
                   help="JSON list of points measured earlier (keys as frontier.json's rows, plus 'source')")
    p.add_argument("--speed", type=Path, help="decode-bench.json of eval/bench/bench_decode.py at several --zeros levels")
    args = p.parse_args()
    rows = []
    for run in map(Path, args.runs):
        rows += points(run / "metrics.jsonl" if run.is_dir() else run, args.trajectory)
    if not rows:
        raise SystemExit("no evaluation after step 0 in the given runs")
    for cloze in args.cloze:
        add_cloze(rows, json.loads(cloze.read_text())["models"])
    for recorded in args.recorded:
        rows += [{**r, "run": f"{r['run']} (recorded)"} for r in json.loads(recorded.read_text())]
    rows.sort(key=lambda r: (r.get("method", ""), r["zeros"]))
    fixed = ("run", "step", "tokens", "zeros", "min_layer_zeros", "min_layer", "method", "source", "cloze",
             "cloze_stderr", "cloze_delta")
    domains = list(dict.fromkeys(k for r in rows for k in r if k not in fixed and any(x.get(k) for x in rows)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    speed = speed_levels(json.loads(args.speed.read_text())) if args.speed else []
    (out / "frontier.json").write_text(json.dumps({"runs": rows, "speed": speed} if speed else rows, indent=1) + "\n")
    cloze = ["cloze acc", "cloze vs original"] if any(r.get("cloze") is not None for r in rows) else []
    head = ["run", "method", "tokens", "zeros (mean)", "least sparse layer"] + [f"ppl ratio: {d}" for d in domains] \
        + cloze
    md = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        least = "-" if r.get("min_layer_zeros") is None else \
            f"{r['min_layer_zeros']:.2%}" + ("" if r.get("min_layer") is None else f" (layer {r['min_layer']})")
        cells = [r["run"], r.get("method", "?"), f"{r['tokens'] / 1e6:.0f}M", f"{r['zeros']:.2%}", least]
        cells += ["-" if r.get(d) is None else f"{r[d]:.3f}x" for d in domains]
        if cloze:
            cells += ["-", "-"] if r.get("cloze") is None else [
                f"{r['cloze']:.3f}" + (f" +- {r['cloze_stderr']:.3f}" if r.get("cloze_stderr") is not None else ""),
                "-" if r.get("cloze_delta") is None else f"{100 * r['cloze_delta']:+.1f} pts"]
        md.append("| " + " | ".join(cells) + " |")
    sources = sorted({r["source"] for r in rows if r.get("source")})
    md += [""] + [f"(recorded) {s}" for s in sources]
    if speed:
        shapes = [k for k in speed[0] if "x" in k and k[0].isdigit()]
        md += ["", "What each level of zeros buys: decode FFN, dense / sparse under CUDA graphs (bf16, synthetic "
               "activations at that level; " + (bench_meta(args.speed)) + ")", "",
               "| zeros | M | " + " | ".join(shapes) + " |", "|" + "---|" * (len(shapes) + 2)]
        md += [f"| {lv['zeros']:.3f} | {lv['M']} | " + " | ".join(
            "-" if lv.get(s) is None else f"{lv[s]:.2f}x" for s in shapes) + " |" for lv in speed]
    (out / "frontier.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, axes = plt.subplots(1, 2 if speed else 1, figsize=(11.5 if speed else 6.5, 4.5), squeeze=False)
    ax = axes[0][0]
    methods = sorted({r.get("method", "?") for r in rows})
    by_method = len(methods) > 1 and "ood_ratio" in domains
    if by_method:  # the headline per method: which method keeps more at equal zeros
        for m, marker in zip(methods, itertools.cycle("osd^v<>Px*")):
            pts = sorted((r for r in rows if r.get("method", "?") == m and r.get("ood_ratio") is not None),
                         key=lambda r: r["zeros"])
            ax.plot([r["zeros"] for r in pts], [r["ood_ratio"] for r in pts], marker, ms=5, label=f"OOD ratio, {m}")
            for r in pts:  # points of one method differ in tokens too: say how many each saw
                ax.annotate(f" {r['tokens'] / 1e6:.0f}M", (r["zeros"], r["ood_ratio"]), fontsize=6, va="center")
    else:
        for d, marker in zip(domains, itertools.cycle("osd^v<>Px*")):
            pts = [r for r in rows if r.get(d) is not None]
            ax.plot([r["zeros"] for r in pts], [r[d] for r in pts], marker + "-" if args.trajectory else marker,
                    ms=4, lw=0.8, label=d)
    if by_method:
        pass  # (each point says its tokens)
    elif args.trajectory:  # one run's path: say how far it went
        last = max(rows, key=lambda r: r["tokens"])
        anchor = next(d for d in domains if last.get(d) is not None)  # (a run without data.ood has no ood_ratio)
        ax.annotate(f"{last['tokens'] / 1e6:.0f}M tokens", (last["zeros"], last[anchor]), fontsize=7)
    else:  # one point per run: name each (next to its first domain's marker)
        for r in rows:
            if r.get(domains[0]) is not None:
                ax.annotate(f" {r['run']}", (r["zeros"], r[domains[0]]), fontsize=6, va="center")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(1.1, color="gray", ls=":", lw=0.8, label="1.10x")
    ax.axhline(1.15, color="gray", ls="--", lw=0.8, label="1.15x")
    ax.set(xlabel="fraction of zeros in h (mean over layers)", ylabel="perplexity / original SiLU model",
           title="quality kept vs sparsity" + (" (each evaluation)" if args.trajectory else ""))
    ax.legend(fontsize=7)
    if speed:
        sx = axes[0][1]
        for m, ls in zip(sorted({lv["M"] for lv in speed}), ("-", "--", ":")):
            for s, marker in zip(shapes, itertools.cycle("osd^")):
                pts = [lv for lv in speed if lv["M"] == m and lv.get(s) is not None]
                sx.plot([lv["zeros"] for lv in pts], [lv[s] for lv in pts], marker + ls, ms=4, lw=0.8,
                        label=f"{s}, M = {m}")
        sx.axhline(1.0, color="gray", lw=0.8)
        sx.set(xlabel="fraction of zeros in h", ylabel="decode FFN speed, sparse / dense",
               title="what the zeros buy (CUDA graphs)")
        sx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=120)
    return 0


def bench_meta(path: Path) -> str:
    env = json.loads(path.read_text()).get("meta", {}).get("env", {})
    return ", ".join(f"{k} {env[k]}" for k in ("gpu", "torch", "triton", "commit") if k in env) or str(path)


if __name__ == "__main__":
    raise SystemExit(main())
