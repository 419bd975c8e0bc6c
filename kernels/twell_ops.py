"""Public sparse FFN entry point `twell_ffn`, its torch.library custom op and the "auto" dispatcher.

Legend: M = tokens, d = hidden size, F = intermediate size. Weights in nn.Linear layout.

twell_ffn(x, w_gate, w_up, w_down, *, backend="auto", w_down_t=None) returns
relu(x @ w_gate.T) * (x @ w_up.T) @ w_down.T for x [..., d].

Backends:
- "dense": three cuBLAS GEMMs in the input dtype (also the path whenever gradients are needed).
- "twell": K1 (gate GEMM + ReLU + TwELL pack) then K2 (fused up/down) from twell_triton.py.
- "auto": per layer (state kept on the W_gate tensor) and per power-of-two bucket of M, the first eager
  call measures the density, then times both paths (CUDA events, like an autotuner) and keeps the
  faster one (first checking that twell's output agrees with dense's: a layer whose kernels give a
  wrong result on this GPU stays dense, logged as an error). Both sides are timed through the code that
  then runs: twell_ffn(backend="auto") itself with the layer's decision forced to "dense" (the fast
  path) or "twell" (checks, dispatcher, W_down^T lookup and the periodic refresh included), re-timing
  held off meanwhile; dense and twell alternate in
  rounds (order swapped every round) and twell is chosen only if the median of the per-round ratios
  t_twell / t_dense is below MARGIN (3% faster), so auto is never measurably slower than dense. For
  M <= GRAPH_TIMED_M it also times both paths replayed from CUDA graphs: eager decode is bound by
  Python launch overhead (dense wins), graph replay by GPU time (twell wins), and calls captured into a
  CUDA graph use the graph-timed decision. Where the eager twell time is CPU_BOUND x its graph time
  (launch-bound: host jitter decides), eager twell must also win by more than the spread of its own
  rounds ((max - min) / median). Calibration cost per layer and M bucket: CAL_BUDGET_MS of rounds, again
  for graph replay, at least CAL_ROUNDS[0] rounds; measured on the H200 at 4096x14336: 38-61 ms for
  M = 1-256, 47 ms at M = 4096, 125 ms at M = 16384 (so ~1-2 s per decode bucket for 30 layers, ~4 s at
  M = 16384), plus the one-time Triton compile / K1 autotune of a new shape.
  A density estimate is refreshed every REFRESH calls WITHOUT a host sync (device count -> pinned
  buffer -> read when its event has completed); when it drifts by more than DRIFT, the layer is
  re-timed (at most MAX_RETUNE times). Inside CUDA-graph capture nothing is timed or counted: the last
  decision is used (dense if none). Once a bucket has chosen dense (eager calls; captured calls too
  unless graph timing chose twell), twell_ffn goes straight to the dense torch ops after one attribute
  and dict lookup, and the cached W_down^T copy is freed while every bucket of the layer is dense (it
  is made only when twell is timed or run).
Without CUDA or triton, "auto" and "twell" on CPU tensors run the dense torch path, except that
"twell" on CPU with TRITON_INTERPRET=1 runs the Triton kernels in the interpreter (tests).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass, field

import torch

from .twell_reference import ffn_dense
from .twell_triton import (DECODE_ROUTE_M, DEFAULT_VARIANT, HAS_TRITON, decode_ffn, gate_pack, k2_spills,
                           split_variant, twell_ffn_triton, updown)

log = logging.getLogger("sparsify.kernels")

BACKENDS = ("auto", "twell", "dense")
# Calls between density refreshes (async, no host sync). A refresh costs 3 CUDA calls on the host (count
# kernel, D2H copy to pinned memory, event record; ~10-20 us) plus the dispatcher's slow-path prelude:
# every 16 calls that was ~1% of an eager decode call (~0.1 ms), every 256 calls it is < 0.1%. Density
# drifts with the input distribution, slowly; a re-timing (tens of ms) would not pay off any sooner.
REFRESH = 256
REFRESH_DENSE = 256  # the same for buckets that chose dense (the fast path counts calls against it)
DRIFT = 1.25  # relative density change that triggers a re-timing
MAX_RETUNE = 8  # re-timings per (layer, M bucket)
# auto runs K1 and K2 itself (the refresh counts K1's output), as twell_ffn_triton(variant=DEFAULT_VARIANT)
# ("r5c" / "r6c": K1 of r5 / r6, then K2 on compacted lists)
K1_VARIANT, COMPACT = split_variant(DEFAULT_VARIANT)
MARGIN = 0.97  # twell must be at least 3% faster than dense at calibration (median paired ratio)
AGREE_TOL = 0.25  # before timing, each row of twell's output within this fraction of the row's max |dense| (_fault)
ROW_FLOOR = 0.1  # ... a row's scale floored at this fraction of the whole output's
GRAPH_TIMED_M = 256  # up to this M, also time both paths inside CUDA graphs (decode is CPU-bound eagerly)
# Prefill (M > GRAPH_TIMED_M) runs twell only where the layer's density is at most this (99% zeros): in
# every H200 prefill measurement below it twell lost to cuBLAS (r6c at M = 16384: 0.97x at 99% zeros,
# 1.29-1.33x at 99.5%; eval/results/kernels-h200-r6/), and timing such a bucket costs up to ~125 ms per
# layer while a timing at 95% zeros could still pick twell on noise (read 0.92x of dense in 2 of 48 cases).
PREFILL_MAX_DENSITY = 0.01
GRAPH_CALLS = 5  # calls per captured graph when timing graph replay
CAL_LOOP_MS = 1.0  # one timed loop: back-to-back calls making ~1 ms (at most CAL_MAX_CALLS)
CAL_MAX_CALLS = 64
CAL_ROUNDS = (5, 9)  # min / max rounds (odd: the median is one round's ratio)
CAL_BUDGET_MS = 40.0  # rounds fill this per layer and bucket (eager; the same again for graph replay)
CPU_BOUND = 1.5  # eager twell > 1.5 x its graph-replay time: launch-bound, apply the spread rule

_last_backend: str | None = None
_logged: dict[tuple, str] = {}
_capture_dense = False  # dense_in_capture(): calls captured into CUDA graphs run dense in every layer


@contextlib.contextmanager
def dense_in_capture():
    """Calls captured into CUDA graphs inside this block run dense whatever each layer's graph-replay
    decision says: a model-level check captures a whole decode step both ways and keeps the faster one
    (a layer's decision is timed on the FFN alone, and a step can still come out slower)."""
    global _capture_dense
    old, _capture_dense = _capture_dense, True
    try:
        yield
    finally:
        _capture_dense = old


def dense_capture_active() -> bool:
    """True inside dense_in_capture(). A model's FFN reads it to take its plain torch path there: dynamo
    guards on the value it read, so a compiled step traced with the opaque sparsify::twell_ffn op is traced
    again for its all-dense twin, whose relu x up inductor fuses as in the dense model (measured on the
    H200, SmolLM2-135M shapes at batch 1: the twin through the op's dense branch stepped 1.8% slower
    than the dense model, so a check that kept it still lost 2%)."""
    return _capture_dense


def _bucket(m: int) -> int:
    """The power-of-two M bucket a call of m rows is decided in (inlined in _dense_decided, the hot path)."""
    return 1 << max(0, (m - 1).bit_length())


def twell_in_capture(w_gate: torch.Tensor, m: int) -> bool:
    """Whether a call of m rows on this layer (its W_gate), captured into a graph now, would run twell."""
    held = getattr(w_gate, "_twell_auto", None)
    if held is None or held[0] != w_gate._version:
        return False
    st = held[1].get(_bucket(m))
    return st is not None and st.graph_decision == "twell"


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
    pinned: torch.Tensor | None = None  # made once per layer/bucket (pinned allocation is slow)
    event: object = None  # torch.cuda.Event, made once and re-recorded at each refresh
    retune: bool = False  # density drifted since the last timing
    timing: bool = False  # calibration running: a drift seen meanwhile does not start a re-timing
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
        st.retune = not st.timing and st.retunes < MAX_RETUNE and _drifted(st)


def _count_async(st: _LayerState, nnz: torch.Tensor, elements: int) -> None:
    """Copy a device count to a pinned host buffer; read it once its event completes (no sync). Buffer
    and event are reused: a refresh starts only when the previous one has been read (pending is None)."""
    if st.pinned is None:
        st.pinned = torch.empty((), dtype=torch.int64, pin_memory=True)
        st.event = torch.cuda.Event()
    st.pinned.copy_(nnz, non_blocking=True)
    st.event.record()
    st.pending = (st.pinned, st.event, elements)


def loop_ms(fn, n: int) -> float:
    """CUDA-event ms per call of n back-to-back calls of fn (no warm-up, no sync before)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def _run_twell(st: _LayerState, x2d, w_gate, w_up, w_down, w_down_t, refresh: bool = False) -> torch.Tensor:
    """auto's twell path, the one every twell decision runs (hot path, refreshes, capture, calibration):
    decode_ffn for M <= DECODE_ROUTE_M, else K1, on a refresh an async count of its output, K2
    (= twell_ffn_triton with DEFAULT_VARIANT)."""
    if x2d.shape[0] <= DECODE_ROUTE_M:
        if refresh:  # one extra gate GEMV every REFRESH calls (decode_ffn keeps no count)
            _count_async(st, (torch.nn.functional.linear(x2d, w_gate) > 0).sum(), x2d.shape[0] * w_gate.shape[0])
        return decode_ffn(x2d, w_gate, w_up, _down_t(w_down, w_down_t))
    packed = gate_pack(x2d, w_gate, variant=K1_VARIANT)
    if refresh:
        # int32 sums to int64 in the reduction itself (sum(dtype=int64) launched a cast kernel first)
        _count_async(st, packed.cnt.sum(), x2d.shape[0] * w_gate.shape[0])
    return updown(x2d, packed, w_gate, w_up, _down_t(w_down, w_down_t), compact=COMPACT)


def _paired_rounds(fns: dict, x2d: torch.Tensor, per_call: int = 1) -> dict[str, list[float]]:
    """{name: [ms per call, one per round]} for fns {name: (prepare, fn)}.

    Every round times each fn once as a loop of back-to-back calls (prepare() runs untimed before its
    loop), in an order that flips every round, so slow drifts and the order itself cancel in the
    per-round ratios. Loop lengths come from one warm call each (~CAL_LOOP_MS per loop: the throughput
    a model sees, not one noisy call); rounds fill CAL_BUDGET_MS within CAL_ROUNDS."""
    est = {}
    for name, (prepare, fn) in fns.items():
        prepare()
        fn()  # warm: compiles, autotunes, allocates
        if x2d.is_cuda:
            torch.cuda.synchronize()
        est[name] = max(loop_ms(fn, 1), 1e-3)
    calls = {k: max(1, min(CAL_MAX_CALLS, round(CAL_LOOP_MS / v))) for k, v in est.items()}
    rounds = int(CAL_BUDGET_MS / sum(calls[k] * est[k] for k in fns))
    rounds = max(CAL_ROUNDS[0], min(CAL_ROUNDS[1], rounds)) | 1  # odd: the median is one round's ratio
    names = list(fns)
    out: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names if r % 2 == 0 else names[::-1]:
            prepare, fn = fns[k]
            prepare()
            out[k].append(loop_ms(fn, calls[k]) / per_call)
    return out


def _median(xs: list[float]) -> float:
    """Median (the mean of the middle two for an even count); no `statistics` import: the model-folder
    copy of this file keeps to the project's short list of stdlib modules."""
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _decide(dense: list[float], twell: list[float], graph_twell: list[float] | None = None) -> tuple[str, dict]:
    """twell only if the median of the per-round ratios t_twell / t_dense is below MARGIN. Where eager
    twell is launch-bound (> CPU_BOUND x its graph-replay time), host jitter is of the size of the
    difference, so its win (1 - ratio) must also exceed the relative spread of its own rounds."""
    ratio = _median([t / d for t, d in zip(twell, dense)])
    med_twell = _median(twell)
    spread = (max(twell) - min(twell)) / med_twell
    cpu_bound = graph_twell is not None and med_twell > CPU_BOUND * _median(graph_twell)
    win = ratio < MARGIN and (not cpu_bound or 1.0 - ratio > spread)
    info = {"dense_ms": _median(dense), "twell_ms": med_twell, "ratio": ratio, "spread": spread,
            "cpu_bound": cpu_bound, "rounds": len(dense)}
    return ("twell" if win else "dense"), info


def _capture(fn) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return graph


def _graph_rounds(st: _LayerState, x2d, w_gate, w_up, w_down, w_down_t) -> dict[str, list[float]]:
    """Per-round GPU ms per call of both paths replayed from CUDA graphs: the kernels captured calls run."""
    graphs = {"dense": _capture(lambda: ffn_dense(x2d, w_gate, w_up, w_down)),
              "twell": _capture(lambda: _run_twell(st, x2d, w_gate, w_up, w_down, w_down_t))}
    out = _paired_rounds({k: (lambda: None, g.replay) for k, g in graphs.items()}, x2d, per_call=GRAPH_CALLS)
    del graphs
    return out


def _fault(y_twell: torch.Tensor, y_dense: torch.Tensor) -> str | None:
    """Why twell's output cannot be the dense FFN's up to rounding (a kernel fault on this GPU or Triton
    build), else None. Judged per row (token): rounding differences are a few % of the row's max |y| at most;
    a fault (a lost or garbled row, a wrong weight row, NaN) is of the row's own size, however small the row is
    next to the others. A row's scale is floored at ROW_FLOOR of the whole output's, so near-zero rows (left by
    cancellation) are not judged on their rounding. Nothing is judged when dense is not finite."""
    ref = y_dense.float().reshape(-1, y_dense.shape[-1]) if y_dense.numel() else y_dense.float()
    if not ref.numel():
        return None
    rows = ref.abs().amax(dim=-1)  # [M]
    scale = float(rows.max())
    if not math.isfinite(scale):
        return None
    got = y_twell.float().reshape(ref.shape)
    if not bool(torch.isfinite(got).all()):
        return "non-finite values where dense is finite"
    err = (got - ref).abs().amax(dim=-1)  # [M]
    bad = err > AGREE_TOL * rows.clamp_min(ROW_FLOOR * scale)
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        return (f"row {r}: max |twell - dense| = {float(err[r]):.3g} against that row's max |dense| = "
                f"{float(rows[r]):.3g} ({int(bad.sum())} of {len(rows)} rows off)")
    return None


def _output_fault(st: _LayerState, x2d, w_gate, w_up, w_down, w_down_t) -> str | None:
    """_fault of one call of auto's twell path against the dense FFN on the same input."""
    return _fault(_run_twell(st, x2d, w_gate, w_up, w_down, w_down_t), ffn_dense(x2d, w_gate, w_up, w_down))


def _dense_by_rule(st: _LayerState, rule: str) -> None:
    """Both regimes of this bucket dense, untimed, for the reason `rule` (kept in st.times)."""
    st.decision = st.graph_decision = "dense"
    st.times = {"density": st.density, "rule": rule}
    st.density0 = st.density


def _calibrate(st: _LayerState, x2d, w_gate, w_up, w_down, w_down_t) -> None:
    """Set st.decision (and st.graph_decision for M <= GRAPH_TIMED_M) from paired timings; prefill
    buckets denser than PREFILL_MAX_DENSITY, and buckets whose K2 would spill (k2_spills), go dense
    untimed.

    Both sides run twell_ffn(backend="auto") with this bucket's decision forced, i.e. exactly what a
    later call runs: dense = the fast path, twell = checks + dispatcher + W_down^T lookup + K1/K2 (+ a
    refresh whenever the call count reaches one). st.timing holds off re-timings meanwhile."""
    if x2d.shape[0] > GRAPH_TIMED_M and st.density > PREFILL_MAX_DENSITY:  # measured sparsity decides
        return _dense_by_rule(st, f"prefill density > {PREFILL_MAX_DENSITY}")
    if x2d.shape[0] > DECODE_ROUTE_M and k2_spills(*x2d.shape):  # hundreds of times slower: not worth a timing
        return _dense_by_rule(st, f"K2 spills at M = {x2d.shape[0]}, d = {x2d.shape[1]}")
    fault = _output_fault(st, x2d, w_gate, w_up, w_down, w_down_t)
    if fault is not None:  # never time (or choose) a path whose output is wrong
        _dense_by_rule(st, f"twell output disagrees with dense ({fault})")
        log.error("twell_ffn %s: the TwELL kernels' output disagrees with dense (%s) on %s; this layer keeps the "
                  "dense FFN. Please report it with your GPU, torch and triton versions.",
                  (tuple(w_gate.shape), x2d.dtype, _bucket(x2d.shape[0])), fault, x2d.device)
        return
    call = lambda: twell_ffn(x2d, w_gate, w_up, w_down, backend="auto", w_down_t=w_down_t)  # noqa: E731

    def force(decision: str):  # the graph decision too: a dense fast path then skips its capture query
        def prepare() -> None:
            st.decision = st.graph_decision = decision
        return prepare

    st.timing = True
    try:
        eager = _paired_rounds({"dense": (force("dense"), call), "twell": (force("twell"), call)}, x2d)
        graph = _graph_rounds(st, x2d, w_gate, w_up, w_down, w_down_t) if x2d.shape[0] <= GRAPH_TIMED_M else None
    except BaseException:
        st.decision = st.graph_decision = None  # never keep a forced decision
        raise
    finally:
        st.timing = False
    st.decision, info = _decide(eager["dense"], eager["twell"], graph["twell"] if graph else None)
    st.graph_decision = st.decision
    st.times = {"density": st.density, **info}
    if graph is not None:
        st.graph_decision, ginfo = _decide(graph["dense"], graph["twell"])
        st.times.update({f"graph_{k}": v for k, v in ginfo.items() if k != "cpu_bound"})
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
    bucket = _bucket(m)
    states = _layer_states(w_gate)
    st = states.get(bucket)
    if st is None:
        st = states[bucket] = _LayerState()
    if torch.cuda.is_current_stream_capturing():
        key = (tuple(w_gate.shape), x2d.dtype, bucket)
        backend = "dense" if _capture_dense else (st.graph_decision or "dense")
        _note(key, backend, "graph capture: decision timed in graph replay")
        if backend == "twell":
            return _run_twell(st, x2d, w_gate, w_up, w_down, w_down_t)
        return ffn_dense(x2d, w_gate, w_up, w_down)
    st.calls += 1
    if st.pending is not None:
        _poll(st)
    period = REFRESH_DENSE if st.decision == "dense" else REFRESH  # (the dense fast path counts calls too)
    refresh = st.calls % period == 0 and st.pending is None
    if st.decision is not None and not st.retune and not refresh:  # hot path: ~nothing but the work
        _last_backend = st.decision
        if st.decision == "twell":
            return _run_twell(st, x2d, w_gate, w_up, w_down, w_down_t)
        return ffn_dense(x2d, w_gate, w_up, w_down)
    key = (tuple(w_gate.shape), x2d.dtype, bucket)
    if st.density is None:  # first call of this layer/bucket: one synchronous count
        st.density = float(gate_pack(x2d, w_gate, variant=K1_VARIANT).cnt.sum().item()) / (m * f)
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
        return _run_twell(st, x2d, w_gate, w_up, w_down, w_down_t, refresh=refresh)
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
    if torch.compiler.is_compiling():  # first: dynamo cannot trace w_gate._version (a graph break per FFN)
        return False
    held = getattr(w_gate, "_twell_auto", None)
    if held is None or held[0] != w_gate._version:
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
