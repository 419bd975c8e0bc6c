"""Kernel speed for `sparsify eval --speed` (CUDA only): prefill and decode tokens/s of the same weights
under each FFN backend (dense torch, forced TwELL kernels, and the `auto` dispatcher users get), back to
back in one run, with the dense run repeated to show the run's noise.
"""

from __future__ import annotations

import argparse
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparsify.errors import SparsifyError
from sparsify.evaluation.loading import ffn_backend
from sparsify.families import mlp_modules


# `eval --speed` off CUDA: refused before any model loads, as `sparsify bench` refuses (was: exit 0 with a note)
GPU_ONLY = ("--speed needs a CUDA GPU, and this run is on {device}: CPU timings say nothing about the TwELL kernels "
            "(`sparsify bench` refuses likewise). Drop --speed here (accuracy, perplexity and the sparsity profile "
            "run on CPU) and run `sparsify eval --speed` on a machine with an NVIDIA GPU; the two reports merge with "
            "`python -m sparsify.evaluation.report CPU_REPORT/ GPU_REPORT/ --out DIR`.")


@dataclass
class SpeedGrid:
    """Shapes timed by --speed (CUDA only)."""

    batches: tuple[int, ...] = (1, 8, 32)
    seqs: tuple[int, ...] = (512, 2048)
    decode_batches: tuple[int, ...] = (1, 16)
    decode_prompt: int = 128
    decode_tokens: int = 64
    repeats: int = 5


def int_list(text: str) -> tuple[int, ...]:
    """argparse type for the grid options of `eval --speed` and `bench`: comma-separated positive integers."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers like 1,8,32") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers like 1,8,32")
    return values


def speed_section(model: Any, tokens: Any, grid: SpeedGrid) -> dict:
    """Prefill and decode tokens/s, TwELL vs dense on the same weights in this run; CUDA only.

    Inputs are real text tokens (random ids would give unrealistic sparsity), tiled to fill each shape.
    """
    import torch

    if model.device.type != "cuda":
        return {"available": False, "reason": "speed needs a CUDA GPU: CPU timings say nothing about the "
                "TwELL kernels. Run `sparsify eval --speed` on a machine with an NVIDIA GPU."}
    # dense: torch FFN; twell: the sparse kernels forced; auto: the dispatcher's choice (what users get)
    with ffn_backend(model, "auto") as switchable:  # an error (or Ctrl-C) mid-run must not leave a forced backend
        backends = ["dense", "twell", "auto"] if switchable else ["stock"]
        seqs = sorted({min(s, int(getattr(model.config, "max_position_embeddings", 0) or s)) for s in grid.seqs})
        prefill, decode, share = _speed_rows(model, tokens, grid, backends, seqs)
    return {"available": True, "backends": backends, "device": torch.cuda.get_device_name(model.device),
            "dtype": str(model.dtype).removeprefix("torch."), "prefill": prefill, "decode": decode,
            "ffn_share": share, "speedup": speedups(prefill, decode)}


def _speed_rows(model: Any, tokens: Any, grid: SpeedGrid, backends: list[str],
                seqs: list[int]) -> tuple[list[dict], list[dict], dict]:
    """Prefill rows, decode rows and FFN time share, each shape under every backend."""
    dev = model.device
    prefill, decode = [], []
    for b in grid.batches:
        for s in seqs:
            prefill += [{"batch": b, "seq": s, **r} for r in
                        _each_backend(model, backends, _prefill_row, text_batch(tokens, b, s, dev), grid.repeats)]
    for b in grid.decode_batches:
        prompt = text_batch(tokens, b, grid.decode_prompt, dev)
        decode += [{"batch": b, "prompt": grid.decode_prompt, "new_tokens": grid.decode_tokens, **r}
                   for r in _each_backend(model, backends, _decode_row, prompt, grid)]
    mid = text_batch(tokens, grid.batches[len(grid.batches) // 2], seqs[-1], dev)
    share = {r.pop("backend"): r for r in _each_backend(model, backends, _ffn_share, mid) if not r.get("repeat")}
    return prefill, decode, share


def _each_backend(model: Any, backends: list[str], fn, *args) -> list[dict]:
    """One shape under every backend back to back (same clocks, same cache state), then dense once more:
    the two dense numbers' spread is the run's noise, reported next to the ratios."""
    order = backends + (["dense"] if "dense" in backends else [])
    rows = []
    for i, backend in enumerate(order):
        if backend != "stock":
            model.set_ffn_backend(backend)
        rows.append({"backend": backend, **({"repeat": True} if i == len(backends) else {}),
                     **_guard_oom(fn, model, *args)})
    return rows


def text_batch(tokens: Any, batch: int, seq: int, device: Any = "cpu") -> Any:
    """[B, S] consecutive text tokens (the text repeated when too short): each row a different passage."""
    import torch

    need = batch * seq
    reps = -(-need // tokens.numel())
    return torch.cat([tokens] * reps)[:need].view(batch, seq).to(device)  # [B, S]


def _guard_oom(fn, *args) -> dict:
    """Run one measurement; out-of-memory or a kernel refusing a shape becomes a row note, not a crash."""
    import torch

    try:
        return {**fn(*args), "path": _ran_path(args[0])}
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"error": "out of memory"}
    except (RuntimeError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def _ran_path(model: Any) -> str | None:
    """Which FFN path the last forward took, from SparseMLP.last_path ("twell_ffn:twell", "twell_ffn:dense"
    as the kernels' dispatcher ran it, or "torch"); None for stock models."""
    paths = sorted({m.last_path for m in model.modules() if getattr(m, "last_path", "")})
    return ",".join(paths) or None


def _forward(model: Any, ids: Any, **kw) -> Any:
    try:  # logits for the last position only, as a real prefill would (the lm_head over all is not FFN work)
        return model(ids, logits_to_keep=1, **kw)
    except TypeError:
        return model(ids, **kw)


def _cuda_ms(fn, repeats: int) -> float:
    """Median milliseconds of fn() over `repeats` timed calls after two warm-ups (autotune, allocator)."""
    import torch

    fn(), fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _prefill_row(model: Any, ids: Any, repeats: int) -> dict:
    import torch

    def run():
        with torch.inference_mode():
            _forward(model, ids, use_cache=False)

    ms = _cuda_ms(run, repeats)
    torch.cuda.reset_peak_memory_stats(model.device)
    run()
    peak = torch.cuda.max_memory_allocated(model.device)
    return {"ms": ms, "tokens_per_s": ids.numel() / ms * 1e3, "peak_mem_gb": peak / 2**30}


def _decode_row(model: Any, prompt: Any, grid: SpeedGrid) -> dict:
    """Greedy decode of grid.decode_tokens tokens after a prefilled prompt; only the decode steps timed."""
    import torch

    # transformers >= 5.2x names the KV cache `cache` (`past_key_values` is deprecated); 5.17 only knows the latter
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def run() -> float:
        with torch.inference_mode():
            out = _forward(model, prompt, use_cache=True)
            past, nxt = getattr(out, name), out.logits[:, -1:].argmax(-1)  # [B, 1]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(grid.decode_tokens):
                out = model(nxt, use_cache=True, **{name: past})
                past, nxt = getattr(out, name), out.logits[:, -1:].argmax(-1)
            end.record()
            end.synchronize()
        return start.elapsed_time(end)

    run()  # warm-up
    torch.cuda.reset_peak_memory_stats(model.device)
    times = sorted(run() for _ in range(max(grid.repeats // 2, 1)))
    ms = times[len(times) // 2]
    return {"ms": ms, "tokens_per_s": prompt.shape[0] * grid.decode_tokens / ms * 1e3,
            "peak_mem_gb": torch.cuda.max_memory_allocated(model.device) / 2**30}


def _ffn_share(model: Any, ids: Any) -> dict:
    """Fraction of one prefill's GPU time spent inside the MLP modules (CUDA events around each call)."""
    import torch

    events: list[tuple[Any, Any]] = []

    def pre(module, inputs):
        events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        events[-1][0].record()

    def post(module, inputs, output):
        events[-1][1].record()

    handles = [h for m in mlp_modules(model) for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        with torch.inference_mode():
            _forward(model, ids, use_cache=False)  # warm-up
            events.clear()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _forward(model, ids, use_cache=False)
            end.record()
            end.synchronize()
    finally:
        for h in handles:
            h.remove()
    total, ffn = start.elapsed_time(end), sum(a.elapsed_time(b) for a, b in events)
    return {"batch": ids.shape[0], "seq": ids.shape[1], "total_ms": total, "ffn_ms": ffn, "ffn_share": ffn / total}


def speedups(prefill: list[dict], decode: list[dict]) -> dict:
    """twell and auto tokens/s over dense tokens/s for each shape measured with all (same run, same weights)."""
    def ratios(rows: list[dict], key: tuple[str, ...]) -> list[dict]:
        by = {(r["backend"], bool(r.get("repeat")), *(r[k] for k in key)): r.get("tokens_per_s") for r in rows}
        out = []
        for r in rows:
            if r["backend"] != "dense" or r.get("repeat") or not r.get("tokens_per_s"):
                continue
            shape = tuple(r[k] for k in key)
            twell, auto, again = (by.get((b, rep, *shape)) for b, rep in (("twell", False), ("auto", False), ("dense", True)))
            if twell or auto:
                dense = r["tokens_per_s"]
                out.append({**dict(zip(key, shape)), "twell_over_dense": twell / dense if twell else None,
                            "auto_over_dense": auto / dense if auto else None,
                            "dense_noise": abs(again / dense - 1) if again else None})
        return out

    return {"prefill": ratios(prefill, ("batch", "seq")), "decode": ratios(decode, ("batch",))}


def speed_tokens(tok: Any, text: Path) -> Any:
    """Real text for speed runs (sparsity depends on it): the token ids of `text`'s first 400k characters."""
    import torch

    if not text.is_file():
        raise SparsifyError(f"--speed needs real text (sparsity depends on it) and {text} is missing: pass "
                            "--text FILE.")
    return torch.tensor(tok(text.read_text(encoding="utf-8", errors="replace")[:400_000],
                            add_special_tokens=False)["input_ids"])  # [N]
