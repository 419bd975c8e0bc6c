"""One owner for a model's FFN backend: FFNRuntime, its backend table, and the op compiled calls go through.

Legend: M = tokens, d = hidden size, F = intermediate size. Weights in nn.Linear layout.

An FFNRuntime belongs to one model (Sparse<Base> makes it; a SparseMLP built alone gets one of its own) and holds
- `backend`: "auto" | "twell" | "dense" (BACKENDS; set_backend switches it for every layer at once),
- `dispatcher`: auto's Dispatcher (dispatch.py): per layer (keyed by W_gate) and M bucket, the eager and graph
  decisions, density refreshes, W_down^T copies, and the step check's dense-in-capture flag,
- `kernels`: the backend table (BACKEND_TABLE), `devices`: the device types whose calls it runs,
- `layers`: its SparseMLPs, each with an FFNLayer record (on the module as `ffn_layer`, one attribute lookup on
  the hot path): the answer the layer holds and the path its last forward took.

One decision, one call. `SparseMLP.forward(x)` is `self.runtime.ffn(self, x)`. A call no answer holds for asks
one question, `answer`: backend "auto" asks the dispatcher (dense or TwELL for this layer, token count and
regime), a forced backend is its own answer; then it calls one function, the backend table's row for the
answer on x's device. Where the layer cannot take the table (x off the runtime's `devices`, gradients, biases or
adapters, the step check's all-dense twin, backend "dense": `kernel_reason`) it runs its own torch expression, as stock
transformers does. The same `run` (answer, then the row) is the op's body, what auto's calibration times, and
what twell_ops.twell_ffn calls after its argument checks.

Held answers: auto's answer for a layer's M bucket holds for the calls up to the bucket's next density refresh
(Answer.calls); the layer runs them after one attribute test (dense: its own torch expression; twell: the
table's row), and the next call that asks first reports how many ran (Dispatcher.used), so the refresh keeps its
period in real calls; a backend switch reports them too. Captured calls are covered only where graph replay
chose dense as well: any other call captured into a CUDA graph asks, and gets the graph decision. Bare eager
twell_ffn(backend="auto") calls hold auto's answer the same way, per W_gate (HeldCall, in `held`): a call with
the asking call's arguments runs the answer's row after a few identity tests.

The registry (registry.py): the first copy of the bundle imported in a process fills its slot with its FFNRuntime /
FFNLayer classes, and every later copy of the same API version uses those (`_shared`): one copy of the runtime
code per process, whichever folder a model came from. The slot also holds the live runtimes by key (weakly), the
process runtime (twell_ffn calls made outside a model), and the log-once memory.

The custom op `sparsify::ffn_<API>` (what torch.compile traces; eager calls skip the op dispatch, ~20 us) is
registered once per process by whichever copy comes first, and takes the calling runtime's integer key: its body
looks the runtime up in the slot and runs that runtime's `run`. Folders written before (API 1's `sparsify::ffn`,
and before the runtime `sparsify::twell_ffn` / `twell_ffn_threshold` with their dispatcher published as
sys.modules["sparsify_twell_ffn_auto"]) keep their own ops and slots beside these.

API (registry.py): bump it when the op schema, a slot field's meaning or the runtime <-> SparseMLP interface
change (SparseMLP's `runtime`, `ffn_layer`, `weights`, `torch_ffn`, `projections`, `gate_weight`, `threshold`):
the new version gets its own slot and registers its own op.
"""

from __future__ import annotations

import logging
import os
import weakref
from types import MappingProxyType

import torch
import torch.nn as nn

from .cpu_sparse import sparse_rows
from .dispatch import Answer, CudaClock, Dispatcher, HostClock, WeightStore
from .registry import API, SLOT as _SLOT
from .twell_reference import ffn_dense, threshold_act
from .twell_triton import HAS_TRITON
from .twell_updown import twell_ffn_triton

OP = f"ffn_{API}"  # sparsify::ffn_2 (API 1 registered "ffn")
BACKENDS = ("auto", "twell", "dense")
TWIN = "the step check's all-dense twin of a decode step"
logger = logging.getLogger("sparsify")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] as row-contiguous [M, d] (x itself where it already is)."""
    return x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, x.shape[-1]).contiguous()


def _device(x: torch.Tensor) -> str:
    """x's device type, the backend table's first key (is_cuda first: the cheap question)."""
    return "cuda" if x.is_cuda else x.device.type


# ----------------------------------------------------------------------------------------- the backend table
def dense_rows(auto: Dispatcher, x, w_gate, w_up, w_down, w_down_t=None, threshold=None, on_count=None):
    """The dense FFN on x [..., d] (three GEMMs, cuBLAS on GPU); on a density refresh it hands `on_count` the
    gate's count of kept values, from the gate it computes anyway."""
    if on_count is None:
        return ffn_dense(x, w_gate, w_up, w_down, threshold)
    g = torch.nn.functional.linear(x, w_gate)  # [..., F]
    on_count((g > (0 if threshold is None else threshold)).sum())
    return torch.nn.functional.linear(threshold_act(g, threshold) * torch.nn.functional.linear(x, w_up), w_down)


def twell_rows(auto: Dispatcher, x, w_gate, w_up, w_down, w_down_t=None, threshold=None, on_count=None):
    """The TwELL FFN on x [..., d], as [M, d] rows: K1 + K2, or at M = 1 the fused decode launch
    (twell_ffn_triton); W_down^T is the caller's or the one `auto`'s store keeps per W_down version; on a
    density refresh K1's count goes to `on_count`."""
    out = twell_ffn_triton(_rows(x), w_gate.contiguous(), w_up.contiguous(), auto.down_t(w_down, w_down_t),
                           threshold=threshold, on_count=on_count)  # [M, d]
    return out if x.dim() == 2 else out.view_as(x)


# The backend table: (device type, answer) -> the function that computes the FFN on x [..., d], each called as
# row(dispatcher, x, w_gate, w_up, w_down, w_down_t, threshold, on_count). A row stands only where it can run
# (TwELL: triton on CUDA); an (device, "dense") row missing runs dense_rows. A new backend is a row here, with its
# device in the runtime's `devices` (DEVICES by default) so that its layers take the table and auto times it there.
# ("cpu", "twell") is the CPU's sparse decode (cpu_sparse.py: the gate GEMM, then only the active rows of W_up and
# W_down^T), except under Triton's interpreter (TRITON_INTERPRET=1: the tests' way to run the TwELL kernels on the
# CPU), where it is the TwELL row and CPU layers keep their torch expression unless a runtime lists "cpu" itself.
INTERPRETED = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
BACKEND_TABLE = MappingProxyType({
    ("cuda", "dense"): dense_rows,
    ("cpu", "dense"): dense_rows,
    **({("cuda", "twell"): twell_rows} if HAS_TRITON else {}),
    ("cpu", "twell"): twell_rows if INTERPRETED else sparse_rows,
})
DEVICES = ("cuda",) if INTERPRETED else ("cuda", "cpu")  # the device types a runtime's layers take the table on
_FORCED = MappingProxyType({path: Answer(path) for path in ("dense", "twell")})  # a forced backend's answers


def _shared(cls: type) -> type:
    """The class of this name that the first copy of the bundle in the process registered (this one if first)."""
    return _SLOT.classes.setdefault(cls.__name__, cls)


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _announce(path: str, reason: str) -> None:
    """Log which FFN path runs, once per process and path, so users can see it in their logs."""
    if path not in _SLOT.announced:
        _SLOT.announced.add(path)
        logger.info("sparsify: FFN path = %s (%s)", path, reason)


def _check_threshold(x: torch.Tensor, f: int, threshold: torch.Tensor) -> None:
    if not isinstance(threshold, torch.Tensor):
        raise ValueError(f"threshold must be a float32 tensor [F={f}] or None, got {type(threshold).__name__}.")
    if threshold.dtype != torch.float32 or tuple(threshold.shape) != (f,) or threshold.device != x.device:
        raise ValueError(
            f"threshold is {threshold.dtype} {tuple(threshold.shape)} on {threshold.device}, expected float32 ({f},) "
            f"on {x.device} (one theta per neuron of w_gate [F, d], on x's device; float32 whatever x's dtype).")


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


@_shared
class FFNLayer:
    """A runtime's record of one SparseMLP: the answer it holds (`answer`, for `left` of `given` calls of input
    shape `shape`, m rows; `in_capture`: calls captured into CUDA graphs too) and the path its last forward took
    ("twell_ffn:twell" / "twell_ffn:dense": the backend table's row that ran, "torch": the nn.Linear modules)."""

    __slots__ = ("answer", "left", "given", "m", "shape", "in_capture", "path")

    def __init__(self):
        self.left = self.given = self.m = 0
        self.answer = self.shape = None
        self.in_capture = False
        self.path = ""

    def __reduce__(self):  # a copied module holds no answer (it was the original's dispatcher's)
        return type(self), ()


class HeldCall:
    """The runtime's record of auto's answer for bare twell_ffn calls on one W_gate (a layer's FFNLayer grant, for
    calls outside a model): it holds for `left` of `given` calls of m rows with the same x shape and dtype, the
    same W_up, W_down and threshold objects, and W_gate unchanged (its storage and in-place version), so the
    call runs its row after a few identity tests instead of the argument checks and the question."""

    __slots__ = ("ref", "row", "answer", "left", "given", "m", "in_capture", "shape", "dtype", "cuda", "up", "down",
                 "theta", "version", "ptr")


@_shared
class FFNRuntime:
    """One model's FFN backend, auto's per-layer decisions, the held answers and the step check's twin (module doc).

    Args:
        backend: "auto" | "twell" | "dense".
        dispatcher: auto's Dispatcher; default: a real one (CUDA clock, and the wall clock for CPU calls). Its
            calibration times this runtime's `run` (set as its entry when it has none).
        devices: device types whose inference calls take the backend table and which "auto" dispatches (elsewhere
            a layer runs its torch expression and a bare "auto" call runs dense); default DEVICES (CUDA and the CPU,
            the CPU left out under Triton's interpreter); tests add "cpu" with a fake clock.
        kernels: the backend table, (device type, answer) -> row (BACKEND_TABLE; tests pass stand-in rows).
    """

    def __init__(self, backend: str = "auto", dispatcher: Dispatcher | None = None, devices=DEVICES,
                 kernels=BACKEND_TABLE):
        check_backend(backend)
        self.backend = backend
        self.dispatcher = (dispatcher if dispatcher is not None
                           else Dispatcher(CudaClock(), WeightStore(), host=HostClock()))
        if self.dispatcher.entry is None:
            self.dispatcher.entry = self.run
        self.devices = tuple(devices)
        self.kernels = kernels
        self.grants = True  # False: every call asks (what eval/bench_auto_overhead.py compares against)
        self.layers: list = []
        self.held: dict[int, HeldCall] = {}  # id(W_gate) -> its bare calls' held answer (dropped with W_gate)
        self.key = next(_SLOT.keys)
        _SLOT.runtimes[self.key] = self
        self._off_device = f"input is not on a {' / '.join(d.upper() for d in self.devices)} device"

    def __getstate__(self) -> dict:  # a copy (deepcopy, pickle) is a runtime of its own: new key, new dispatcher
        return {"backend": self.backend, "devices": self.devices, "grants": self.grants, "layers": self.layers,
                "kernels": None if self.kernels is BACKEND_TABLE else dict(self.kernels)}

    def __setstate__(self, state: dict) -> None:
        type(self).__init__(self, state["backend"], devices=state["devices"], kernels=state["kernels"] or BACKEND_TABLE)
        self.grants, self.layers = state["grants"], state["layers"]

    # -------------------------------------------------------------------------------- the model's side
    def attach(self, mlp: nn.Module) -> None:
        """Make `mlp` (a SparseMLP) one of this runtime's layers."""
        mlp.runtime = self
        mlp.ffn_layer = FFNLayer()
        self.layers.append(mlp)

    def set_backend(self, backend: str) -> None:
        """Switch every layer to `backend`; held answers end (auto counts the calls they ran)."""
        check_backend(backend)
        for mlp in self.layers:
            self._settle(mlp, mlp.ffn_layer)
        self.backend = backend

    @property
    def last_backend(self) -> str | None:
        """What this runtime's most recent answer named ("twell" / "dense")."""
        return self.dispatcher.last_backend

    def decisions(self, mlp: nn.Module) -> dict[int, dict]:
        """What auto decided for this layer, per M bucket (eager and graph replay), with the density and why."""
        return self.dispatcher.decisions(mlp.gate_weight())

    def dense_in_capture(self):
        """Context: captured calls run dense in every layer (the step check's all-dense twin; on "auto" each
        SparseMLP takes its torch path, which inductor fuses as in the dense model)."""
        return self.dispatcher.dense_in_capture()

    def twell_in_step(self, batch: int) -> bool:
        """Whether some layer runs TwELL when a step of `batch` tokens is captured now (backend "auto")."""
        return self.backend == "auto" and any(self.dispatcher.twell_in_capture(m.gate_weight(), batch)
                                              for m in self.layers)

    def kernel_reason(self, mlp: nn.Module, x: torch.Tensor) -> str | None:
        """None when this layer's call may take the backend table; otherwise why its torch path runs."""
        if self.backend == "auto" and self.dispatcher.capture_dense:
            return TWIN  # the step check's all-dense twin (under torch.compile: fusable torch ops, not the op)
        device = x.device.type
        if device not in self.devices:
            return self._off_device
        if (device, "twell") not in self.kernels:
            return "triton is not installed" if not HAS_TRITON else f"no TwELL kernels for {device} tensors"
        if self.backend == "dense":
            return "ffn_backend='dense'"
        if torch.is_grad_enabled() and (mlp.training or x.requires_grad
                                        or any(p.requires_grad for p in mlp.parameters())):
            return "gradients enabled (training path calls the nn.Linear modules)"
        if any(type(m) is not nn.Linear or m.bias is not None for m in mlp.projections()):
            return "projections carry biases or adapters"
        return None

    def ffn(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """SparseMLP.forward: the answer the layer holds, else the torch expression where the table cannot run
        (kernel_reason), else one question and one call of the table (_ask)."""
        if torch.compiler.is_compiling():  # first: dynamo must not guard on the held answer's countdown
            if self.kernel_reason(mlp, x) is not None:
                return mlp.torch_ffn(x)
            return self.twell_ffn(x, *mlp.weights(), self.backend, None, mlp.threshold)  # traced: the op
        rec = mlp.ffn_layer
        if rec.left and x.shape == rec.shape and (rec.in_capture or not self.dispatcher.capturing()):
            rec.left -= 1  # auto's answer holds (the path stays the answering call's); _settle reports the calls
            if rec.answer == "dense":
                return mlp.torch_ffn(x)  # the layer's own expression: what stock transformers runs
            w_gate, w_up, w_down = mlp.weights()  # [F, d], [F, d], [d, F]
            row = self.kernels.get((_device(x), rec.answer), dense_rows)
            return row(self.dispatcher, x, w_gate, w_up, w_down, None, mlp.threshold)
        reason = self.kernel_reason(mlp, x)
        if reason is not None:
            rec.path = "torch"
            if reason != TWIN:  # (the twin is a check inside a capture, not the path the model runs)
                _announce("torch", reason)
            return mlp.torch_ffn(x)
        return self._ask(mlp, rec, x)

    def _ask(self, mlp: nn.Module, rec: FFNLayer, x: torch.Tensor) -> torch.Tensor:
        """A layer's call that holds no answer: report the calls the last one ran, ask, run the answer's row, and
        hold the answer for the calls it covers."""
        if rec.given:
            self._settle(mlp, rec)
        w_gate, w_up, w_down = mlp.weights()
        device = _device(x)
        answer = self.answer(x, w_gate, w_up, w_down, None, mlp.threshold, self.backend, device=device)
        row = self.kernels.get((device, answer.path), dense_rows)
        y = row(self.dispatcher, x, w_gate, w_up, w_down, None, mlp.threshold, answer.on_count)
        _announce(f"twell_ffn (backend={self.backend}, {device})",
                  "CUDA inference with Triton" if device == "cuda" else f"{device} inference, backend table row")
        rec.path = f"twell_ffn:{answer.path}"
        if answer.calls and self.grants:
            rec.answer, rec.given, rec.left, rec.in_capture = answer.path, answer.calls, answer.calls, answer.in_capture
            rec.m, rec.shape = x.numel() // x.shape[-1], x.shape
        return y

    def _settle(self, mlp: nn.Module, rec: FFNLayer) -> None:
        """End the layer's held answer, telling auto how many calls it ran (its refresh period counts them)."""
        used = rec.given - rec.left
        rec.given = rec.left = 0
        if used:
            self.dispatcher.used(mlp.gate_weight(), rec.m, used)

    # ----------------------------------------------------------------------------- the one decision, one call
    def answer(self, x, w_gate, w_up, w_down, w_down_t=None, threshold=None, backend: str = "auto", *,
               device: str | None = None) -> Answer:
        """The one question for x [..., d] (M rows): the path ("dense" | "twell": a row of the backend table on x's
        device, `device` if the caller has it) and for how many calls it holds. "auto" on one of `devices` asks
        the dispatcher (this layer, M, the regime); a forced backend is its own answer where its row can run,
        dense elsewhere."""
        auto, device = self.dispatcher, device or _device(x)
        twell = (device, "twell") in self.kernels
        if backend == "auto" and twell and device in self.devices:
            return auto.choose(x, w_gate, w_up, w_down, w_down_t, threshold)  # (M = 0: dense)
        if backend == "twell" and twell and x.numel():
            auto.note(("twell", device), "twell", "requested")
            return _FORCED["twell"]
        auto.note(("dense", backend, device), "dense", "requested" if backend == "dense" else
                  f"no TwELL kernels for {device} tensors" if not twell else f"auto dispatches {self.devices} only")
        return _FORCED["dense"]

    def run(self, x, w_gate, w_up, w_down, w_down_t=None, threshold=None, backend: str = "auto") -> torch.Tensor:
        """The one decision and the one call on x [..., d], weights checked: the op's body, auto's timed entry,
        and bare twell_ffn calls."""
        device = _device(x)
        answer = self.answer(x, w_gate, w_up, w_down, w_down_t, threshold, backend, device=device)
        row = self.kernels.get((device, answer.path), dense_rows)
        return row(self.dispatcher, x, w_gate, w_up, w_down, w_down_t, threshold, answer.on_count)

    def twell_ffn(self, x, w_gate, w_up, w_down, backend: str = "auto", w_down_t=None, threshold=None):
        """twell_ops.twell_ffn on this runtime (same arguments, positional): argument checks, the gradient path,
        then `run` (eager and CUDA-graph capture: no custom-op dispatch, ~20 us a call) or, traced, the op that
        runs it on [M, d] rows. An eager "auto" call that auto's held answer covers (HeldCall: same arguments as
        the call that asked) runs the answer's row at once."""
        if not torch.compiler.is_compiling():  # (first: dynamo must not trace the held answers)
            held = self.held.get(id(w_gate))
            if (held is not None and held.left and backend == "auto" and held.ref() is w_gate and x.shape == held.shape
                    and x.dtype == held.dtype and x.is_cuda == held.cuda and held.up() is w_up and held.down() is w_down
                    and threshold is held.theta and w_gate.data_ptr() == held.ptr
                    and (held.version < 0 or w_gate._version == held.version)
                    and not (torch.is_grad_enabled() and (x.requires_grad or w_gate.requires_grad
                                                          or w_up.requires_grad or w_down.requires_grad))
                    and (held.in_capture or not self.dispatcher.capturing())):
                held.left -= 1
                self.dispatcher.last_backend = held.answer
                return held.row(self.dispatcher, x, w_gate, w_up, w_down, w_down_t, threshold)
        d = x.shape[-1]
        if (backend not in BACKENDS or w_gate.shape[-1] != d or w_up.shape != w_gate.shape
                or w_down.shape[0] != d or w_down.shape[-1] != w_gate.shape[0]
                or w_gate.dtype != x.dtype or w_up.dtype != x.dtype or w_down.dtype != x.dtype):
            _check(x, w_gate, w_up, w_down, backend)  # builds the full message
        if threshold is not None:
            _check_threshold(x, w_gate.shape[0], threshold)
        if torch.is_grad_enabled() and (x.requires_grad or w_gate.requires_grad or w_up.requires_grad
                                        or w_down.requires_grad):
            self.dispatcher.note(("grad",), "dense", "gradients needed")
            return ffn_dense(x, w_gate, w_up, w_down, threshold)
        if not torch.compiler.is_compiling():
            if backend != "auto" or not self.grants:
                return self.run(x, w_gate, w_up, w_down, w_down_t, threshold, backend)
            return self._ask_bare(x, w_gate, w_up, w_down, w_down_t, threshold)
        x2d = _rows(x)  # traced: the opaque op for dynamo / inductor, carrying this runtime's key
        out = getattr(torch.ops.sparsify, OP)(x2d, w_gate, w_up, w_down, w_down_t, backend, threshold, self.key)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], w_down.shape[0])

    def _ask_bare(self, x, w_gate, w_up, w_down, w_down_t, threshold) -> torch.Tensor:
        """An eager bare "auto" call no held answer covers: report the calls the last one ran (as _settle does),
        ask, run the answer's row, and hold the answer for this W_gate's next calls with the same arguments."""
        key = id(w_gate)
        held = self.held.get(key)
        if held is not None and held.ref() is w_gate and held.given:
            self.dispatcher.used(w_gate, held.m, held.given - held.left)
            held.given = held.left = 0
        device = _device(x)
        answer = self.answer(x, w_gate, w_up, w_down, w_down_t, threshold, "auto", device=device)
        row = self.kernels.get((device, answer.path), dense_rows)
        y = row(self.dispatcher, x, w_gate, w_up, w_down, w_down_t, threshold, answer.on_count)
        if answer.calls:
            if held is None or held.ref() is not w_gate:
                held = self.held[key] = HeldCall()
                held.ref = weakref.ref(w_gate, lambda ref, held=self.held: held.pop(key, None)
                                       if held.get(key) is not None and held[key].ref is ref else None)
            held.row, held.answer, held.given, held.left, held.in_capture = (row, answer.path, answer.calls,
                                                                            answer.calls, answer.in_capture)
            held.m, held.shape, held.dtype, held.cuda, held.theta = (x.numel() // x.shape[-1], x.shape, x.dtype,
                                                                     x.is_cuda, threshold)
            held.up, held.down = weakref.ref(w_up), weakref.ref(w_down)  # (weakly: W_up / W_down may be replaced)
            held.ptr, held.version = w_gate.data_ptr(), -1 if w_gate.is_inference() else w_gate._version
        return y


def process_runtime() -> FFNRuntime:
    """The runtime of twell_ffn calls made outside a model: one per process, whichever copy asks."""
    if _SLOT.process is None:
        _SLOT.process = FFNRuntime()
    return _SLOT.process


def runtime_of(model) -> FFNRuntime | None:
    """The FFN runtime of a sparsify model (Sparse<Base> sets `ffn_runtime`); None for any other model."""
    runtime = getattr(model, "ffn_runtime", None)
    return runtime if isinstance(runtime, FFNRuntime) else None


def _define_op() -> None:
    """Register sparsify::<OP> unless a copy of the bundle (this API version) already did: its body runs the
    `run` of the runtime whose key the call carries, whichever copy's code registered it."""
    if getattr(torch.ops.sparsify, OP, None) is not None:
        return
    try:
        @torch.library.custom_op(f"sparsify::{OP}", mutates_args=())
        def op(
            x2d: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
            w_down_t: torch.Tensor | None, backend: str, threshold: torch.Tensor | None, runtime: int,
        ) -> torch.Tensor:
            return _SLOT.runtimes[runtime].run(x2d, w_gate, w_up, w_down, w_down_t, threshold, backend)

        @op.register_fake
        def _(x2d, w_gate, w_up, w_down, w_down_t, backend, threshold, runtime):
            return x2d.new_empty(x2d.shape[0], w_down.shape[0])
    except RuntimeError:  # registered meanwhile by another copy
        pass


_define_op()
