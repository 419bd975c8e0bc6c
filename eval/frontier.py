"""Zeros vs quality kept, from finetune runs' metrics.jsonl: a table (frontier.md) and a plot (frontier.png).

    python eval/frontier.py RUN_DIR_OR_METRICS [...] --out DIR [--trajectory]

One point per run (its last evaluation, with the zeros of the training step logged nearest before it): mean
zeros over layers, the least sparse layer, the headline `ood_ratio` (geometric mean over the out-of-distribution
domains, data.ood) and `id_ratio` (over the other held-out domains), and the perplexity ratio to the original
SiLU model on the validation text and on every held-out domain (data.heldout), as `sparsify finetune` logs them.
--cloze cloze.json (eval/cloze.py over the same runs, named as the run folders, plus the original) adds the
cloze accuracy and its difference from the first model in that file. With
--trajectory every evaluation of every run is a point too (a run's path through the plane: how quality comes
back as training goes on at the sparsity its target holds).
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
        rows.append(row)
    return rows


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
    p.add_argument("--cloze", type=Path, help="cloze.json of eval/cloze.py over the same runs (adds acc columns)")
    args = p.parse_args()
    rows = []
    for run in map(Path, args.runs):
        rows += points(run / "metrics.jsonl" if run.is_dir() else run, args.trajectory)
    if not rows:
        raise SystemExit("no evaluation after step 0 in the given runs")
    fixed = ("run", "step", "tokens", "zeros", "min_layer_zeros", "min_layer")
    domains = list(dict.fromkeys(k for r in rows for k in r if k not in fixed and any(x.get(k) for x in rows)))
    if args.cloze:
        add_cloze(rows, json.loads(args.cloze.read_text())["models"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(json.dumps(rows, indent=1) + "\n")
    cloze = ["cloze acc", "cloze vs original"] if args.cloze else []
    head = ["run", "tokens", "zeros (mean)", "least sparse layer"] + [f"ppl ratio: {d}" for d in domains] + cloze
    md = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["run"], f"{r['tokens'] / 1e6:.0f}M", f"{r['zeros']:.2%}",
                 f"{r['min_layer_zeros']:.2%} (layer {r['min_layer']})"]
        cells += ["-" if r.get(d) is None else f"{r[d]:.3f}x" for d in domains]
        if cloze:
            cells += ["-", "-"] if r.get("cloze") is None else [f"{r['cloze']:.3f} +- {r['cloze_stderr']:.3f}",
                                                                 f"{100 * r['cloze_delta']:+.1f} pts"]
        md.append("| " + " | ".join(cells) + " |")
    (out / "frontier.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for d, marker in zip(domains, itertools.cycle("osd^v<>Px*")):
        pts = [r for r in rows if r.get(d) is not None]
        ax.plot([r["zeros"] for r in pts], [r[d] for r in pts], marker + "-" if args.trajectory else marker,
                ms=4, lw=0.8, label=d)
    if args.trajectory:  # one run's path: say how far it went
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
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
