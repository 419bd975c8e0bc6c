"""The "auto" FFN dispatcher: per layer and power-of-two bucket of M, dense or TwELL, whichever measured faster.

Legend: M = tokens, d = hidden size, F = intermediate size. Weights in nn.Linear layout.

The dispatcher answers one question and runs nothing: `choose` says which path ("dense" or "twell", a row of
its FFNRuntime's backend table) runs a call of M rows on a layer in the current regime (eager, or captured into
a CUDA graph), for how many of the caller's next calls of M rows that answer holds, and whether this call
refreshes the density. A layer (keyed by its W_gate tensor object, for one in-place version of it) and M bucket
starts with one synchronous density count and a check that TwELL's output is the dense FFN's; then both paths
are timed in paired rounds through `entry` (the runtime's call: what a later call runs), eagerly and, for decode
sizes, replayed from CUDA graphs (captured calls use that decision). TwELL is kept only when the median paired
ratio beats `margin`. The density is refreshed every `refresh` calls without a host sync; a drift re-times the
bucket. Between refreshes a decided bucket's answer holds: the caller runs it without asking and reports the
calls it ran (`used`), so the refresh keeps its period in real calls.

A call may carry a threshold theta [F] (float32: h = g [g > theta] * up): both paths compute that function,
the density is the fraction of g > theta, and a bucket's state belongs to one theta tensor object (a call
with another theta, or none, starts the bucket afresh: its density, hence its decision, differs).

The clock (timing, graph capture), the store (per-layer state, W_down^T copies), the capture query, the
TwELL kernels' facts (the density count, whether K2 spills) and the entry are injected; CudaClock, WeightStore
and TwellProbe are the real ones, an FFNRuntime gives its `run` as the entry.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple

import torch
from torch.utils.weak import WeakIdRef

from .cpu_sparse import active_count, pack, weight_key
from .twell_reference import ffn_dense, transpose_down
from .twell_triton import DEFAULT_VARIANT, gate_pack
from .twell_updown import k2_spills

log = logging.getLogger("sparsify.kernels")


@dataclass(frozen=True)
class Policy:
    """The dispatcher's rules (kernels/NOTES.md, "auto", has the measurements behind each value)."""

    refresh: int = 256  # calls between density refreshes (each costs ~10-20 us of host time)
    refresh_dense: int = 256  # the same for buckets that chose dense (the fast path counts calls against it)
    drift: float = 1.25  # relative density change that triggers a re-timing
    max_retune: int = 8  # re-timings per (layer, M bucket)
    margin: float = 0.97  # twell must be at least 3% faster than dense (median paired ratio)
    host_margin: float = 0.85  # CPU calls (the host clock): 15% faster. Calibration repeats one input (its active rows
    # cached, its pattern learnt): at 576 x 1536, M = 2..8, a 0.97 margin kept the sparse row where inputs that change
    # from call to call ran it at 0.90-0.96x of dense, 0.9 at M = 4 where they ran it at 0.88x (kernels/NOTES.md)
    agree_tol: float = 0.25  # twell's output rows within this fraction of the row's max |dense| (output_fault)
    row_floor: float = 0.1  # ... a row's scale floored at this fraction of the whole output's
    graph_timed_m: int = 256  # up to this M, also time both paths inside CUDA graphs (eager decode is CPU-bound)
    prefill_max_density: float = 0.01  # above M = graph_timed_m, twell is timed only up to this density
    graph_calls: int = 5  # calls per captured graph when timing graph replay
    cal_loop_ms: float = 1.0  # one timed loop: back-to-back calls making ~1 ms (at most cal_max_calls)
    cal_max_calls: int = 64
    cal_rounds: tuple = (5, 9)  # min / max rounds (odd: the median is one round's ratio)
    cal_budget_ms: float = 40.0  # rounds fill this per layer and bucket (eager; the same again for graphs)
    cpu_bound: float = 1.5  # eager twell > 1.5 x its graph-replay time: launch-bound, apply the spread rule


def loop_ms(fn, n: int) -> float:
    """CUDA-event ms per call of n back-to-back calls of fn (no warm-up, no sync before)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


class CudaClock:
    """GPU time: CUDA events around loops of calls, CUDA graphs for the captured regime."""

    ms = staticmethod(loop_ms)
    sync = staticmethod(torch.cuda.synchronize)

    @staticmethod
    def capture(fn, calls: int):
        """A CUDA graph of `calls` calls of fn (after one warm call); replay() runs them."""
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        return graph


def stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False where CUDA was never initialised: a CPU-only
    torch has no capture query to ask)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class HostClock:
    """Wall-clock time of calls on the CPU (the CPU's sparse row, kernels/cpu_sparse.py) and what auto asks it:
    the density count (a torch count of the gate) and K2's spill rule (never: no K2 there). No `capture`: CPU
    calls have no graph regime, so their buckets are timed eagerly only."""

    @staticmethod
    def ms(fn, n: int) -> float:
        """ms per call of n back-to-back calls of fn."""
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) * 1e3 / n

    @staticmethod
    def sync() -> None:
        pass

    count = staticmethod(active_count)

    @staticmethod
    def spills(m: int, d: int) -> bool:
        return False


class WeightStore:
    """Values keyed by a weight tensor object, valid while its weight_key (storage, dtype, device, in-place
    version: a model's `.to()` keeps the Parameter object but not its storage) is unchanged, and dropped with the
    tensor (a data_ptr key alone would go stale when memory is reused)."""

    def __init__(self):
        self._tables: dict[str, dict] = {"states": {}, "down_t": {}, "packed": {}}

    def get(self, table: str, w: torch.Tensor):
        entry = self._tables[table].get(id(w))
        return entry[2] if entry is not None and entry[0]() is w and entry[1] == weight_key(w) else None

    def put(self, table: str, w: torch.Tensor, value) -> None:
        entries, key = self._tables[table], id(w)

        def forget(ref):  # the tensor is gone: free its value (unless the id already holds a newer entry)
            if entries.get(key, (None,))[0] is ref:
                del entries[key]

        entries[key] = (WeakIdRef(w, forget), weight_key(w), value)

    def drop(self, table: str, w: torch.Tensor) -> None:
        self._tables[table].pop(id(w), None)


@dataclass
class LayerState:
    decision: str | None = None  # eager calls (CPU launch overhead included in the timing)
    graph_decision: str | None = None  # calls captured in CUDA graphs (GPU time only)
    density0: float | None = None  # density at the last timing
    density: float | None = None  # latest estimate
    calls: int = 0
    retunes: int = 0
    pending: tuple | None = None  # (count tensor, event, elements) of a refresh in flight
    pinned: torch.Tensor | None = None  # made once per layer/bucket (pinned allocation is slow)
    event: object = None  # torch.cuda.Event, made once and re-recorded at each refresh
    retune: bool = False  # density drifted since the last timing
    timing: bool = False  # calibration running: a drift seen meanwhile does not start a re-timing
    times: dict = field(default_factory=dict)
    theta: torch.Tensor | None = None  # the threshold object this bucket was counted and timed with

    @property
    def all_dense(self) -> bool:
        """Eager and graph decisions are both dense (then no W_down^T copy is needed for this bucket)."""
        return self.decision == "dense" and self.graph_decision == "dense"


class _Ready:
    """The event of a count made on the CPU: readable at once."""

    @staticmethod
    def query() -> bool:
        return True


class TwellProbe:
    """What auto asks the TwELL kernels: the density (K1's count of kept gate values, as the twell path packs
    them) and whether K2 would spill at an M and d."""

    @staticmethod
    def count(x2d: torch.Tensor, w_gate: torch.Tensor, threshold: torch.Tensor | None = None) -> torch.Tensor:
        """Active gate values, g > 0 or g > theta (int64 scalar tensor, on x2d's device)."""
        return gate_pack(x2d, w_gate, variant=DEFAULT_VARIANT, threshold=threshold).cnt.sum()

    spills = staticmethod(k2_spills)


class Answer(NamedTuple):
    """The dispatcher's answer for one call: `path` ("dense" | "twell") runs it; it holds for the caller's next
    `calls` calls of the same M without asking (`in_capture`: calls captured into a CUDA graph too), which the
    caller reports with Dispatcher.used before it asks again; `on_count`: this call refreshes the density, the
    path hands it its count of kept gate values (an int64 scalar tensor)."""

    path: str
    calls: int = 0
    in_capture: bool = False
    on_count: Callable | None = None


def median(xs: list[float]) -> float:
    """Median (the mean of the middle two for an even count)."""
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def decide(dense: list[float], twell: list[float], graph_twell: list[float] | None = None,
           policy: Policy = Policy()) -> tuple[str, dict]:
    """twell only if the median of the per-round ratios t_twell / t_dense is below policy.margin. Where
    eager twell is launch-bound (> cpu_bound x its graph-replay time), host jitter is of the size of the
    difference, so its win (1 - ratio) must also exceed the relative spread of its own rounds."""
    ratio = median([t / d for t, d in zip(twell, dense)])
    med_twell = median(twell)
    spread = (max(twell) - min(twell)) / med_twell
    cpu_bound = graph_twell is not None and med_twell > policy.cpu_bound * median(graph_twell)
    win = ratio < policy.margin and (not cpu_bound or 1.0 - ratio > spread)
    info = {"dense_ms": median(dense), "twell_ms": med_twell, "ratio": ratio, "spread": spread,
            "cpu_bound": cpu_bound, "rounds": len(dense)}
    return ("twell" if win else "dense"), info


def output_fault(y_twell: torch.Tensor, y_dense: torch.Tensor, policy: Policy = Policy()) -> str | None:
    """Why twell's output cannot be the dense FFN's up to rounding (a kernel fault on this GPU or Triton
    build), else None. Judged per row: rounding is a few % of the row's max |y|, a fault (a lost or garbled
    row, NaN) is of the row's own size. A row's scale is floored at row_floor of the whole output's, so
    rows left near zero by cancellation are not judged on their rounding; nothing is judged when dense is
    not finite."""
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
    bad = err > policy.agree_tol * rows.clamp_min(policy.row_floor * scale)
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        return (f"row {r}: max |twell - dense| = {float(err[r]):.3g} against that row's max |dense| = "
                f"{float(rows[r]):.3g} ({int(bad.sum())} of {len(rows)} rows off)")
    return None


def bucket(m: int) -> int:
    """The power-of-two M bucket a call of m rows is decided in."""
    return 1 << max(0, (m - 1).bit_length())



class Dispatcher:
    """backend="auto": `choose` answers which path runs a call (module docstring); nothing here runs the FFN but
    calibration, through `entry`.

    Args:
        clock: `ms(fn, n)` (ms per call of n back-to-back calls), `sync()`, `capture(fn, calls)` (an object
            whose replay() runs fn `calls` times): CudaClock.
        store: per-layer state and W_down^T copies keyed by weight tensor (WeightStore).
        policy: the rules (Policy).
        capturing: whether the current stream is capturing a CUDA graph.
        sparse: the TwELL kernels' facts (TwellProbe: `count` (takes threshold=), `spills`).
        entry: what calibration runs and times, (x2d, w_gate, w_up, w_down, w_down_t, threshold) -> y: a call of
            backend "auto" that asks this dispatcher and runs its answer (FFNRuntime.run; an FFNRuntime made
            with this dispatcher sets it when it is None).
        host: the clock and probe of calls on CPU tensors (HostClock: `ms`, `sync`, `count`, `spills`; with no
            `capture` they have no graph regime); None: CPU calls use `clock` and `sparse` too (tests' fakes).

    One per FFNRuntime (ffn_runtime.py), i.e. per model, plus the process runtime's for bare twell_ffn calls.
    """

    def __init__(self, clock=None, store=None, policy: Policy = Policy(), capturing=None, sparse=None, entry=None,
                 host=None):
        self.clock = clock or CudaClock()
        self.host = host
        self.store = store if store is not None else WeightStore()
        self.policy = policy
        self.capturing = capturing or stream_capturing
        self.sparse = sparse or TwellProbe()
        self.entry = entry
        self.last_backend: str | None = None  # what the most recent call ran
        self.capture_dense = False  # dense_in_capture(): captured calls run dense in every layer
        self._logged: dict[tuple, str] = {}

    def note(self, key: tuple, backend: str, why: str) -> None:
        """Record the backend that ran; log it once per key and backend."""
        self.last_backend = backend
        if self._logged.get(key) != backend:
            self._logged[key] = backend
            log.info("twell_ffn %s -> %s (%s)", key, backend, why)

    @contextlib.contextmanager
    def dense_in_capture(self):
        """Calls captured into CUDA graphs inside this block run dense whatever each layer's graph decision:
        a model-level check captures a decode step both ways and keeps the faster one."""
        old, self.capture_dense = self.capture_dense, True
        try:
            yield
        finally:
            self.capture_dense = old

    def _state(self, w_gate: torch.Tensor, m: int) -> LayerState | None:
        """This layer's state for the M bucket of m rows, if it has one."""
        states = self.store.get("states", w_gate)
        return None if states is None else states.get(bucket(m))

    def twell_in_capture(self, w_gate: torch.Tensor, m: int) -> bool:
        """Whether a call of m rows on this layer (its W_gate), captured into a graph now, would run twell."""
        st = self._state(w_gate, m)
        return st is not None and st.graph_decision == "twell"

    def decisions(self, w_gate: torch.Tensor) -> dict[int, dict]:
        """Per M bucket of this layer (its W_gate): the eager and graph-replay decisions, the density last
        measured, and why (the median paired ratio twell / dense of each timing, or the rule that decided)."""
        states = self.store.get("states", w_gate) or {}
        return {b: {"eager": st.decision, "graph": st.graph_decision, "density": st.density,
                    **{k: st.times[k] for k in ("ratio", "graph_ratio", "rule") if k in st.times}}
                for b, st in sorted(states.items())}

    def down_t(self, w_down: torch.Tensor, w_down_t: torch.Tensor | None = None) -> torch.Tensor:
        """W_down^T [F, d] for K2: the caller's copy, else one cached per W_down version (made on first use)."""
        if w_down_t is not None:
            return w_down_t
        cached = self.store.get("down_t", w_down)
        if cached is None:
            cached = transpose_down(w_down)
            self.store.put("down_t", w_down, cached)
        return cached

    def packed(self, w: torch.Tensor) -> torch.Tensor | None:
        """cpu_sparse.pack(w), made once per weight (as W_down^T is), None where packing does not apply."""
        cached = self.store.get("packed", w)
        if cached is None:
            cached = (pack(w),)  # (a tuple: "does not pack" is kept too)
            self.store.put("packed", w, cached)
        return cached[0]

    def choose(self, x, w_gate, w_up, w_down, w_down_t=None, threshold=None) -> Answer:
        """The answer for a call on x [..., d] (M rows) on this layer (its W_gate, with this threshold object) in
        the current regime: its path, for how many of the caller's next calls of M rows it holds, whether it
        refreshes the density (Answer). A bucket that chose dense answers after one lookup (the hot path of
        every dense call); the first call of a layer and bucket counts the density and calibrates; captured
        calls get the decision timed in graph replay. w_up, w_down and w_down_t are what calibration runs."""
        shape = x.shape
        m = shape[0] if len(shape) == 2 else x.numel() // shape[-1]
        states = self.store.get("states", w_gate)
        st = None if states is None else states.get(1 << max(0, (m - 1).bit_length()))  # bucket(m), inline
        every = self.policy.refresh_dense
        if (st is not None and st.decision == "dense" and st.calls % every != every - 1 and not st.retune
                and st.theta is threshold and (st.graph_decision == "dense" or not self.capturing())):
            st.calls += 1
            self.last_backend = "dense"
            return Answer("dense", every - 1 - st.calls % every, st.graph_decision == "dense")
        return self._slow(x if len(shape) == 2 else x.reshape(-1, shape[-1]), w_gate, w_up, w_down, w_down_t, threshold)

    def _slow(self, x2d, w_gate, w_up, w_down, w_down_t, threshold) -> Answer:
        """choose past the dense hot path on x2d [M, d]: new layers and buckets, graph capture, refreshes,
        re-timings, twell."""
        m, f = x2d.shape[0], w_gate.shape[0]
        if m == 0:  # nothing to count or time
            self.last_backend = "dense"
            return Answer("dense")
        states = self.store.get("states", w_gate)
        if states is None:  # a new layer, or W_gate changed in place (its density may have changed)
            states = {}
            self.store.put("states", w_gate, states)
        st = states.get(bucket(m))
        if st is None or st.theta is not threshold:  # (not setdefault: that would build a LayerState per call)
            st = states[bucket(m)] = LayerState(theta=threshold)  # another theta: another density and decision
        if self.capturing():
            path = "dense" if self.capture_dense else (st.graph_decision or "dense")
            self.note((tuple(w_gate.shape), x2d.dtype, bucket(m)), path, "graph capture: decision timed in graph replay")
            return self._holds(st, path)
        st.calls += 1
        if st.pending is not None:
            self._poll(st)
        period = self.policy.refresh_dense if st.decision == "dense" else self.policy.refresh
        refresh = st.calls % period == 0 and st.pending is None
        if st.decision is not None and not st.retune and not refresh:  # hot path: ~nothing but the work
            self.last_backend = st.decision
            return self._holds(st, st.decision)
        if st.density is None:  # first call of this layer/bucket: one synchronous count
            st.density = float(self._side(x2d)[1].count(x2d, w_gate, threshold).item()) / (m * f)
        if st.decision is None or st.retune:
            st.retunes += st.decision is not None
            st.retune = False
            self._calibrate(st, x2d, w_gate, w_up, w_down, w_down_t)
            self.note((tuple(w_gate.shape), x2d.dtype, bucket(m)), st.decision, f"timed {st.times}")
            if all(s.all_dense for s in states.values()):  # W_down^T / packed W_gate: as large as the weight
                self.store.drop("down_t", w_down)
                self.store.drop("packed", w_gate)
        # no note here: two layers of one shape that decided differently would log at every refresh
        self.last_backend = st.decision
        return self._holds(st, st.decision, (lambda nnz: self._count_async(st, nnz, m * f)) if refresh else None)

    def _side(self, x2d: torch.Tensor) -> tuple:
        """(clock, probe) for a call on x2d: `host` for CPU tensors where there is one, else `clock`, `sparse`."""
        return (self.clock, self.sparse) if x2d.is_cuda or self.host is None else (self.host, self.host)

    def _holds(self, st: LayerState, path: str, on_count=None) -> Answer:
        """`path` for this call, holding for the caller's next calls up to the bucket's next refresh when it is
        the bucket's eager decision and no re-timing is due; for captured calls too only where graph replay
        chose dense as well (a captured twell call asks each time: the step check's all-dense twin may be
        capturing, and decode buckets often run dense eagerly but TwELL in graphs)."""
        if path != st.decision or st.retune:
            return Answer(path, 0, False, on_count)
        every = self.policy.refresh_dense if path == "dense" else self.policy.refresh
        return Answer(path, every - 1 - st.calls % every, path == "dense" and st.graph_decision == "dense", on_count)

    def used(self, w_gate: torch.Tensor, m: int, calls: int) -> None:
        """Count `calls` calls of m rows that ran on an answer that held (an answer left unused costs nothing)."""
        st = self._state(w_gate, m)
        if st is not None:
            st.calls += calls

    def _count_async(self, st: LayerState, nnz: torch.Tensor, elements: int) -> None:
        """Copy a device count to a pinned host buffer, read once its event completes (no sync). Buffer and
        event are reused: a refresh starts only when the previous one has been read (pending is None)."""
        if not nnz.is_cuda:
            st.pending = (nnz.clone(), _Ready, elements)
            return
        if st.pinned is None:
            st.pinned = torch.empty((), dtype=torch.int64, pin_memory=True)
            st.event = torch.cuda.Event()
        st.pinned.copy_(nnz, non_blocking=True)
        st.event.record()
        st.pending = (st.pinned, st.event, elements)

    def _poll(self, st: LayerState) -> None:
        if st.pending[1].query():
            st.density = float(st.pending[0].item()) / st.pending[2]
            st.pending = None
            st.retune = not st.timing and st.retunes < self.policy.max_retune and self._drifted(st)

    def _drifted(self, st: LayerState) -> bool:
        if st.density0 is None:
            return False
        return abs(math.log(max(st.density, 1e-6) / max(st.density0, 1e-6))) > math.log(self.policy.drift)

    def _dense_by_rule(self, st: LayerState, rule: str) -> None:
        """Both regimes of this bucket dense, untimed, for the reason `rule` (kept in st.times)."""
        st.decision = st.graph_decision = "dense"
        st.times = {"density": st.density, "rule": rule}
        st.density0 = st.density

    def _calibrate(self, st: LayerState, x2d, w_gate, w_up, w_down, w_down_t) -> None:
        """Set st.decision (and st.graph_decision up to graph_timed_m) from paired timings of `entry` with
        this bucket's decision forced, i.e. exactly what a later call runs, after a check of twell's output
        against the dense FFN; prefill buckets denser than prefill_max_density, and buckets whose K2 would
        spill, go dense untimed."""
        p, (clock, probe) = self.policy, self._side(x2d)
        if x2d.shape[0] > p.graph_timed_m and st.density > p.prefill_max_density:  # measured sparsity decides
            return self._dense_by_rule(st, f"prefill density > {p.prefill_max_density}")
        if probe.spills(*x2d.shape):  # hundreds of times slower: not worth a timing
            return self._dense_by_rule(st, f"K2 spills at M = {x2d.shape[0]}, d = {x2d.shape[1]}")
        call = lambda: self.entry(x2d, w_gate, w_up, w_down, w_down_t, st.theta)  # noqa: E731

        def force(decision: str):  # the graph decision too: a dense hot path then skips its capture query
            def prepare() -> None:
                st.decision = st.graph_decision = decision
            return prepare

        st.timing = True  # (a drift read meanwhile starts no re-timing)
        try:
            force("twell")()
            fault = output_fault(call(), ffn_dense(x2d, w_gate, w_up, w_down, st.theta), p)
            if fault is not None:  # never time (or choose) a path whose output is wrong
                self._dense_by_rule(st, f"twell output disagrees with dense ({fault})")
                log.error("twell_ffn %s: the TwELL kernels' output disagrees with dense (%s) on %s; this layer keeps "
                          "the dense FFN. Please report it with your GPU, torch and triton versions.",
                          (tuple(w_gate.shape), x2d.dtype, bucket(x2d.shape[0])), fault, x2d.device)
                return
            eager = self._paired_rounds({"dense": (force("dense"), call), "twell": (force("twell"), call)}, x2d)
            graph = (self._graph_rounds(st, x2d, w_gate, w_up, w_down, w_down_t, force)
                     if x2d.shape[0] <= p.graph_timed_m and hasattr(clock, "capture") else None)
        except BaseException:
            st.decision = st.graph_decision = None  # never keep a forced decision
            raise
        finally:
            st.timing = False
        rule = p if clock is self.clock else replace(p, margin=p.host_margin)
        st.decision, info = decide(eager["dense"], eager["twell"], graph["twell"] if graph else None, rule)
        st.graph_decision = st.decision
        st.times = {"density": st.density, **info}
        if graph is not None:
            st.graph_decision, ginfo = decide(graph["dense"], graph["twell"], None, p)
            st.times.update({f"graph_{k}": v for k, v in ginfo.items() if k != "cpu_bound"})
        st.density0 = st.density

    def _paired_rounds(self, fns: dict, x2d: torch.Tensor, per_call: int = 1) -> dict[str, list[float]]:
        """{name: [ms per call, one per round]} for fns {name: (prepare, fn)}: every round times each fn
        once as a loop of back-to-back calls (prepare() untimed before it), in an order that flips every
        round, so drifts and the order cancel in the per-round ratios. Loop lengths come from one warm call
        each (~cal_loop_ms per loop); rounds fill cal_budget_ms within cal_rounds."""
        p, est, clock = self.policy, {}, self._side(x2d)[0]
        for name, (prepare, fn) in fns.items():
            prepare()
            fn()  # warm: compiles, autotunes, allocates
            if x2d.is_cuda:
                clock.sync()
            est[name] = max(clock.ms(fn, 1), 1e-3)
        calls = {k: max(1, min(p.cal_max_calls, round(p.cal_loop_ms / v))) for k, v in est.items()}
        rounds = int(p.cal_budget_ms / sum(calls[k] * est[k] for k in fns))
        rounds = max(p.cal_rounds[0], min(p.cal_rounds[1], rounds)) | 1  # odd: the median is one round's ratio
        names = list(fns)
        out: dict[str, list[float]] = {k: [] for k in names}
        for r in range(rounds):
            for k in names if r % 2 == 0 else names[::-1]:
                prepare, fn = fns[k]
                prepare()
                out[k].append(clock.ms(fn, calls[k]) / per_call)
        return out

    def _graph_rounds(self, st, x2d, w_gate, w_up, w_down, w_down_t, force) -> dict[str, list[float]]:
        """Per-round GPU ms per call of both paths replayed from CUDA graphs: the kernels captured calls run (the
        twell graph captures `entry` with twell forced; each replay is prepared with its decision forced, which
        a real graph ignores and a test's stand-in replay, calling the function again, follows)."""
        n = self.policy.graph_calls
        call = lambda: self.entry(x2d, w_gate, w_up, w_down, w_down_t, st.theta)  # noqa: E731
        graphs = {"dense": self.clock.capture(lambda: ffn_dense(x2d, w_gate, w_up, w_down, st.theta), n)}
        force("twell")()
        graphs["twell"] = self.clock.capture(call, n)
        out = self._paired_rounds({k: (force(k), g.replay) for k, g in graphs.items()}, x2d, per_call=n)
        del graphs
        return out
