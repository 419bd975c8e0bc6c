"""One owner for a model's FFN backend: FFNRuntime, and the process registry every copy of the bundle finds it in.

Legend: M = tokens, d = hidden size, F = intermediate size. Weights in nn.Linear layout.

An FFNRuntime belongs to one model (Sparse<Base> makes it; a SparseMLP built alone gets one of its own) and holds
- `backend`: "auto" | "twell" | "dense" (BACKENDS; set_backend switches it for every layer at once),
- `dispatcher`: auto's Dispatcher (dispatch.py): per layer (keyed by W_gate) and M bucket, the eager and graph
  decisions, density refreshes, W_down^T copies, and the step check's dense-in-capture flag,
- `layers`: its SparseMLPs, each with an FFNLayer record (on the module as `_ffn`, one attribute lookup on the
  hot path): the layer's grant and the path its last forward took.
`SparseMLP.forward(x)` is `self.runtime.ffn(self, x)`.

Grants: once auto decided dense for a layer's M bucket, `ffn` lets that layer run its own torch expression for
the calls up to the bucket's next density refresh (Dispatcher.grant_dense), after one attribute test: no
argument checks, no store lookup. The next call through auto first reports how many granted calls ran
(Dispatcher.dense_used), so the refresh keeps its period in real calls; a backend switch reports them too.
Where graph replay chose TwELL for the bucket, the grant covers eager calls only: a call captured into a CUDA
graph goes to auto, which runs the graph decision.

The registry (registry.py): the first copy of the bundle imported in a process fills its slot with its FFNRuntime /
FFNLayer classes, and every later copy of the same API version uses those (`_shared`): one copy of the runtime
code per process, whichever folder a model came from. The slot also holds the live runtimes by key (weakly), the
process runtime (twell_ffn calls made outside a model), and the log-once memory.

The custom op `sparsify::ffn` (what torch.compile traces; eager calls skip the op dispatch, ~20 us) is
registered once per process by whichever copy comes first, and takes the calling runtime's integer key: its
body looks the runtime up in the slot and runs that runtime's `impl`. Folders written before this file (their
ops `sparsify::twell_ffn` / `twell_ffn_threshold`, their dispatcher published as sys.modules
["sparsify_twell_ffn_auto"]) never meet these names, and these never read theirs.

API (registry.py): bump it when the op schema, a slot field's meaning or the runtime <-> SparseMLP interface
change (SparseMLP's `runtime`, `_ffn`, `_weights`, `_torch_ffn`, `_projections`, `gate_weight`, `threshold`): the
new version gets its own slot and registers `sparsify::ffn_<API>`.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn as nn

from .dispatch import CudaClock, Dispatcher, WeightStore
from .registry import SLOT as _SLOT
from .twell_reference import ffn_dense
from .twell_triton import HAS_TRITON
from .twell_updown import twell_ffn_triton

OP = "ffn"  # sparsify::ffn (FFNRuntime.call names it; API 2 would register "ffn_2")
BACKENDS = ("auto", "twell", "dense")
TWIN = "the step check's all-dense twin of a decode step"
_KERNELS_MISSING = "" if HAS_TRITON else "triton is not installed"
logger = logging.getLogger("sparsify")


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


def _triton_ok(x: torch.Tensor) -> bool:
    if not HAS_TRITON:
        return False
    if x.is_cuda:
        return True
    return x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


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
    """A runtime's record of one SparseMLP: its grant (`left` of `given` calls of input shape `shape`, m rows;
    `in_capture`: the grant covers calls captured into CUDA graphs too) and the path its last forward took
    ("twell_ffn:twell" / "twell_ffn:dense" as the kernels' entry ran it, "torch": the nn.Linear modules)."""

    __slots__ = ("left", "given", "m", "shape", "in_capture", "path")

    def __init__(self):
        self.left = self.given = self.m = 0
        self.shape = None
        self.in_capture = False
        self.path = ""

    def __reduce__(self):  # a copied module starts without a grant (it was the original's dispatcher's)
        return type(self), ()


@_shared
class FFNRuntime:
    """One model's FFN backend, auto's per-layer decisions, the grants and the step check's twin (module doc).

    Args:
        backend: "auto" | "twell" | "dense".
        dispatcher: auto's Dispatcher; default: a real one (CUDA clock) timing through this runtime's entry.
        auto_devices: device types whose calls "auto" dispatches (elsewhere it runs dense); tests add "cpu"
            with a fake clock.
    """

    def __init__(self, backend: str = "auto", dispatcher: Dispatcher | None = None, auto_devices=("cuda",)):
        check_backend(backend)
        self.backend = backend
        self.dispatcher = dispatcher if dispatcher is not None else Dispatcher(
            CudaClock(), WeightStore(), entry=self._auto_entry)
        self.auto_devices = tuple(auto_devices)
        self.grants = True  # False: every call of a dense-decided layer goes through auto (bench_auto_overhead)
        self.layers: list = []
        self.key = next(_SLOT.keys)
        _SLOT.runtimes[self.key] = self

    def __getstate__(self) -> dict:  # a copy (deepcopy, pickle) is a runtime of its own: new key, new dispatcher
        return {"backend": self.backend, "auto_devices": self.auto_devices, "grants": self.grants,
                "layers": self.layers}

    def __setstate__(self, state: dict) -> None:
        type(self).__init__(self, state["backend"], auto_devices=state["auto_devices"])
        self.grants, self.layers = state["grants"], state["layers"]

    # -------------------------------------------------------------------------------- the model's side
    def attach(self, mlp: nn.Module) -> None:
        """Make `mlp` (a SparseMLP) one of this runtime's layers."""
        mlp.runtime = self
        mlp._ffn = FFNLayer()
        self.layers.append(mlp)

    def set_backend(self, backend: str) -> None:
        """Switch every layer to `backend`; grants end (auto counts the calls they ran)."""
        check_backend(backend)
        for mlp in self.layers:
            self._settle(mlp, mlp._ffn)
        self.backend = backend

    @property
    def last_backend(self) -> str | None:
        """What this runtime's most recent call through the kernels' entry ran ("twell" / "dense")."""
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
        """None when this layer's call may go to the kernels' entry; otherwise why its torch path runs."""
        if _KERNELS_MISSING:
            return _KERNELS_MISSING
        if self.backend == "auto" and self.dispatcher.capture_dense:
            return TWIN  # the step check's all-dense twin (under torch.compile: fusable torch ops, not the op)
        if not x.is_cuda:
            return "input is not on a CUDA device"
        if self.backend == "dense":
            return "ffn_backend='dense'"
        if torch.is_grad_enabled() and (mlp.training or any(p.requires_grad for p in mlp.parameters())):
            return "gradients enabled (training path calls the nn.Linear modules)"
        if any(type(m) is not nn.Linear or m.bias is not None for m in mlp._projections()):
            return "projections carry biases or adapters"
        return None

    def ffn(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """SparseMLP.forward: a granted call runs the layer's torch expression; else the kernels' entry
        (CUDA inference with Triton) or the nn.Linear modules (kernel_reason says why)."""
        if torch.compiler.is_compiling():  # first: dynamo must not guard on the grant's countdown
            return self._traced(mlp, x)
        rec = mlp._ffn
        if rec.left and x.shape == rec.shape and (rec.in_capture or not self.dispatcher.capturing()):
            rec.left -= 1  # granted by auto: the path is still the granting call's "twell_ffn:dense"
            return mlp._torch_ffn(x)
        reason = self.kernel_reason(mlp, x)
        if reason is not None:
            rec.path = "torch"
            if reason != TWIN:  # (the twin is a check inside a capture, not the path the model runs)
                _announce("torch", reason)
            return mlp._torch_ffn(x)
        if rec.given:
            self._settle(mlp, rec)
        w_gate, w_up, w_down = mlp._weights()  # [F, d], [F, d], [d, F]
        y = self.twell_ffn(x, w_gate, w_up, w_down, self.backend, None, mlp.threshold)
        _announce(f"twell_ffn (backend={self.backend})", "CUDA inference with Triton")
        ran = self.dispatcher.last_backend
        rec.path = f"twell_ffn:{ran}"
        if ran == "dense" and self.backend == "auto" and self.grants:  # (a twell call gets no grant: no lookup)
            rec.m = x.numel() // x.shape[-1]
            rec.given, rec.in_capture = self.dispatcher.grant_dense(w_gate, rec.m)
            rec.left, rec.shape = rec.given, x.shape
        return y

    def _traced(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """ffn under torch.compile: the torch modules or the op, nothing recorded (the op's path is only known
        when it runs)."""
        if self.kernel_reason(mlp, x) is not None:
            return mlp._torch_ffn(x)
        w_gate, w_up, w_down = mlp._weights()
        return self.call(x, w_gate, w_up, w_down, self.backend, None, mlp.threshold)

    def _settle(self, mlp: nn.Module, rec: FFNLayer) -> None:
        """End the layer's grant, telling auto how many of its calls ran (its refresh period counts them)."""
        used = rec.given - rec.left
        rec.given = rec.left = 0
        if used:
            self.dispatcher.dense_used(mlp.gate_weight(), rec.m, used)

    # --------------------------------------------------------------------------------- the kernels' entry
    def twell_ffn(self, x, w_gate, w_up, w_down, backend: str = "auto", w_down_t=None, threshold=None):
        """twell_ops.twell_ffn through this runtime's dispatcher (same arguments, positional)."""
        if backend == "auto":  # a bucket that chose dense: the same torch ops as the dense backend
            y = self.dispatcher.fast_path(x, w_gate, w_up, w_down, threshold)
            if y is not None:
                return y
        return self.call(x, w_gate, w_up, w_down, backend, w_down_t, threshold)

    def _auto_entry(self, x2d, w_gate, w_up, w_down, w_down_t, threshold=None):
        """What the dispatcher's calibration times: the whole entry, argument checks included."""
        return self.twell_ffn(x2d, w_gate, w_up, w_down, "auto", w_down_t, threshold)

    def call(self, x, w_gate, w_up, w_down, backend: str = "auto", w_down_t=None, threshold=None):
        """twell_ffn past auto's dense fast path: argument checks, the gradient path, then the op (traced)
        or its body (eager and CUDA-graph capture: no custom-op dispatch, ~20 us a call)."""
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
        x2d = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, d).contiguous()
        if torch.compiler.is_compiling():  # opaque op for dynamo / inductor, carrying this runtime's key
            out = torch.ops.sparsify.ffn(x2d, w_gate.contiguous(), w_up.contiguous(), w_down, w_down_t, backend,
                                         threshold, self.key)
        else:
            out = self.impl(x2d, w_gate.contiguous(), w_up.contiguous(), w_down, w_down_t, backend, threshold)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], w_down.shape[0])

    def impl(self, x2d, w_gate, w_up, w_down, w_down_t, backend: str, threshold=None) -> torch.Tensor:
        """The op's body on [M, d]: dense, auto's dispatcher, or the TwELL kernels."""
        auto = self.dispatcher
        if backend == "dense" or not _triton_ok(x2d) or x2d.shape[0] == 0:
            auto.note(("dense", backend), "dense", "requested" if backend == "dense" else "no triton/CUDA for this tensor")
            return ffn_dense(x2d, w_gate, w_up, w_down, threshold)
        if backend == "auto" and x2d.device.type in self.auto_devices:
            return auto(x2d, w_gate, w_up, w_down, w_down_t, threshold)
        if backend == "auto":  # CPU interpreter: correct but slow, never chosen automatically
            auto.note(("cpu", "auto"), "dense", "auto on CPU")
            return ffn_dense(x2d, w_gate, w_up, w_down, threshold)
        auto.note(("twell", "requested"), "twell", "requested")
        return twell_ffn_triton(x2d, w_gate, w_up, auto.down_t(w_down, w_down_t), threshold=threshold)


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
    `impl` of the runtime whose key the call carries, whichever copy's code registered it."""
    if getattr(torch.ops.sparsify, OP, None) is not None:
        return
    try:
        @torch.library.custom_op(f"sparsify::{OP}", mutates_args=())
        def op(
            x2d: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
            w_down_t: torch.Tensor | None, backend: str, threshold: torch.Tensor | None, runtime: int,
        ) -> torch.Tensor:
            return _SLOT.runtimes[runtime].impl(x2d, w_gate, w_up, w_down, w_down_t, backend, threshold)

        @op.register_fake
        def _(x2d, w_gate, w_up, w_down, w_down_t, backend, threshold, runtime):
            return x2d.new_empty(x2d.shape[0], w_down.shape[0])
    except RuntimeError:  # registered meanwhile by another copy
        pass


_define_op()
