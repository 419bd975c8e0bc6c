"""Public sparse FFN entry point `twell_ffn`.

Legend: M = tokens, d = hidden size, F = intermediate size. Weights in nn.Linear layout.

twell_ffn(x, w_gate, w_up, w_down, *, backend="auto", w_down_t=None, threshold=None) returns
act(x @ w_gate.T) * (x @ w_up.T) @ w_down.T for x [..., d], act = relu, or with a threshold theta [F]
(float32) g * [g > theta] (twell_reference.threshold_act). Backends: "dense" (three cuBLAS GEMMs; also
whenever gradients are needed), "twell" (K1 + K2 of twell_triton.py), "auto" (dispatch.py: per layer and
M bucket, whichever path measured faster; CUDA only). Without CUDA or triton every backend runs the dense
torch path, except "twell" on CPU with TRITON_INTERPRET=1 (the Triton interpreter: tests).

Calls made here are the process runtime's (ffn_runtime.process_runtime: one per process, shared by every copy
of the bundle): its argument checks, then the one decision and the one call of its backend table that a model's
layers make through their own runtime. Under torch.compile the call is the runtime's custom op (ffn_runtime.py).
"""

from __future__ import annotations

import torch

from .dispatch import Dispatcher
from .ffn_runtime import BACKENDS, process_runtime
from .twell_reference import transpose_down  # (re-exported, public)

__all__ = ["twell_ffn", "last_backend", "transpose_down", "auto_dispatcher", "BACKENDS"]
_PROCESS = process_runtime()  # (held by the registry: the only state here is the registry's)


def last_backend() -> str | None:
    """The backend the most recent twell_ffn call of this process ran: "twell", "dense" or None before any call.
    (A model's layers report theirs in SparseMLP.last_path.)"""
    return _PROCESS.dispatcher.last_backend


def auto_dispatcher() -> Dispatcher:
    """The dispatcher of twell_ffn(backend="auto") calls made here (its store, policy: benches and tests)."""
    return _PROCESS.dispatcher


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
    return _PROCESS.twell_ffn(x, w_gate, w_up, w_down, backend, w_down_t, threshold)
