"""Model cards: the README.md written into every model folder, and the Hub card `sparsify push` uploads in
its place (the same text plus a pinned revision and the numbers of a `sparsify eval` report).

Every number in a Hub card comes from report.json; nothing is measured here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sparsify.evaluation.report import fmt, is_metric, markdown_table, ood_ratios, ood_texts, with_stderr
from sparsify.families import thresholded
from sparsify.sources import is_hub_id

TAGS = ["sparsify", "relu", "activation-sparsity", "twell"]
PAPER = "https://arxiv.org/abs/2603.23198"


def folder_card(name: str, config: dict[str, Any]) -> str:
    """README.md of a model folder titled `name` (the folder's final name): what it is, how to load it."""
    return _card(name, name, config, meta={}, pinned=False)


def hub_card(repo_id: str, config: dict, report: dict | None, row: dict | None) -> str:
    """README.md for the Hub: metadata (model-index from the report), what the model is, how to load it
    (trust_remote_code, pinned revision), and the measured accuracy, sparsity and speed of `row`."""
    name = repo_id.split("/")[-1]
    results = _index_results(report or {}, row) if row else []
    meta = {"model-index": [{"name": name, "results": results}]} if results else {}
    card = _card(name, repo_id, config, meta, pinned=True)
    if row:
        return card + "\n\n" + _results_section(report or {}, row) + "\n"
    return card + ("\n\nNo `sparsify eval` report was found next to this folder, so no measured numbers are shown. "
                   "Run `sparsify eval FOLDER --out FOLDER/report` before pushing to include them.\n")


def _card(title: str, model_id: str, config: dict, meta: dict[str, Any], pinned: bool) -> str:
    """Front matter, title, what the model is, how to load `model_id` (without the trailing newline)."""
    import yaml

    prov = config.get("sparsify") or {}
    front: dict[str, Any] = {"library_name": "transformers", "pipeline_tag": "text-generation", "tags": TAGS}
    source = str(prov.get("source", ""))
    if is_hub_id(source) and not Path(source).exists():
        front["base_model"] = source
    front = yaml.safe_dump({**front, **meta}, sort_keys=False, allow_unicode=True)
    return "\n\n".join([f"---\n{front}---", f"# {title}", _about(config, prov),
                        _load_section(model_id, pinned, thresholded(config))])


def _about(config: dict, prov: dict) -> str:
    family = config.get("model_type", "?")
    act = config.get("hidden_act") or config.get("hidden_activation") or "?"
    if thresholded(config):
        act = f"ReLU with a learned threshold per {prov['threshold'].get('mode') or 'neuron'} (g kept where g > theta)"
    how = ("ReLU swap + continued pretraining with a thresholded gate" if thresholded(config) else
           "ReLU swap + L1 continued pretraining") if prov.get("finetuned") else "ReLU swap, no continued pretraining"
    lines = [f"A `{family}` model whose gated MLP uses `{act}`, so many FFN hidden activations are exactly zero; "
             f"made with sparsify ({how}) and shipped with TwELL sparse GPU kernels ([paper]({PAPER}))."]
    if prov:
        keys = ("source", "revision", "source_activation", "activation", "version")
        lines.append("Provenance: " + ", ".join(f"{k} `{prov[k]}`" for k in keys if prov.get(k)) + ".")
    return "\n\n".join(lines)


def _load_section(model_id: str, pinned: bool, threshold: bool = False) -> str:
    """Loading code for a Hub repo (a pinned `revision=`) or a local folder (none: its code is what is there).
    A thresholded model has no stock-code load (transformers refuses its activation name)."""
    rev = ", revision=revision" if pinned else ""
    pin = '\nrevision = "main"  # pin a commit hash here: remote code runs on your machine' if pinned else ""
    where = "repository" if pinned else "folder"
    stock = ("# stock transformers refuses it (KeyError): its thresholds need the modeling code above"
             if threshold else "# or stock transformers code only (a plain dense ReLU model, no custom code):\n"
             f'dense = AutoModelForCausalLM.from_pretrained("{model_id}"{rev})')
    return f"""## How to load

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
{pin}
tok = AutoTokenizer.from_pretrained("{model_id}"{rev}, trust_remote_code=True)
# TwELL sparse kernels on CUDA (needs triton); dense torch on CPU or without triton:
model = AutoModelForCausalLM.from_pretrained("{model_id}"{rev}, trust_remote_code=True)
{stock}
```

`trust_remote_code=True` runs the modeling and kernel files in this {where}. Read them; from the Hub, pin
`revision=` to the commit you read, so later pushes cannot change the code you execute."""


def _ood_ratio(report: dict, row: dict) -> float | None:
    """This model's OOD ratio in the report, None for the reference model (the first) or without OOD texts."""
    ratios = ood_ratios(report) if report.get("models") else []
    at = next((i for i, m in enumerate(report.get("models") or []) if m is row), 0)
    return ratios[at] if at and ratios else None


def _index_results(report: dict, row: dict) -> list[dict]:
    """model-index entries: each lm-eval task with its metrics, each text with perplexity, bits per byte
    and the activation sparsity measured on it, and the prefill speed-ups (all from report.json)."""
    source = {"name": "sparsify eval", "url": PAPER}

    def entry(name: str, kind: str, metrics: dict[str, float | None]) -> dict | None:
        values = [{"type": k, "value": round(float(v), 4), "name": k} for k, v in metrics.items() if v is not None]
        return {"task": {"type": "text-generation", "name": "Text Generation"}, "dataset": {"name": name, "type": kind},
                "metrics": values, "source": source} if values else None

    results = [entry(task, task, {k: v for k, v in sorted(m.items()) if is_metric(k)})
               for task, m in sorted((row.get("accuracy") or {}).items())]
    summary = (row.get("sparsity") or {}).get("summary") or {}
    for text, ppl in sorted((row.get("perplexity") or {}).items()):
        results.append(entry(text, "text", {"perplexity": ppl.get("perplexity"), "bits_per_byte": ppl.get("bits_per_byte"),
                                            "ffn_activation_zeros": summary.get("zeros"),
                                            "ffn_nonzeros_per_token": summary.get("nnz_mean")}))
    ood = _ood_ratio(report, row)
    if ood is not None:
        results.append(entry("out-of-distribution text", "text", {"ood_perplexity_ratio": ood}))
    speed = {f"prefill_b{r['batch']}_s{r['seq']}_auto_over_dense": r.get("auto_over_dense")
             for r in ((row.get("speed") or {}).get("speedup") or {}).get("prefill", [])}
    results.append(entry(f"prefill throughput on {(row.get('speed') or {}).get('device')}", "speed", speed))
    return [r for r in results if r]


def _results_section(report: dict, row: dict) -> str:
    """The report's numbers for this model only."""
    parts = ["## Evaluation (`sparsify eval`)"]
    if row.get("accuracy"):
        rows = [[t, k, with_stderr(m, k), m.get("samples")] for t, m in sorted(row["accuracy"].items())
                for k in sorted(m) if is_metric(k)]
        parts.append(markdown_table(["task", "metric", "value (± standard error)", "items"], rows))
    ood = _ood_ratio(report, row)
    if ood is not None:
        parts.append(f"**Out-of-distribution ratio: {ood:.3f}x**: perplexity / "
                     f"{report['models'][0]['name']}'s, geometric mean over text from sources it never trained on "
                     f"({', '.join(ood_texts(report))}).")
    if row.get("perplexity"):
        parts.append(markdown_table(["text", "tokens", "perplexity", "bits per byte"],
                                    [[t, p["tokens"], p["perplexity"], p["bits_per_byte"]]
                                     for t, p in row["perplexity"].items()]))
    if ((row.get("sparsity") or {}).get("summary")):
        parts.append(_sparsity_paragraph(row["sparsity"]))
    speed = row.get("speed") or {}
    ratios = (speed.get("speedup") or {}).get("prefill") or []
    if ratios:
        parts.append(f"Prefill speed on {speed['device']} ({speed['dtype']}), the same weights in the same run: "
                     "`twell` forces the sparse kernels, `auto` is what loading with trust_remote_code runs.\n\n"
                     + markdown_table(["batch", "seq", "twell / dense tokens/s", "auto / dense tokens/s"],
                                      [[r["batch"], r["seq"], r.get("twell_over_dense"), r.get("auto_over_dense")]
                                       for r in ratios]))
    prov = report.get("provenance") or {}
    if prov:
        parts.append(f"Measured with sparsify {prov.get('sparsify')} (commit {str(prov.get('git_commit'))[:12]}), "
                     f"{', '.join(f'{k} {v}' for k, v in (prov.get('versions') or {}).items() if v)}, on "
                     f"{prov.get('gpu') or prov.get('device')}, {prov.get('date')}.")
    return "\n\n".join(parts)


def _sparsity_paragraph(sparsity: dict) -> str:
    """The activation profile in plain words, against the TwELL layout (tile, slots) eval measured it for."""
    summary = sparsity["summary"]
    reuse = ", ".join(f"R({bt}) {fmt(v, 2)}" for bt, v in (summary.get("reuse") or {}).items())
    tile, slots = sparsity.get("tile"), sparsity.get("slots")
    block = f"{tile}-neuron block" if tile else "neuron block"
    return (f"Activation sparsity over {sparsity.get('tokens')} tokens: {fmt(summary['nnz_mean'], 1)} "
            f"non-zeros per token per layer on average ({fmt(100 * summary['zeros'], 2)}% of the FFN "
            f"hidden activations are exactly zero), {fmt(100 * summary['dead_frac'], 1)}% of neurons never "
            f"active on this text. At most {summary['tile_max']} active neurons of one token fall in one "
            f"{block}; {fmt(100 * summary['overflow_rate'], 2)}% of (token, block) pairs hold more than the "
            f"{slots or ''} values TwELL stores per block and are computed again on a slower path. "
            f"Weight-row reuse (tokens sharing each loaded weight row, per block of BT tokens): {reuse}.")
