"""Turn an evaluation report (the dict `sparsify.evaluation.evaluate.evaluate` returns) into files people read.

write_report(report, out) writes report.json, report.md and PNG plots (per-layer sparsity, speed vs batch,
accuracy bars) into a new folder, built beside it and renamed into place at the end, so a reader never sees half
a report and an existing report is replaced only when asked (--overwrite).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from sparsify.errors import SparsifyError
from sparsify.folder.atomic import atomic_dir, check_output

PLOTS = ("sparsity_per_layer.png", "speed_vs_batch.png", "accuracy.png")
REPORT_FILES = ("report.json", "report.md", *PLOTS)  # everything a report folder holds


def check_report_output(out: str | Path, overwrite: bool = False) -> None:
    """Refuses an existing `out` unless `overwrite`, and even then one holding anything but a report (--overwrite
    replaces the whole folder: a model folder or other files in it would be deleted). Call it before long work."""
    out = Path(out).absolute()
    check_output(out, overwrite, "--out", kind="report")
    others = sorted(p.name for p in out.iterdir() if p.name not in REPORT_FILES) if out.is_dir() else []
    if others:
        raise SparsifyError(f"--out {out} holds files that are not part of a report ({', '.join(others[:5])}"
                            f"{', ...' if len(others) > 5 else ''}): --overwrite replaces the whole folder, so it "
                            f"would delete them. Choose another --out, a folder of its own (e.g. {out / 'report'}).")


def write_report(report: dict, out: str | Path, overwrite: bool = False) -> Path:
    """Write report.md, the plots and report.json into the folder `out` at once: they are written into a folder
    beside it, renamed to `out` at the end (atomic_dir). An existing `out` is refused unless `overwrite`, which
    replaces it whole, and only when it holds nothing but a report (check_report_output)."""
    out = Path(out)
    check_report_output(out, overwrite)
    with atomic_dir(out, overwrite, "--out", kind="report") as tmp:
        report["plots"] = _write_plots(report, tmp)
        (tmp / "report.md").write_text(render_markdown(report), encoding="utf-8")
        (tmp / "report.json").write_text(json.dumps(report, indent=2, default=str), encoding="utf-8")
    return out


def fmt(value: Any, digits: int = 3) -> str:
    """A table cell: floats to `digits` places (large ones in 3 significant digits), None as "-"."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 1e5 else f"{value:.3g}"
    return str(value)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table, each cell through fmt."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(report: dict) -> str:
    """All sections, models side by side in columns."""
    models = report["models"]
    names = [m["name"] for m in models]
    parts = ["# sparsify eval report", "", _models_table(models), ""]
    for title, body in (("Out-of-distribution ratio (the headline)", _ood_table(report, names)),
                        ("Accuracy (lm-eval)", _accuracy_table(models, names)),
                        ("Perplexity", _perplexity_table(models, names)),
                        ("Activation sparsity (h = act(gate) * up, the input of down_proj)", _sparsity_table(models, names)),
                        ("Speed", _speed_tables(models))):
        if body:
            parts += [f"## {title}", "", body, ""]
    parts += ["## Provenance", "", _provenance(report), ""]
    return "\n".join(parts)


def _models_table(models: list[dict]) -> str:
    rows = [[m["name"], m["source"], m.get("model_type"), m.get("activation"), m.get("layers"),
             m.get("intermediate_size"), f"{m.get('parameters', 0) / 1e6:.1f}M", "yes" if m.get("twell_capable") else "no"]
            for m in models]
    return markdown_table(["model", "source", "type", "act", "layers", "F", "params", "TwELL code"], rows)


def ood_texts(report: dict) -> list[str]:
    """The names of the texts no model trained on (--ood-text), as the perplexity tables key them (a merged
    report has one settings dict per report it merged: their texts, each once)."""
    settings = report.get("settings") or {}
    texts = [t for s in (settings if isinstance(settings, list) else [settings]) for t in (s or {}).get("ood_texts") or []]
    return list(dict.fromkeys(Path(t).name for t in texts))


def ood_ratios(report: dict) -> list[float | None]:
    """Each model's OOD ratio, the headline: the geometric mean over the --ood-text texts of its perplexity / the
    first model's (the reference: 1.0 for itself); None where a model lacks one of them; [] without such texts
    or a second model. Worked out from the perplexities, so a merged report gets it too."""
    texts, models = ood_texts(report), report["models"]
    if not texts or len(models) < 2:
        return []

    def ppls(model: dict) -> list[float | None]:
        return [((model.get("perplexity") or {}).get(t) or {}).get("perplexity") for t in texts]

    base = ppls(models[0])
    return [None if None in base or None in mine else statistics.geometric_mean([a / b for a, b in zip(mine, base)])
            for mine in map(ppls, models)]


def _ood_table(report: dict, names: list[str]) -> str:
    texts, ratios = ood_texts(report), ood_ratios(report)
    if not ratios:
        return ""
    return (markdown_table(["", *names], [["OOD ratio", *(_ratio(r, 1.0) for r in ratios)]])
            + f"\n\nPerplexity / {names[0]}'s, geometric mean over the {len(texts)} text(s) given as never trained on "
            f"(--ood-text): {', '.join(texts)}. The per-text ratios are in the perplexity table.")


def _accuracy_table(models: list[dict], names: list[str]) -> str:
    tasks = sorted({t for m in models for t in m.get("accuracy", {})})
    if not tasks:
        return ""
    rows = []
    for task in tasks:
        metrics = sorted({k for m in models for k in m["accuracy"].get(task, {}) if is_metric(k)})
        for metric in metrics:
            samples = max(m["accuracy"].get(task, {}).get("samples", 0) for m in models)
            rows.append([task, metric, samples] + [with_stderr(m["accuracy"].get(task, {}), metric) for m in models])
    note = ("\n\n± is the standard error of a proportion over n items, sqrt(p (1 - p) / (n - 1)): with few items, "
            "differences smaller than about two of them are noise." if any("±" in str(c) for r in rows for c in r) else "")
    return markdown_table(["task", "metric", "n"] + names, rows) + note


def is_metric(key: str) -> bool:
    return key != "samples" and not key.endswith("_stderr")


def with_stderr(results: dict, metric: str) -> Any:
    """`0.450 ± 0.114` when the metric has a standard error, else the value."""
    value, err = results.get(metric), results.get(f"{metric}_stderr")
    return f"{fmt(value)} ± {fmt(err)}" if value is not None and err is not None else value


def _perplexity_table(models: list[dict], names: list[str]) -> str:
    texts = sorted({t for m in models for t in m.get("perplexity", {})})
    rows = []
    for text in texts:
        first = next(m["perplexity"][text] for m in models if text in m["perplexity"])
        for key in ("perplexity", "bits_per_byte"):
            rows.append([text, key, first["tokens"]] + [m["perplexity"].get(text, {}).get(key) for m in models])
        base = models[0].get("perplexity", {}).get(text, {}).get("perplexity")
        if len(models) > 1 and base:  # the quality kept, per text: the first model is the reference (the original)
            rows.append([text, f"perplexity / {names[0]}", first["tokens"]]
                        + [_ratio(m["perplexity"].get(text, {}).get("perplexity"), base) for m in models])
    if not rows:
        return ""
    windows = sorted({p.get("window") for m in models for p in m["perplexity"].values() if p.get("window")})
    note = (f"\n\nWindows of {'/'.join(map(str, windows))} tokens moved by half a window: each token is scored once, "
            f"and every token past the first window has at least {windows[0] // 2} tokens of context before it. "
            "`sparsify finetune` logs its validation perplexity on non-overlapping windows of train.seq_len tokens, "
            "where a token has half a window of context on average, so on the same text it reads higher than "
            "here." if windows else "")
    return markdown_table(["text", "metric", "tokens"] + names, rows) + note


def _ratio(value: float | None, base: float) -> str | None:
    return None if value is None else f"{value / base:.3f}x"


def _sparsity_table(models: list[dict], names: list[str]) -> str:
    sums = [m.get("sparsity", {}).get("summary") or {} for m in models]
    if not any(sums):
        return ""
    tile = next((m["sparsity"].get("tile") for m in models if (m.get("sparsity") or {}).get("tile")), None)
    slots = next((m["sparsity"].get("slots") for m in models if (m.get("sparsity") or {}).get("slots")), None)
    block = f"{tile}-neuron block" if tile else "neuron block"
    keys = [("nnz_mean", "active neurons per token (non-zeros of h, mean over layers)"),
            ("nnz_p99_max", "active neurons per token, 99th percentile (worst layer)"),
            ("nnz_max", "active neurons per token, most seen"),
            ("zeros", "share of h that is exactly zero"),
            ("dead_frac", "share of neurons never active on this text (dead)"),
            ("tile_max", f"most active neurons of one token in one {block}"),
            ("overflow_rate", f"share of (token, {block}) pairs over the {slots or 'TwELL'} values TwELL stores "
                              "per block (computed again on a slower path)")]
    rows = [[label] + [s.get(k) for s in sums] for k, label in keys]
    # the layout each profile was measured against (the kernels' prefill tile and slots), as recorded
    rows += [[label] + [m.get("sparsity", {}).get(k) for m in models]
             for k, label in (("tile", "TwELL block width (neurons)"), ("slots", "values TwELL stores per token per block"))]
    rows += [[f"weight-row reuse R({bt})"] + [(s.get("reuse") or {}).get(bt) for s in sums] for bt in ("16", "32", "64", "128")]
    text = markdown_table(["statistic"] + names, rows)
    tokens = [m.get("sparsity", {}).get("tokens") for m in models]
    text += f"\n\nTokens profiled: {', '.join(f'{n}: {t}' for n, t in zip(names, tokens))}. h is the FFN hidden " \
        "activation, act(gate) * up, one value per neuron; a neuron is active for a token when its value is not " \
        "exactly zero. The TwELL kernels store each token's active neurons block by block, so the fewer and the " \
        "more evenly spread they are, the faster. R(BT) = over blocks of BT consecutive tokens, the (token, active " \
        "neuron) pairs divided by the distinct neurons active in the block: how many tokens share each weight row " \
        "the kernels load."
    return text + "".join(_layer_table(m) for m in models)


def _layer_table(model: dict) -> str:
    layers = [l for l in (model.get("sparsity") or {}).get("layers", []) if l.get("tokens")]
    if not layers:
        return ""
    rows = [[i, l["nnz_mean"], l["nnz_p99"], l["nnz_max"], l["dead"], l["tile_max"], l["overflow_rate"],
             l["reuse"]["16"], l["reuse"]["128"]] for i, l in enumerate(layers)]
    table = markdown_table(["layer", "active mean", "active p99", "active max", "dead neurons", "block max",
                    "overflow share", "R(16)", "R(128)"], rows)
    return f"\n\n<details><summary>{model['name']}: per layer (of {layers[0]['width']} neurons)</summary>\n\n{table}\n\n</details>"


def _speed_tables(models: list[dict]) -> str:
    blocks = []
    for m in models:
        speed = m.get("speed") or {}
        if not speed:
            continue
        if not speed.get("available"):
            blocks.append(f"**{m['name']}**: {speed.get('reason')}")
            continue
        label = lambda r: r["backend"] + (" (again)" if r.get("repeat") else "")  # noqa: E731
        rows = [[label(r), r["batch"], r["seq"], r.get("tokens_per_s"), r.get("ms"), r.get("peak_mem_gb"),
                 r.get("error") or r.get("path")] for r in speed["prefill"]]
        rows += [[label(r), r["batch"], f"decode {r['new_tokens']} after {r['prompt']}", r.get("tokens_per_s"),
                  r.get("ms"), r.get("peak_mem_gb"), r.get("error") or r.get("path")] for r in speed["decode"]]
        blocks.append(f"**{m['name']}** on {speed['device']} ({speed['dtype']})\n\n"
                      + markdown_table(["backend", "batch", "seq", "tokens/s", "ms", "peak GiB", "FFN path / note"], rows))
        ratios = [[f"prefill b{r['batch']} s{r['seq']}", r["twell_over_dense"], r["auto_over_dense"], r.get("dense_noise")]
                  for r in speed["speedup"]["prefill"]]
        ratios += [[f"decode b{r['batch']}", r["twell_over_dense"], r["auto_over_dense"], r.get("dense_noise")]
                   for r in speed["speedup"]["decode"]]
        if ratios:
            blocks.append(markdown_table(["shape", "twell / dense tokens/s", "auto / dense tokens/s",
                                  "noise (dense run twice)"], ratios))
        shares = [[b, s.get("batch"), s.get("seq"), s.get("ffn_share")] for b, s in speed["ffn_share"].items()]
        blocks.append(markdown_table(["backend", "batch", "seq", "FFN share of prefill time"], shares))
    return "\n\n".join(blocks)


def _provenance(report: dict) -> str:
    if report.get("merged_from"):
        return "\n".join(f"- {_provenance({'provenance': m['provenance']})} From `{m['report']}`: "
                         + "; ".join(f"{n}: {', '.join(s)}" for n, s in m["sections"].items())
                         for m in report["merged_from"])
    p = report["provenance"]
    versions = ", ".join(f"{k} {v}" for k, v in p["versions"].items() if v)
    commit = (p.get("git_commit") or "unknown")[:12] + (" (dirty)" if p.get("git_dirty") else "")
    return (f"sparsify {p['sparsify']}, commit {commit}; {versions}; Python {p['python']}; "
            f"device {p.get('gpu') or p['device']}; {p['date']}.")


def summary(report: dict, out: Path | None = None) -> str:
    """A few lines for the terminal: per model the perplexity of each text, the share of zeros in h, each
    accuracy metric with its standard error and the median speed-up; then where the full report is."""
    models = report["models"]

    def line(title: str, cells: list[tuple[str, Any]]) -> str | None:
        cells = [(n, v) for n, v in cells if v not in (None, "")]
        return f"{title}: " + " | ".join(f"{n} {v}" for n, v in cells) if cells else None

    lines = [f"sparsify eval: {len(models)} model{'s' * (len(models) != 1)} ({', '.join(m['name'] for m in models)})"]
    ratios = ood_ratios(report)
    if ratios:
        lines.append(line(f"OOD ratio (perplexity / {models[0]['name']}'s, geometric mean over "
                          f"{len(ood_texts(report))} text(s) never trained on)",
                          [(m["name"], _ratio(r, 1.0)) for m, r in zip(models, ratios)]))
    for text in sorted({t for m in models for t in m.get("perplexity", {})}):
        first = next(m["perplexity"][text] for m in models if text in m["perplexity"])
        scored = f"{first['tokens']} tokens" + (f", {first['window']}-token windows" if first.get("window") else "")
        lines.append(line(f"perplexity on {text} ({scored})",
                          [(m["name"], fmt(m["perplexity"].get(text, {}).get("perplexity"), 2)) for m in models]))
    lines.append(line("FFN zeros (active neurons per token)",
                      [(m["name"], _zeros_cell((m.get("sparsity") or {}).get("summary") or {})) for m in models]))
    for task in sorted({t for m in models for t in m.get("accuracy", {})}):
        metrics = sorted({k for m in models for k in m["accuracy"].get(task, {}) if is_metric(k)})
        for metric in metrics:
            n = max(m["accuracy"].get(task, {}).get("samples", 0) for m in models)
            lines.append(line(f"{task} {metric} ({n} items)",
                              [(m["name"], fmt(with_stderr(m["accuracy"].get(task, {}), metric))) for m in models]))
    for kind in ("prefill", "decode"):
        lines.append(line(f"{kind} speed, auto / dense tokens/s (median over shapes)",
                          [(m["name"], _median_ratio(m, kind)) for m in models]))
    for m in models:
        speed = m.get("speed") or {}
        if speed and not speed.get("available"):
            lines.append(f"speed ({m['name']}): {speed.get('reason')}")
            break
    if out is not None:
        lines.append(f"full report: {out / 'report.md'} (per-layer tables; data in report.json, plots beside it)")
    return "\n".join(l for l in lines if l)


def _zeros_cell(s: dict) -> str | None:
    return f"{100 * s['zeros']:.1f}% ({s['nnz_mean']:.0f})" if s.get("zeros") is not None else None


def _median_ratio(model: dict, kind: str) -> str | None:
    ratios = sorted(r["auto_over_dense"] for r in ((model.get("speed") or {}).get("speedup") or {}).get(kind, [])
                    if r.get("auto_over_dense"))
    return f"{ratios[len(ratios) // 2]:.2f}x" if ratios else None


def _write_plots(report: dict, out: Path) -> list[str]:
    """Only plots with data are drawn; returns the file names written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional: `pip install twell-sparsify[eval]` brings matplotlib
        return []
    written = []
    for name, draw in zip(PLOTS, (_plot_sparsity, _plot_speed, _plot_accuracy)):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        if draw(ax, report["models"]):
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(out / name, dpi=110)
            written.append(name)
        plt.close(fig)
    return written


def _plot_sparsity(ax: Any, models: list[dict]) -> bool:
    drawn = False
    for m in models:
        layers = [l for l in (m.get("sparsity") or {}).get("layers", []) if l.get("tokens")]
        if layers:
            (line,) = ax.plot(range(len(layers)), [l["nnz_mean"] for l in layers], marker="o", label=f"{m['name']} mean")
            ax.plot(range(len(layers)), [l["nnz_p99"] for l in layers], ls="--", color=line.get_color(),
                    label=f"{m['name']} p99")
            drawn = True
    ax.set(xlabel="layer", ylabel="non-zeros per token", yscale="log", title="Active FFN neurons per token")
    return drawn


def _plot_speed(ax: Any, models: list[dict]) -> bool:
    drawn = False
    for m in models:
        speed = m.get("speed") or {}
        rows = [r for r in speed.get("prefill", []) if "tokens_per_s" in r and not r.get("repeat")]
        if not rows:
            continue
        seq = max(r["seq"] for r in rows)
        for backend in speed["backends"]:
            pts = sorted((r["batch"], r["tokens_per_s"]) for r in rows if r["backend"] == backend and r["seq"] == seq)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{m['name']} {backend} (seq {seq})")
                drawn = True
    from matplotlib.ticker import ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set(xlabel="batch", ylabel="prefill tokens/s", title="Prefill throughput (same weights, same run)")
    return drawn


def _plot_accuracy(ax: Any, models: list[dict]) -> bool:
    tasks = sorted({t for m in models for t, r in m.get("accuracy", {}).items() if "acc" in r})
    if not tasks:
        return False
    width = 0.8 / len(models)
    for i, m in enumerate(models):
        values = [m["accuracy"].get(t, {}).get("acc", 0.0) for t in tasks]
        errors = [m["accuracy"].get(t, {}).get("acc_stderr") or 0.0 for t in tasks]
        ax.bar([j + i * width for j in range(len(tasks))], values, width, yerr=errors, capsize=3, label=m["name"])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], tasks, rotation=20, fontsize=8)
    ax.set(ylabel="accuracy", ylim=(0, 1), title="Accuracy (lm-eval acc, bars: ± one standard error)")
    return True


SECTIONS = ("accuracy", "perplexity", "sparsity", "speed")


def merge_reports(reports: list[dict], names: list[str]) -> dict:
    """Combine reports of the same models measured on different machines (e.g. accuracy with lm-eval on a
    CPU box, sparsity and speed on a GPU box without lm-eval). Models are matched by name; a section comes
    from the first report where it is non-empty (accuracy tasks are unioned); each report's provenance is
    kept with the sections it contributed."""
    merged: dict[str, dict] = {}
    sources = []
    for report, name in zip(reports, names):
        contributed: dict[str, list[str]] = {}
        for row in report["models"]:
            target = merged.setdefault(row["name"], {k: v for k, v in row.items() if k not in SECTIONS})
            for section in SECTIONS:
                value = row.get(section) or {}
                if section == "accuracy" and value:
                    new = {t: r for t, r in value.items() if t not in target.setdefault("accuracy", {})}
                    target["accuracy"].update(new)
                    if new:
                        contributed.setdefault(row["name"], []).append(section)
                elif value and not target.get(section):
                    target[section] = value
                    contributed.setdefault(row["name"], []).append(section)
                else:
                    target.setdefault(section, {})
        sources.append({"report": name, "provenance": report["provenance"], "sections": contributed})
    return {"sparsify_report": 1, "provenance": reports[0]["provenance"], "merged_from": sources,
            "settings": [r.get("settings") for r in reports], "models": list(merged.values())}


def main(argv: list[str] | None = None) -> int:
    """`python -m sparsify.evaluation.report A/report.json B/report.json --out DIR` merges (one file: re-renders).

    A missing report is a clear message and exit status 2 (argparse's convention for bad arguments)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m sparsify.evaluation.report",
                                     description="Re-render or merge sparsify eval reports (report.md + plots).")
    parser.add_argument("reports", nargs="+", help="report.json files (or folders holding one)")
    parser.add_argument("--out", required=True, help="output folder (must not exist, unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out report folder (--out may be one of the reports re-rendered)")
    args = parser.parse_args(argv)
    paths = [Path(p) / "report.json" if Path(p).is_dir() else Path(p) for p in args.reports]
    reports = []
    for path in paths:
        if not path.is_file():
            parser.error(f"{path}: no such report.json. Pass report.json files or folders holding one "
                         "(written by `sparsify eval --out DIR`).")
        try:
            reports.append(json.loads(path.read_text(encoding="utf-8")))
        except ValueError as e:
            parser.error(f"{path} is not valid JSON ({e}); pass report.json files written by `sparsify eval`.")
    report = merge_reports(reports, [str(p) for p in paths]) if len(reports) > 1 else reports[0]
    try:
        write_report(report, Path(args.out), args.overwrite)
    except SparsifyError as e:
        parser.error(str(e))
    print(f"wrote {Path(args.out) / 'report.json'}, report.md and {len(report['plots'])} plots")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
