"""TwELL layout and plain-torch reference of the sparse gated FFN (test oracle and CPU fallback).

Legend: M = tokens, d = hidden size, F = intermediate size, T = tile width, S = slots per (row, tile),
NT = ceil(F / T) tiles per row. Weights in nn.Linear layout: W_gate [F, d], W_up [F, d], W_down [d, F].

The FFN: y = (relu(x W_gate^T) * (x W_up^T)) W_down^T.

TwELL ("tiled ELL") layout used by our kernels
-----------------------------------------------
The intermediate dimension F is cut into NT tiles of T columns (the last one may be short). For each
(row, tile) the gate GEMM's epilogue keeps the positive gate values (after ReLU) in S = T / C slots,
C being the compression factor:
- ``cnt`` [M, NT] int32: the TRUE number of positive gate values in the (row, tile), even when it
  exceeds S.
- ``col`` [M, NT, S] int32: global column index j of each kept entry, ascending within the tile
  (slot order = column order, built with a cumulative sum, so it is deterministic).
- ``val`` [M, NT, S] float32: the gate value relu(g_j) > 0 of each entry, kept in fp32 (the GEMM
  accumulator), so fp32/fp16/bf16 inputs are all exact up to the GEMM's own rounding.
Slots at or beyond min(cnt, S) are undefined (never read).

Deviation from the paper's layout (one uint32 per slot, bf16 value bits << 16 | uint16 column, slot 0 =
count): values and columns are kept apart so that fp32 and fp16 models work and F may exceed 65535;
the packed rows are < 3% of the bytes the fused up/down kernel moves, so this costs nothing measurable.

Overflow is lossless. A (row, tile) with cnt > S keeps its first S entries but is marked overflowed by
cnt itself; every consumer (the fused up/down kernel, `twell_unpack`) recomputes such a tile densely
from x and W_gate instead of trusting its slots. No flag, no host sync, no dropped entries: rows with
every neuron active simply run densely.

Defaults: prefill T = 128, C = 8 (S = 16); decode (M <= 16) T = 32, S = 32 (C = 1: cannot overflow).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TILE = 128
SLOTS = 16
DECODE_TILE = 32
DECODE_SLOTS = 32


@dataclass
class TwellPacked:
    """Gate activations of M rows in TwELL layout (see module docstring)."""

    cnt: torch.Tensor  # [M, NT] int32, true count of positive gate values per (row, tile)
    col: torch.Tensor  # [M, NT, S] int32, global column index per slot
    val: torch.Tensor  # [M, NT, S] float32, relu(gate) per slot
    tile: int  # T
    n_cols: int  # F

    @property
    def slots(self) -> int:
        return self.col.shape[-1]

    @property
    def n_tiles(self) -> int:
        return self.cnt.shape[-1]

    def overflowed(self) -> torch.Tensor:
        """[M, NT] bool: tiles whose slots do not hold every entry (consumers recompute them)."""
        return self.cnt > self.slots


def n_tiles(n_cols: int, tile: int) -> int:
    return (n_cols + tile - 1) // tile


def twell_pack(gate: torch.Tensor, tile: int = TILE, slots: int = SLOTS) -> TwellPacked:
    """Pack pre-activation gate values [M, F] (any float dtype) into TwELL; ReLU is applied here."""
    m, f = gate.shape
    nt = n_tiles(f, tile)
    g = torch.zeros(m, nt * tile, dtype=torch.float32, device=gate.device)
    g[:, :f] = gate.float()
    g = g.view(m, nt, tile)  # [M, NT, T]
    active = g > 0
    cnt = active.sum(-1, dtype=torch.int32)  # [M, NT]
    pos = active.to(torch.int32).cumsum(-1) - 1  # [M, NT, T] slot of each active column
    keep = active & (pos < slots)
    col = torch.full((m, nt, slots), -1, dtype=torch.int32, device=gate.device)
    val = torch.zeros(m, nt, slots, dtype=torch.float32, device=gate.device)
    r, t, c = keep.nonzero(as_tuple=True)
    s = pos[r, t, c]
    col[r, t, s] = (t * tile + c).to(torch.int32)
    val[r, t, s] = g[r, t, c]
    return TwellPacked(cnt=cnt, col=col, val=val, tile=tile, n_cols=f)


def twell_unpack(packed: TwellPacked, dense_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild relu(gate) [M, F] float32. Overflowed tiles need `dense_gate` ([M, F], pre-activation)."""
    m, nt = packed.cnt.shape
    tile, f, s = packed.tile, packed.n_cols, packed.slots
    out = torch.zeros(m, nt * tile, dtype=torch.float32, device=packed.cnt.device)
    kept = torch.arange(s, device=out.device) < packed.cnt.clamp(max=s).unsqueeze(-1)  # [M, NT, S]
    rows = torch.arange(m, device=out.device).view(m, 1, 1).expand(m, nt, s)
    out[rows[kept], packed.col[kept].long()] = packed.val[kept]
    ovf = packed.overflowed()
    if bool(ovf.any()):
        if dense_gate is None:
            raise ValueError(
                f"{int(ovf.sum())} (row, tile) pairs overflowed their {s} slots; pass dense_gate "
                "(the pre-activation gate [M, F]) so twell_unpack can rebuild them losslessly."
            )
        full = torch.zeros_like(out)
        full[:, :f] = dense_gate.float().relu()
        mask = ovf.repeat_interleave(tile, dim=1)  # [M, NT*T]
        out[mask] = full[mask]
    return out[:, :f]


def twell_updown_reference(
    x: torch.Tensor, packed: TwellPacked, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """What the fused up/down kernel computes from a TwELL gate: [M, d] float32."""
    xf = x.float()  # [M, d]
    gate = xf @ w_gate.float().t() if bool(packed.overflowed().any()) else None  # [M, F]
    h = twell_unpack(packed, gate) * (xf @ w_up.float().t())  # [M, F]
    return h @ w_down.float().t()


def ffn_reference(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """relu(x W_gate^T) * (x W_up^T) W_down^T in float32 (the oracle); returns float32 [..., d]."""
    xf = x.float()
    h = torch.relu(xf @ w_gate.float().t()) * (xf @ w_up.float().t())  # [..., F]
    return h @ w_down.float().t()


def ffn_dense(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """The plain dense FFN in the input dtype (cuBLAS on GPU): the 'dense' backend and CPU fallback."""
    g = torch.nn.functional.linear(x, w_gate)  # [..., F]
    u = torch.nn.functional.linear(x, w_up)  # [..., F]
    return torch.nn.functional.linear(torch.relu(g) * u, w_down)  # [..., d]
