"""Shared cases and checks of the kernel tests: honest-sparsity inputs, tolerances with where-and-how-much messages.

Honest sparsity: input feature 0 is a constant 1 and W_gate[:, 0] holds a negative bias, so the gate
GEMM itself produces the zeros. Shapes are tiny and tiles large because the interpreter is slow.
"""

from __future__ import annotations

import torch

from sparsify.kernels import twell_reference as ref

ZEROS = [0.0, 0.5, 0.9, 0.99, 1.0]


def make_case(m, d, f, zeros, *, seed=0, dtype=torch.float32, device="cpu", skew=False):
    """x [M, d] with x[:, 0] = 1, weights [F, d], [F, d], [d, F]; `zeros` of the gate values <= 0."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=gen)
    w_gate = torch.randn(f, d, generator=gen) / d**0.5
    w_up = torch.randn(f, d, generator=gen) / d**0.5
    w_down = torch.randn(d, f, generator=gen) / f**0.5
    x[:, 0] = 1.0
    w_gate[:, 0] = 0.0
    g0 = x @ w_gate.t()  # [M, F] gate without bias
    if skew:  # per-neuron bias: neuron j active with probability ~ zipf, a third of them dead
        p = (1.0 / torch.arange(1, f + 1).float()) * (1 - zeros) * f / (1.0 / torch.arange(1, f + 1)).sum()
        p[torch.randperm(f, generator=gen)[: f // 3]] = 0.0
        bias = torch.stack([torch.quantile(g0[:, j], 1 - float(min(p[j], 1.0))) for j in range(f)])
        bias[p == 0] = g0.max() + 1
    elif zeros <= 0.0:
        bias = torch.full((f,), float(g0.min()) - 1.0)
    elif zeros >= 1.0:
        bias = torch.full((f,), float(g0.max()) + 1.0)
    else:
        bias = torch.full((f,), float(torch.quantile(g0.flatten()[:100000], zeros)))
    w_gate[:, 0] = -bias
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return cast(x), cast(w_gate), cast(w_up), cast(w_down)


def assert_close(got, want, *, rtol, atol, what):
    """Max-abs check scaled by the reference's magnitude; the message says where and by how much."""
    got, want = got.float().cpu(), want.float().cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values at {torch.nonzero(~torch.isfinite(got))[:5].tolist()}"
    err = (got - want).abs()
    bound = atol + rtol * want.abs().max().item()
    worst = int(err.argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
    assert err.max().item() <= bound, (
        f"{what}: max |err| {err.max().item():.3e} > bound {bound:.3e} at {idx} "
        f"(got {got[idx].item():.6g}, want {want[idx].item():.6g}; {int((err > bound).sum())} of {err.numel()} off)"
    )


FP32 = dict(rtol=2e-5, atol=1e-5)


def check_packed(packed, x, w_gate, what):
    """K1 output vs the oracle: every kept slot, every count (skipping rows with |gate| ~ 0 entries)."""
    gate = x.float() @ w_gate.float().t()  # [M, F]
    want = ref.twell_pack(gate, packed.tile, packed.slots)
    sure = (gate.abs() > 1e-4).all(dim=1)  # rows where the sign of every gate value is unambiguous
    assert sure.float().mean() > 0.5, f"{what}: test case too close to zero; change the seed"
    bad = (packed.cnt != want.cnt)[sure]
    assert not bad.any(), f"{what}: counts differ at (row, tile) {bad.nonzero()[:5].tolist()}"
    assert_close(ref.twell_unpack(packed, gate), gate.relu(), what=f"{what} unpack", **FP32)
    kept = torch.arange(packed.slots) < packed.cnt.clamp(max=packed.slots).unsqueeze(-1)
    kept &= sure.view(-1, 1, 1)
    assert torch.equal(packed.columns()[kept], want.columns()[kept]), f"{what}: slot columns differ from the oracle"


def packed_value_bound(want, mag, d, entries):
    """Elementwise bound on |K1's unpacked value - the fp32 reference relu(g)| for the same inputs.

    K1's fp32 accumulator acc and the reference sum the same products in different orders: each is
    within d * 2^-24 * sum_k |x_k w_k| of the exact sum (the standard fp32 dot-product bound, u = 2^-24),
    so |acc - g| <= delta = 2 d 2^-24 mag. The split encoding stores acc itself. The packed encodings
    round acc to nearest: |rn(acc) - acc| <= u16 |acc|, with the unit roundoff u16 = 2^-p of a p-bit
    significand: bf16 p = 8 (2^-8), fp16 p = 11 (2^-11). Half an ulp is up to 2^-8 of a bf16 value (at
    the bottom of a binade), not 2^-9 (round 5's bound, which failed on the H200 exactly where plain
    round-to-nearest is off by more than 2^-9: test_packed_value_bound_matches_k1_rounding). So
    |rn(acc) - g| <= u16 (|g| + delta) + delta."""
    u16 = {"split": 0.0, "bf16": 2.0**-8, "fp16": 2.0**-11}[entries]
    delta = 2 * d * 2.0**-24 * mag
    return u16 * want.abs() + (1 + u16) * delta


def check_packed_values(packed, x, wg, gate, what):
    """Every value K1 packed (or the dense gate, for overflowed tiles) within packed_value_bound."""
    got = ref.twell_unpack(packed, gate)  # [M, F]
    want = gate.relu()
    mag = x.float().abs() @ wg.float().abs().t()  # [M, F] sum_k |x_k w_k|
    err = (got - want).abs()
    bad = err > packed_value_bound(want, mag, x.shape[1], packed.entries)
    assert not bad.any(), (f"{what}: {int(bad.sum())} values off, worst {err.max():.3e}; "
                           f"worst err/|want| {(err / want.abs().clamp_min(1e-30))[bad].max():.3e}, "
                           f"worst err/mag {(err / mag)[bad].max():.3e}")
    return err, want


def bf16_rule(got, x, wg, wu, wd, what):
    """Kernel error vs the fp32 oracle at most 2x a plain torch low-precision FFN's error, + small atol."""
    want = ref.ffn_reference(x, wg, wu, wd)
    plain = ref.ffn_dense(x, wg, wu, wd).float()
    base = (plain - want).abs().max().item()
    assert_close(got, want, rtol=0.0, atol=2 * base + 1e-3 * want.abs().max().item(), what=what)


def tma_case(m, d, f, zeros, seed):
    """A case for the TMA-tiled K1: fp16 inputs (the interpreter's bf16 tl.dot is not usable); every 4th row has every neuron
    active (all its tiles overflow), at zeros < 1."""
    x, wg, wu, wd = make_case(m, d, f, zeros, seed=seed, dtype=torch.float16)
    if 0.0 < zeros < 1.0:
        x[::4, 0] = -30.0  # the bias column is negative: -30 * -b outweighs the rest (fp16-safe in K2)
    return x, wg, wu, wd
