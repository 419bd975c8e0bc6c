"""train.kernels: which training MLPs run the packed-activation FFN kernels (kernels/train/twell_train.py), and
with what capacity.

    kernels = PackedFFN(mlps.layers, mode)              # "dense" | "twell" | "auto"; mlps: train/mlp.py TrainMLPs
    ...
    kernels.update(stats.zeros, stats.nonzeros)         # at logged steps (reads device stats: host sync)

A packed layer's training forward (TrainMLP.terms) runs sparse_ffn_train(x, gate, up, down) instead of the three
Linear calls, so autograd keeps a bitmask and the active gate/up values instead of three dense [tokens, F] tensors
(the gradients are those of the dense expression, to the dtype's rounding), and the kernel returns the L1 term,
the count of h != 0 and the fired neurons the dense expression gives. Evaluation and no-grad forwards run the
dense expression.

Modes: "dense" packs nothing; "twell" packs every layer from the first step; "auto" packs a layer once its
measured zeros reach AUTO_ON and returns it to dense below AUTO_OFF (hysteresis: a layer near the threshold
does not flip at every logged step, and every flip recompiles a compiled model).

Capacity (packed values per row, C): from the last recorded forward's per-row count of active slots,
HEADROOM x its p99, rounded up on a grid of four values per doubling, multiples of 16 (capacity_grid); grown
as soon as the need exceeds C, shrunk only when the need falls to C / 2 or less. C is a shape of the saved tensors, so
under torch.compile each change recompiles: the coarse grid and the one-sided hysteresis keep changes rare.
Before any measurement: MEAN_HEADROOM x the mean non-zeros per token + 32 (update's nonzeros_per_layer),
else the kernel's default F / 4. Rows beyond C are never wrong (module docstring of twell_train), only
slower and larger.

Families: separate gate_proj/up_proj and Phi-3's fused gate_up_proj (its first F rows are the gate) are packed;
an MLP with biases runs dense (logged once). LoRA-wrapped projections are refused (the adapters' own
autograd would be bypassed). The activation must be ReLU (a converted model), or the training side's threshold
activation: a float32 buffer `theta` [F], read at every forward (h = g [g > theta] * up, the exact gradient; a
straight-through estimator is refused by the recipe checks with packed kernels).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch
from torch import nn

from sparsify.errors import SparsifyError
from sparsify.kernels.train.twell_train import default_capacity
from sparsify.train.mlp import TrainMLP

log = logging.getLogger("sparsify.train.packed_ffn")

MODES = ("dense", "twell", "auto")
# auto: a layer switches to the packed path at >= AUTO_ON zeros and back to dense below AUTO_OFF. The packed
# path saves >= 50% of the FFN's activation memory from ~45% zeros on (bf16: (F / 8 + 4 C) / (6 F) with C ~
# 1.3 (1 - zeros) F) but runs slower than dense (eval/bench/bench_train_ffn.py), so auto is a memory setting (larger
# batches or sequences), not a speed one: 0.85 packs the layers sparse enough to save most.
AUTO_ON = 0.85
AUTO_OFF = 0.80
HEADROOM = 1.25  # capacity = HEADROOM x p99 of the per-row active counts (~1% of rows overflow to the side buffer)
MEAN_HEADROOM = 1.5  # without a measured distribution: 1.5 x mean non-zeros per token + 32
SHRINK = 0.5  # shrink the capacity only when the need is at most SHRINK x the current capacity


def capacity_grid(need: float, f: int) -> int:
    """need rounded up to a multiple of max(16, 2^(floor(log2 need) - 2)), at most F: four grid values per
    doubling (..., 1024, 1280, 1536, 1792, 2048, ...), so at most 25% (and 16) above the need."""
    n = max(float(need), 1.0)
    step = max(16, 2 ** (math.floor(math.log2(n)) - 2))
    return min(f, max(16, step * math.ceil(n / step)))


class PackedFFN:
    """The train.kernels decision of every training MLP (TrainMLP.kernel: packed or dense, capacity)."""

    def __init__(self, mlps: list[TrainMLP], mode: str):
        if mode not in MODES:
            raise SparsifyError(f"train.kernels={mode!r} is not one of {MODES}.")
        self.mode = mode
        self.layers: list[TrainMLP] = []  # every layer ([] in mode dense)
        self.supported: list[bool] = []  # False: biases, always dense
        self.changes: list[str] = []  # what the last update() switched, for the trainer's log
        if mode == "dense":
            return
        for index, mlp in enumerate(mlps):
            supported = self._check(index, mlp)
            mlp.kernel.packed = supported and mode == "twell"
            self.layers.append(mlp)
            self.supported.append(supported)
        log.info("train.kernels=%s: %d MLPs (%d packed now)", mode, len(self.layers), len(self.packed_layers))

    def _check(self, index: int, mlp: TrainMLP) -> bool:
        """Refuses LoRA and an activation the kernels do not compute; False for an MLP with biases."""
        projs = {"gate_up_proj": mlp.gate_up_proj} if mlp.fused else {"gate_proj": mlp.gate_proj, "up_proj": mlp.up_proj}
        projs["down_proj"] = mlp.down_proj
        for name, proj in projs.items():
            if hasattr(proj, "base_layer") or hasattr(proj, "lora_A"):
                raise SparsifyError(
                    f"train.kernels={self.mode!r} cannot train LoRA adapters: layer {index} {name} is LoRA-wrapped "
                    "(lora.r > 0). Set train.kernels=dense to keep LoRA, or lora.r=0 for a full fine-tune with "
                    "the packed FFN kernels.")
        if not (isinstance(mlp.act, nn.ReLU) or getattr(mlp.act, "theta", None) is not None):
            raise SparsifyError(
                f"train.kernels={self.mode!r} computes relu(gate) * up (or g [g > theta] * up with a threshold "
                f"activation), but layer {index}'s MLP activation is {type(mlp.act).__name__}; convert the model to "
                "ReLU first (sparsify convert), or set train.kernels=dense.")
        supported = all(getattr(p, "bias", None) is None for p in projs.values())
        if not supported:
            log.info("train.kernels: layer %d MLP has biases; it runs the dense path", index)
        return supported

    @property
    def packed(self) -> list[bool]:
        """Per layer: whether its next training forward runs the packed kernels."""
        return [layer.kernel.packed for layer in self.layers]

    @property
    def packed_layers(self) -> list[int]:
        return [i for i, packed in enumerate(self.packed) if packed]

    @property
    def capacities(self) -> list[int]:
        """The capacity each layer's packed path uses now (the kernel's default until update() sets one)."""
        return [layer.kernel.capacity or default_capacity(layer.width) for layer in self.layers]

    def update(self, zeros_per_layer: list[float], nonzeros_per_layer: list[float] | None = None) -> list[int]:
        """Per-layer decisions from a logged step's stats (StepStats.zeros / .nonzeros); returns the packed
        layers. Reads the last recorded per-row counts (a host sync: call it where the trainer syncs anyway).
        Changes are logged and kept in `self.changes`."""
        self.changes = []
        for i, (layer, supported) in enumerate(zip(self.layers, self.supported)):
            if not supported:
                continue
            z, k = zeros_per_layer[i], layer.kernel
            if self.mode == "auto" and not k.packed and z >= AUTO_ON:
                k.packed = True
                self.changes.append(f"layer {i}: packed FFN ({z:.1%} zeros >= {AUTO_ON:.0%})")
            elif self.mode == "auto" and k.packed and z < AUTO_OFF:
                k.packed = False
                k.counts = None
                self.changes.append(f"layer {i}: dense FFN ({z:.1%} zeros < {AUTO_OFF:.0%})")
            mean = nonzeros_per_layer[i] if nonzeros_per_layer is not None else None
            self._set_capacity(i, layer, mean)
        for line in self.changes:
            log.info("train.kernels: %s", line)
        return self.packed_layers

    def _set_capacity(self, index: int, layer: TrainMLP, mean_nonzeros: float | None) -> None:
        k = layer.kernel
        if k.counts is not None and k.counts.numel() > 0:
            need = HEADROOM * float(torch.quantile(k.counts.float(), 0.99))
        elif mean_nonzeros is not None:
            need = MEAN_HEADROOM * mean_nonzeros + 32
        else:
            return
        want = capacity_grid(need, layer.width)
        old = k.capacity if k.capacity is not None else default_capacity(layer.width)
        if want > old or want <= SHRINK * old:
            k.capacity = want
            if k.packed:
                self.changes.append(f"layer {index}: capacity {old} -> {want} (need {need:.0f} per row)")

    def state_dict(self) -> dict:
        """Per-layer decisions, for checkpoints (a resumed run then takes the same path from its first step)."""
        return {"mode": self.mode, "packed": self.packed, "capacity": [layer.kernel.capacity for layer in self.layers]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("mode") != self.mode or len(state.get("packed", [])) != len(self.layers):
            return  # another mode or model: start from this mode's defaults
        for layer, supported, packed, capacity in zip(self.layers, self.supported, state["packed"], state["capacity"]):
            layer.kernel.packed = packed and supported
            layer.kernel.capacity = capacity


def saved_bytes(fn: Callable[[], Any], exclude: tuple[torch.Tensor, ...] = ()) -> dict:
    """Bytes autograd saves for backward while `fn()` runs (each storage counted once), as
    {"total": bytes, "excluded": bytes of the storages of `exclude` (e.g. x and the weights),
    "activations": total - excluded, "tensors": [(shape, dtype, bytes), ...]}. fn's outputs are kept alive
    until the count is done (a freed storage's address could be reused by a later saved tensor)."""
    seen: dict[int, tuple] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen.setdefault(st.data_ptr(), (tuple(t.shape), str(t.dtype).replace("torch.", ""), st.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    total = sum(v[2] for v in seen.values())
    excluded = sum(v[2] for k, v in seen.items() if k in skip)
    del out
    return {"total": total, "excluded": excluded, "activations": total - excluded,
            "tensors": sorted(seen.values(), key=lambda v: -v[2])}


def dense_saved_bytes(m: int, f: int, element_size: int) -> int:
    """What dense autograd of the FFN saves beyond x and the weights: relu(gate), up, h ([M, F] each)."""
    return 3 * m * f * element_size


__all__ = ["PackedFFN", "saved_bytes", "dense_saved_bytes", "capacity_grid", "MODES",
           "AUTO_ON", "AUTO_OFF"]
