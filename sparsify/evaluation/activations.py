"""The activation-sparsity profile: what the TwELL kernels' speed depends on, measured on real text.

Forward pre-hooks on every layer's mlp.down_proj capture h = act(gate) * up (its input in every supported
family). Per layer: non-zeros per token (mean, p99, max), dead neurons (never active on the text), the
most non-zeros any token has in one tile of columns against the slots TwELL stores per tile (more spill
into the overflow path), and the union reuse R(BT) the kernels exploit. Driven by sparsify.evaluation.perplexity,
which runs the forward passes.
"""

from __future__ import annotations

from typing import Any

from sparsify.families import mlp_modules

REUSE_BLOCKS = (16, 32, 64, 128)  # token-block sizes BT for the union reuse R(BT), each a multiple of the one before


class SparsityRecorder:
    """Forward pre-hooks on each layer's down_proj accumulating TwELL-relevant statistics of h (exact zeros).

    Only positions in `self.keep` (the newly scored tokens of a sliding window) are counted, so every
    token of the text contributes once, in order; the union reuse uses consecutive tokens across windows.
    """

    def __init__(self, model: Any):
        modules = [mlp.down_proj for mlp in mlp_modules(model)]  # its input is h = act(gate) * up in every family
        self.keep = slice(None)
        self.layers = [LayerStats() for _ in modules]
        self.handles = [m.register_forward_pre_hook(self._hook(i)) for i, m in enumerate(modules)]

    def _hook(self, i: int):
        def hook(module, inputs):
            h = inputs[0][:, self.keep]  # [B, t, F]
            self.layers[i].add((h != 0).reshape(-1, h.shape[-1]))  # [B*t, F] bool
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def summary(self) -> dict:
        layers = [s.result() for s in self.layers]
        tile, slots = kernel_layout()
        return {"tokens": layers[0]["tokens"] if layers else 0, "tile": tile, "slots": slots,
                "layers": layers, "summary": _summarise(layers)}


def kernel_layout() -> tuple[int, int]:
    """(tile width T, slots S) of the TwELL prefill layout the shipped kernels use."""
    from sparsify.kernels.twell_reference import SLOTS, TILE

    return TILE, SLOTS


class LayerStats:
    """Accumulators stay on h's device (no host synchronisation per forward pass); result() reads them once."""

    def __init__(self):
        self.tile, self.slots = kernel_layout()
        self.nnz: list[Any] = []  # per-token counts, [t] int32 chunks (on h's device)
        self.fired = None  # [F] uint8: 1 where the neuron was active in some token
        self.tiles = 0
        self.tile_max = self.overflow = None  # 0-d, and [2] (overflowing tiles, rows): int64 on h's device
        self.carry_rows: tuple[Any, Any] | None = None  # rows past the last full block of REUSE_BLOCKS[0]
        self.carry: dict[int, tuple[Any, Any]] = {}  # BT -> (unions [k, F], pairs [k]) of smaller whole blocks
        self.pairs: dict[int, Any] = dict.fromkeys(REUSE_BLOCKS, 0)  # active pairs inside full blocks
        self.unions: dict[int, Any] = dict.fromkeys(REUSE_BLOCKS, 0)

    def add(self, active: Any) -> None:
        """Count one chunk of consecutive tokens: `active` [t, F] bool (h != 0)."""
        import torch

        rows, width = active.shape
        self.width = width
        if not rows:
            return
        active = active.view(torch.uint8)  # same bytes; reductions over uint8 run many times faster than bool
        pad = (-width) % self.tile
        padded = torch.nn.functional.pad(active, (0, pad)) if pad else active
        tiled = padded.view(rows, -1, self.tile).sum(dim=2, dtype=torch.int32)  # [t, F/T]
        nnz = tiled.sum(dim=1, dtype=torch.int32)  # [t]
        self.nnz.append(nnz)
        fired = active.amax(dim=0)  # [F]
        self.fired = fired if self.fired is None else torch.maximum(self.fired, fired)
        over = tiled > self.slots
        top, counts = tiled.max().long(), torch.stack([over.sum(), over.any(dim=1).sum()])
        self.tile_max = top if self.tile_max is None else torch.maximum(self.tile_max, top)
        self.overflow = counts if self.overflow is None else self.overflow + counts
        self.tiles += tiled.numel()
        self._reuse(active, nnz)

    def _reuse(self, active: Any, nnz: Any) -> None:
        """Unions and pairs of the smallest blocks from the rows, each larger size from the size below it (each
        BT a multiple of the one before): one pass over the rows instead of one per block size."""
        import torch

        if self.carry_rows is not None:
            active, nnz = torch.cat([self.carry_rows[0], active]), torch.cat([self.carry_rows[1], nnz])  # [r, F], [r]
        bt = REUSE_BLOCKS[0]
        full = active.shape[0] // bt * bt
        unions = active[:full].view(-1, bt, active.shape[1]).amax(dim=1)  # [n, F]: who fired in each block
        pairs = nnz[:full].view(-1, bt).sum(dim=1, dtype=torch.int64)  # [n]
        self.carry_rows = (active[full:], nnz[full:]) if full < active.shape[0] else None
        self._count(bt, unions, pairs)
        for smaller, bt in zip(REUSE_BLOCKS, REUSE_BLOCKS[1:]):
            if bt in self.carry:
                unions, pairs = torch.cat([self.carry[bt][0], unions]), torch.cat([self.carry[bt][1], pairs])
            k = bt // smaller
            full = unions.shape[0] // k * k
            self.carry[bt] = (unions[full:], pairs[full:])
            unions = unions[:full].view(-1, k, unions.shape[1]).amax(dim=1)  # [n / k, F]
            pairs = pairs[:full].view(-1, k).sum(dim=1)
            self._count(bt, unions, pairs)

    def _count(self, bt: int, unions: Any, pairs: Any) -> None:
        import torch

        if unions.shape[0]:
            self.pairs[bt] = self.pairs[bt] + pairs.sum()
            self.unions[bt] = self.unions[bt] + unions.sum(dtype=torch.int64)

    def result(self) -> dict:
        import torch

        if not self.nnz:
            return {"tokens": 0}
        nnz = torch.cat(self.nnz).double().cpu()  # [N]
        dead = int((self.fired == 0).sum())
        overflow_tiles, overflow_rows = self.overflow.tolist()
        pairs = {bt: int(v) for bt, v in self.pairs.items()}
        unions = {bt: int(v) for bt, v in self.unions.items()}
        return {
            "tokens": nnz.numel(), "width": self.width,
            "nnz_mean": float(nnz.mean()), "nnz_p99": float(torch.quantile(nnz, 0.99)), "nnz_max": int(nnz.max()),
            "density": float(nnz.mean()) / self.width,
            "dead": dead, "dead_frac": dead / self.width,
            "tile_max": int(self.tile_max), "overflow_rate": overflow_tiles / max(self.tiles, 1),
            "overflow_row_rate": overflow_rows / nnz.numel(),
            "reuse": {str(bt): (pairs[bt] / unions[bt] if unions[bt] else None) for bt in REUSE_BLOCKS},
        }


def _summarise(layers: list[dict]) -> dict:
    """Across layers: mean non-zeros per token, zeros %, dead %, worst tile, overflow, pooled reuse."""
    layers = [l for l in layers if l.get("tokens")]
    if not layers:
        return {}
    n = len(layers)
    width = sum(l["width"] for l in layers)
    return {
        "nnz_mean": sum(l["nnz_mean"] for l in layers) / n,
        "nnz_p99_max": max(l["nnz_p99"] for l in layers),
        "nnz_max": max(l["nnz_max"] for l in layers),
        "zeros": 1 - sum(l["nnz_mean"] for l in layers) / width,
        "dead_frac": sum(l["dead"] for l in layers) / width,
        "tile_max": max(l["tile_max"] for l in layers),
        "overflow_rate": sum(l["overflow_rate"] for l in layers) / n,
        "reuse": {bt: _mean_or_none([l["reuse"][bt] for l in layers]) for bt in map(str, REUSE_BLOCKS)},
    }


def _mean_or_none(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None
