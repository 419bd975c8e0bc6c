"""Capturing one decode step into a CUDA graph, and the step check that keeps the faster of two captures.

Used by fast_decode.py. `cpu_emulation` (tests) runs the same flow on CPU tensors: an _EagerReplay stands in
for a graph, its replay() calling the captured function again on the captured input buffers.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from .ffn_runtime import runtime_of

logger = logging.getLogger("sparsify")
# The FFN dispatcher decides per layer on the FFN timed alone, so a whole step with TwELL layers can still
# lose to the same step all dense (kernels/NOTES.md, "step check"): both are captured, the dense one is
# kept unless TwELL's is at least 1% faster.
STEP_CHECK_ROUNDS = 5  # timed batches per graph (median)
STEP_CHECK_REPLAYS = 4  # replays per batch: they write the captured step's position and the next 3
STEP_CHECK_MARGIN = 0.99


def static_layers_only(cache) -> bool:
    """A cache whose every layer is a plain StaticLayer: fixed tensors and no rolling window, so a replayed
    step writes where the eager step would."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and getattr(cache, "is_compileable", False) and all(
        type(layer).__name__ == "StaticLayer" for layer in layers)


def signature(value):
    """Hashable description of one forward argument: tensors by shape/dtype/device, plain values as they
    are, dicts item by item. Raises TypeError for anything a graph cannot take as a replaceable input."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if isinstance(value, dict):
        return ("dict", tuple((k, signature(v)) for k, v in sorted(value.items())))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(type(value).__name__)


def clone_inputs(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: clone_inputs(v) for k, v in value.items()}
    return value


def copy_inputs(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, dict):
        for k, v in dst.items():
            copy_inputs(v, src[k])


def cache_counters(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, saved copy) of each cache layer's small bookkeeping tensors (e.g. cumulative_length), so
    the warm-up run before a capture can be undone: it must not count as a step."""
    saved = []
    for layer in cache.layers:
        for name, t in vars(layer).items():
            if isinstance(t, torch.Tensor) and name not in ("keys", "values"):
                saved.append((t, t.clone()))
    return saved


def restore(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each (tensor, saved copy) pair back: undoes a warm-up or timed run (cache counters, loop buffers)."""
    for t, copy in saved:
        t.copy_(copy)


def ffn_state(model) -> tuple:
    """What a captured graph baked in besides its inputs: the model's FFN backend, as its FFNRuntime holds it
    (a graph captured on one backend must not be replayed after a switch to another); () for other models."""
    runtime = runtime_of(model)
    return () if runtime is None else (runtime.backend,)


def twell_in_step(model, batch: int) -> bool:
    """Whether some sparse FFN on "auto" runs TwELL when a step of `batch` tokens is captured now."""
    runtime = runtime_of(model)
    return runtime is not None and runtime.twell_in_step(batch)


class EagerReplay:
    """cpu_emulation's stand-in for a CUDA graph: replay() calls the captured function again."""

    def __init__(self, fn):
        self.fn, self.output = fn, None

    def replay(self) -> None:
        self.output = self.fn()


def capture_call(fn, undo, cuda: bool):
    """(graph, output) of fn() captured into a CUDA graph, after one run on a side stream (cuBLAS workspaces)
    that undo() undoes; with cpu_emulation (cuda False) an EagerReplay of fn stands in for both."""
    if not cuda:
        replay = EagerReplay(fn)
        return replay, replay
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    undo()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # its own memory pool: graphs of dropped caches free theirs
        output = fn()
    return graph, output


def time_graphs(graphs: list, undo) -> list[float]:
    """Median ms per replay of each graph: one untimed replay each, then STEP_CHECK_ROUNDS batches of
    STEP_CHECK_REPLAYS replays, graphs alternating in an order that flips every round; undo() undoes
    each batch's writes (cache counters, loop buffers)."""
    for g in graphs:
        g.replay()
        undo()
    times: list[list[float]] = [[] for _ in graphs]
    for r in range(STEP_CHECK_ROUNDS):
        for i in (range(len(graphs)) if r % 2 == 0 else reversed(range(len(graphs)))):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(STEP_CHECK_REPLAYS):
                graphs[i].replay()
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end) / STEP_CHECK_REPLAYS)
            undo()
    return [sorted(t)[len(t) // 2] for t in times]


def free_positions(cache) -> int:
    """Cache positions past the one the next decode step writes (0 when the cache does not say): the step
    check's timed replays write that many positions ahead, which must stay inside the cache."""
    layer = cache.layers[0]
    length, written = getattr(layer, "max_cache_len", None), getattr(layer, "cumulative_length", None)
    if length is None or written is None:
        return 0
    return int(length) - int(written) - 1


def step_check(fast, capture, undo, batch: int, cache, first: tuple, loop: str) -> tuple:
    """The (graph, output) to replay for a decode step: `first` = capture(), or, when that step runs TwELL
    in some layer and the cache has room for the timed replays, the faster of it and capture() again with
    every layer dense (the dense one unless TwELL's is >= 1% faster). undo() undoes a replay's writes.
    `fast` (a FastDecode) supplies check_step, twell_in_step, step_timer and collects step_checks."""
    if not fast.check_step or not fast.twell_in_step(batch) or free_positions(cache) <= STEP_CHECK_REPLAYS:
        return first
    runtime = runtime_of(fast.model)
    with runtime.dense_in_capture() if runtime is not None else contextlib.nullcontext():
        dense = capture()
    twell_ms, dense_ms = fast.step_timer([first[0], dense[0]], undo)
    kept = "twell" if twell_ms <= STEP_CHECK_MARGIN * dense_ms else "dense"
    fast.step_checks.append({"loop": loop, "batch": batch, "twell_ms": twell_ms, "dense_ms": dense_ms, "kept": kept})
    logger.info("sparsify: decode step at batch %d (%s loop): TwELL layers %.3f ms, all dense %.3f ms: kept %s",
                batch, loop, twell_ms, dense_ms, kept)
    return first if kept == "twell" else dense
