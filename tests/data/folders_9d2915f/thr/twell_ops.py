"""Public sparse FFN entry point `twell_ffn` and its torch.library custom op `sparsify::twell_ffn`.

Legend: M = tokens, d = hidden size, F = intermediate size. Weights in nn.Linear layout.

twell_ffn(x, w_gate, w_up, w_down, *, backend="auto", w_down_t=None, threshold=None) returns
act(x @ w_gate.T) * (x @ w_up.T) @ w_down.T for x [..., d], act = relu, or with a threshold theta [F]
(float32) g * [g > theta] (twell_reference.threshold_act). Backends: "dense" (three cuBLAS GEMMs; also
whenever gradients are needed), "twell" (K1 + K2 of twell_triton.py), "auto" (dispatch.py: per layer and
M bucket, whichever path measured faster; CUDA only). Without CUDA or triton every backend runs the dense
torch path, except "twell" on CPU with TRITON_INTERPRET=1 (the Triton interpreter: tests).
"""

from __future__ import annotations

import os
import sys
import types

import torch

from .dispatch import CudaClock, Dispatcher, WeightStore
from .twell_reference import ffn_dense, transpose_down  # (transpose_down: re-exported, public)
from .twell_triton import HAS_TRITON
from .twell_updown import twell_ffn_triton

BACKENDS = ("auto", "twell", "dense")


def _auto_entry(x2d, w_gate, w_up, w_down, w_down_t, threshold=None):
    """What the dispatcher's calibration times: the public call, argument checks included."""
    return twell_ffn(x2d, w_gate, w_up, w_down, backend="auto", w_down_t=w_down_t, threshold=threshold)


SHARED = "sparsify_twell_ffn_auto"  # the sys.modules entry that holds the process's one dispatcher
_USED = ("note", "down_t", "fast_path", "grant_dense", "dense_used", "decisions", "dense_in_capture",
         "twell_in_capture", "capture_dense", "last_backend", "thresholds")


def _process_auto() -> Dispatcher:
    """The process's one "auto". The custom op runs the code of the copy of this file that registered it first
    (sparsify.kernels and each model folder's copy can all be imported in one process), so every copy uses that
    copy's dispatcher: compiled calls then decide in the store the modules, the step check and bench read. A
    copy that is first, or that finds a dispatcher lacking what it calls (an older copy's, e.g. one without
    thresholds), makes its own."""
    shared = getattr(sys.modules.get(SHARED), "auto", None)
    if shared is not None and all(hasattr(shared, name) for name in _USED):
        return shared
    return Dispatcher(CudaClock(), WeightStore(), entry=_auto_entry)


AUTO = _process_auto()  # real clock and store
dense_in_capture = AUTO.dense_in_capture
twell_in_capture = AUTO.twell_in_capture
grant_dense = AUTO.grant_dense  # (w_gate, m) -> (calls a module may run dense without twell_ffn, in captures too)
dense_used = AUTO.dense_used  # (w_gate, m, calls): the granted calls it ran (they count for the refresh period)
auto_decisions = AUTO.decisions  # (w_gate) -> {M bucket: eager / graph decision, density, why}


def dense_capture_active() -> bool:
    """True inside dense_in_capture(). A model's FFN reads it to take its plain torch path there: dynamo
    guards on the value read, so a compiled step is traced again for its all-dense twin, whose relu x up
    inductor fuses as in the dense model."""
    return AUTO.capture_dense


def last_backend() -> str | None:
    """The backend the most recent twell_ffn call ran: "twell", "dense" or None before any call."""
    return AUTO.last_backend


def _triton_ok(x: torch.Tensor) -> bool:
    if not HAS_TRITON:
        return False
    if x.is_cuda:
        return True
    return x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def _impl(x2d, w_gate, w_up, w_down, w_down_t, backend: str, threshold=None) -> torch.Tensor:
    if backend == "dense" or not _triton_ok(x2d) or x2d.shape[0] == 0:
        AUTO.note(("dense", backend), "dense", "requested" if backend == "dense" else "no triton/CUDA for this tensor")
        return ffn_dense(x2d, w_gate, w_up, w_down, threshold)
    if backend == "auto" and x2d.is_cuda:
        return AUTO(x2d, w_gate, w_up, w_down, w_down_t, threshold)
    if backend == "auto":  # CPU interpreter: correct but slow, never chosen automatically
        AUTO.note(("cpu", "auto"), "dense", "auto on CPU")
        return ffn_dense(x2d, w_gate, w_up, w_down, threshold)
    AUTO.note(("twell", "requested"), "twell", "requested")
    return twell_ffn_triton(x2d, w_gate, w_up, AUTO.down_t(w_down, w_down_t), threshold=threshold)


# The op's names, first free or threshold-taking one wins: a process where an older copy of this file (without
# thresholds) registered sparsify::twell_ffn first gets a second op whose code honours them.
OP_NAMES = ("twell_ffn", "twell_ffn_threshold")


def _takes_threshold(op) -> bool:
    return any(a.name == "threshold" for a in op.default._schema.arguments)


def _define_op():
    """Register sparsify::twell_ffn once, even when several copies of this file are imported; the copy that
    registers it publishes its dispatcher for the others (see _process_auto). Reused only with the threshold
    argument; next to an older copy's op, one of the next name in OP_NAMES."""
    for name in OP_NAMES:
        existing = getattr(torch.ops.sparsify, name, None) if hasattr(torch.ops, "sparsify") else None
        if existing is not None:
            if _takes_threshold(existing):
                return existing
            continue
        try:
            @torch.library.custom_op(f"sparsify::{name}", mutates_args=())
            def op(
                x2d: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                w_down_t: torch.Tensor | None, backend: str, threshold: torch.Tensor | None = None,
            ) -> torch.Tensor:
                return _impl(x2d, w_gate, w_up, w_down, w_down_t, backend, threshold)

            @op.register_fake
            def _(x2d, w_gate, w_up, w_down, w_down_t, backend, threshold=None):
                return x2d.new_empty(x2d.shape[0], w_down.shape[0])
        except RuntimeError:  # registered meanwhile by another copy of this module
            return getattr(torch.ops.sparsify, name)
        sys.modules.setdefault(SHARED, types.ModuleType(SHARED)).auto = AUTO
        return op
    raise RuntimeError(f"every sparsify op name {OP_NAMES} is taken by an op without the threshold argument")


_op = _define_op()


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


def twell_ffn(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    backend: str = "auto",
    w_down_t: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(x @ w_gate.T) * (x @ w_up.T) @ w_down.T with TwELL kernels when they are faster.

    Args:
        x: [..., d] activations (bf16/fp16/fp32).
        w_gate, w_up: [F, d]; w_down: [d, F] (nn.Linear weights), same dtype and device as x.
        backend: "auto" (fastest measured path), "twell" (force the sparse kernels) or "dense".
        w_down_t: optional cached `transpose_down(w_down)` ([F, d] contiguous); computed and cached
            per weight version when omitted.
        threshold: optional theta [F] float32 on x's device: act(g) = g * [g > theta] (g compared as x's
            dtype holds it, strictly greater; the value kept is g) instead of relu. "auto" keeps its
            per-layer state for one theta object: pass the same tensor every call (a module's buffer).

    Returns:
        [..., d] in x's dtype. When autograd needs gradients, the dense torch path runs (inference-only
        kernels); `last_backend()` tells which path ran.
    """
    if backend == "auto":  # a bucket that chose dense: the same torch ops as the dense backend
        y = AUTO.fast_path(x, w_gate, w_up, w_down, threshold)
        if y is not None:
            return y
    d = x.shape[-1]
    if (backend not in BACKENDS or w_gate.shape[-1] != d or w_up.shape != w_gate.shape
            or w_down.shape[0] != d or w_down.shape[-1] != w_gate.shape[0]
            or w_gate.dtype != x.dtype or w_up.dtype != x.dtype or w_down.dtype != x.dtype):
        _check(x, w_gate, w_up, w_down, backend)  # builds the full message
    if threshold is not None:
        _check_threshold(x, w_gate.shape[0], threshold)
    if torch.is_grad_enabled() and (x.requires_grad or w_gate.requires_grad or w_up.requires_grad
                                    or w_down.requires_grad):
        AUTO.note(("grad",), "dense", "gradients needed")
        return ffn_dense(x, w_gate, w_up, w_down, threshold)
    x2d = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, d).contiguous()
    if torch.compiler.is_compiling():  # opaque op for dynamo / inductor
        out = _op(x2d, w_gate.contiguous(), w_up.contiguous(), w_down, w_down_t, backend, threshold)
    else:  # eager (and CUDA-graph capture): skip the custom-op dispatch, ~20 us a call
        out = _impl(x2d, w_gate.contiguous(), w_up.contiguous(), w_down, w_down_t, backend, threshold)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], w_down.shape[0])
