"""TwELL layout and plain-torch reference of the sparse gated FFN (test oracle and CPU fallback).

Legend: M = tokens, d = hidden size, F = intermediate size, T = tile width, S = slots per (row, tile),
NT = ceil(F / T) tiles per row. Weights in nn.Linear layout: W_gate [F, d], W_up [F, d], W_down [d, F].

The FFN: y = (act(x W_gate^T) * (x W_up^T)) W_down^T with act = relu, or with a per-neuron threshold theta [F]
(float32, >= 0; FATReLU / JumpReLU-style) act(g)_j = g_j * [g_j > theta_j] (`threshold_act`): g_j is compared
in the precision the dense path has it (the input dtype's value of g: bf16 / fp16 rounding of the fp32
accumulator to nearest even; fp32 inputs: the fp32 value) against theta_j in float32, strictly greater, and
the value kept is g_j itself. theta = 0 is relu (up to gate values that round to zero in the input dtype).

TwELL ("tiled ELL") layout used by our kernels
-----------------------------------------------
The intermediate dimension F is cut into NT tiles of T columns (the last one may be short). For each
(row, tile) the gate GEMM's epilogue keeps the active gate values (g > 0, or g > theta with a threshold)
in S = T / C slots, C being the compression factor:
- ``cnt`` [M, NT] int32: the TRUE number of active gate values in the (row, tile), even when it
  exceeds S.
- the S slots of each (row, tile), in one of two encodings (``TwellPacked.entries``):
  * "bf16" / "fp16" (the default for bf16/fp16 inputs): ``ent`` [M, NT, S] int32, one 32-bit
    word per slot: bits 31..16 = the 16-bit pattern of relu(g_j) rounded (to nearest even) to bf16 or
    fp16, bits 15..0 = the column WITHIN the tile, c = j - t * T (0 <= c < T <= 65536). The value is
    positive so bit 31 is 0 and the word is a non-negative int32. One store per entry in the gate
    GEMM's epilogue and one load per entry in the up/down kernel (half of the split encoding), and F
    is unlimited because the tile index comes from the slot's position. The value rounding equals the
    dense path's (cuBLAS writes the gate in bf16/fp16 before ReLU too).
  * "split" (fp32 inputs): ``col`` [M, NT, S] int32 global column index j and
    ``val`` [M, NT, S] float32 g_j (the fp32 GEMM accumulator, exact up to the GEMM's rounding).
  In both, entries are in ascending column order within the tile (slot = rank among the tile's
  active columns, from a cumulative sum, so the layout is deterministic).
Slots at or beyond min(cnt, S) are undefined (never read).

The paper's layout (one uint32 per slot, bf16 value bits << 16 | uint16 column, slot 0 = count) is the
"bf16" encoding except that the count lives in ``cnt`` (so all S slots hold entries) and the column is
relative to the tile.

Overflow is lossless. A (row, tile) with cnt > S keeps its first S entries but is marked overflowed by
cnt itself; every consumer (the fused up/down kernel, `twell_unpack`) recomputes such a tile densely
from x and W_gate (applying theta, when there is one) instead of trusting its slots. No flag, no host sync, no dropped entries: rows with
every neuron active simply run densely.

Defaults: prefill T = 128, C = 8 (S = 16); decode (M <= 16) T = 32, S = 32 (C = 1: cannot overflow).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch

TILE = 128
SLOTS = 16
DECODE_TILE = 32
DECODE_SLOTS = 32


ENTRY_DTYPES = MappingProxyType({"bf16": torch.bfloat16, "fp16": torch.float16})


@dataclass
class TwellPacked:
    """Gate activations of M rows in TwELL layout (see module docstring)."""

    cnt: torch.Tensor  # [M, NT] int32, true count of active gate values per (row, tile)
    col: torch.Tensor | None  # "split": [M, NT, S] int32, global column index per slot
    val: torch.Tensor | None  # "split": [M, NT, S] float32, the kept gate value per slot
    tile: int  # T
    n_cols: int  # F
    ent: torch.Tensor | None = None  # "bf16"/"fp16": [M, NT, S] int32, value bits << 16 | column in tile
    entries: str = "split"  # "split" | "bf16" | "fp16"

    @property
    def slots(self) -> int:
        return (self.ent if self.ent is not None else self.col).shape[-1]

    @property
    def n_tiles(self) -> int:
        return self.cnt.shape[-1]

    def overflowed(self) -> torch.Tensor:
        """[M, NT] bool: tiles whose slots do not hold every entry (consumers recompute them)."""
        return self.cnt > self.slots

    def columns(self) -> torch.Tensor:
        """[M, NT, S] int32 global column of each slot, whatever the encoding."""
        if self.entries == "split":
            return self.col
        base = torch.arange(self.n_tiles, device=self.cnt.device, dtype=torch.int32).view(1, -1, 1) * self.tile
        return base + (self.ent & 0xFFFF)

    def values(self) -> torch.Tensor:
        """[M, NT, S] float32 kept gate value of each slot, whatever the encoding."""
        if self.entries == "split":
            return self.val
        return unpack_entry_values(self.ent, self.entries)


def n_tiles(n_cols: int, tile: int) -> int:
    return (n_cols + tile - 1) // tile


def pack_entries(col_in_tile: torch.Tensor, val: torch.Tensor, entries: str) -> torch.Tensor:
    """int32 words (value bits << 16 | column in tile) from columns in [0, 65536) and values >= 0."""
    bits = val.float().to(ENTRY_DTYPES[entries]).view(torch.int16).to(torch.int32) & 0xFFFF  # RTNE
    return (bits << 16) | col_in_tile.to(torch.int32)


def unpack_entry_values(ent: torch.Tensor, entries: str) -> torch.Tensor:
    """float32 values held in the high 16 bits of packed entries (non-negative, so bit 31 is 0)."""
    return (ent >> 16).to(torch.int16).view(ENTRY_DTYPES[entries]).float()


def threshold_act(g: torch.Tensor, threshold: torch.Tensor | None = None) -> torch.Tensor:
    """g * [g > theta] in g's dtype ([..., F]; threshold: [F] float32, broadcast over the rows), relu(g) when
    threshold is None: the one definition every torch path of the FFN uses. The comparison promotes g to
    float32 (exact for bf16 / fp16 values), so g is compared as its dtype holds it; autograd gives g's gradient
    where g > theta and zero elsewhere (none to theta)."""
    if threshold is None:
        return torch.relu(g)
    return torch.where(g > threshold, g, 0.0)


def twell_pack(gate: torch.Tensor, tile: int = TILE, slots: int = SLOTS, entries: str = "split",
               threshold: torch.Tensor | None = None) -> TwellPacked:
    """Pack pre-activation gate values [M, F] (any float dtype) into TwELL: the columns with g > 0, or with
    g > threshold [F] (float32) where one is given, g compared as `gate`'s dtype holds it (pass the gate
    rounded to the input dtype to get what the kernels pack for 16-bit inputs).

    entries: "split" (int32 col + fp32 val) or "bf16"/"fp16" (one int32 word per slot, see module doc).
    """
    if entries not in ("split", *ENTRY_DTYPES):
        raise ValueError(f"entries={entries!r} is not one of 'split', 'bf16', 'fp16'.")
    m, f = gate.shape
    nt = n_tiles(f, tile)
    g = torch.zeros(m, nt * tile, dtype=torch.float32, device=gate.device)
    g[:, :f] = gate.float()
    g = g.view(m, nt, tile)  # [M, NT, T]
    if threshold is None:
        active = g > 0
    else:  # padding columns: g = 0 > theta = 0 is False
        th = torch.zeros(nt * tile, dtype=torch.float32, device=gate.device)
        th[:f] = threshold
        active = g > th.view(nt, tile)
    cnt = active.sum(-1, dtype=torch.int32)  # [M, NT]
    pos = active.to(torch.int32).cumsum(-1) - 1  # [M, NT, T] slot of each active column
    keep = active & (pos < slots)
    col = torch.full((m, nt, slots), -1, dtype=torch.int32, device=gate.device)
    val = torch.zeros(m, nt, slots, dtype=torch.float32, device=gate.device)
    r, t, c = keep.nonzero(as_tuple=True)
    s = pos[r, t, c]
    col[r, t, s] = (t * tile + c).to(torch.int32)
    val[r, t, s] = g[r, t, c]
    if entries == "split":
        return TwellPacked(cnt=cnt, col=col, val=val, tile=tile, n_cols=f)
    in_tile = col - torch.arange(nt, device=gate.device, dtype=torch.int32).view(1, -1, 1) * tile
    ent = torch.where(col >= 0, pack_entries(in_tile.clamp(min=0), val, entries), 0)  # [M, NT, S]
    return TwellPacked(cnt=cnt, col=None, val=None, tile=tile, n_cols=f, ent=ent, entries=entries)


def twell_unpack(packed: TwellPacked, dense_gate: torch.Tensor | None = None,
                 threshold: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild act(gate) [M, F] float32. Overflowed tiles need `dense_gate` ([M, F], pre-activation), rebuilt
    as threshold_act(dense_gate, threshold): pass the threshold the packing used."""
    m, nt = packed.cnt.shape
    tile, f, s = packed.tile, packed.n_cols, packed.slots
    out = torch.zeros(m, nt * tile, dtype=torch.float32, device=packed.cnt.device)
    kept = torch.arange(s, device=out.device) < packed.cnt.clamp(max=s).unsqueeze(-1)  # [M, NT, S]
    rows = torch.arange(m, device=out.device).view(m, 1, 1).expand(m, nt, s)
    out[rows[kept], packed.columns()[kept].long()] = packed.values()[kept]
    ovf = packed.overflowed()
    if bool(ovf.any()):
        if dense_gate is None:
            raise ValueError(
                f"{int(ovf.sum())} (row, tile) pairs overflowed their {s} slots; pass dense_gate "
                "(the pre-activation gate [M, F]) so twell_unpack can rebuild them losslessly."
            )
        full = torch.zeros_like(out)
        full[:, :f] = threshold_act(dense_gate, threshold).float()
        mask = ovf.repeat_interleave(tile, dim=1)  # [M, NT*T]
        out[mask] = full[mask]
    return out[:, :f]


def twell_updown_reference(
    x: torch.Tensor, packed: TwellPacked, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
    threshold: torch.Tensor | None = None,
) -> torch.Tensor:
    """What the fused up/down kernel computes from a TwELL gate: [M, d] float32. Its overflowed tiles keep the
    fp32 recomputed g; with a threshold they compare g rounded to x's dtype (as the kernel does)."""
    xf = x.float()  # [M, d]
    gate = None
    if bool(packed.overflowed().any()):
        gate = xf @ w_gate.float().t()  # [M, F]
        if threshold is not None:  # decide on x's dtype's value, keep the fp32 one
            gate = torch.where(gate.to(x.dtype).float() > threshold, gate, 0.0)
    h = twell_unpack(packed, gate) * (xf @ w_up.float().t())  # [M, F]
    return h @ w_down.float().t()


def ffn_reference(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
    threshold: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(x W_gate^T) * (x W_up^T) W_down^T in float32 (the oracle); returns float32 [..., d]. act: relu, or
    threshold_act with `threshold` [F] on the fp32 gate."""
    xf = x.float()
    h = threshold_act(xf @ w_gate.float().t(), threshold) * (xf @ w_up.float().t())  # [..., F]
    return h @ w_down.float().t()


def ffn_dense(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
    threshold: torch.Tensor | None = None,
) -> torch.Tensor:
    """The plain dense FFN in the input dtype (cuBLAS on GPU): the 'dense' backend and CPU fallback. With a
    threshold [F] (float32), g * [g > theta] on the gate as this dtype holds it."""
    g = torch.nn.functional.linear(x, w_gate)  # [..., F]
    u = torch.nn.functional.linear(x, w_up)  # [..., F]
    return torch.nn.functional.linear(threshold_act(g, threshold) * u, w_down)  # [..., d]


def transpose_down(w_down: torch.Tensor) -> torch.Tensor:
    """W_down [d, F] -> contiguous [F, d] rows for K2. Cache it per layer (twell_ffn's w_down_t)."""
    return w_down.t().contiguous()
