"""The sparse FFN on the CPU: the backend table's ("cpu", "twell") row (ffn_runtime.py), plain torch ops; and the
packed bf16 GEMM it runs its gate on, which `pack_linears` also gives a model's other nn.Linear layers (opt-in).

Legend: M = tokens, d = hidden size, F = intermediate size, k = active neurons. Weights in nn.Linear layout.

Decode on the CPU is memory-bound: a dense step reads W_gate, W_up and W_down whole. This row reads W_gate whole
(the gate decides which neurons fire) and then only the rows of W_up and of W_down^T [F, d] whose gate fired:
    g = x W_gate^T                          [M, F]   the dense expression's own gate GEMM, in x's dtype (bf16: on
                                                     W_gate packed once, below)
    on = g > theta (or g > 0: ReLU)         [M, F]   theta [F] float32, compared as threshold_act compares it
    cols = neurons active in some token     [k]      (the union over the M tokens; M = 1: the token's own)
    u = x W_up[cols]^T                      [M, k]   index_select of k rows, one GEMM
    h = act(g[:, cols]) * u                 [M, k]   the dense expression's elementwise product, same rounding
    y_m = sum over token m's active j of h_mj W_down^T[j]   one embedding_bag: per token, only its own rows
W_down^T is the copy the runtime's dispatcher keeps per W_down version (Dispatcher.down_t, made on first use and
dropped when every bucket of the layer decided dense): contiguous rows, where W_down's columns would be a strided
read of d cache lines per neuron. The function is the dense FFN's: the same g, the same mask, the same h values;
only the down projection's sum runs over the active terms alone (order: rounding of the dtype's accumulator).

The gate GEMM in bf16 runs on W_gate packed once into oneDNN's blocked layout (`pack`, kept by the dispatcher per
W_gate version beside W_down^T): F.linear's bf16 GEMM on the CPU is the same oneDNN kernel, but it reorders the
weight into that layout at every call, which reads and writes W_gate once more; packed, the call is ~1.9x faster at
576x1536 and 2048x8192, M = 1, and gives the same bits (the same kernel and blocking). float32 packed sums in another
order (not the dense function's bits), float16 needs AVX-NE-CONVERT: both keep F.linear, as does a CPU where oneDNN
has no bf16 linear (then `pack` returns None).

kernels/NOTES.md ("CPU sparse decode", issue 43) has the measurements behind the choice of ops. `auto` decides per
layer and M bucket from paired wall-clock timings of this row against dense (dispatch.py, HostClock), so prefill
and large M stay dense.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .twell_reference import threshold_act

SMALL_UP = 1 << 17  # elements of W_up[cols] up to which a 16-bit up projection runs in float32 (up_rows)


def active(g: torch.Tensor, threshold: torch.Tensor | None = None) -> torch.Tensor:
    """[..., F] bool: the gate values the activation keeps, g > theta (float32 theta [F]) or g > 0."""
    return g > (0 if threshold is None else threshold)


def active_count(x2d: torch.Tensor, w_gate: torch.Tensor, threshold: torch.Tensor | None = None) -> torch.Tensor:
    """The density probe's count on the CPU: active gate values of x2d [M, d] (int64 scalar tensor)."""
    return active(F.linear(x2d, w_gate), threshold).sum()


def pack(w: torch.Tensor) -> torch.Tensor | None:
    """W [F, d] (bf16) packed for gemm's x W^T in oneDNN's blocked layout (a copy as large as W), or None where the
    packed call would not give F.linear's bits or cannot run: another dtype, no oneDNN, no bf16 linear on this CPU."""
    if w.dtype != torch.bfloat16 or w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)
    except (RuntimeError, AttributeError):  # e.g. "mkldnn_reorder_linear_weight: bf16 path needs the cpu support ..."
        return None


def weight_key(w: torch.Tensor) -> tuple:
    """What a packed copy of w was made from: its storage, dtype, device and in-place version (an inference tensor
    has no version; `w.data` edited in place bypasses it, as for every per-version copy the bundle keeps)."""
    return (w.data_ptr(), w.dtype, w.device, -1 if w.is_inference() else w._version)


def gemm(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None = None,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias), or on `packed` (pack(w)) the same oneDNN kernel without its per-call reorder (F.linear
    too while oneDNN is switched off, torch.backends.mkldnn.flags(enabled=False): it leaves oneDNN then)."""
    if packed is None or x.dtype != torch.bfloat16 or not torch.backends.mkldnn.enabled:
        return F.linear(x, w, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")


def up_rows(x2d: torch.Tensor, w_up: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """x2d W_up[cols]^T [M, k] in x's dtype. A small 16-bit product runs in float32 and is rounded once (what a
    16-bit GEMM's float32 accumulator gives): oneDNN's 16-bit GEMM costs ~15 us of setup at every new k, more than
    the conversion of the k rows (kernels/NOTES.md, "CPU sparse decode")."""
    rows = w_up.index_select(0, cols)  # [k, d]
    if x2d.dtype not in (torch.bfloat16, torch.float16) or rows.numel() > SMALL_UP:
        return F.linear(x2d, rows)
    return F.linear(x2d.float(), rows.float()).to(x2d.dtype)


def sparse_ffn(x2d: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor,
               threshold: torch.Tensor | None = None, on_count=None, gate_packed: torch.Tensor | None = None
               ) -> torch.Tensor:
    """The FFN on x2d [M, d] reading W_gate [F, d] whole (`gate_packed`: pack(W_gate)) and only the active rows of
    W_up [F, d] and W_down^T [F, d] (module doc); `on_count` (a density refresh) gets the count of active gate
    values."""
    g = gemm(x2d, w_gate, gate_packed)  # [M, F]
    on = active(g, threshold)  # [M, F]
    if on_count is not None:
        on_count(on.sum())
    if x2d.shape[0] == 1:  # decode: the token's own neurons, no union to build
        cols = on[0].nonzero().squeeze(1)  # [k]
        if not cols.numel():  # (embedding_bag takes no empty 2-D bag)
            return x2d.new_zeros(1, w_down_t.shape[1])
        h = g.index_select(1, cols) * up_rows(x2d, w_up, cols)  # [1, k] (g > theta there: act(g) = g)
        return F.embedding_bag(cols.unsqueeze(0), w_down_t, mode="sum", per_sample_weights=h)  # [1, d]
    cols = on.any(0).nonzero().squeeze(1)  # [k] the union over the tokens
    u = up_rows(x2d, w_up, cols)  # [M, k]
    h = threshold_act(g.index_select(1, cols), None if threshold is None else threshold[cols]) * u  # 0 where off
    rows, pos = on[:, cols].nonzero(as_tuple=True)  # each token's active entries, in token order
    offsets = torch.zeros(x2d.shape[0], dtype=torch.long)
    offsets[1:] = torch.bincount(rows, minlength=x2d.shape[0])[:-1].cumsum(0)
    return F.embedding_bag(cols[pos], w_down_t, offsets, mode="sum", per_sample_weights=h[rows, pos])  # [M, d]


def sparse_rows(auto, x, w_gate, w_up, w_down, w_down_t=None, threshold=None, on_count=None):
    """The backend table's ("cpu", "twell") row: sparse_ffn on x [..., d] as [M, d] rows, W_down^T the caller's
    or the one `auto` (the runtime's Dispatcher) keeps per W_down version, W_gate packed as auto keeps it."""
    x2d = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, x.shape[-1]).contiguous()
    out = sparse_ffn(x2d, w_gate, w_up, auto.down_t(w_down, w_down_t), threshold, on_count, auto.packed(w_gate))
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


class PackedLinear(nn.Linear):
    """An nn.Linear whose bf16 inference calls on the CPU run on its weight packed once (pack / gemm): F.linear's
    bits without its per-call reorder. Other dtypes and devices, gradients (any of x, weight, bias requiring them),
    oneDNN switched off and torch.compile take F.linear, as does a non-contiguous input with a bias (F.linear adds
    that bias in a second rounding step there). The packed copy (as large as the weight) is kept per weight_key,
    outside the state dict, and dropped by `.to()` / `.cuda()` / `.half()` (_apply) and by pickling or deepcopy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype != torch.bfloat16 or x.device.type != "cpu" or torch.compiler.is_compiling()
                or (self.bias is not None and not x.is_contiguous())
                or (torch.is_grad_enabled() and (x.requires_grad or any(
                    p.requires_grad for p in (self.weight, self.bias) if p is not None)))):
            return F.linear(x, self.weight, self.bias)
        key, kept = self.__dict__.get("packed_cpu", (None, None))
        if key != weight_key(self.weight):
            key, kept = self.__dict__["packed_cpu"] = (weight_key(self.weight), pack(self.weight))
        return gemm(x, self.weight, kept, self.bias)  # (F.linear where kept is None or oneDNN is off)

    def _apply(self, fn, *args, **kwargs):
        self.__dict__.pop("packed_cpu", None)  # a move or cast: the copy would be stale, or hold CPU memory
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):
        state = super().__getstate__()
        return {k: v for k, v in state.items() if k != "packed_cpu"}  # (an opaque oneDNN tensor has no storage)


def pack_linears(model: nn.Module, enabled: bool = True, skip: tuple[type, ...] = ()) -> int:
    """Run `model`'s nn.Linear layers (those inside modules of a `skip` type excepted) as PackedLinear, or back
    (`enabled` False: packed copies freed). Returns how many layers it switched. On the CPU in bf16 each packed
    layer holds a second copy of its weight, made on its first call: decode's GEMVs then run ~1.6-1.9x faster
    (kernels/NOTES.md, "CPU sparse decode"), the model's memory grows by those weights."""
    inside = {id(m) for s in model.modules() if isinstance(s, skip) for m in s.modules()} if skip else set()
    switched = 0
    for module in model.modules():
        if id(module) in inside:
            continue
        if enabled and type(module) is nn.Linear:
            module.__class__ = PackedLinear
            switched += 1
        elif not enabled and type(module) is PackedLinear:
            module.__dict__.pop("packed_cpu", None)
            module.__class__ = nn.Linear
            switched += 1
    return switched
