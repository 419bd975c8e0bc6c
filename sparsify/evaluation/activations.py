"""The activation-sparsity profile: what the TwELL kernels' speed depends on, measured on real text.

Forward pre-hooks on every layer's mlp.down_proj capture h = act(gate) * up (its input in every supported
family). Per layer: non-zeros per token (mean, p99, max), dead neurons (never active on the text), the
most non-zeros any token has in one tile of columns against the slots TwELL stores per tile (more spill
into the overflow path), and the union reuse R(BT) the kernels exploit. Driven by sparsify.evaluation.perplexity,
which runs the forward passes.
"""

from __future__ import annotations

from typing import Any

REUSE_BLOCKS = (16, 32, 64, 128)  # token-block sizes BT for the union reuse R(BT)


def down_projs(model: Any) -> list[Any]:
    """Each layer's down_proj, in layer order: its input is h = act(gate) * up in every supported family."""
    from sparsify.families import mlp_modules

    return [m.down_proj for m in mlp_modules(model)]


class SparsityRecorder:
    """Forward pre-hooks on each down_proj accumulating TwELL-relevant statistics of h (exact zeros).

    Only positions in `self.keep` (the newly scored tokens of a sliding window) are counted, so every
    token of the text contributes once, in order; the union reuse uses consecutive tokens across windows.
    """

    def __init__(self, modules: list[Any]):
        self.keep = slice(None)
        self.layers = [_LayerStats() for _ in modules]
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


class _LayerStats:
    """Accumulators stay on h's device (no host synchronisation per forward pass); result() reads them once."""

    def __init__(self):
        self.tile, self.slots = kernel_layout()
        self.nnz: list[Any] = []  # per-token counts, [t] int32 chunks (on h's device)
        self.neuron_hits = None  # [F] int64: tokens in which each neuron fired
        self.tiles = 0
        self.tile_max = self.overflow = None  # 0-d, and [2] (overflowing tiles, rows): int64 on h's device
        self.carry: dict[int, Any] = {}  # BT -> leftover rows [r < BT, F] bool
        self.pairs: dict[int, Any] = dict.fromkeys(REUSE_BLOCKS, 0)  # active pairs inside full blocks
        self.unions: dict[int, Any] = dict.fromkeys(REUSE_BLOCKS, 0)

    def add(self, active: Any) -> None:
        import torch

        rows, width = active.shape
        self.width = width
        if not rows:
            return
        self.nnz.append(active.sum(dim=1, dtype=torch.int32))  # [t]
        hits = active.sum(dim=0, dtype=torch.int64)  # [F]
        self.neuron_hits = hits if self.neuron_hits is None else self.neuron_hits + hits
        pad = (-width) % self.tile
        tiled = torch.nn.functional.pad(active, (0, pad)).view(rows, -1, self.tile).sum(dim=2)  # [t, F/T]
        over = tiled > self.slots
        top, counts = tiled.max().long(), torch.stack([over.sum(), over.any(dim=1).sum()])
        self.tile_max = top if self.tile_max is None else torch.maximum(self.tile_max, top)
        self.overflow = counts if self.overflow is None else self.overflow + counts
        self.tiles += tiled.numel()
        for bt in REUSE_BLOCKS:
            self._reuse(bt, active)

    def _reuse(self, bt: int, active: Any) -> None:
        import torch

        rows = torch.cat([self.carry[bt], active]) if bt in self.carry else active  # [r, F]
        full = rows.shape[0] // bt * bt
        if full:
            blocks = rows[:full].view(-1, bt, rows.shape[1])  # [n, BT, F]
            self.pairs[bt] = self.pairs[bt] + blocks.sum(dtype=torch.int64)
            self.unions[bt] = self.unions[bt] + blocks.any(dim=1).sum()
        self.carry[bt] = rows[full:]

    def result(self) -> dict:
        import torch

        if not self.nnz:
            return {"tokens": 0}
        nnz = torch.cat(self.nnz).double().cpu()  # [N]
        dead = int((self.neuron_hits == 0).sum())
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
