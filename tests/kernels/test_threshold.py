"""The per-neuron threshold theta (h = g [g > theta] * up) through every FFN path: the torch definition, the
TwELL packing, K1 / K2 in the interpreter, twell_ffn and the op, the dispatcher (CPU; GPU tests marked `gpu`).

Exact cases: x and the weights are small dyadic numbers (k / 64), so every fp32 partial sum of the gate GEMM is
exact and every summation order (torch, tl.dot, the GEMV's, K2's) gives the same g; a 16-bit input's g is
then that exact value rounded to nearest even. So kernel and reference must pack exactly the same columns,
and a theta equal to a gate value (strictness) or between g and its 16-bit rounding (the comparison happens
on the input dtype's value) is decided the same way everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from sparsify.kernels import ffn_runtime as fr, twell_ops, twell_reference as ref, twell_triton as tt, twell_updown as tu
from sparsify.kernels.dispatch import Policy, TwellProbe

from tests.kernels.helpers import FP32, assert_close, make_case
from tests.kernels.fake_auto import ALL_DENSE, EAGER_TWELL, Kernels, dispatcher, state

ROOT = Path(__file__).resolve().parents[2]
TMA_SMALL = dict(BLOCK_M=32, BLOCK_K=32, num_warps=4, num_stages=2)  # interpreter-sized TMA K1 blocks


def dyadic_case(m, d, f, seed=0, dtype=torch.float32):
    """x [M, d], w_gate / w_up [F, d], w_down [d, F] of multiples of 1/64 in [-1, 1] (exact in fp16 and bf16):
    with d <= 64, x @ w_gate.T is exact in fp32 whatever the summation order."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-64, 65, (m, d), generator=gen) / 64
    w_gate = torch.randint(-64, 65, (f, d), generator=gen) / 64
    w_up = torch.randint(-64, 65, (f, d), generator=gen) / 64
    w_down = torch.randint(-64, 65, (d, f), generator=gen) / (64 * f**0.5)
    return tuple(t.to(dtype) for t in (x, w_gate, w_up, w_down))


def gate_as(x, w_gate):
    """(exact fp32 g, g as x's dtype holds it, as float32) [M, F]."""
    g = x.float() @ w_gate.float().t()
    return g, g.to(x.dtype).float()


def make_theta(g, g_dt, *, seed=1, scale=0.5, row=0):
    """theta [F] float32 >= 0: random up to scale x max|g|; every 5th 0 (relu); every 7th 1e4 (all cut); every
    6th equal to the gate value of `row` as the input dtype holds it (strictly greater: that one is cut); and
    for 16-bit g every 4th column whose `row` value rounds away from the exact g: the midpoint of the two
    (kept or cut by the rounded value, the opposite of what the exact one gets)."""
    f = g.shape[1]
    th = torch.rand(f, generator=torch.Generator().manual_seed(seed)) * scale * g.abs().max()
    th[0::5] = 0.0
    th[1::7] = 1e4
    th[2::6] = g_dt[row, 2::6].clamp(min=0.0)
    mid = (torch.arange(f) % 4 == 3) & (g_dt[row] != g[row]) & (g[row] > 0)
    th[mid] = ((g[row] + g_dt[row]) / 2)[mid]
    return th


def midpoints(g, g_dt, th, row=0) -> int:
    """How many thetas lie strictly between a gate value of `row` and its rounding to the input dtype."""
    return int(((th > torch.minimum(g[row], g_dt[row])) & (th < torch.maximum(g[row], g_dt[row]))).sum())


def expect_pack(packed, g_dt, th):
    """K1's packing equals the torch packer's on the dtype's gate values: counts, slot columns and values."""
    want = ref.twell_pack(g_dt, packed.tile, packed.slots, threshold=th)
    kept = torch.arange(packed.slots) < packed.cnt.clamp(max=packed.slots).unsqueeze(-1)
    assert torch.equal(packed.cnt, want.cnt), f"counts differ at {(packed.cnt != want.cnt).nonzero()[:5].tolist()}"
    assert torch.equal(packed.columns()[kept], want.columns()[kept]), "slot columns differ"
    assert torch.equal(packed.values()[kept], want.values()[kept]), "slot values differ"


# ------------------------------------------------------------------------------------------------ torch paths
def test_threshold_act_is_strict_keeps_g_and_compares_the_dtypes_value():
    g = torch.tensor([[-1.0, 0.0, 0.25, 0.5, 2.0, 1.0 + 2**-9]])
    th = torch.tensor([0.0, 0.0, 0.25, 0.25, 1.0, 1.0 + 2**-10])
    assert torch.equal(ref.threshold_act(g, th), torch.tensor([[0.0, 0.0, 0.0, 0.5, 2.0, 1.0 + 2**-9]]))
    assert torch.equal(ref.threshold_act(g, None), g.relu())
    # bf16 holds 1 + 2^-9 as 1.0 (ties to even): 1.0 > 1 + 2^-10 is False, so the dtype's value is cut
    got = ref.threshold_act(g.bfloat16(), th)
    assert got.dtype == torch.bfloat16 and got[0, 5] == 0 and got[0, 4] == 2.0
    leaf = g.clone().requires_grad_()
    ref.threshold_act(leaf, th).sum().backward()  # plain autograd: 1 where kept, 0 at g <= theta
    assert torch.equal(leaf.grad, torch.tensor([[0.0, 0.0, 0.0, 1.0, 1.0, 1.0]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_theta_zero_is_relu_bit_for_bit_in_torch(dtype):
    """theta = 0 gives today's results on every torch path (a case without gate values that round to zero)."""
    x, wg, wu, wd = dyadic_case(9, 48, 200, seed=3, dtype=dtype)
    zero = torch.zeros(200)
    assert torch.equal(ref.ffn_dense(x, wg, wu, wd, zero), ref.ffn_dense(x, wg, wu, wd))
    assert torch.equal(ref.ffn_reference(x, wg, wu, wd, zero), ref.ffn_reference(x, wg, wu, wd))
    g = x.float() @ wg.float().t()
    for entries in ("split", "bf16", "fp16"):
        a, b = ref.twell_pack(g, 64, 8, entries, zero), ref.twell_pack(g, 64, 8, entries)
        assert torch.equal(a.cnt, b.cnt) and torch.equal(ref.twell_unpack(a, g, zero), ref.twell_unpack(b, g))
        assert torch.equal(ref.twell_updown_reference(x, a, wg, wu, wd, zero), ref.twell_updown_reference(x, b, wg, wu, wd))


@pytest.mark.parametrize("entries", ["split", "bf16", "fp16"])
def test_pack_unpack_round_trip_with_threshold(entries):
    """twell_pack keeps exactly g > theta (cnt counts them, strictly); twell_unpack rebuilds them, overflowed
    tiles (forced by a low theta) from the dense gate with the same threshold."""
    x, wg, _, _ = dyadic_case(9, 48, 300, seed=4)
    g, _ = gate_as(x, wg)
    th = make_theta(g, g, scale=0.2)
    th[:64] = 0.0  # tile 0: about half of each row active, more than 8 slots: overflows
    packed = ref.twell_pack(g, 64, 8, entries, th)
    active = g > th
    pad = torch.nn.functional.pad(active, (0, 320 - 300)).view(9, 5, 64)
    assert torch.equal(packed.cnt, pad.sum(-1, dtype=torch.int32))
    equal = (th == g[0]) & (g[0] > 0)  # make_theta's columns 2::6 outside tile 0
    assert equal.sum() > 10 and not active[0][equal].any(), "g == theta must be cut"
    ovf = packed.overflowed()
    assert ovf[:, 0].all() and not ovf.all(), "the case needs overflowed and fitting tiles"
    want = ref.threshold_act(g, th)
    if entries != "split":  # slot values hold the 16-bit rounding; overflowed tiles the dense gate's
        rounded = ref.threshold_act(g.to(ref.ENTRY_DTYPES[entries]).float(), th)
        want = torch.where(ovf.repeat_interleave(64, dim=1)[:, :300], want, rounded)
    assert torch.equal(ref.twell_unpack(packed, g, th), want)
    with pytest.raises(ValueError, match="dense_gate"):
        ref.twell_unpack(packed)


# ------------------------------------------------------------------------------------ K1 / K2 (interpreter)
K1_CASES = {  # name: (rows, gate_pack kwargs); fp32 "tma" runs the tiled K1 (split entries), as it does in use
    "tiled": (37, dict(BLOCK_M=32, T=64, S=8)),
    "decode": (5, {}),
    "gemv": (1, dict(variant="gemv")),
    "tma": (37, dict(variant="tma", **TMA_SMALL)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("k1", list(K1_CASES))
def test_k1_packs_exactly_the_columns_above_theta(k1, dtype):
    """Every K1 (the plain-tiled GEMM with overflowing tiles, decode tiles, the GEMV at M = 1, the TMA K1's
    slot-major epilogue) packs the torch packer's columns and values on g as the input dtype holds it."""
    m, kw = K1_CASES[k1]
    x, wg, _, _ = dyadic_case(m, 48, 200, seed=5, dtype=dtype)
    g, g_dt = gate_as(x, wg)
    th = make_theta(g, g_dt, scale=0.3)
    assert midpoints(g, g_dt, th) >= (5 if dtype == torch.float16 else 0), "the case has no midpoint thetas"
    packed = tt.gate_pack(x, wg, threshold=th, **kw)
    expect_pack(packed, g_dt, th)
    if k1 == "tiled":
        assert packed.overflowed().any() and not packed.overflowed().all()
    if k1 == "tma" and dtype == torch.float16:
        assert packed.entries == "fp16" and packed.tile == ref.TILE


def test_k1_gemv_bf16_compares_the_rounded_gate():
    """bf16 (rounded in integers in K1): the GEMV K1 (no tl.dot, which the interpreter cannot run in bf16)."""
    x, wg, _, _ = dyadic_case(1, 48, 200, seed=6, dtype=torch.bfloat16)
    g, g_dt = gate_as(x, wg)
    th = make_theta(g, g_dt, scale=0.3)
    assert midpoints(g, g_dt, th) >= 10
    packed = tt.gate_pack(x, wg, variant="gemv", threshold=th)
    assert packed.entries == "bf16"
    expect_pack(packed, g_dt, th)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_k2_recomputes_overflowed_tiles_with_theta(dtype):
    """K2's lossless path (tiles with cnt > S recomputed from x and W_gate) applies theta on g in x's dtype,
    keeping the fp32 value: twell_updown_reference's definition. The packing comes from the torch packer
    (the interpreter runs no bf16 tl.dot); a theta of 0 on tile 0 makes every row overflow there."""
    x, wg, wu, wd = dyadic_case(9, 48, 200, seed=7, dtype=dtype)
    g, g_dt = gate_as(x, wg)
    th = make_theta(g, g_dt, scale=0.2)
    th[:64] = torch.where(torch.arange(64) % 4 == 3, th[:64], 0.0)  # keep tile 0's midpoints
    packed = ref.twell_pack(g_dt, 64, 8, tt.default_entries(dtype), th)
    assert packed.overflowed()[:, 0].all() and not packed.overflowed().all()
    out = tu.updown(x, packed, wg, wu, ref.transpose_down(wd), threshold=th)
    want = ref.twell_updown_reference(x, packed, wg, wu, wd, th)
    tol = FP32 if dtype == torch.float32 else dict(rtol=2.0**-7, atol=0.0)  # the output's 16-bit rounding
    assert_close(out, want, what=f"K2 overflow {dtype}", **tol)
    blind = tu.updown(x, packed, wg, wu, ref.transpose_down(wd))  # relu in the overflowed tiles: far off
    assert (blind.float() - want).abs().max() > 10 * (out.float() - want).abs().max() + 1e-3


@pytest.mark.parametrize("m", [1, 2, 8, 16])
def test_decode_paths_with_theta(m):
    """Decode (M <= 16): the GEMV K1 + chunked K2 at M = 1, decode tiles + split K2 above; the chunked K2 forced
    at M > 1 too; against the fp32 oracle, and theta = 0 equal to no theta bit for bit."""
    x, wg, wu, wd = dyadic_case(m, 48, 200, seed=8)
    g, _ = gate_as(x, wg)
    th = make_theta(g, g, scale=0.3)
    wdt = ref.transpose_down(wd)
    want = ref.ffn_reference(x, wg, wu, wd, th)
    out = tu.twell_ffn_triton(x, wg, wu, wdt, threshold=th)
    assert_close(out, want, what=f"decode m={m}", **FP32)
    packed = tt.gate_pack(x, wg, threshold=th)
    assert packed.tile == ref.DECODE_TILE
    assert_close(tu.updown(x, packed, wg, wu, wdt, chunked=True, threshold=th), want, what=f"chunked m={m}", **FP32)
    zero = torch.zeros(200)
    assert torch.equal(tu.twell_ffn_triton(x, wg, wu, wdt, threshold=zero), tu.twell_ffn_triton(x, wg, wu, wdt))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_decode_ffn_keeps_exactly_the_gates_above_theta(dtype):
    """The fused decode FFN (K1's GEMV and K2 in one launch) with theta: exact dyadic gates, so it must keep
    the oracle's columns, including thetas equal to a gate (cut) and, in bf16, between g and its rounding
    (decided on the rounded value); theta = 0 gives the relu output bit for bit; a blind kernel would be far off."""
    x, wg, wu, wd = dyadic_case(1, 48, 200, seed=10, dtype=dtype)
    g, g_dt = gate_as(x, wg)
    th = make_theta(g, g_dt, scale=0.3)
    if dtype == torch.bfloat16:
        assert midpoints(g, g_dt, th) >= 10
    wdt = ref.transpose_down(wd)
    sums = tu.twell_ffn_decode_fused(x, wg, wu, wdt, threshold=th, BLOCK_K=16, BD=16, fp32_out=True)
    packed = tt.gate_pack(x, wg, variant="gemv", threshold=th)
    expect_pack(packed, g_dt, th)  # the columns K1 keeps are the oracle's
    want = ref.twell_updown_reference(x.float(), packed, wg.float(), wu.float(), wd.float())
    assert_close(sums, want, what=f"fused theta {dtype}", **FP32)
    relu = tu.twell_ffn_decode_fused(x, wg, wu, wdt, fp32_out=True, BLOCK_K=16, BD=16)
    zero = tu.twell_ffn_decode_fused(x, wg, wu, wdt, threshold=torch.zeros(200), fp32_out=True, BLOCK_K=16, BD=16)
    assert torch.equal(zero, relu)
    assert (relu - want).abs().max() > 10 * (sums - want).abs().max() + 1e-3


def test_theta_zero_is_relu_bit_for_bit_in_the_kernels():
    """theta = 0 through K1 (tiled, tma) and K2 (overflowing tiles) gives exactly the relu path's packing and
    output (fp32 and fp16; no gate value here rounds to zero in fp16)."""
    for dtype, k1 in ((torch.float32, "tiled"), (torch.float16, "tma")):
        x, wg, wu, wd = dyadic_case(37, 48, 300, seed=9, dtype=dtype)
        zero, wdt = torch.zeros(300), ref.transpose_down(wd)
        kw = dict(BLOCK_M=32, T=64, S=8) if k1 == "tiled" else dict(variant="tma", **TMA_SMALL)
        a, b = tt.gate_pack(x, wg, threshold=zero, **kw), tt.gate_pack(x, wg, **kw)
        kept = torch.arange(a.slots) < a.cnt.clamp(max=a.slots).unsqueeze(-1)
        assert torch.equal(a.cnt, b.cnt) and torch.equal(a.columns()[kept], b.columns()[kept]), k1
        assert torch.equal(a.values()[kept], b.values()[kept]) and a.overflowed().any(), k1
        assert torch.equal(tu.updown(x, a, wg, wu, wdt, threshold=zero), tu.updown(x, b, wg, wu, wdt)), k1


# ------------------------------------------------------------------------------------ twell_ffn and the op
def test_backends_agree_with_theta():
    """dense == twell == auto (CPU: dense) == the fp32 oracle with theta, x as [B, T, d]; theta changes y."""
    x, wg, wu, wd = dyadic_case(12, 48, 300, seed=10)
    g, _ = gate_as(x, wg)
    th = make_theta(g, g, scale=0.3)
    x3 = x.view(3, 4, 48)
    want = ref.ffn_reference(x3, wg, wu, wd, th)
    assert (want - ref.ffn_reference(x3, wg, wu, wd)).abs().max() > 0.1 * want.abs().max(), "theta does nothing"
    for backend in ("dense", "twell", "auto"):
        got = twell_ops.twell_ffn(x3, wg, wu, wd, backend=backend, threshold=th)
        assert got.shape == (3, 4, 48) and twell_ops.last_backend() == ("twell" if backend == "twell" else "dense")
        assert_close(got, want, what=f"backend={backend}", **FP32)
    wg.requires_grad_(True)  # gradients: the dense path, with theta
    y = twell_ops.twell_ffn(x3, wg, wu, wd, backend="twell", threshold=th)
    assert twell_ops.last_backend() == "dense"
    assert_close(y, want, what="grad path", **FP32)


def test_bad_thresholds_name_the_fix():
    x, wg, wu, wd = make_case(2, 16, 64, 0.5)
    for bad, what in ((torch.zeros(64, dtype=torch.bfloat16), "torch.bfloat16"), (torch.zeros(63), r"\(63,\)"),
                      (torch.zeros(1), r"\(1,\)"), (torch.zeros(64, device="meta"), "meta")):
        for backend in ("auto", "twell", "dense"):
            with pytest.raises(ValueError, match=rf"threshold is .*{what}.*expected float32 \(64,\) on cpu"):
                twell_ops.twell_ffn(x, wg, wu, wd, backend=backend, threshold=bad)


def test_compiled_call_passes_theta_through_the_op():
    """Under torch.compile twell_ffn calls the custom op, whose schema carries the threshold."""
    x, wg, wu, wd = dyadic_case(5, 48, 200, seed=11)
    g, _ = gate_as(x, wg)
    th = make_theta(g, g, scale=0.3)
    assert any(a.name == "threshold" for a in getattr(torch.ops.sparsify, fr.OP).default._schema.arguments)
    fn = torch.compile(lambda a: twell_ops.twell_ffn(a, wg, wu, wd, backend="twell", threshold=th),
                       backend="aot_eager", fullgraph=True)
    assert_close(fn(x), ref.ffn_reference(x, wg, wu, wd, th), what="compiled twell", **FP32)


def test_an_older_copys_op_and_dispatcher_are_never_used(tmp_path):
    """An older bundle copy registered sparsify::twell_ffn (no threshold argument) and published its dispatcher
    (sys.modules["sparsify_twell_ffn_auto"]) first: this copy registers its own op, sparsify::ffn, never runs
    theirs and leaves their entry as it was (older copies keep finding their own dispatcher there)."""
    code = textwrap.dedent("""
        import sys, types, torch
        class OldDispatcher:  # an older copy's: every attribute it used, no `thresholds`
            note = down_t = fast_path = grant_dense = dense_used = decisions = dense_in_capture = None
            twell_in_capture = capture_dense = last_backend = None
        old_auto = OldDispatcher()
        sys.modules.setdefault("sparsify_twell_ffn_auto", types.ModuleType("x")).auto = old_auto

        @torch.library.custom_op("sparsify::twell_ffn", mutates_args=())
        def old(x2d: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                w_down_t: torch.Tensor | None, backend: str) -> torch.Tensor:
            raise AssertionError("the older op ran")

        from sparsify.kernels import twell_ops, twell_reference as ref
        from sparsify.kernels.ffn_runtime import OP
        assert hasattr(torch.ops.sparsify, OP) and not hasattr(torch.ops.sparsify, "twell_ffn_threshold")
        assert not isinstance(twell_ops.auto_dispatcher(), OldDispatcher)
        assert sys.modules["sparsify_twell_ffn_auto"].auto is old_auto
        gen = torch.Generator().manual_seed(0)
        x, wg, wu, wd = (torch.randn(*s, generator=gen) for s in ((3, 8), (20, 8), (20, 8), (8, 20)))
        th = torch.rand(20, generator=gen)
        fn = torch.compile(lambda a: twell_ops.twell_ffn(a, wg, wu, wd, backend="dense", threshold=th),
                           backend="aot_eager", fullgraph=True)
        want = ref.ffn_reference(x, wg, wu, wd, th)
        assert (fn(x) - want).abs().max() <= 1e-5 * want.abs().max()
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


# ---------------------------------------------------------------------------------------------- dispatcher
def test_auto_counts_times_and_runs_with_the_calls_theta():
    """The density is the fraction of g > theta; calibration, the twell path and the dense fast path all get
    the call's theta; a call with another theta object (or none) starts the bucket afresh."""
    x, wg, wu, wd = make_case(20, 16, 64, 0.0, seed=12)  # every g > 0: density 1 without theta
    g = x @ wg.t()
    th = torch.quantile(g, 0.9, dim=0)  # [F]: ~10% of each column above
    d = dispatcher(ALL_DENSE)
    out = d.entry(x, wg, wu, wd, threshold=th)
    st = state(d, wg)
    assert st.theta is th and st.density == pytest.approx(float((g > th).float().mean()))
    assert d.sparse.thetas and all(t is th for t in d.sparse.thetas), "the twell path ran without theta"
    assert torch.equal(out, ref.ffn_dense(x, wg, wu, wd, th))
    calls = st.calls
    assert d.choose(x, wg, wu, wd, threshold=th).path == "dense" and st.calls == calls + 1  # the dense hot path
    assert torch.equal(d.entry(x, wg, wu, wd, threshold=th), ref.ffn_dense(x, wg, wu, wd, th))
    other = th.clone()
    d.choose(x, wg, wu, wd, threshold=other)  # another theta object: a fresh bucket, counted and timed again
    assert state(d, wg).theta is other
    d.entry(x, wg, wu, wd)  # no theta: a fresh bucket, counted and timed again
    assert state(d, wg).theta is None and state(d, wg).density == pytest.approx(1.0)
    assert torch.equal(d.entry(x, wg, wu, wd), ref.ffn_dense(x, wg, wu, wd))


def test_auto_dense_refresh_counts_above_theta():
    """A dense bucket's refresh counts g > theta (the dense row's count, with theta)."""
    x, wg, wu, wd = make_case(20, 16, 64, 0.0, seed=13)
    th = torch.quantile(x @ wg.t(), 0.75, dim=0)
    d = dispatcher(ALL_DENSE, policy=Policy(refresh_dense=4))
    d.entry(x, wg, wu, wd, threshold=th)
    st = state(d, wg)
    st.density = None
    while st.pending is None:
        assert torch.equal(d.entry(x, wg, wu, wd, threshold=th), ref.ffn_dense(x, wg, wu, wd, th))
    assert st.pending[0].item() == int((x @ wg.t() > th).sum())


def test_auto_twell_decision_with_theta_runs_the_kernels():
    x, wg, wu, wd = dyadic_case(20, 48, 200, seed=14)
    g, _ = gate_as(x, wg)
    th = make_theta(g, g, scale=0.3)
    d = dispatcher(EAGER_TWELL, policy=Policy(graph_timed_m=0, prefill_max_density=1.0, cal_rounds=(5, 5)),
                   kernels=TwellProbe())
    out = d.entry(x, wg, wu, wd, threshold=th)
    assert d.last_backend == "twell" and state(d, wg).density == pytest.approx(float((g > th).float().mean()))
    assert_close(out, ref.ffn_reference(x, wg, wu, wd, th), what="auto twell with theta", **FP32)


def test_fake_kernels_honour_theta():
    """(the stand-in TwELL row of the dispatcher tests computes the thresholded FFN)"""
    x, wg, wu, wd = make_case(4, 16, 64, 0.5, seed=15)
    th = torch.rand(64)
    assert torch.equal(Kernels()(dispatcher(), x, wg, wu, wd, threshold=th), ref.ffn_dense(x, wg, wu, wd, th))


# ---------------------------------------------------------------- GPU (run on the H200, skipped on CPU)
GPU_M = [1, 2, 8, 16, 128, 4096, 16384]


def gpu_case(m, seed=40):
    """bf16 Llama-ish layer (d 2048, F 8192) and theta [F] drawn so ~95% of g are cut: each neuron's 95th
    percentile of g over 4096 calibration rows (some neurons at 0: ~50% active, some at 1e4: never)."""
    d, f = 2048, 8192
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, d, device="cuda", generator=gen).bfloat16()
    w_gate = (torch.randn(f, d, device="cuda", generator=gen) / d**0.5).bfloat16()
    w_up = (torch.randn(f, d, device="cuda", generator=gen) / d**0.5).bfloat16()
    w_down = (torch.randn(d, f, device="cuda", generator=gen) / f**0.5).bfloat16()
    calib = torch.randn(4096, d, device="cuda", generator=gen).bfloat16()
    th = torch.quantile(calib.float() @ w_gate.float().t(), 0.95, dim=0).clamp(min=0)  # [F] float32
    th[::97] = 0.0
    th[1::89] = 1e4
    return x, w_gate, w_up, w_down, th.contiguous()


def bf16_rule_theta(got, x, wg, wu, wd, th, what):
    """helpers.bf16_rule with a threshold: error against the fp32 oracle at most 2x the plain bf16 dense FFN's
    (whose gate rounding flips the values next to theta too), + a small atol."""
    want = ref.ffn_reference(x, wg, wu, wd, th)
    base = (ref.ffn_dense(x, wg, wu, wd, th).float() - want).abs().max().item()
    assert_close(got, want, rtol=0.0, atol=2 * base + 1e-3 * want.abs().max().item(), what=what)
    return want


@pytest.mark.gpu
@pytest.mark.parametrize("m", GPU_M)
def test_gpu_theta_twell_auto_dense_match_oracle(m):
    """twell, auto and dense with theta at decode and prefill M, bf16 (2048 x 8192, ~95% cut), each within the
    bf16 rule against the fp32 oracle; the packing's density is the dense path's fraction of g > theta."""
    x, wg, wu, wd, th = gpu_case(m)
    for backend in ("twell", "auto", "dense"):
        got = twell_ops.twell_ffn(x, wg, wu, wd, backend=backend, threshold=th)
        want = bf16_rule_theta(got, x, wg, wu, wd, th, f"{backend} m={m}")
    assert (want - ref.ffn_reference(x, wg, wu, wd)).abs().max() > 0.2 * want.abs().max(), "theta does nothing"
    packed = tt.gate_pack(x, wg, variant="tma", threshold=th)
    g = torch.nn.functional.linear(x, wg)  # bf16, as the dense path has it
    dense_active = int((g.float() > th).sum())
    assert abs(int(packed.cnt.sum()) - dense_active) <= max(2, dense_active // 1000), (int(packed.cnt.sum()), dense_active)
    assert dense_active <= 0.08 * g.numel() or m <= 2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 4096])
def test_gpu_theta_zero_is_relu_and_graphs_replay(m):
    """On the GPU theta = 0 packs what relu packs (and, without the decode K2's fp32 atomics, gives the same
    bits), and a thresholded auto call replays from a CUDA graph."""
    x, wg, wu, wd, th = gpu_case(m, seed=41)
    zero = torch.zeros_like(th)
    wdt = ref.transpose_down(wd)
    a, b = tt.gate_pack(x, wg, variant="tma", threshold=zero), tt.gate_pack(x, wg, variant="tma")
    kept = torch.arange(a.slots, device="cuda") < a.cnt.clamp(max=a.slots).unsqueeze(-1)
    assert torch.equal(a.cnt, b.cnt) and torch.equal(a.ent[kept], b.ent[kept])
    if m > tu.K2_SPLIT_MAX_M:
        assert torch.equal(tu.twell_ffn_triton(x, wg, wu, wdt, threshold=zero), tu.twell_ffn_triton(x, wg, wu, wdt))
    eager = twell_ops.twell_ffn(x, wg, wu, wd, w_down_t=wdt, threshold=th)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static = twell_ops.twell_ffn(x, wg, wu, wd, w_down_t=wdt, threshold=th)
    graph.replay()
    torch.cuda.synchronize()
    for got, what in ((eager, "eager auto"), (static, "graph auto")):
        bf16_rule_theta(got, x, wg, wu, wd, th, f"{what} m={m}")
