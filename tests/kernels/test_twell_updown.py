"""K2 (fused up/down from the TwELL packing), its decode paths and twell_ffn_triton against the oracle."""

from __future__ import annotations

import pytest
import torch

from sparsify.kernels import twell_reference as ref, twell_triton as tt, twell_updown as tu
from sparsify.kernels.twell_ops import transpose_down

from tests.kernels.helpers import FP32, ZEROS, assert_close, bf16_rule, check_packed, make_case, tma_case

@pytest.mark.parametrize("zeros", ZEROS)
def test_k2_updown_matches_reference(zeros):
    x, wg, wu, wd = make_case(13, 40, 300, zeros, seed=2)  # K2: one program per row, 13 rows suffice
    packed = tt.gate_pack(x, wg, BLOCK_M=32, T=64, S=8)
    out = tu.updown(x, packed, wg, wu, transpose_down(wd))
    assert_close(out, ref.ffn_reference(x, wg, wu, wd), what=f"K2 zeros={zeros}", **FP32)
    assert_close(out, ref.twell_updown_reference(x, packed, wg, wu, wd), what=f"K2 vs packed oracle", **FP32)


def test_k2_overflow_is_lossless_on_mixed_rows():
    """Half the rows have every neuron active (all tiles overflow), half are 99% sparse."""
    x, wg, wu, wd = make_case(8, 40, 300, 0.99, seed=3)
    x[::2, 0] = -1000.0  # flips the bias sign: every gate value of these rows becomes positive
    packed = tt.gate_pack(x, wg, BLOCK_M=32, T=64, S=8)
    assert packed.overflowed()[::2].all() and not packed.overflowed()[1::2].any()
    out = tu.updown(x, packed, wg, wu, transpose_down(wd))
    assert_close(out, ref.ffn_reference(x, wg, wu, wd), what="K2 mixed overflow", **FP32)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("zeros", [0.0, 0.9, 0.99])
def test_decode_path(m, zeros):
    """K1/K2 at M <= 16 (auto's twell path, and the old decode path of eval/bench/bench_decode.py): narrow
    tiles (T = 32, S = 32) and K2 split over programs with fp32 atomics."""
    x, wg, wu, wd = make_case(m, 24, 200, zeros, seed=4)
    assert tu.k2_config(m, 24)["SPLIT"] > 1 and tt.k1_config(m, 24)["T"] == ref.DECODE_TILE
    packed = tt.gate_pack(x, wg)
    check_packed(packed, x, wg, f"decode K1 m={m}")
    out = tu.updown(x, packed, wg, wu, transpose_down(wd))
    assert_close(out, ref.ffn_reference(x, wg, wu, wd), what=f"decode m={m} zeros={zeros}", **FP32)


@pytest.mark.parametrize("entries", ["split", "bf16"])
@pytest.mark.parametrize("zeros", [0.0, 0.99, 1.0])
def test_k2_compact_variant_equals_k2(entries, zeros):
    """K2 reading per-row compacted lists (what twell_ffn_triton runs) sums the same entries in the same order as plain K2."""
    x, wg, wu, wd = make_case(13, 40, 200, zeros, seed=27)
    x[::3, 0] = -1000.0  # a third of the rows: every neuron active, every tile overflows
    packed = tt.gate_pack(x, wg, BLOCK_M=32, T=64, S=8, entries=entries)
    wdt = transpose_down(wd)
    got = tu.updown(x, packed, wg, wu, wdt, compact=True)
    assert torch.equal(got, tu.updown(x, packed, wg, wu, wdt)), "compacted K2 differs from K2"
    assert_close(got, ref.twell_updown_reference(x, packed, wg, wu, wd), what=f"K2 compact {entries}", **FP32)


def test_variants_and_default_encodings():
    """Two prefill variants, named by their K1 ("tma", the default, and its fallback "tiled"), both with compacted
    K2; the removed ones and the old round names (kernels/NOTES.md) are refused with the valid names."""
    assert tt.default_entries(torch.bfloat16) == "bf16" and tt.default_entries(torch.float16) == "fp16"
    assert tt.default_entries(torch.float32) == "split"
    assert tt.VARIANTS == ("tma", "tiled") and tt.DEFAULT_VARIANT == "tma"
    x, wg, wu, wd = make_case(40, 16, 64, 0.9, seed=18)  # M > DECODE_MAX_M: K1 + K2
    wdt = transpose_down(wd)
    out = tu.twell_ffn_triton(x, wg, wu, wdt, variant="tiled")
    assert torch.equal(out, tu.updown(x, tt.gate_pack(x, wg), wg, wu, wdt, compact=True))
    assert_close(out, ref.ffn_reference(x, wg, wu, wd), what="tiled variant", **FP32)
    for gone in ("r4", "r5tma", "r5", "r6", "r5c", "r6c", "gemv"):
        with pytest.raises(ValueError, match=r"not one of \('tma', 'tiled'\)"):
            tu.twell_ffn_triton(x, wg, wu, wdt, variant=gone)
    with pytest.raises(ValueError, match=r"not one of \('tma', 'tiled', 'gemv'\)"):
        tt.gate_pack(x, wg, variant="r5tma")


def test_tma_ffn_in_interpreter():
    """The default variant ("tma": the TMA-tiled K1, compacted K2) against K2 on the same packing and the oracle."""
    assert tt.DEFAULT_VARIANT == "tma"
    x, wg, wu, wd = tma_case(37, 32, 256, 0.9, seed=35)
    wdt = transpose_down(wd)
    got = tu.twell_ffn_triton(x, wg, wu, wdt)
    packed = tt.gate_pack(x, wg, variant="tma")
    assert torch.equal(got, tu.updown(x, packed, wg, wu, wdt, compact=True))
    assert_close(got, ref.twell_updown_reference(x.float(), packed, wg.float(), wu.float(), wd.float()),
                 what="tma vs K2 oracle on its packing", rtol=2e-3, atol=1e-3)
    assert_close(got, ref.ffn_reference(x, wg, wu, wd), what="tma vs oracle", rtol=1e-2, atol=1e-3)


# ------------------------------------------------- chunked decode K2 (d in chunks: no d-length registers)
@pytest.mark.parametrize("m, d, bd, split", [(1, 80, 32, 3), (3, 64, 64, 5), (5, 96, 32, 16)])
@pytest.mark.parametrize("zeros", [0.0, 0.9, 0.99])
def test_k2_decode_chunked_matches_reference(m, d, bd, split, zeros):
    """d over several chunks (and not a multiple of the chunk), more programs than entries, every neuron
    active (0% zeros fills every decode tile: S = T, no overflow) and near-empty rows; fp32 and bf16 entries."""
    x, wg, wu, wd = make_case(m, d, 200, zeros, seed=7)
    x[-1] = 0.0  # an all-zero row: no entry at all
    packed = tt.gate_pack(x, wg)
    assert packed.tile == ref.DECODE_TILE and packed.slots >= packed.tile
    out = tu.updown_decode_chunked(x, packed, wu, transpose_down(wd), BD=bd, SPLIT=split)
    assert_close(out, ref.ffn_reference(x, wg, wu, wd), what=f"chunked m={m} d={d} zeros={zeros}", **FP32)
    assert torch.equal(out[-1], torch.zeros(d))
    xb, wgb, wub, wdb = (t.bfloat16() for t in (x, wg, wu, wd))
    pb = tt.gate_pack(xb, wgb)
    assert pb.entries == "bf16"
    got = tu.updown_decode_chunked(xb, pb, wub, transpose_down(wdb), BD=bd, SPLIT=split)
    want = tu.updown(xb, pb, wgb, wub, transpose_down(wdb))  # the split K2 on the same entries
    assert_close(got.float(), want.float(), what=f"chunked bf16 m={m}", rtol=2e-2, atol=2e-2 * want.float().abs().max().item())


def test_decode_k2_routes_to_chunked_from_its_d():
    """The decode K2 (split, M <= 16) is the chunked K2 at M = 1 at every d and at every decode M from
    DECODE_CHUNKED_MIN_D on, the split _k2_updown otherwise, with chunked=False or with block overrides."""
    big = tu.DECODE_CHUNKED_MIN_D
    assert tu.decode_k2_chunked(1, 48) and tu.decode_k2_chunked(5, big) and tu.decode_k2_chunked(16, big)
    assert not tu.decode_k2_chunked(3, 48) and not tu.decode_k2_chunked(3, big - 1)
    assert not tu.decode_k2_chunked(17, big)  # prefill: one program per row
    for m, d in ((1, 64), (3, 48)):
        x, wg, wu, wd = make_case(m, d, 96, 0.9, seed=9)
        packed, wdt = tt.gate_pack(x, wg), transpose_down(wd)
        routed_k1 = tt.gate_pack(x, wg, variant=tt.DEFAULT_VARIANT)  # the GEMV K1 at M = 1
        chunked = tu.updown_decode_chunked(x, routed_k1, wu, wdt)
        split = tu.updown(x, packed, wg, wu, wdt, chunked=False)
        out = tu.twell_ffn_triton(x, wg, wu, wdt)
        assert torch.equal(out, chunked if m == 1 else split), (m, d)
        for got, what in ((out, "routed"), (chunked, "chunked"), (split, "split")):
            assert_close(got, ref.ffn_reference(x, wg, wu, wd), what=f"{what} m={m} d={d}", **FP32)
        assert torch.equal(tu.updown(x, packed, wg, wu, wdt, E=4), tu.updown(x, packed, wg, wu, wdt, chunked=False, E=4))


# ------------------------------------------------- fused decode FFN: K1's GEMV and K2 in one launch
@pytest.mark.parametrize("m, d, f, bk, bd", [(1, 80, 200, 32, 32), (1, 64, 96, 64, 64), (3, 96, 130, 64, 32)])
@pytest.mark.parametrize("zeros", [0.0, 0.9, 0.99, 1.0])
def test_fused_decode_ffn_matches_the_oracle_and_k1_k2(m, d, f, bk, bd, zeros):
    """d over several chunks (not a multiple of BD or BLOCK_K), F not a multiple of the tile (and both
    multiples: the unmasked loop), every neuron kept (0% zeros: 32 per tile, E = 4 at a time), none kept
    (100%), an all-zero row; fp32 against the oracle and against K1 + K2 (twell_ffn_triton)."""
    x, wg, wu, wd = make_case(m, d, f, zeros, seed=11)
    if m > 1:
        x[-1] = 0.0
    wdt = transpose_down(wd)
    out = tu.twell_ffn_decode_fused(x, wg, wu, wdt, BLOCK_K=bk, BD=bd, E=4)
    assert out.dtype == torch.float32 and out.shape == (m, d)
    want = ref.ffn_reference(x, wg, wu, wd)
    assert_close(out, want, what=f"fused m={m} d={d} f={f} zeros={zeros}", **FP32)
    assert_close(out, tu.twell_ffn_triton(x, wg, wu, wdt), what=f"fused vs K1+K2 m={m}", **FP32)
    if m > 1:
        assert torch.equal(out[-1], torch.zeros(d))
    if zeros == 1.0:
        assert torch.equal(out, torch.zeros(m, d))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_decode_ffn_16bit_uses_the_gate_k2_reads(dtype):
    """16-bit x: h = g * u with g rounded to x's dtype, as K2 reads it from K1's packed words. The float32 sums
    (fp32_out) equal the K2 oracle on the GEMV K1's packing to fp32 rounding, far closer than g's own 16-bit
    rounding (which the fp32-gate oracle differs by); the 16-bit output agrees with K1 + K2
    (twell_ffn_triton's M = 1 route) to the output's rounding."""
    x, wg, wu, wd = (t.to(dtype) for t in make_case(1, 64, 160, 0.9, seed=12))
    wdt = transpose_down(wd)
    sums = tu.twell_ffn_decode_fused(x, wg, wu, wdt, BD=32, BLOCK_K=32, fp32_out=True)
    assert sums.dtype == torch.float32
    packed = tt.gate_pack(x, wg, variant="gemv")
    oracle = ref.twell_updown_reference(x.float(), packed, wg.float(), wu.float(), wd.float())  # g as packed
    fp32_gate = ref.ffn_reference(x, wg, wu, wd)  # g unrounded
    scale = oracle.abs().max().item()
    assert (fp32_gate - oracle).abs().max().item() > 50 * 1e-6 * scale  # the rounding of g shows at this scale
    assert_close(sums, oracle, what=f"fused sums {dtype}", rtol=1e-5, atol=1e-6 * scale)
    out = tu.twell_ffn_decode_fused(x, wg, wu, wdt, BD=32, BLOCK_K=32)
    assert out.dtype == dtype and torch.equal(out, sums.to(dtype))
    assert_close(out.float(), tu.twell_ffn_triton(x, wg, wu, wdt).float(), what=f"fused vs K1+K2 {dtype}",
                 rtol=2.0**-7, atol=1e-3 * scale)


def test_fused_decode_ffn_refuses_strided_weights():
    x, wg, wu, wd = make_case(1, 40, 64, 0.9, seed=13)
    with pytest.raises(ValueError, match="w_down_t must be contiguous"):
        tu.twell_ffn_decode_fused(x, wg, wu, wd.t())  # W_down^T as a view, not the [F, d] copy


def test_twell_ffn_routes_m1_on_fused_route_shapes_only(monkeypatch):
    """twell_ffn_triton runs the fused decode FFN with the table's launch at M = 1 on a FUSED_ROUTE shape (theta
    passed on), and K1 + K2 everywhere else: M > 1, another shape, a variant asked for, a strided x, fused=False,
    and a call that asks for K1's count (auto's density refresh)."""
    d, f = 64, 160
    monkeypatch.setattr(tu, "FUSED_ROUTE", {(d, f): {"E": 8, "BD": 32, "BLOCK_K": 32}})
    calls = []
    fused = tu.twell_ffn_decode_fused
    monkeypatch.setattr(tu, "twell_ffn_decode_fused", lambda *a, **k: calls.append(k) or fused(*a, **k))
    x, wg, wu, wd = make_case(2, d, f, 0.9, seed=14)
    wdt = transpose_down(wd)
    th = torch.full((f,), 0.05)
    for theta in (None, th):
        calls.clear()
        got = tu.twell_ffn_triton(x[:1], wg, wu, wdt, threshold=theta)
        assert calls == [{"E": 8, "BD": 32, "BLOCK_K": 32}]
        assert torch.equal(got, fused(x[:1], wg, wu, wdt, theta, E=8, BD=32, BLOCK_K=32))
        k1k2 = tu.twell_ffn_triton(x[:1], wg, wu, wdt, variant="tiled", threshold=theta)  # a variant asked for
        assert_close(got, k1k2, what=f"routed fused vs K1+K2 theta={theta is not None}", **FP32)
        assert_close(got, ref.ffn_reference(x[:1], wg, wu, wd, theta), what="routed fused vs oracle", **FP32)
    calls.clear()
    tu.twell_ffn_triton(x, wg, wu, wdt)  # M = 2
    wide = torch.zeros(1, 2 * d)
    wide[:, ::2] = x[:1]
    tu.twell_ffn_triton(wide[:, ::2], wg, wu, wdt)  # strided x: K1 + K2, no error
    xo, wgo, wuo, wdo = make_case(1, d, f + 32, 0.9, seed=15)
    tu.twell_ffn_triton(xo, wgo, wuo, transpose_down(wdo))  # a shape not in the table
    tu.twell_ffn_triton(x[:1], wg, wu, wdt, fused=False)
    assert calls == []
    got = tu.twell_ffn_triton(x[:1], wg, wu, wdt)
    assert calls == [{"E": 8, "BD": 32, "BLOCK_K": 32}] and torch.equal(got, fused(x[:1], wg, wu, wdt, E=8, BD=32,
                                                                                   BLOCK_K=32))
    counts = []
    counted = tu.twell_ffn_triton(x[:1], wg, wu, wdt, on_count=counts.append)
    assert len(calls) == 1 and counts[0].item() == int((x[:1] @ wg.t() > 0).sum())
    assert_close(counted, got, what="twell_ffn_triton with count (K1 + K2) vs routed", **FP32)


def test_k2_decode_chunked_refuses_tiles_that_can_overflow():
    x, wg, wu, wd = make_case(2, 40, 300, 0.9, seed=8)
    packed = tt.gate_pack(x, wg, BLOCK_M=32, T=64, S=8)
    with pytest.raises(ValueError, match="cannot overflow"):
        tu.updown_decode_chunked(x, packed, wu, transpose_down(wd))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 8, 16])
def test_gpu_decode_k2_chunked_at_8192_matches_oracle(dtype, m):
    """The decode path twell_ffn_triton takes at d = 8192 (K1 decode tiles + the chunked K2) within the
    low-precision rule, skewed 90% zeros, every 3rd row with every neuron active; also under a CUDA graph."""
    x, wg, wu, wd = make_case(m, 8192, 28672, 0.9, seed=47, dtype=dtype, device="cuda")
    x[::3, 0] = -30.0
    wdt = transpose_down(wd)
    got = tu.twell_ffn_triton(x, wg, wu, wdt)
    bf16_rule(got, x, wg, wu, wd, f"gpu chunked {dtype} m={m}")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tu.twell_ffn_triton(x, wg, wu, wdt)
    graph.replay()
    torch.cuda.synchronize()
    bf16_rule(out, x, wg, wu, wd, f"gpu chunked graph {dtype} m={m}")


@pytest.mark.gpu
@pytest.mark.parametrize("m,d,f", [(33, 2048, 8192), (300, 576, 1536), (1024, 2048, 8192)])
def test_gpu_fallback_variant(m, d, f):
    """"tiled" (the default's fallback K1 everywhere, compacted K2) against the oracle, bf16."""
    x, wg, wu, wd = make_case(m, d, f, 0.99, seed=26, dtype=torch.bfloat16, device="cuda")
    got = tu.twell_ffn_triton(x, wg, wu, transpose_down(wd), variant="tiled")
    bf16_rule(got, x, wg, wu, wd, f"gpu tiled {m}x{d}x{f}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d, f", [(2048, 8192), (4096, 14336), (8192, 28672)])
def test_gpu_fused_decode_ffn_matches_oracle(dtype, d, f):
    """The fused decode FFN at M = 1 on the three decode shapes within the low-precision rule, at 95.7% and 0%
    zeros (every neuron kept: the E-at-a-time loop at its longest), the default launch; also under a CUDA graph
    (its zero-fill, kernel and cast replayed)."""
    for zeros in (0.957, 0.0):
        x, wg, wu, wd = make_case(1, d, f, zeros, seed=48, dtype=dtype, device="cuda")
        wdt = transpose_down(wd)
        got = tu.twell_ffn_decode_fused(x, wg, wu, wdt)
        bf16_rule(got, x, wg, wu, wd, f"gpu fused {dtype} {d}x{f} zeros={zeros}")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tu.twell_ffn_decode_fused(x, wg, wu, wdt)
    graph.replay()
    torch.cuda.synchronize()
    bf16_rule(out, x, wg, wu, wd, f"gpu fused graph {dtype} {d}x{f}")
