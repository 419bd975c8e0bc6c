# Shipped verbatim inside every sparsify model folder (loaded with trust_remote_code=True), beside the
# decode engine (fast_decode.py) and the kernel files. Imports only torch, transformers and its siblings.
"""Sparse-FFN causal LMs: the family's own transformers class with its gated MLPs replaced by SparseMLP.

`config.json` keeps the family's `model_type` with a ReLU activation, so stock transformers loads the same
folder as a dense ReLU model; `auto_map` points AutoModelForCausalLM here, to `Sparse<Base>` (for example
`SparseLlamaForCausalLM`), built on first access from `transformers.<Base>`.

SparseMLP keeps the parameter names (gate_proj / up_proj / down_proj, or Phi-3's fused gate_up_proj), so
state dicts load unchanged, and it calls those modules whenever gradients may flow (training, LoRA). Its forward
is one call into the model's FFNRuntime (ffn_runtime.py: the backend, auto's decisions, the backend table), which
at inference on CUDA with Triton, and on the CPU (its sparse row, cpu_sparse.py), runs the row of its backend table
that its answer names, and anywhere else the layer's own torch expression (`torch_ffn`), identical to the stock
model's.

Thresholded folders (FATReLU / JumpReLU-style, h = g * [g > theta] * up): config.json's activation field
(`hidden_act`, Gemma 2/3: `hidden_activation`) holds THRESHOLD_ACT, which stock transformers refuses
(KeyError naming it: never a dense ReLU model without the thresholds), and the `sparsify` section holds
`"threshold": {"mode": "layer" | "neuron"}`. `Sparse<Base>` builds the base model with "relu" in that field,
restores THRESHOLD_ACT on the config (save_pretrained round-trips) and gives every SparseMLP a persistent
float32 buffer `threshold` [F] (state-dict key `<mlp path>.threshold`), float32 whatever the model's dtype.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn as nn
import transformers

from .cpu_sparse import pack_linears
from .fast_decode import FastDecode, enable_fast_decode, fast_decode_of
from .ffn_runtime import BACKENDS, TWIN, FFNRuntime, check_backend
from .twell_reference import threshold_act

__all__ = ["SparseMLP", "sparsify_mlps", "set_ffn_backend", "default_backend", "enable_fast_decode", "FastDecode",
           "fast_decode_of", "THRESHOLD_ACT", "threshold_mode", "FFNRuntime", "TWIN"]
# The activation field of a thresholded folder: not an activation stock transformers knows, so its model classes
# refuse the folder (KeyError naming this string) instead of building a ReLU model that drops the thresholds.
THRESHOLD_ACT = "relu_threshold (load with trust_remote_code=True)"
ACT_FIELDS = ("hidden_act", "hidden_activation")  # where a family's config names its MLP activation
logger = logging.getLogger("sparsify")


class SparseMLP(nn.Module):
    """relu(gate_proj(x)) * up_proj(x) -> down_proj, with a TwELL kernel path for CUDA inference. With
    `threshold=True` the gate activation is g * [g > theta] (twell_reference.threshold_act), theta the
    persistent float32 buffer `threshold` [F] (zeros until a state dict fills it; float32 under any .to(),
    .half(), from_pretrained(dtype=)); without, that buffer is None (not in the state dict).

    The FFN path belongs to the model's FFNRuntime (ffn_runtime.py; `runtime`, shared by the model's layers, or
    one of its own when built alone): forward is one call into it, which reads what the layer exposes for it:
    `weights()`, `torch_ffn(x)`, `projections()`, `gate_weight()`, `threshold`, and `ffn_layer` (the runtime's
    record of this layer: the answer it holds). `ffn_backend` ("auto" | "twell" | "dense", read-only:
    model.set_ffn_backend switches it) is the runtime's; `last_path` the path this layer's last forward took:
    "twell_ffn:twell" / "twell_ffn:dense" (the backend table's row that ran) or "torch" (the nn.Linear modules).
    A layer holds auto's answer for its calls up to the next density refresh (ffn_runtime.py, "Held answers"):
    dense runs its torch expression, twell the table's TwELL row, without asking.
    """

    def __init__(self, mlp: nn.Module, threshold: bool = False, runtime: FFNRuntime | None = None):
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
        self._views = None  # Phi-3: cached gate/up views (the dispatcher keys a layer by its W_gate object)
        (runtime if runtime is not None else FFNRuntime()).attach(self)  # sets self.runtime and self.ffn_layer

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
        return self.runtime.backend

    @property
    def last_path(self) -> str:
        return self.ffn_layer.path

    def projections(self) -> list[nn.Module]:
        """The projection modules (plain nn.Linear without bias, unless adapters or quantisation replaced them)."""
        return [self.gate_up_proj, self.down_proj] if self.fused else [self.gate_proj, self.up_proj, self.down_proj]

    def kernel_reason(self, x: torch.Tensor) -> str | None:
        """None when the TwELL path may run; otherwise why the dense torch path runs instead."""
        return self.runtime.kernel_reason(self, x)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(W_gate [F, d], W_up [F, d], W_down [d, F]) as the kernels read them (Phi-3: views of gate_up_proj)."""
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
        return self.runtime.decisions(self)

    def gate_weight(self) -> torch.Tensor:
        """W_gate [F, d] as the kernels see it (the object the dispatcher keys this layer by)."""
        return self.weights()[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.runtime.ffn(self, x)

    def torch_ffn(self, x: torch.Tensor) -> torch.Tensor:
        """The stock model's expression through the nn.Linear modules (what stock transformers runs), with the
        threshold where there is one (plain autograd of g * [g > theta] * up)."""
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(up * threshold_act(gate, self.threshold))
        return self.down_proj(threshold_act(self.gate_proj(x), self.threshold) * self.up_proj(x))


def sparsify_mlps(model: nn.Module, threshold: bool = False, runtime: FFNRuntime | None = None) -> int:
    """Replace every gated MLP module in `model` by a SparseMLP sharing its projections (with a threshold
    buffer each when `threshold`), all on one FFNRuntime (`runtime`, else the model's, else a new one), kept
    as `model.ffn_runtime`; returns the count."""
    targets = [(name, m) for name, m in model.named_modules()
               if not isinstance(m, SparseMLP) and hasattr(m, "down_proj")
               and (hasattr(m, "gate_up_proj") or (hasattr(m, "gate_proj") and hasattr(m, "up_proj")))]
    runtime = runtime or model.__dict__.get("ffn_runtime") or FFNRuntime()
    model.ffn_runtime = runtime
    for name, mlp in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, SparseMLP(mlp, threshold=threshold, runtime=runtime))
    return len(targets)


def set_ffn_backend(model: nn.Module, backend: str) -> None:
    """Switch the FFN runtime of every SparseMLP of `model` to `backend` ("auto", "twell" or "dense")."""
    check_backend(backend)
    for runtime in {id(m.runtime): m.runtime for m in model.modules() if isinstance(m, SparseMLP)}.values():
        runtime.set_backend(backend)


def pack_cpu_linears(model: nn.Module, enabled: bool = True) -> int:
    """CPU decode speed: the model's nn.Linear layers outside its FFNs (attention projections, LM head) run their
    bf16 CPU inference calls on weights packed once for oneDNN (cpu_sparse.PackedLinear: the same bits, no per-call
    reorder; the FFNs' sparse row packs its gate itself). A sparsify model's first generate() on the CPU in bf16
    does this itself (unless its folder sets `sparsify.pack_cpu: false`). Costs a second copy of those weights, made
    on each layer's first CPU call; `enabled=False` frees it, and generate() then leaves the layers unpacked.
    Returns how many layers it switched."""
    fast = fast_decode_of(model)
    if fast is not None:
        fast.cpu_pack = None  # decided here: generate() packs no more on its own
    return pack_linears(model, enabled, skip=(SparseMLP,))


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
        sparsify_mlps(self, threshold=bool(fields) or threshold_mode(config) is not None,
                      runtime=FFNRuntime(default_backend(config)))  # the model's one runtime (ffn_runtime.py)
        info = getattr(config, "sparsify", None) or {}
        fast = enable_fast_decode(self, enabled=info.get("fast_decode", True) is not False,
                                  compile=info.get("compile_decode", True) is not False)
        if info.get("pack_cpu", True) is not False:  # the first generate() on the CPU in bf16 packs (pack_cpu_linears)
            fast.cpu_pack = functools.partial(pack_cpu_linears, self)

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

    # __name__ is the base's: transformers' pipelines accept a model by its class name (check_model_type against
    # the task's mapping), save_pretrained writes it as the architecture; __qualname__ (repr) says Sparse<Base>.
    cls = type(base_name, (base,), {
        "__init__": __init__, "__module__": __name__, "__qualname__": f"Sparse{base_name}",
        "__doc__": f"{base_name} with SparseMLP FFNs.", "set_ffn_backend": set_ffn_backend,
        "enable_fast_decode": enable_fast_decode, "pack_cpu_linears": pack_cpu_linears,
        "_initialize_missing_keys": _initialize_missing_keys,
    })
    return cls


def __getattr__(name: str) -> type:
    """`Sparse<Base>` for any transformers `<Base>` causal LM, built on first access (PEP 562) and kept as a module
    attribute under both names (later accesses find it there): folders' auto_map names `Sparse<Base>`, and
    save_pretrained of a loaded model writes `<Base>` (the class's __name__)."""
    base_name = name.removeprefix("Sparse")
    base = getattr(transformers, base_name, None) if name.endswith("ForCausalLM") else None
    if isinstance(base, type) and issubclass(base, transformers.PreTrainedModel):
        cls = globals().get(f"Sparse{base_name}") or _sparse_class(base_name)
        globals()[f"Sparse{base_name}"] = globals()[base_name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
