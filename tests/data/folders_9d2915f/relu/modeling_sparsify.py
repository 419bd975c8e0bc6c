# Shipped verbatim inside every sparsify model folder (loaded with trust_remote_code=True), beside the
# decode engine (fast_decode.py) and the kernel files. Imports only torch, transformers and its siblings.
"""Sparse-FFN causal LMs: the family's own transformers class with its gated MLPs replaced by SparseMLP.

`config.json` keeps the family's `model_type` with a ReLU activation, so stock transformers loads the same
folder as a dense ReLU model; `auto_map` points AutoModelForCausalLM here, to `Sparse<Base>` (for example
`SparseLlamaForCausalLM`), built on first access from `transformers.<Base>`.

SparseMLP keeps the parameter names (gate_proj / up_proj / down_proj, or Phi-3's fused gate_up_proj), so
state dicts load unchanged, and it calls those modules whenever gradients may flow (training, LoRA). At
inference on CUDA with Triton it runs the TwELL kernels through `twell_ffn`; anywhere else the dense torch
expression, identical to the stock model's.

Thresholded folders (FATReLU / JumpReLU-style, h = g * [g > theta] * up): config.json's activation field
(`hidden_act`, Gemma 2/3: `hidden_activation`) holds THRESHOLD_ACT, which stock transformers refuses
(KeyError naming it: never a dense ReLU model without the thresholds), and the `sparsify` section holds
`"threshold": {"mode": "layer" | "neuron"}`. `Sparse<Base>` builds the base model with "relu" in that field,
restores THRESHOLD_ACT on the config (save_pretrained round-trips) and gives every SparseMLP a persistent
float32 buffer `threshold` [F] (state-dict key `<mlp path>.threshold`), float32 whatever the model's dtype.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import transformers

from .fast_decode import FastDecode, enable_fast_decode
from .twell_ops import auto_decisions, dense_capture_active, dense_used, grant_dense, last_backend, twell_ffn
from .twell_reference import threshold_act
from .twell_triton import HAS_TRITON

__all__ = ["SparseMLP", "sparsify_mlps", "set_ffn_backend", "default_backend", "enable_fast_decode", "FastDecode",
           "THRESHOLD_ACT", "threshold_mode"]
# The activation field of a thresholded folder: not an activation stock transformers knows, so its model classes
# refuse the folder (KeyError naming this string) instead of building a ReLU model that drops the thresholds.
THRESHOLD_ACT = "relu_threshold (load with trust_remote_code=True)"
ACT_FIELDS = ("hidden_act", "hidden_activation")  # where a family's config names its MLP activation
_KERNELS_MISSING = "" if HAS_TRITON else "triton is not installed"
logger = logging.getLogger("sparsify")
BACKENDS = ("auto", "twell", "dense")
TWIN = "the step check's all-dense twin of a decode step"
_capturing = torch.cuda.is_current_stream_capturing  # asked only under an eager-only grant (CUDA calls)
_announced: set[str] = set()


def _announce(path: str, reason: str) -> None:
    """Log which FFN path runs, once per process and path, so users can see it in their logs."""
    if path not in _announced:
        _announced.add(path)
        logger.info("sparsify: FFN path = %s (%s)", path, reason)


class SparseMLP(nn.Module):
    """relu(gate_proj(x)) * up_proj(x) -> down_proj, with a TwELL kernel path for CUDA inference. With
    `threshold=True` the gate activation is g * [g > theta] (twell_reference.threshold_act), theta the
    persistent float32 buffer `threshold` [F] (zeros until a state dict fills it; float32 under any .to(),
    .half(), from_pretrained(dtype=)); without, that buffer is None (not in the state dict).

    `ffn_backend` ("auto" | "twell" | "dense") is passed to twell_ffn; "dense" also skips the kernels.
    `last_path` records which path the last forward took: "twell_ffn:twell" / "twell_ffn:dense" (what the
    kernels' dispatcher actually ran) or "torch" (the nn.Linear modules).

    Once "auto" decided dense for a shape's M bucket, the dispatcher grants the calls up to its next density
    refresh: those run the torch expression directly, after one attribute test (no op, no lookup), and the
    refresh call goes through twell_ffn again. Where graph replay chose TwELL for the bucket (decode sizes
    often do), the grant holds for eager calls only: a call captured into a CUDA graph goes to auto.
    """

    def __init__(self, mlp: nn.Module, threshold: bool = False):
        super().__init__()
        self.fused = hasattr(mlp, "gate_up_proj")
        if self.fused:  # Phi-3: one [2F, d] projection, gate first
            self.gate_up_proj = mlp.gate_up_proj
        else:
            self.gate_proj = mlp.gate_proj
            self.up_proj = mlp.up_proj
        self.down_proj = mlp.down_proj
        w = mlp.down_proj.weight  # [d, F]
        self.register_buffer("threshold", torch.zeros(w.shape[1], dtype=torch.float32, device=w.device)
                             if threshold else None)
        self._granted = self._dense_left = 0  # calls of shape _dense_shape auto granted / still to run dense
        self._dense_shape: torch.Size | None = None
        self._grant_in_capture = False  # the grant also covers calls captured into CUDA graphs
        self.ffn_backend = "auto"
        self.last_path = ""
        self._views = None  # Phi-3: cached gate/up views (the dispatcher keys a layer by its W_gate object)

    def _apply(self, fn, recurse=True):
        """nn.Module._apply, then the threshold back in float32 if fn cast it (model.to(bf16), .half(),
        .double()): the comparison is defined against float32 theta, and bf16 would move the thresholds."""
        theta = self.threshold
        out = super()._apply(fn, recurse)
        moved = self.threshold
        if theta is not None and moved is not None and moved.dtype != torch.float32:
            self.threshold = theta.to(device=moved.device)  # the exact float32 values, on fn's device
        return out

    @property
    def ffn_backend(self) -> str:
        return self._ffn_backend

    @ffn_backend.setter
    def ffn_backend(self, backend: str) -> None:
        self._settle_grant()  # a grant is auto's: another backend ends it
        self._ffn_backend = backend

    def _settle_grant(self) -> None:
        """End the current grant, telling auto how many of its calls ran (its refresh period counts them)."""
        if self._granted:
            used, shape = self._granted - self._dense_left, self._dense_shape
            self._granted = self._dense_left = 0
            if used:
                dense_used(self.gate_weight(), shape.numel() // shape[-1], used)

    def _projections(self) -> list[nn.Module]:
        return [self.gate_up_proj, self.down_proj] if self.fused else [self.gate_proj, self.up_proj, self.down_proj]

    def kernel_reason(self, x: torch.Tensor) -> str | None:
        """None when the TwELL path may run; otherwise why the dense torch path runs instead."""
        if _KERNELS_MISSING:
            return _KERNELS_MISSING
        if self.ffn_backend == "auto" and dense_capture_active():
            return TWIN  # the step check's all-dense twin (under torch.compile: fusable torch ops, not the op)
        if not x.is_cuda:
            return "input is not on a CUDA device"
        if self.ffn_backend == "dense":
            return "ffn_backend='dense'"
        if torch.is_grad_enabled() and (self.training or any(p.requires_grad for p in self.parameters())):
            return "gradients enabled (training path calls the nn.Linear modules)"
        if any(type(m) is not nn.Linear or m.bias is not None for m in self._projections()):
            return "projections carry biases or adapters"
        return None

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.fused:
            return self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight
        w = self.gate_up_proj.weight  # [2F, d], gate rows first
        key = (w.data_ptr(), w._version)
        if self._views is None or self._views[0] != key:
            f = w.shape[0] // 2
            self._views = (key, w[:f], w[f:])  # [F, d] each
        return self._views[1], self._views[2], self.down_proj.weight

    def auto_decisions(self) -> dict[int, dict]:
        """What `auto` decided for this layer, per M bucket (eager and graph replay), with the density and why."""
        return auto_decisions(self.gate_weight())

    def gate_weight(self) -> torch.Tensor:
        """W_gate [F, d] as the kernels see it (the object the dispatcher keys this layer by)."""
        return self._weights()[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (is_compiling first: dynamo must not guard on the countdown, or every call would recompile)
        if (not torch.compiler.is_compiling() and self._dense_left and x.shape == self._dense_shape
                and (self._grant_in_capture or not _capturing())):
            self._dense_left -= 1  # granted by auto: last_path is still the granting call's "twell_ffn:dense"
            return self._torch_ffn(x)
        reason = self.kernel_reason(x)
        if reason is None:
            compiling = torch.compiler.is_compiling()
            if not compiling:
                self._settle_grant()
            w_gate, w_up, w_down = self._weights()  # [F, d], [F, d], [d, F]
            y = twell_ffn(x, w_gate, w_up, w_down, backend=self.ffn_backend, threshold=self.threshold)
            if not compiling:  # (traced: the op's path is only known when it runs)
                _announce(f"twell_ffn (backend={self.ffn_backend})", "CUDA inference with Triton")
                ran = last_backend()
                self.last_path = f"twell_ffn:{ran}"
                if self.ffn_backend == "auto" and ran == "dense":  # (a twell call gets no grant: no lookup)
                    grant, self._grant_in_capture = grant_dense(w_gate, x.numel() // x.shape[-1])
                    self._granted = self._dense_left = grant
                    self._dense_shape = x.shape
            return y
        if not torch.compiler.is_compiling():
            self.last_path = "torch"
            if reason != TWIN:  # (the twin is a check inside a capture, not the path the model runs)
                _announce("torch", reason)
        return self._torch_ffn(x)

    def _torch_ffn(self, x: torch.Tensor) -> torch.Tensor:
        """The stock model's expression through the nn.Linear modules (what stock transformers runs), with the
        threshold where there is one (plain autograd of g * [g > theta] * up)."""
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(up * threshold_act(gate, self.threshold))
        return self.down_proj(threshold_act(self.gate_proj(x), self.threshold) * self.up_proj(x))


def sparsify_mlps(model: nn.Module, threshold: bool = False) -> int:
    """Replace every gated MLP module in `model` by a SparseMLP sharing its projections (with a threshold
    buffer each when `threshold`); returns the count."""
    targets = [(name, m) for name, m in model.named_modules()
               if not isinstance(m, SparseMLP) and hasattr(m, "down_proj")
               and (hasattr(m, "gate_up_proj") or (hasattr(m, "gate_proj") and hasattr(m, "up_proj")))]
    for name, mlp in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, SparseMLP(mlp, threshold=threshold))
    return len(targets)


def set_ffn_backend(model: nn.Module, backend: str) -> None:
    """Set `ffn_backend` on every SparseMLP of `model` ("auto", "twell" or "dense")."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    for m in model.modules():
        if isinstance(m, SparseMLP):
            m.ffn_backend = backend


def default_backend(config) -> str:
    """The FFN backend a model starts with: `sparsify.ffn_backend` if the folder pins one, else "auto".

    "auto" (the kernels' dispatcher) decides per layer, per power-of-two token-count bucket and per regime
    (eager calls, calls captured in CUDA graphs) from that layer's measured density and paired timings,
    so a folder at moderate sparsity decodes on TwELL under graphs where that wins and prefills dense."""
    info = getattr(config, "sparsify", None) or {}
    if info.get("ffn_backend") in BACKENDS:
        return info["ffn_backend"]
    return "auto"


def threshold_mode(config) -> str | None:
    """The folder's threshold mode ("layer" | "neuron") from config.sparsify.threshold; None: no thresholds."""
    info = getattr(config, "sparsify", None) or {}
    threshold = info.get("threshold") if isinstance(info, dict) else None
    return (threshold.get("mode") or "neuron") if isinstance(threshold, dict) else None


_classes: dict[str, type] = {}


def _sparse_class(base_name: str) -> type:
    base = getattr(transformers, base_name)

    def __init__(self, config, *args, **kwargs):
        # the base class builds its MLPs from the activation field: "relu" while it does (the threshold is ours)
        fields = [f for f in ACT_FIELDS if getattr(config, f, None) == THRESHOLD_ACT]
        for field in fields:
            setattr(config, field, "relu")
        try:
            base.__init__(self, config, *args, **kwargs)
        finally:
            for field in fields:
                setattr(config, field, THRESHOLD_ACT)
        sparsify_mlps(self, threshold=bool(fields) or threshold_mode(config) is not None)
        set_ffn_backend(self, default_backend(config))
        info = getattr(config, "sparsify", None) or {}
        enable_fast_decode(self, enabled=info.get("fast_decode", True) is not False,
                           compile=info.get("compile_decode", True) is not False)

    def _initialize_missing_keys(self, *args, **kwargs):
        """from_pretrained's init of what the checkpoint lacked, then zeros for thresholds it lacked: transformers
        materialises a missing buffer uninitialised, and SparseMLP sits inside the base model, whose own
        _init_weights does not know it (loaded tensors carry transformers' _is_hf_initialized flag)."""
        base._initialize_missing_keys(self, *args, **kwargs)
        missing = [name for name, m in self.named_modules() if isinstance(m, SparseMLP) and m.threshold is not None
                   and not getattr(m.threshold, "_is_hf_initialized", False)]
        for name in missing:
            self.get_submodule(name).threshold.zero_()
        if missing:
            logger.warning("sparsify: the checkpoint has no thresholds for %s; they run at 0 (plain ReLU)",
                           ", ".join(missing))

    cls = type(f"Sparse{base_name}", (base,), {
        "__init__": __init__, "__module__": __name__, "__doc__": f"{base_name} with SparseMLP FFNs.",
        "set_ffn_backend": set_ffn_backend, "enable_fast_decode": enable_fast_decode,
        "_initialize_missing_keys": _initialize_missing_keys,
    })
    return cls


def __getattr__(name: str) -> type:
    """`Sparse<Base>` for any transformers `<Base>` causal LM, built once on first access (PEP 562)."""
    if name.startswith("Sparse") and name.endswith("ForCausalLM"):
        if name not in _classes:
            _classes[name] = _sparse_class(name[len("Sparse"):])
        return _classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
