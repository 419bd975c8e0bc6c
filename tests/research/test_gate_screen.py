"""The exact gate screen (eval/research/gate_screen.py, research code outside the shipped bundle): the torch reference and the screened decode K1 never drop an
active row, on random and adversarial inputs (rows built to sit on the bound, one-ulp thresholds, large norms,
all-zero rows, outlier channels, NaN); the screened K1 packs exactly what gate_pack packs and the screened FFN
equals twell_ffn_triton (CPU: Triton interpreter; GPU tests marked `gpu`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparsify.kernels import twell_reference as ref, twell_triton as tt, twell_updown as tu
from sparsify.kernels.twell_reference import transpose_down

from tests.kernels.helpers import FP32, assert_close, bf16_rule, check_packed_values, make_case

ROOT = Path(__file__).resolve().parents[2]
RESEARCH = ROOT / "eval" / "research"
if str(RESEARCH) not in sys.path:
    sys.path.insert(0, str(RESEARCH))  # gate_screen.py is imported as its scripts import it

import gate_screen as gs  # noqa: E402
SCREENS = [("int8", None, 0), ("int8", 32, 0), ("fp8", None, 1), ("int8", None, 2), ("fp8", 32, 1)]


def screen(wg, kind, group, k, x=None):
    return gs.screen_weights(wg, kind, group, gs.outlier_columns(wg, k, x) if k else None)


def theta_for(gate, dtype, seed):
    """A per-row theta within the gate's typical size, a few exactly 0."""
    gen = torch.Generator().manual_seed(seed)
    th = (gate.float().abs().mean(0) * torch.rand(gate.shape[1], generator=gen)).float()
    th[::7] = 0.0
    return th


def assert_superset(mask, act, what):
    missed = act & ~mask
    assert not missed.any(), f"{what}: {int(missed.sum())} active rows dropped, first at {missed.nonzero()[:5].tolist()}"


# -------------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("seed", range(6))
def test_reference_never_drops_an_active_row(seed):
    """Property over seeds, kinds, groups, exact channels, dtypes, relu and theta: reference mask >= active."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        d, f = (64, 256) if seed % 2 else (200, 320)
        x, wg, _, _ = make_case(24, d, f, 0.9, seed=seed, dtype=dtype, skew=bool(seed % 3))
        x[3] *= 1000.0 if dtype != torch.float16 else 30.0  # a large-norm row
        x[5, 7] = 50.0  # an outlier channel
        x[6] = 0.0
        gate = x.float() @ wg.float().t()
        for kind, group, k in SCREENS:
            sw = screen(wg, kind, group, k, x)
            for th in (None, theta_for(gate, dtype, seed)):
                act = gs.active_mask(x, wg, th)
                for b in ("cs", "holder", "min", "group", "group_min"):
                    mask = gs.screen_mask(gs.screen_terms(x, sw), th, x.dtype, b)
                    assert_superset(mask, act, f"seed {seed} {dtype} {kind} g{group} k{k} theta {th is not None} {b}")
                if th is None:  # relu: an all-zero row passes nothing
                    assert not gs.screen_reference(x, sw)[6].any()


def aligned_case(d, f, kind, group, seed=0):
    """Rows sitting on the Cauchy-Schwarz bound: x_m = e_j / ||e_j|| * c + a small multiple of w-hat_j, so
    e_j . x = ||e_j|| ||x'|| exactly in real arithmetic (fp32 inputs): the real gate exceeds the estimate by the
    whole quantisation radius. Returns x [M, d], W_gate, the screen, the aimed rows j [M]."""
    gen = torch.Generator().manual_seed(seed)
    wg = (torch.randn(f, d, generator=gen) / d**0.5)
    sw = gs.screen_weights(wg, kind, group)
    deq = sw.q.double() * sw.scale.double().repeat_interleave(sw.group, 1)[:, :d]
    e = wg.double() - deq  # [F, d]
    js = torch.arange(0, f, max(1, f // 8))[:8]
    x = torch.stack([e[j] / e[j].norm() for j in js]).float()  # [M, d]
    return x, wg, sw, js


@pytest.mark.parametrize("kind,group", [("int8", None), ("fp8", None), ("int8", 32)])
def test_reference_adversarial_rows_on_the_bound(kind, group):
    """Gate = estimate + the full quantisation radius (x along e_j); theta one fp32 ulp below the exact gate
    (active) and at it (inactive): the screen passes the active row, and a radius without the quantisation
    term would have dropped it (the case really sits on the bound)."""
    x, wg, sw, js = aligned_case(128, 64, kind, group)
    gate = x.float() @ wg.float().t()  # [M, F]
    terms = gs.screen_terms(x, sw)
    for i, j in enumerate(js.tolist()):
        g = gate[i, j]
        below = torch.full((wg.shape[0],), float("inf"))
        below[j] = torch.nextafter(g, torch.tensor(-float("inf")))
        act = gs.active_mask(x, wg, below)
        assert act[i, j]
        mask = gs.screen_mask(terms, below, x.dtype, "min" if group is None else "group_min")
        assert_superset(mask, act, f"{kind} g{group} row {j}")
        # the real gate exceeds the estimate by (nearly) the whole quantisation radius, and the rounding term
        # is small beside it: a radius without the quantisation term would have dropped the row
        quant = terms["cs" if group is None else "group"][i, j]
        assert g - terms["est"][i, j] >= 0.9 * quant and terms["round"][i, j] < 0.1 * quant, (
            f"row {j}: not on the bound (est {terms['est'][i, j]:.6g}, gate {g:.6g}, radius {quant:.3g})")
        at = below.clone()
        at[j] = g
        assert not gs.active_mask(x, wg, at)[i, j]


def test_reference_one_ulp_thresholds_16bit():
    """bf16 / fp16 inputs: theta between the fp32 accumulator and its 16-bit rounding, and one 16-bit ulp
    around it: the comparison on the rounded value never loses an active row."""
    for dtype in (torch.bfloat16, torch.float16):
        x, wg, _, _ = make_case(8, 96, 128, 0.5, seed=3, dtype=dtype)
        gate = x.float() @ wg.float().t()
        r = gate.to(dtype).float()
        sw = gs.screen_weights(wg, "int8")
        ups = torch.nextafter(r.to(dtype), torch.tensor(float("inf"), dtype=dtype)).float()
        downs = torch.nextafter(r.to(dtype), torch.tensor(-float("inf"), dtype=dtype)).float()
        for cand in (r, (r + gate) / 2, downs, (r + downs) / 2, ups):
            for i in range(8):
                th = cand[i].clamp_min(0).float()
                act = gs.active_mask(x, wg, th)
                assert_superset(gs.screen_reference(x, sw, th), act, f"{dtype} row {i}")


def test_reference_nonfinite_and_huge_rows_pass_everything():
    x, wg, _, _ = make_case(4, 64, 128, 0.9, seed=4)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3] = 3e37  # ||x|| above n_big: no claim about overflow-free sums, so everything passes
    sw = gs.screen_weights(wg, "int8")
    assert float(x[3].double().norm()) > sw.n_big
    mask = gs.screen_reference(x, sw)
    assert mask[1:].all()
    nb = sw.nbytes()  # the copy is half a bf16 W_gate; the per-row terms 16 bytes a row
    assert nb["copy"] == 128 * 64 and nb["terms"] == 128 * 16 and nb["exact"] == 0


# ----------------------------------------------------------------------------------------------- kernel
def _same_packing(got, want, what):
    assert got.entries == want.entries and got.tile == want.tile == ref.DECODE_TILE, what
    assert torch.equal(got.cnt, want.cnt), f"{what}: counts differ at {(got.cnt != want.cnt).nonzero()[:5].tolist()}"
    kept = torch.arange(got.slots) < got.cnt.clamp(max=got.slots).unsqueeze(-1)
    if got.entries == "split":
        assert torch.equal(got.col[kept], want.col[kept]), f"{what}: columns differ"
        assert torch.equal(got.val[kept], want.val[kept]), f"{what}: values differ"
    else:
        assert torch.equal(got.ent[kept], want.ent[kept]), f"{what}: packed words differ"


def _k1(x, wg, th):
    """The decode K1 that twell_ffn_triton runs: the GEMV K1 at M = 1, the plain-tiled _k1_tiled above."""
    return tt.gate_pack(x, wg, variant="gemv" if x.shape[0] == 1 else "tiled", threshold=th)


CASES = [(1, 128, 256, torch.float32), (1, 96, 200, torch.bfloat16), (5, 128, 256, torch.float32),
         (16, 256, 320, torch.float16), (3, 200, 256, torch.float16), (1, 256, 512, torch.bfloat16)]


@pytest.mark.parametrize("m,d,f,dtype", CASES)
def test_kernel_packs_what_gate_pack_packs(m, d, f, dtype):
    """Bitwise equal packing (counts and words / col+val) to the unscreened decode K1, relu and theta, every
    screen kind; the kernel's pass mask covers every active row."""
    x, wg, _, _ = make_case(m, d, f, 0.9, seed=m + d, dtype=dtype, skew=True)
    if m > 2:
        x[1] = 0.0
        x[2, 5] = 40.0
    gate = x.float() @ wg.float().t()
    for kind, group, k in SCREENS:
        sw = screen(wg, kind, group, k, x)
        for th in (None, theta_for(gate, dtype, 1)):
            what = f"M={m} {d}x{f} {dtype} {kind} g{group} k{k} theta {th is not None}"
            got, pas, npass = gs.gate_pack_screened(x, wg, sw, th, return_pass=True)
            _same_packing(got, _k1(x, wg, th), what)
            assert_superset(pas, gs.active_mask(x, wg, th), what)
            assert int(npass.sum()) == int(pas.any(0).sum()), what


@pytest.mark.parametrize("kind,group", [("int8", None), ("fp8", None), ("int8", 32)])
def test_kernel_adversarial_rows(kind, group):
    """The kernel on rows sitting on the bound (x along e_j, theta one ulp under the gate), a zero row, a huge
    row and a NaN row: same packing as gate_pack, nothing active dropped; NaN / huge rows pass everything."""
    x, wg, sw, js = aligned_case(128, 64, kind, group)
    gate = x.float() @ wg.float().t()
    th = torch.full((wg.shape[0],), 1e30)
    for i, j in enumerate(js.tolist()):
        th[j] = torch.nextafter(gate[i, j], torch.tensor(-float("inf")))
    for rows in (x[:1], x[:8], torch.cat([x[:4], torch.zeros(1, 128), x[4:5] * 2.0**40]),
                 torch.cat([x[:2], torch.full((1, 128), float("nan"))])):
        nan = bool(torch.isnan(rows).any())
        for t in (th, None):
            got, pas, _ = gs.gate_pack_screened(rows, wg, sw, t, return_pass=True)
            what = f"{kind} g{group} M={rows.shape[0]} theta {t is not None}"
            assert_superset(pas, gs.active_mask(rows, wg, t), what)
            if nan:
                assert pas[-1].all(), what
            else:
                _same_packing(got, _k1(rows, wg, t), what)
            if rows.shape[0] == 6 and t is None:
                assert not pas[4].any(), f"{what}: the all-zero row passed rows under relu"


@pytest.mark.parametrize("m,dtype", [(1, torch.float32), (1, torch.bfloat16), (4, torch.float32), (16, torch.float16)])
def test_ffn_screened_equals_twell_and_dense(m, dtype):
    """dense == twell == screened: the screened FFN is bitwise twell_ffn_triton (same packing, same K2), and both
    match the fp32 oracle (fp32: FP32 tolerance; 16-bit: the bf16 rule), relu and theta."""
    x, wg, wu, wd = make_case(m, 128, 256, 0.9, seed=7, dtype=dtype, skew=True)
    wdt = transpose_down(wd)
    gate = x.float() @ wg.float().t()
    for kind, group, k in SCREENS[:3]:
        sw = screen(wg, kind, group, k, x)
        for th in (None, theta_for(gate, dtype, 2)):
            got = gs.twell_ffn_screened(x, wg, wu, wdt, sw, th)
            want = tu.twell_ffn_triton(x, wg, wu, wdt, threshold=th)
            assert torch.equal(got, want), f"M={m} {dtype} {kind}: screened FFN != twell_ffn_triton"
            if dtype == torch.float32:
                assert_close(got, ref.ffn_reference(x, wg, wu, wd, th), what=f"screened vs oracle M={m}", **FP32)
            elif th is None:
                bf16_rule(got, x, wg, wu, wd, f"screened M={m} {dtype}")


def test_kernel_random_seeds_never_drop():
    """Property over seeds in the kernel (M = 1 and 8, fp32 and fp16): the pass mask covers the active rows."""
    for seed in range(4):
        for m, dtype in ((1, torch.float32), (8, torch.float16)):
            x, wg, _, _ = make_case(m, 64, 128, 0.95, seed=100 + seed, dtype=dtype, skew=True)
            for kind, group, k in SCREENS:
                sw = screen(wg, kind, group, k)
                _, pas, _ = gs.gate_pack_screened(x, wg, sw, return_pass=True)
                assert_superset(pas, gs.active_mask(x, wg), f"seed {seed} M={m} {kind} g{group} k{k}")


# launch configurations the bench sweeps (gate_pack_screened overrides): (M, overrides, same order as gate_pack)
SWEEP_CFGS = [(1, dict(CP=1), True), (1, dict(CP=2, BK1=64, num_warps=8), True), (1, dict(CP=32, CVT=0), True),
              (1, dict(BK2=64, CP=4), False), (5, dict(CP=16), False), (5, dict(BK1=64, CVT=0), True),
              (16, dict(CP=16, BK2=64), False)]


@pytest.mark.parametrize("m,over,same", SWEEP_CFGS)
def test_kernel_sweep_configs(m, over, same):
    """Every swept launch configuration (passed rows gathered 1 / 2 / 4 / 32 at a time at M = 1, passed columns 16
    at a time at M > 1, other phase-1 / phase-2 steps, the plain int8 cast): the pass mask covers every active
    row, on random rows and on rows sitting on the bound (theta one ulp under the gate). Configurations that keep
    gate_pack's summation order pack bitwise the same; the others pack values within the K1 bound."""
    x, wg, _, _ = make_case(m, 128, 256, 0.9, seed=40 + m, dtype=torch.float32, skew=True)
    xa, wa, _, js = aligned_case(128, 256, "int8", None)
    gate_a = xa.float() @ wa.float().t()
    th_a = torch.full((256,), 1e30)
    for i, j in enumerate(js.tolist()):
        th_a[j] = torch.nextafter(gate_a[i, j], torch.tensor(-float("inf")))
    for kind, group, k in (("int8", None, 1), ("fp8", None, 0), ("int8", 32, 0)):
        if group is not None and "BK1" in over:
            continue
        for xx, ww, th in ((x, wg, None), (x, wg, theta_for(x.float() @ wg.float().t(), x.dtype, 3)),
                           (xa[:m], wa, th_a)):
            sw = screen(ww, kind, group, k, xx)
            what = f"M={m} {over} {kind} g{group} k{k} theta {th is not None}"
            got, pas, npass = gs.gate_pack_screened(xx, ww, sw, th, return_pass=True, **over)
            assert_superset(pas, gs.active_mask(xx, ww, th), what)
            assert int(npass.sum()) == int(pas.any(0).sum()), what
            if same:
                _same_packing(got, _k1(xx, ww, th), what)
            elif th is None:
                check_packed_values(got, xx, ww, xx.float() @ ww.float().t(), what)


def test_int8_conversion_trick_is_exact():
    """CVT = 1's integer trick gives every int8 value exactly (what the plain cast gives)."""
    import triton
    import triton.language as tl

    @triton.jit
    def conv(q_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(o_ptr + i, gs._q_f32(tl.load(q_ptr + i), True, 1))

    q = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8)
    out = torch.empty(256, dtype=torch.float32)
    conv[(1,)](q, out, N=256)
    assert torch.equal(out, q.float())


def test_overrides_checked():
    x, wg, _, _ = make_case(4, 64, 128, 0.9, seed=1)
    sw = gs.screen_weights(wg, "int8", 32)
    with pytest.raises(ValueError, match="unknown overrides"):
        gs.gate_pack_screened(x, wg, sw, BLOCK_K=64)
    with pytest.raises(ValueError, match="one group"):
        gs.gate_pack_screened(x, wg, sw, BK1=64)
    with pytest.raises(ValueError, match="CP >= 16"):
        gs.gate_pack_screened(x, wg, gs.screen_weights(wg, "int8"), CP=8)


def test_bench_screen_cuda_smoke_on_cpu(tmp_path):
    """eval/research/bench_screen.py --cuda --smoke: the CUDA mode's code path (every variant's default launch and a
    part of the launch sweep, each checked: pass mask covers the active rows, FFN within the bf16 rule of the fp32
    reference) in the interpreter; both tables and the best config per case written."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, str(RESEARCH / "bench_screen.py"), "--cuda", "--smoke", "--out",
                          str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads((tmp_path / "screen.json").read_text())["rows"]
    assert [r["M"] for r in rows] == [1, 8]
    for r in rows:
        assert not r["errors"] and "bad" not in r, (r["errors"], r.get("bad"))
        assert len([c for c in r["configs"].values() if c["variant"] == "int8-row+ex"]) == 3
        assert set(r["best"]) == {"int8-row+ex", "int8-g128+ex", "fp8-row+ex", "int8-row"}
    md = (tmp_path / "screen.md").read_text()
    assert "Launch sweep of the screened K1" in md and "Best per case" in md


def test_bench_screen_cpu_mode_tiny(tmp_path):
    """eval/research/bench_screen.py --cpu on a tiny synthetic shape (no real model): JSON and table written, every
    rigorous bound checked inside (it asserts no active row is dropped)."""
    res = subprocess.run([sys.executable, str(RESEARCH / "bench_screen.py"), "--cpu", "--shapes", "64x256",
                          "--tokens", "16", "--no-real", "--out", str(tmp_path)],
                         capture_output=True, text=True, env={**os.environ}, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads((tmp_path / "screen.json").read_text())["rows"]
    assert len(rows) == 1 and len(rows[0]["variants"]) == 7
    assert (tmp_path / "screen.md").read_text().count("| synth 64x256 |") == 7 + 2  # + the two lossy rows


# -------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("d,f", [(2048, 8192), (4096, 14336), (8192, 28672)])
def test_gpu_screen_decode_shapes(d, f):
    """M = 1..16 on the three decode shapes, bf16, 95.7% skewed zeros (plus a zero row and an outlier channel):
    the screened K1's pass mask covers every active row; its packing equals gate_pack's and its values are
    within the K1 bound of the fp32 reference; the screened FFN within the bf16 rule of the fp32 oracle."""
    x, wg, wu, wd = make_case(16, d, f, 0.957, seed=31, dtype=torch.bfloat16, device="cuda", skew=True)
    x[3] = 0.0
    x[5, 11] = 60.0
    wdt = transpose_down(wd)
    gate = x.float() @ wg.float().t()
    for kind, group, k in (("int8", None, 1), ("int8", 128, 1), ("fp8", None, 1), ("int8", None, 0)):
        sw = screen(wg, kind, group, k, x)
        for m in range(1, 17):
            xm = x[:m].contiguous()
            what = f"gpu {d}x{f} M={m} {kind} g{group} k{k}"
            got, pas, _ = gs.gate_pack_screened(xm, wg, sw, return_pass=True)
            assert_superset(pas, gs.active_mask(xm, wg), what)
            check_packed_values(got, xm, wg, gate[:m], what)
            sure = (gate[:m].abs() > 1e-3 * gate[:m].abs().amax()).all()  # no gate near 0: counts must agree
            assert not sure or torch.equal(got.cnt, _k1(xm, wg, None).cnt), what
            if m in (1, 8, 16):
                bf16_rule(gs.twell_ffn_screened(xm, wg, wu, wdt, sw), xm, wg, wu, wd, what)
