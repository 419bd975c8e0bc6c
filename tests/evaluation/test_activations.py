"""The activation-sparsity profile: statistics against hand-computed values, and h captured exactly."""

from __future__ import annotations

import pytest
import torch

from sparsify.evaluation import activations as prof
from tests.tiny import tiny_llama


def test_layer_stats_match_hand_computed_values():
    from sparsify.kernels.twell_reference import SLOTS, TILE

    assert (TILE, SLOTS) == (128, 16)  # the kernels' prefill layout, which the numbers below assume
    # F = 300 (not a multiple of the 128 tile): tiles 0..127, 128..255, 256..299 (padded) -> 3 per row.
    active = torch.zeros(4, 300, dtype=torch.bool)
    active[0, :40] = True  # 40 in tile 0 -> overflows the 16 slots
    active[1, 256:261] = True  # 5 in tile 2
    active[2, [0, 1, 299]] = True  # 2 in tile 0, 1 in tile 2
    active[3, 128:145] = True  # 17 in tile 1 -> overflows 16 (but would fit the old 31-slot layout)
    stats = prof.LayerStats()
    stats.add(active)
    r = stats.result()
    assert r["tokens"] == 4 and r["width"] == 300
    assert r["nnz_mean"] == pytest.approx((40 + 5 + 3 + 17) / 4)
    assert r["nnz_max"] == 40
    assert r["nnz_p99"] == pytest.approx(float(torch.quantile(torch.tensor([40.0, 5, 3, 17]), 0.99)))
    assert r["density"] == pytest.approx(65 / 4 / 300)
    assert r["dead"] == 300 - (40 + 17 + 5 + 1)  # columns 0..39, 128..144, 256..260 and 299 ever fire
    assert r["tile_max"] == 40
    assert r["overflow_rate"] == pytest.approx(2 / 12)  # 4 rows x 3 tiles, two over 16
    assert r["overflow_row_rate"] == pytest.approx(2 / 4)
    assert r["reuse"] == {"16": None, "32": None, "64": None, "128": None}  # fewer tokens than a block


def test_union_reuse_counts_blocks_across_chunks():
    torch.manual_seed(0)
    active = torch.rand(100, 64) < 0.1  # [N, F]
    whole, chunked = prof.LayerStats(), prof.LayerStats()
    whole.add(active)
    for part in active.split([7, 30, 1, 62]):  # windows of uneven length carry partial blocks over
        chunked.add(part)
    assert whole.result() == chunked.result()
    blocks = active[:96].view(6, 16, 64)  # the 4 leftover tokens never complete a block
    expected = blocks.sum().item() / blocks.any(dim=1).sum().item()
    assert whole.result()["reuse"]["16"] == pytest.approx(expected)
    assert whole.result()["reuse"]["64"] == pytest.approx(active[:64].sum().item() / active[:64].any(0).sum().item())


def test_recorder_captures_h_exactly():
    model = tiny_llama(0, 50)
    ids = torch.randint(0, 50, (1, 12))
    recorder = prof.SparsityRecorder(model)
    captured = {}
    mlp = model.model.layers[1].mlp
    handle = mlp.register_forward_pre_hook(lambda m, a: captured.setdefault("x", a[0].detach()))
    with torch.no_grad():
        model(ids)
    handle.remove()
    recorder.remove()
    x = captured["x"]  # [1, 12, d]
    h = torch.relu(mlp.gate_proj(x)) * mlp.up_proj(x)  # [1, 12, F]
    r = recorder.layers[1].result()
    assert r["tokens"] == 12
    assert r["nnz_mean"] == pytest.approx((h != 0).sum().item() / 12)
    assert r["nnz_max"] == (h != 0).sum(-1).max().item()
    assert 0 < r["density"] < 1  # ReLU: some but not all zero
