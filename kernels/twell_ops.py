"""Public sparse FFN entry point `twell_ffn`, its torch.library custom op and the "auto" dispatcher.

Legend: M = tokens, d = hidden size, F = intermediate size. Weights in nn.Linear layout.

twell_ffn(x, w_gate, w_up, w_down, *, backend="auto", w_down_t=None) returns
relu(x @ w_gate.T) * (x @ w_up.T) @ w_down.T for x [..., d].

Backends:
- "dense": three cuBLAS GEMMs in the input dtype (also the path whenever gradients are needed).
- "twell": K1 (gate GEMM + ReLU + TwELL pack) then K2 (fused up/down) from twell_triton.py.
- "auto": per layer (state kept on the W_gate tensor) and per power-of-two bucket of M, the first eager
  call measures the density, then times both paths once (CUDA events, like an autotuner) and keeps the
  faster one; twell must win by > 3% to be chosen, so auto is never measurably slower than dense. For
  M <= GRAPH_TIMED_M it also times both paths replayed from CUDA graphs: eager decode is bound by
  Python launch overhead (dense wins), graph replay by GPU time (twell wins), and calls captured into a
  CUDA graph use the graph-timed decision. A density estimate is
  refreshed every REFRESH calls WITHOUT a host sync (device count -> pinned buffer -> read when its
  event has completed); when it drifts by more than DRIFT, the layer is re-timed (at most MAX_RETUNE
  times). Inside CUDA-graph capture nothing is timed or counted: the last decision is used (dense if
  none). Once a bucket has chosen dense (eager calls; captured calls too unless graph timing chose
  twell), twell_ffn goes straight to the dense torch ops after one attribute and dict lookup
  (refreshing the density only every REFRESH_DENSE calls), and the cached W_down^T copy is freed while
  every bucket of the layer is dense (it is made only when twell is timed or run).
Without CUDA or triton, "auto" and "twell" on CPU tensors run the dense torch path, except that
"twell" on CPU with TRITON_INTERPRET=1 runs the Triton kernels in the interpreter (tests).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

import torch

from .twell_reference import ffn_dense
from .twell_triton import DEFAULT_VARIANT, HAS_TRITON, gate_pack, twell_ffn_triton, updown

log = logging.getLogger("sparsify.kernels")

BACKENDS = ("auto", "twell", "dense")
REFRESH = 16  # calls between density refreshes (async, no host sync)
REFRESH_DENSE = 256  # the same when every path of the bucket is dense (keeps that path a plain dense FFN)
DRIFT = 1.25  # relative density change that triggers a re-timing
MAX_RETUNE = 8  # re-timings per (layer, M bucket)
COMPACT = DEFAULT_VARIANT == "r5c"  # the refresh path splits K1/K2 (to count K1's output): same K2 as the rest
MARGIN = 0.97  # twell must be at least 3% faster than dense at calibration
GRAPH_TIMED_M = 256  # up to this M, also time both paths inside CUDA graphs (decode is CPU-bound eagerly)

_last_backend: str | None = None
_logged: dict[tuple, str] = {}


def last_backend() -> str | None:
    """The backend the most recent twell_ffn call ran: "twell", "dense" or None before any call."""
    return _last_backend


def _note(key: tuple, backend: str, why: str) -> None:
    global _last_backend
    _last_backend = backend
    if _logged.get(key) != backend:
        _logged[key] = backend
        log.info("twell_ffn %s -> %s (%s)", key, backend, why)


def transpose_down(w_down: torch.Tensor) -> torch.Tensor:
    """W_down [d, F] -> contiguous [F, d] rows for K2. Cache it per layer (twell_ffn's w_down_t)."""
    return w_down.t().contiguous()


def _cached_down_t(w_down: torch.Tensor) -> torch.Tensor:
    """Transposed copy stored ON the weight tensor (a data_ptr key goes stale when memory is reused)."""
    hit = getattr(w_down, "_twell_down_t", None)
    if hit is not None and hit[0] == w_down._version:
        return hit[1]
    wdt = transpose_down(w_down)
    try:
        w_down._twell_down_t = (w_down._version, wdt)
    except (AttributeError, RuntimeError):  # some tensor subclasses refuse attributes
        pass
    return wdt


def _triton_ok(x: torch.Tensor) -> bool:
    if not HAS_TRITON:
        return False
    if x.is_cuda:
        return True
    return x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class _LayerState:
    decision: str | None = None  # eager calls (CPU launch overhead included in the timing)
    graph_decision: str | None = None  # calls captured in CUDA graphs (GPU time only)
    density0: float | None = None  # density at the last timing
    density: float | None = None  # latest estimate
    calls: int = 0
    retunes: int = 0
    pending: tuple | None = None  # (pinned count, event, elements)
    pinned: torch.Tensor | None = None
    retune: bool = False  # density drifted since the last timing
    times: dict = field(default_factory=dict)

    @property
    def all_dense(self) -> bool:
        """Eager and graph decisions are both dense (then no W_down^T copy is needed for this bucket)."""
        return self.decision == "dense" and self.graph_decision == "dense"


_state: dict[tuple, _LayerState] = {}


def _poll(st: _LayerState) -> None:
    if st.pending is not None and st.pending[1].query():
        st.density = float(st.pending[0].item()) / st.pending[2]
        st.pending = None
        st.retune = st.retunes < MAX_RETUNE and _drifted(st)


def _count_async(st: _LayerState, nnz: torch.Tensor, elements: int) -> None:
    """Copy a device count to a pinned host buffer; read it once its event completes (no sync)."""
    if st.pinned is None:  # one pinned scalar per layer/bucket: pinned allocation is slow
        st.pinned = torch.empty((), dtype=torch.int64, pin_memory=True)
    st.pinned.copy_(nnz, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    st.pending = (st.pinned, ev, elements)


def loop_ms(fn, n: int) -> float:
    """CUDA-event ms per call of n back-to-back calls of fn (no warm-up, no sync before)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def _time(fn, reps: int = 5) -> float:
    """Median ms per call over `reps` measurements of n back-to-back calls (n makes ~0.5 ms), so that
    launch-bound sizes are timed as the throughput a model sees, not one noisy call."""
    fn()
    torch.cuda.synchronize()
    n = 1
    ts = []
    for _ in range(reps + 1):
        ts.append(loop_ms(fn, n))
        n = max(n, min(50, int(0.5 / max(ts[0], 1e-3))))  # the first measurement sizes the others
    ts = ts[1:]
    return sorted(ts)[len(ts) // 2]


def _graph_time(fn, calls: int = 5) -> float:
    """GPU time of fn per call, replayed from a CUDA graph (no Python launch overhead)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    t = _time(graph.replay) / calls
    del graph
    return t


def _calibrate(st: _LayerState, x2d, w_gate, w_up, w_down, w_down_t) -> None:
    w_down_t = _down_t(w_down, w_down_t)
    dense = lambda: ffn_dense(x2d, w_gate, w_up, w_down)  # noqa: E731
    twell = lambda: twell_ffn_triton(x2d, w_gate, w_up, w_down_t)  # noqa: E731
    # eager: each path with the Python it really costs per call (dense: the fast path is ~ffn_dense;
    # twell: the checks and the dispatcher's hot path, about what backend="twell" pays)
    twell_eager = lambda: twell_ffn(x2d, w_gate, w_up, w_down, backend="twell", w_down_t=w_down_t)  # noqa: E731
    t_dense, t_twell = _time(dense), _time(twell_eager)
    st.decision = "twell" if t_twell < MARGIN * t_dense else "dense"
    st.graph_decision = st.decision
    st.times = {"dense_ms": t_dense, "twell_ms": t_twell, "density": st.density}
    if x2d.shape[0] <= GRAPH_TIMED_M:  # launch-bound sizes: eager and graph replay rank differently
        g_dense, g_twell = _graph_time(dense), _graph_time(twell)
        st.graph_decision = "twell" if g_twell < MARGIN * g_dense else "dense"
        st.times.update(graph_dense_ms=g_dense, graph_twell_ms=g_twell)
    st.density0 = st.density


def _layer_states(w_gate: torch.Tensor) -> dict:
    """Per-layer dispatcher state, stored on W_gate itself (data_ptr keys go stale on reuse) and
    dropped when W_gate is modified in place (its density may have changed)."""
    held = getattr(w_gate, "_twell_auto", None)
    if held is not None and held[0] == w_gate._version:
        return held[1]
    states: dict = {}
    try:
        w_gate._twell_auto = (w_gate._version, states)
    except (AttributeError, RuntimeError):
        states = _state.setdefault((w_gate.data_ptr(), tuple(w_gate.shape), w_gate._version), states)
    return states


def _down_t(w_down: torch.Tensor, w_down_t: torch.Tensor | None) -> torch.Tensor:
    """W_down^T for K2: the caller's copy, else one cached on w_down (created only when twell runs)."""
    return w_down_t if w_down_t is not None else _cached_down_t(w_down)


def _drop_down_t_if_unused(states: dict, w_down: torch.Tensor) -> None:
    """Free the cached W_down^T ([F, d], as large as W_down) while every M bucket of the layer is dense."""
    if all(st.all_dense for st in states.values()) and getattr(w_down, "_twell_down_t", None) is not None:
        w_down._twell_down_t = None


def _auto(x2d, w_gate, w_up, w_down, w_down_t) -> torch.Tensor:
    """The dispatcher's slow path (first calls, refreshes, re-timings, graph capture, twell layers).
    w_down_t may be None: the transposed copy is then made (and cached) only if twell is timed or run."""
    global _last_backend
    m, f = x2d.shape[0], w_gate.shape[0]
    bucket = 1 << max(0, (m - 1).bit_length())
    states = _layer_states(w_gate)
    st = states.get(bucket)
    if st is None:
        st = states[bucket] = _LayerState()
    if torch.cuda.is_current_stream_capturing():
        key = (tuple(w_gate.shape), x2d.dtype, bucket)
        backend = st.graph_decision or "dense"
        _note(key, backend, "graph capture: decision timed in graph replay")
        if backend == "twell":
            return twell_ffn_triton(x2d, w_gate, w_up, _down_t(w_down, w_down_t))
        return ffn_dense(x2d, w_gate, w_up, w_down)
    st.calls += 1
    if st.pending is not None:
        _poll(st)
    refresh = st.calls % REFRESH == 0 and st.pending is None
    if st.decision is not None and not st.retune and not refresh:  # hot path: ~nothing but the work
        _last_backend = st.decision
        if st.decision == "twell":
            return twell_ffn_triton(x2d, w_gate, w_up, _down_t(w_down, w_down_t))
        return ffn_dense(x2d, w_gate, w_up, w_down)
    key = (tuple(w_gate.shape), x2d.dtype, bucket)
    if st.density is None:  # first call of this layer/bucket: one synchronous count
        st.density = float(gate_pack(x2d, w_gate).cnt.sum().item()) / (m * f)
    if st.decision is None or st.retune:
        st.retunes += st.decision is not None
        st.retune = False
        _calibrate(st, x2d, w_gate, w_up, w_down, w_down_t)
        _note(key, st.decision, f"timed {st.times}")
        _drop_down_t_if_unused(states, w_down)
    # no _note here: _logged is keyed by (shape, dtype, bucket), so two layers of one shape that decided
    # differently would flip it and log a line at every refresh of either (the decision is logged above)
    _last_backend = st.decision
    if st.decision == "twell":
        packed = gate_pack(x2d, w_gate)
        if refresh:
            _count_async(st, packed.cnt.sum(dtype=torch.int64), m * f)
        return updown(x2d, packed, w_gate, w_up, _down_t(w_down, w_down_t), compact=COMPACT)
    g = torch.nn.functional.linear(x2d, w_gate)  # [M, F]
    if refresh:
        _count_async(st, (g > 0).sum(), m * f)
    return torch.nn.functional.linear(torch.relu(g) * torch.nn.functional.linear(x2d, w_up), w_down)


def _drifted(st: _LayerState) -> bool:
    if st.density0 is None:
        return False
    return abs(math.log(max(st.density, 1e-6) / max(st.density0, 1e-6))) > math.log(DRIFT)


def _impl(x2d, w_gate, w_up, w_down, w_down_t, backend: str) -> torch.Tensor:
    if backend == "dense" or not _triton_ok(x2d) or x2d.shape[0] == 0:
        _note(("dense", backend), "dense", "requested" if backend == "dense" else "no triton/CUDA for this tensor")
        return ffn_dense(x2d, w_gate, w_up, w_down)
    if backend == "auto" and x2d.is_cuda:
        return _auto(x2d, w_gate, w_up, w_down, w_down_t)
    if backend == "auto":  # CPU interpreter: correct but slow, never chosen automatically
        _note(("cpu", "auto"), "dense", "auto on CPU")
        return ffn_dense(x2d, w_gate, w_up, w_down)
    _note(("twell", "requested"), "twell", "requested")
    return twell_ffn_triton(x2d, w_gate, w_up, _down_t(w_down, w_down_t))


def _dense_decided(x: torch.Tensor, w_gate: torch.Tensor) -> bool:
    """Fast path of "auto": this layer's M bucket chose dense (for graph capture too, or this call is not
    being captured), and no refresh is due. A plain dense FFN then pays only this lookup (no checks of
    its own: F.linear validates the shapes, and a layer only gets state after a fully checked call). Every REFRESH_DENSE-th call goes
    through the dispatcher to refresh the density estimate (no host sync)."""
    held = getattr(w_gate, "_twell_auto", None)
    if held is None or held[0] != w_gate._version or torch.compiler.is_compiling():
        return False
    shape = x.shape
    m = shape[0] if len(shape) == 2 else x.numel() // max(shape[-1], 1)
    st = held[1].get(1 << max(0, (m - 1).bit_length()))
    if st is None or st.decision != "dense" or st.calls % REFRESH_DENSE == REFRESH_DENSE - 1 or st.retune:
        return False
    if st.graph_decision != "dense" and torch.cuda.is_current_stream_capturing():
        return False  # graph replay chose twell for this bucket: the dispatcher runs it
    st.calls += 1  # (with gradients needed the checked path would run the same dense ops)
    return True


def _define_op():
    """Register sparsify::twell_ffn once, even when several copies of this file are imported."""
    if hasattr(torch.ops, "sparsify") and hasattr(torch.ops.sparsify, "twell_ffn"):
        return torch.ops.sparsify.twell_ffn
    try:
        @torch.library.custom_op("sparsify::twell_ffn", mutates_args=())
        def op(
            x2d: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
            w_down_t: torch.Tensor | None, backend: str,
        ) -> torch.Tensor:
            return _impl(x2d, w_gate, w_up, w_down, w_down_t, backend)

        @op.register_fake
        def _(x2d, w_gate, w_up, w_down, w_down_t, backend):
            return x2d.new_empty(x2d.shape[0], w_down.shape[0])
    except RuntimeError:  # registered meanwhile by another copy of this module
        return torch.ops.sparsify.twell_ffn
    return op


_op = _define_op()


def _check(x, w_gate, w_up, w_down, backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}; use 'auto' unless debugging.")
    d = x.shape[-1]
    f = w_gate.shape[0]
    want = {"w_gate": (f, d), "w_up": (f, d), "w_down": (d, f)}
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if tuple(w.shape) != want[name]:
            raise ValueError(
                f"{name} has shape {tuple(w.shape)}, expected {want[name]} for x[..., {d}] and F={f} "
                "(weights in nn.Linear layout: w_gate/w_up [F, d], w_down [d, F])."
            )
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"{name} is {w.dtype} on {w.device} but x is {x.dtype} on {x.device}; cast one.")


def twell_ffn(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    backend: str = "auto",
    w_down_t: torch.Tensor | None = None,
) -> torch.Tensor:
    """relu(x @ w_gate.T) * (x @ w_up.T) @ w_down.T with TwELL kernels when they are faster.

    Args:
        x: [..., d] activations (bf16/fp16/fp32).
        w_gate, w_up: [F, d]; w_down: [d, F] (nn.Linear weights), same dtype and device as x.
        backend: "auto" (fastest measured path), "twell" (force the sparse kernels) or "dense".
        w_down_t: optional cached `transpose_down(w_down)` ([F, d] contiguous); computed and cached
            per weight version when omitted.

    Returns:
        [..., d] in x's dtype. When autograd needs gradients, the dense torch path runs (inference-only
        kernels); `last_backend()` tells which path ran.
    """
    global _last_backend
    if backend == "auto" and _dense_decided(x, w_gate):  # the same torch ops as the dense backend
        _last_backend = "dense"
        return ffn_dense(x, w_gate, w_up, w_down)
    d = x.shape[-1]
    if (backend not in BACKENDS or w_gate.shape[-1] != d or w_up.shape != w_gate.shape
            or w_down.shape[0] != d or w_down.shape[-1] != w_gate.shape[0]
            or w_gate.dtype != x.dtype or w_up.dtype != x.dtype or w_down.dtype != x.dtype):
        _check(x, w_gate, w_up, w_down, backend)  # builds the full message
    if torch.is_grad_enabled() and (x.requires_grad or w_gate.requires_grad or w_up.requires_grad
                                    or w_down.requires_grad):
        _note(("grad",), "dense", "gradients needed")
        return ffn_dense(x, w_gate, w_up, w_down)
    x2d = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, d).contiguous()
    if torch.compiler.is_compiling():  # opaque op for dynamo / inductor
        out = _op(x2d, w_gate.contiguous(), w_up.contiguous(), w_down, w_down_t, backend)
    else:  # eager (and CUDA-graph capture): skip the custom-op dispatch, ~20 us a call
        out = _impl(x2d, w_gate.contiguous(), w_up.contiguous(), w_down, w_down_t, backend)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], w_down.shape[0])
