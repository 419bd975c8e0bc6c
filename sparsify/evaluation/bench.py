"""bench: end-to-end generation speed as a user measures it: `model.generate()` time to first token and
decode tokens/s, dense vs sparse, on the same GPU in the same run and the same cache/graph regime.

Every model runs through `model.generate()`. Regimes:
- "compiled" (what a sparsify folder gives greedy generate() on CUDA): static KV cache, the decode step's
  forward through torch.compile (inductor fuses the small non-FFN kernels: norms, rotary, residual adds),
  and the whole step (forward + argmax) replayed from one CUDA graph with no host sync per token
  (modeling_sparsify.FastDecode); the dense side gets the very same regime (`enable_fast_decode(model,
  compile=True)`). The warm-up includes one compile per variant and shape.
- "graphs": the same without torch.compile (a folder with `"compile_decode": false`).
- "hf-graphs": transformers' own generation loop (what sampling and other options run), the forward
  replayed from a CUDA graph on the static cache.
- "eager": transformers' default dynamic cache, every kernel launched from Python.
Variants of one sparsify folder: "dense" (its FFN through cuBLAS, i.e. the speed of the original model of
the same shape) and "sparse" (the `auto` dispatcher a user gets). Other folders run "stock".

`--device cpu` runs the same report on the CPU (issue 43): regime "eager" (transformers' loop and dynamic cache, what
generate() runs there), "sparse" being `auto` with the CPU's sparse row (kernels/cpu_sparse.py), the wall clock for
every timing, and the number of torch threads stated in the report (`--threads`, default torch's own). A sparsify
folder's first generate() on the CPU in bf16 runs its nn.Linear layers outside the FFNs on weights packed for oneDNN
(the same bits, faster bf16 GEMVs, one more copy of those weights): its default, dense and sparse alike. `--pack`
packs a stock model's layers the same way too, `--no-pack` no model's.

For each (batch, prompt length) every variant is warmed up once (kernel compiles, dispatcher timing, graph
capture), then timed `repeats` times, variants alternating in an order that flips every round. Each timed call
follows one untimed forward of the prompt after its variant is set: a model in use keeps the state `auto`
gives it (a decided layer holds auto's answer until its next density refresh, and a backend switch ends it), so the
first call after a switch is not what a user's calls cost. The time to first token is prefill plus the first
token's logits; decode tokens/s counts the batch's tokens after it. The prefill alone is also timed in paired
rounds (paired_prefill_ms): the steadier answer to "is sparse prefill slower than dense?".
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from statistics import median
from typing import Any

from sparsify.errors import SparsifyError
from sparsify.evaluation.loading import ffn_backend_of, installed_modeling, load_model, parse_models
from sparsify.evaluation.speed import int_list
from sparsify.families import mlp_modules

GPU_ONLY = ("sparsify bench --device cuda needs a CUDA GPU and none is visible here. `--device cpu` times generate() on "
            "the CPU instead (the CPU's sparse FFN row against dense); `sparsify eval` measures accuracy, perplexity "
            "and sparsity.")

REGIMES = ("graphs", "compiled", "hf-graphs", "eager")
CPU_REGIMES = ("eager",)  # no CUDA graphs on the CPU: transformers' loop and dynamic cache


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA); the CPU's calls return when done."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


class _FirstToken:
    """A logits processor that notes when the first token's logits are ready (one sync, at step one)."""

    def __init__(self):
        self.at: float | None = None

    def __call__(self, input_ids, scores):
        if self.at is None:
            sync(scores.device.type)
            self.at = time.perf_counter()
        return scores


def time_generate(model: Any, ids: Any, new_tokens: int) -> dict:
    """One greedy generate() of exactly `new_tokens` tokens: time to first token (ms) and decode tokens/s.

    The graph loop times itself (a sync after the prefill and one at the end: FastDecode.timing); for
    transformers' loop a logits processor notes when the first token's logits are ready."""
    import torch
    from transformers import LogitsProcessorList

    from sparsify.kernels.fast_decode import fast_decode_of

    device = ids.device.type
    fast = fast_decode_of(model)
    loop = fast is not None and fast.enabled and fast.loop
    extra = {} if loop else {"logits_processor": LogitsProcessorList([_FirstToken()])}
    if fast is not None:
        fast.timing, replays = loop, fast.replays
    sync(device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **extra)
    sync(device)
    end = time.perf_counter()
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"generate() returned {out.shape[1] - ids.shape[1]} tokens, expected {new_tokens}")
    if loop:
        fast.timing = False
        if "decode_s" not in fast.last:
            raise RuntimeError("the greedy graph loop did not serve this call (see _greedy_plan)")
        ttft_s, decode_s = fast.last["ttft_s"], fast.last["decode_s"]
    else:
        first = extra["logits_processor"][0].at
        ttft_s, decode_s = first - start, end - first
    return {"ttft_ms": ttft_s * 1e3, "decode_tok_s": ids.shape[0] * (new_tokens - 1) / decode_s,
            "step_ms": decode_s * 1e3 / (new_tokens - 1), "tokens": out,
            "replays": None if fast is None else fast.replays - replays}


PREFILL_ROUNDS = 15  # paired prefill timings per case (odd: the median is one round's ratio). 7 rounds of a
# host-bound 12 ms prefill (Llama-3.2-1B shape, 512 tokens, H200) spread 0.90-1.04: too few to tell 3% from noise


def paired_prefill_ms(model: Any, ids: Any, variants: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """{variant: [ms of one prompt forward, one per round]}: the prefill alone (the base model's forward of the
    prompt, no cache, no sampling), each variant set and warmed by one untimed forward in every round, in an
    order that flips every round. TTFT from a few generate() calls is a host-bound number with a wide spread;
    these rounds pair the variants tightly enough to say whether sparse prefill is slower."""
    out: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            use_variant(model, ids, variants[name])
            sync(ids.device.type)
            start = time.perf_counter()
            prompt_forward(model, ids)
            sync(ids.device.type)
            out[name].append((time.perf_counter() - start) * 1e3)
    return out


def prompt_forward(model: Any, ids: Any) -> None:
    """One forward of the prompt through the base model (no cache, no logits)."""
    import torch

    with torch.no_grad():
        model.base_model(input_ids=ids, use_cache=False)


def use_variant(model: Any, ids: Any, apply: Any) -> None:
    """Set a variant, then one untimed prompt forward: the state a model in use holds (a layer `auto` decided
    holds its answer until the next density refresh; a backend switch ends it), not that of a first call."""
    apply()
    prompt_forward(model, ids)


def _variants(model: Any) -> dict[str, Any]:
    """name -> function that puts the model in that variant (sparsify models: dense and sparse FFN)."""
    if ffn_backend_of(model) is None:
        return {"stock": lambda: None}
    return {"dense": lambda: model.set_ffn_backend("dense"), "sparse": lambda: model.set_ffn_backend("auto")}


def _prompt(vocab: int, batch: int, length: int, tokens: Any, device: str) -> Any:
    """[batch, length] prompt ids: real text tokens tiled when given (activation sparsity depends on the
    text), else random ids (synthetic models are calibrated on random ids)."""
    import torch

    if tokens is not None and len(tokens) > 0:
        need = batch * length
        reps = -(-need // len(tokens))
        return tokens.repeat(reps)[:need].view(batch, length).to(device)
    g = torch.Generator().manual_seed(batch * 100003 + length)
    return torch.randint(0, vocab, (batch, length), generator=g).to(device)


def bench_model(model: Any, *, batches: tuple[int, ...], prompts: tuple[int, ...], new_tokens: int,
                repeats: int, regimes: tuple[str, ...] = ("compiled",), tokens: Any = None,
                budget_s: float | None = None, progress: bool = True) -> list[dict]:
    """Rows {regime, variant, batch, prompt, ttft_ms, decode_tok_s, step_ms, ...} for one loaded model."""
    import torch

    device = model.device.type
    if device not in ("cuda", "cpu"):
        raise SparsifyError(f"sparsify bench runs on CUDA or the CPU, not {device}.")
    if device == "cpu" and set(regimes) - set(CPU_REGIMES):
        raise SparsifyError(f"--regimes {','.join(regimes)}: on the CPU only {','.join(CPU_REGIMES)} runs (no CUDA graphs).")
    fast = installed_modeling().enable_fast_decode(model)
    folder_compile = fast.compile  # (a sparsify folder compiles by default; each regime sets its own)
    variants = _variants(model)
    vocab = model.get_input_embeddings().weight.shape[0]
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
    rows: list[dict] = []
    t0 = time.perf_counter()
    cases = [(r, b, p) for r in regimes for p in prompts for b in batches if p + new_tokens <= limit]
    for regime, batch, prompt in cases:
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            rows.append({"regime": regime, "batch": batch, "prompt": prompt, "skipped": "time budget"})
            continue
        fast.enabled, fast.loop = regime != "eager", regime in ("graphs", "compiled")
        fast.compile, fast.compile_error = regime == "compiled", None
        fast.step_checks.clear()
        ids = _prompt(vocab, batch, prompt, tokens, device)
        times: dict[str, list[dict]] = {v: [] for v in variants}
        outputs: dict[str, Any] = {}
        compiled: dict[str, bool] = {}  # per variant: still compiled after its warm-up (a failure turns it off)
        try:
            for name, apply in variants.items():  # warm-up: compiles, dispatcher timing, graph capture
                apply()
                outputs[name] = time_generate(model, ids, new_tokens)["tokens"]
                compiled[name] = fast.compile
            names = list(variants)
            for r in range(repeats):
                for name in names if r % 2 == 0 else names[::-1]:
                    use_variant(model, ids, variants[name])
                    t = time_generate(model, ids, new_tokens)
                    t.pop("tokens")
                    times[name].append(t)
            prefill = paired_prefill_ms(model, ids, variants, PREFILL_ROUNDS)
        except torch.OutOfMemoryError:
            if device == "cuda":
                torch.cuda.empty_cache()
            rows.append({"regime": regime, "batch": batch, "prompt": prompt, "skipped": f"out of {device} memory"})
            continue
        same = None
        if len(outputs) == 2:  # greedy tokens of the two variants: equal, or the first position they differ
            a, b = outputs.values()
            diff = (a != b).any(0).nonzero()
            same = "equal" if len(diff) == 0 else f"first difference at new token {int(diff[0]) - prompt + 1}"
        for name, ts in times.items():
            rows.append({"regime": regime, "variant": name, "batch": batch, "prompt": prompt,
                         "new_tokens": new_tokens, "ttft_ms": median([t["ttft_ms"] for t in ts]),
                         "decode_tok_s": median([t["decode_tok_s"] for t in ts]),
                         "step_ms": median([t["step_ms"] for t in ts]),
                         "step_ms_spread": (max(t["step_ms"] for t in ts) - min(t["step_ms"] for t in ts)),
                         "prefill_ms": median(prefill[name]), "prefill_ms_rounds": prefill[name],
                         "graph_replays_per_call": ts[-1]["replays"],
                         "greedy_tokens": same,
                         "step_checks": list(fast.step_checks) if name != "dense" else [],
                         **({"compiled": compiled[name], "compile_error": fast.compile_error}
                            if regime == "compiled" else {})})
        if progress:
            line = "  ".join(f"{n} {median([t['decode_tok_s'] for t in ts]):.0f} tok/s" for n, ts in times.items())
            print(f"bench: {regime} batch {batch} prompt {prompt}: {line}", flush=True)
    fast.enabled, fast.loop, fast.compile = True, True, folder_compile
    return rows


def speedups(rows: list[dict]) -> list[dict]:
    """sparse / dense ratios of decode tokens/s and dense / sparse of time to first token, per case."""
    out = []
    by = {(r["regime"], r["batch"], r["prompt"], r.get("variant")): r for r in rows if "variant" in r}
    for (regime, batch, prompt, variant), sparse in by.items():
        dense = by.get((regime, batch, prompt, "dense"))
        if variant != "sparse" or dense is None:
            continue
        ratios = [d / s for d, s in zip(dense.get("prefill_ms_rounds") or [], sparse.get("prefill_ms_rounds") or [])]
        out.append({"regime": regime, "batch": batch, "prompt": prompt,
                    "decode_speedup": sparse["decode_tok_s"] / dense["decode_tok_s"],
                    "ttft_speedup": dense["ttft_ms"] / sparse["ttft_ms"],
                    "prefill_speedup": median(ratios) if ratios else None,
                    "prefill_quartiles": quartiles(ratios) if len(ratios) >= 4 else None,
                    "dense_step_spread": dense["step_ms_spread"] / dense["step_ms"]})
    return out


def quartiles(xs: list[float]) -> tuple[float, float]:
    """(first, third) quartile: the middle half of the paired rounds, the spread a median ratio sits in."""
    from statistics import quantiles

    q = quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def markdown(report: dict) -> str:
    cpu = report.get("device") == "cpu"
    lines = [f"# Generation speed: {report['gpu']}", "",
             *(["On the CPU: transformers' generation loop and dynamic cache (regime eager); dense = the FFN as "
                "three dense GEMMs, sparse = `auto` with the CPU's sparse row (kernels/cpu_sparse.py); wall clock; "
                f"{report['settings'].get('threads')} torch threads"
                + {True: "; every model's layers outside the FFNs on packed weights (--pack).",
                   False: "; no layer on packed weights (--no-pack)."}.get(
                    report["settings"].get("packed"), "; a sparsify folder's layers outside the FFNs on packed weights "
                    "in bf16 (its default; --no-pack: none), a stock model's unpacked (--pack: packed too)."),
                ""] if cpu else []),
             "`model.generate()` end to end, greedy, "
             f"{report['settings']['new_tokens']} new tokens. decode tok/s = batch x tokens after the first / "
             "their time; TTFT = prompt processing + first token. dense = the same weights with the FFN on "
             "cuBLAS (the original model's speed); sparse = the TwELL `auto` dispatcher. "
             "graphs = static KV cache + the whole greedy decode step in one CUDA graph; "
             "compiled = graphs with the step's forward through torch.compile (the sparsify default on CUDA); "
             "hf-graphs = transformers' generation loop with the forward replayed from a graph; eager = dynamic cache.",
             "", f"Provenance: {json.dumps(report['provenance'])}", ""]
    for name, model in report["models"].items():
        lines += [f"## {name}", "", model.get("info", ""), "",
                  "| regime | batch | prompt | variant | decode tok/s | step ms | TTFT ms | greedy tokens |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in model["rows"]:
            if "skipped" in r:
                lines.append(f"| {r['regime']} | {r['batch']} | {r['prompt']} | - | skipped: {r['skipped']} | | | |")
                continue
            lines.append(f"| {r['regime']} | {r['batch']} | {r['prompt']} | {r['variant']} | {r['decode_tok_s']:.0f} "
                         f"| {r['step_ms']:.3f} | {r['ttft_ms']:.1f} | {r['greedy_tokens'] or ''} |")
        if model["speedups"]:
            lines += ["", "| regime | batch | prompt | decode sparse/dense | TTFT dense/sparse | prefill dense/sparse "
                      "(paired) | dense step spread |", "|---|---|---|---|---|---|---|"]
            lines += [f"| {s['regime']} | {s['batch']} | {s['prompt']} | **{s['decode_speedup']:.2f}x** | "
                      f"{s['ttft_speedup']:.2f}x | {_ratio(s.get('prefill_speedup'))}{_middle(s.get('prefill_quartiles'))} | "
                      f"{100 * s['dense_step_spread']:.1f}% |" for s in model["speedups"]]
            lines += ["", f"prefill dense/sparse (paired): the median over {PREFILL_ROUNDS} rounds of the ratio of "
                      "one prompt forward's time (the base model, no cache), the variants alternating, each after "
                      "an untimed forward, with the middle half of the rounds' ratios (first to third quartile) "
                      "in brackets; TTFT is the median of the timed generate() calls (host-bound, wider spread)."]
        lines += layer_tables(model.get("layers") or [])
        lines.append("")
    return "\n".join(lines)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}x"


def _middle(q: list[float] | None) -> str:
    return "" if not q else f" ({q[0]:.3f}-{q[1]:.3f})"


def layer_tables(layers: list[dict]) -> list[str]:
    """Which FFN backend each layer ran, per M bucket: what `auto` decided in eager calls and in graph replay,
    the density it measured, and why (a paired timing's median ratio twell / dense, or a rule)."""
    buckets = sorted({int(b) for layer in layers for b in layer}, key=int)
    if not buckets:
        return []
    n = len(layers)

    def get(layer: dict, b: int) -> dict | None:
        return layer.get(b, layer.get(str(b)))  # (int keys in memory, str keys from bench.json)

    lines = ["", "FFN backend per layer, as `auto` decided it (eager calls / calls replayed from CUDA graphs):", "",
             "| M bucket | layers on twell, eager | layers on twell, graph replay | density (median over layers) |",
             "|---|---|---|---|"]
    for b in buckets:
        states = [st for st in (get(layer, b) for layer in layers) if st]
        eager = [i for i, layer in enumerate(layers) if (get(layer, b) or {}).get("eager") == "twell"]
        graph = [i for i, layer in enumerate(layers) if (get(layer, b) or {}).get("graph") == "twell"]
        dens = sorted(st["density"] for st in states if st.get("density") is not None)
        lines.append(f"| {b} | {len(eager)} of {n}{_ids(eager)} | {len(graph)} of {n}{_ids(graph)} | "
                     f"{'-' if not dens else f'{100 * dens[len(dens) // 2]:.2f}%'} |")
    lines += ["", "| layer | " + " | ".join(f"M <= {b}" for b in buckets) + " |", "|---" * (len(buckets) + 1) + "|"]
    for i, layer in enumerate(layers):
        lines.append(f"| {i} | " + " | ".join(_cell(get(layer, b)) for b in buckets) + " |")
    return lines + ["", "A cell: eager / graph decision, the density measured, and why (the median paired ratio "
                        "twell / dense of its timing, or the rule that decided without timing)."]


def _ids(layers: list[int]) -> str:
    return "" if not layers else f" ({', '.join(map(str, layers[:12]))}{', ...' if len(layers) > 12 else ''})"


def _cell(st: dict | None) -> str:
    if not st:
        return "-"
    why = st.get("rule") or " ".join(f"{k.replace('_ratio', '')} {st[k]:.2f}" for k in ("ratio", "graph_ratio") if k in st)
    density = "" if st.get("density") is None else f" {100 * st['density']:.1f}%"
    return f"{st.get('eager')} / {st.get('graph')}{density}" + (f" ({why})" if why else "")


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = list(report["models"].items())
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, (name, model) in zip(axes[0], models):
        series: dict[tuple, list] = {}
        for r in model["rows"]:
            if "variant" in r:
                series.setdefault((r["variant"], r["regime"], r["prompt"]), []).append((r["batch"], r["decode_tok_s"]))
        for (variant, regime, prompt), pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    linestyle="-" if variant != "dense" else "--", label=f"{variant} {regime} p{prompt}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(name)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo where there is one)."""
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                platform.processor() or "unknown")


def gpu_provenance() -> dict:
    import importlib.metadata as md
    import subprocess

    import torch

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    commit = os.environ.get("SPARSIFY_COMMIT") or commit  # a copied tree (device runs) has no .git of its own
    return {"torch": torch.__version__, "transformers": version("transformers"), "triton": version("triton"),
            "commit": commit, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def bench(models: list[str], *, batches=(1, 8, 32), prompts=(128, 512, 2048), new_tokens: int = 256,
          repeats: int = 5, regimes=None, dtype: str = "bf16", text: str | Path | None = None,
          out: str | Path | None = None, trust_remote_code: bool = False, budget_s: float | None = None,
          progress: bool = True, overwrite: bool = False, device: str = "cuda", threads: int | None = None,
          pack: bool | None = None) -> dict:
    """Benchmark each model (`[NAME=]PATH`) on `device` ("cuda" or "cpu": regime eager, `threads` torch threads,
    `pack`: the layers outside the FFNs on packed weights, both variants alike: True every model, False none, None
    each model's default: a sparsify folder's first bf16 generate() packs);
    writes OUT/bench.json, report.md and decode.png if `out` (an existing `out` is refused before any work unless
    `overwrite`, and unless it is empty or an earlier bench's; it is replaced whole at the end)."""
    import gc

    import torch

    from sparsify.folder.atomic import atomic_dir, check_output

    if out is not None:
        check_output(out, overwrite, "--out", kind="bench")
    if device not in ("cuda", "cpu"):
        raise SparsifyError(f"--device {device}: choose cuda or cpu.")
    if pack is not None and device != "cpu":
        raise SparsifyError(f"--{'' if pack else 'no-'}pack chooses weights packed for the CPU's oneDNN GEMMs: "
                            "use it with --device cpu.")
    regimes = tuple(regimes or (CPU_REGIMES if device == "cpu" else ("compiled",)))
    if device == "cuda" and not torch.cuda.is_available():
        raise SparsifyError(GPU_ONLY)
    if device == "cpu" and set(regimes) - set(CPU_REGIMES):
        raise SparsifyError(f"--regimes {','.join(regimes)}: on the CPU only {','.join(CPU_REGIMES)} runs (no CUDA graphs).")
    if threads is not None:
        if threads < 1:
            raise SparsifyError(f"--threads {threads}: must be at least 1.")
        torch.set_num_threads(threads)
    if new_tokens < 2:
        raise SparsifyError("--new-tokens must be at least 2 (decode speed is measured after the first token).")
    if repeats < 1:
        raise SparsifyError(f"--repeats {repeats}: must be at least 1 timed call per variant and case.")
    bad = [r for r in regimes if r not in REGIMES]
    if bad:
        raise SparsifyError(f"--regimes {','.join(bad)}: choose from {','.join(REGIMES)}.")
    specs = parse_models(models)
    hardware = (torch.cuda.get_device_name() if device == "cuda"
                else f"CPU ({cpu_name()}), {torch.get_num_threads()} torch threads")
    report: dict[str, Any] = {"gpu": hardware, "device": device, "provenance": gpu_provenance(),
                              "settings": {"batches": list(batches), "prompts": list(prompts),
                                           "new_tokens": new_tokens, "repeats": repeats, "dtype": dtype,
                                           "regimes": list(regimes),
                                           **({"threads": torch.get_num_threads(), "packed": pack}
                                              if device == "cpu" else {})},
                              "models": {}}
    text_ids = None
    for spec in specs:
        model, tok = load_model(spec, device, dtype, trust_remote_code=trust_remote_code)
        packed_layers = None
        if pack:
            from sparsify.kernels.cpu_sparse import pack_linears

            # a sparsify folder's own method; a stock model alike: its FFN modules' layers stay F.linear
            packed_layers = (model.pack_cpu_linears() if hasattr(model, "pack_cpu_linears") else
                             pack_linears(model, skip=tuple({type(m) for m in mlp_modules(model)})))
        elif pack is False and hasattr(model, "pack_cpu_linears"):
            model.pack_cpu_linears(False)  # (also: its generate() packs no more on its own)
        if text is not None and tok is not None:
            text_ids = tok(Path(text).read_text(encoding="utf-8"), return_tensors="pt").input_ids[0]
        info = model.config.to_dict().get("sparsify", {}) or {}
        zeros = info.get("sparsity")
        rows = bench_model(model, batches=batches, prompts=prompts, new_tokens=new_tokens, repeats=repeats,
                           regimes=regimes, tokens=text_ids if text is not None else None, budget_s=budget_s,
                           progress=progress)
        layers = [m.auto_decisions() for m in mlp_modules(model) if hasattr(m, "auto_decisions")]
        report["models"][spec.name] = {
            "layers": layers,  # per layer {M bucket: auto's eager / graph decision, density, why}
            "info": f"{type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters"
                    + (f", recorded FFN zeros {zeros:.1%}" if isinstance(zeros, float) else "")
                    + (", synthetic (random weights)" if info.get("synthetic") else ""),
            "rows": rows, "speedups": speedups(rows), **({"packed_layers": packed_layers} if pack else {})}
        del model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    if out is not None:
        with atomic_dir(out, overwrite, "--out", kind="bench") as tmp:
            (tmp / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
            (tmp / "report.md").write_text(markdown(report) + "\n")
            plot(report, tmp / "decode.png")
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "On a CUDA GPU, or with --device cpu on the CPU (eager regime, the CPU's sparse FFN row). End-to-end generation speed: "
        "model.generate() time to first token and decode tokens/s "
        "for batch x prompt-length grids, the sparse FFN against the same weights on dense cuBLAS, in the same "
        "run and cache/graph regime. Works on any sparsify folder, including `sparsify synth` ones.")
    parser.add_argument("models", nargs="+", metavar="[NAME=]MODEL", help="model folders (or Hub ids / .gguf)")
    parser.add_argument("--batch", type=int_list, default=(1, 8, 32), help="batch sizes (default 1,8,32)")
    parser.add_argument("--prompt", type=int_list, default=(128, 512, 2048), help="prompt lengths (default 128,512,2048)")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens generated per call (default 256)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per variant and case (default 5)")
    parser.add_argument("--regimes", default=None,
                        help="comma list of compiled (greedy graph loop with the step through torch.compile: "
                             "what folders do by default; a compile per variant and shape), graphs (the same "
                             "uncompiled), hf-graphs (transformers' loop, forward from a graph), eager "
                             "(dynamic cache). Default: compiled only on CUDA, eager (the only one) on the CPU")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="default bf16")
    parser.add_argument("--text", default=None, help="prompt text file (default: random token ids)")
    parser.add_argument("--budget-s", type=float, default=None, help="skip remaining cases after this many seconds")
    parser.add_argument("-o", "--out", "--output", dest="out", default=None,
                        help="folder for bench.json, report.md, decode.png (default: none, the tables are printed "
                             "only)")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow other folders' own modeling code")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder (only an empty one or an earlier "
                        "bench's)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cuda (default) or cpu: regime eager, the CPU's sparse row against dense, wall clock")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on the CPU (default: torch's own)")
    parser.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                        help="CPU: the layers outside the FFNs (attention, LM head) on weights packed once for oneDNN "
                        "(same bits, faster bf16 decode, one more copy of those weights), dense and sparse alike. "
                        "Default: each model's own (a sparsify folder packs in its first bf16 generate(), a stock "
                        "model does not); --pack: every model; --no-pack: none")
    parser.add_argument("-q", "--quiet", action="store_true", help="no per-case lines")


def main(args: argparse.Namespace) -> int:
    report = bench(args.models, batches=args.batch, prompts=args.prompt, new_tokens=args.new_tokens,
                   repeats=args.repeats, regimes=tuple((args.regimes or ("eager" if args.device == "cpu" else "compiled")).split(",")), dtype=args.dtype, text=args.text,
                   out=args.out, trust_remote_code=args.trust_remote_code, budget_s=args.budget_s,
                   progress=not args.quiet, overwrite=args.overwrite, device=args.device, threads=args.threads,
                   pack=args.pack)
    print(markdown(report) if args.out is None else f"bench: wrote {args.out}/report.md")
    return 0
