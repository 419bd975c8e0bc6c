"""Exact gate screen for TwELL decode (M <= 16): a low-precision copy of W_gate rules out gate rows.

Legend: M = tokens (decode: M <= 16), d = hidden size, F = intermediate size, x [M, d] the FFN input, w_j [d]
row j of W_gate [F, d], theta [F] float32 the optional threshold (relu without one). Layout of the output:
twell_reference.py (decode tiles T = S = 32).

What it does
------------
`screen_weights` stores per layer a copy q of W_gate in int8 (symmetric, absmax scale per row, or per group of
`group` columns) or fp8 e4m3 (scale = absmax / 448), the scales s, and per row (or per (row, group)) error
terms computed once in float64 and rounded UP to float32. At decode, per (m, j) the screen computes an estimate
est = s_j (q_j . x) and a radius rad from the error terms and x's norms; only rows j for which some m has
est + rad above the threshold ("candidates", "passed rows") are computed exactly (bf16 rows of W_gate loaded
under a mask: rows that do not pass cause no memory traffic) and packed exactly as `gate_pack` packs them, so
K2 (`updown`) runs unchanged. Optionally a few channels (`exact_cols`, e.g. the bias channel of a synth model
or an LLM's massive-activation channels) are held exactly (W_gate's own values, in its dtype) and left out
of the quantisation.

The guarantee: a row whose gate, AS THE TWELL KERNELS COMPUTE AND ROUND IT, is active (relu: fp32
accumulator > 0; theta: the accumulator rounded to x's dtype > theta_j) is always a candidate. So the screened
TwELL FFN packs exactly the same entries as the unscreened one: lossless.

The bound (proof sketch; every constant below is named in the code)
--------------------------------------------------------------------
Write w-hat_j for the screen's copy of w_j (s_j q_j off the exact channels, w_j on them) and
e_j = w_j - w-hat_j (zero on the exact channels). Real arithmetic: G_j = w_j.x = w-hat_j.x + e_j.x.
Assumption on the GPU/interpreter arithmetic: every fp32 operation (product, sum, including inside tl.dot /
MMA accumulation, in ANY order or blocking) has relative error <= u = 2^-23 (IEEE round-to-nearest is 2^-24;
2^-23 also covers truncating accumulators), plus at most 2^-126 absolute where results are flushed to zero;
16-bit x 16-bit products and int8 / e4m3 -> bf16 / fp16 conversions are exact.
1. The kernel's exact gate g^ = fl(sum_i w_ji x_i) (any summation order, d terms): by the standard dot-product
   bound |g^ - G_j| <= gamma(d+4) sum_i |w_ji x_i|, gamma(n) = n u / (1 - n u); flushing adds <= 2 d 2^-126.
   Split the sum: sum_i |w_ji x_i| = sum_K |w_ji x_i| + sum_{not K} |w_ji x_i| <= X_j + B_j ||x'||_2 (Cauchy-Schwarz
   off the exact channels K), X_j = sum_K |w_ji x_i| (the kernel has both factors loaded for the estimate),
   B_j >= ||w_j off K||_2, x' = x off K. (Without the split, a large weight on a small constant input, the synth
   bias channel, made ||w|| ||x|| a hundred times sum |w x| there: 44% of the radius at d = 8192.)
2. The screen's estimate est = fl(s_j fl(q_j.x)) (per group: sum_g fl(s_jg fl(q_jg.x_g)); exact channels:
   + fl(sum_K w_ji x_i)) is a dot product of w-hat_j with x in which every term is rounded at most
   d + G + MAX_EXACT + 4 times (one group's sum, its scale, the sum over G groups, the exact part):
   |est - w-hat_j.x| <= gamma_A (X_j + A_j ||x'||_2), A_j >= ||w-hat_j off K||_2 (w-hat = w on K).
3. Quantisation: |e_j.x| <= R_j ||x'||_2 (Cauchy-Schwarz) and <= m_j ||x'||_1 (Hoelder), R_j >= ||e_j||_2,
   m_j >= max_i |e_ji|; per group the sum over groups of min(R_jg ||x'_g||_2, m_jg ||x'_g||_1) (each group
   bounded by the smaller: rigorous, and never looser than per-row Cauchy-Schwarz by more than the min picks).
So g^ <= est + Q_j(x) + C_j ||x'||_2 + c_X X_j with C_j = gamma(d+4) B_j + gamma_A A_j ("err_round", float64,
rounded up), c_X = gamma(d+4) + gamma_A ("c_exact") and Q_j the quantisation term of 3. The kernel evaluates this
right-hand side itself in fp32 (norms of x summed in fp32): every evaluated quantity is made an upper bound by
explicit slack: norms and the radius are multiplied by (1 + 2^-6) (covers gamma(d) <= 2^-8 of the norm sums for
d <= 2^15 and the few roundings of the radius), + 2^-55 on ||x||_2 and + 2^-100 on ||x||_1 and on U (flushed subnormals: d 2^-126 <= 2^-111), and
|est| 2^-20 on the estimate (one product and two sums rounded, 3 u < 2^-20). Call the result U (g^ <= U).
4. The comparison. relu: active <=> g^ > 0, so active => U > 0. theta, 16-bit x: active <=> rn(g^) > theta,
   rn = round to nearest even to bf16 (unit roundoff 2^-8, half the subnormal spacing 2^-134) or fp16 (2^-11,
   2^-25): rn(v) <= v + 2^-8 |v| + 2^-134, hence rn(g^) > theta => g^ > theta - |theta| 2^-7 - 2^-120 =: theta_e
   (the 2^-7 instead of 2^-8 absorbs theta_e's own fp32 rounding; fp16: 2^-10 and 2^-23); a bf16 (fp16) value
   that rounds to inf has g^ >= 2^127 (65520), so theta_e is capped at 2^126 (65000). fp32 x: theta_e = theta.
   A row passes iff NOT (U <= theta_e): active => g^ > theta_e and U >= g^ => passes; a NaN U passes.
5. Rows of x that are all zero: g^ = 0 exactly, so such a row makes j active iff 0 > theta_j (relu: never); the
   screen uses that instead of U (without it the absolute slack would pass every row at every zero input). The
   kernel tests the bit patterns (|x| bits all 0), not a float compare a flush-to-zero mode could fool: a
   subnormal x is not zero (its flushed squares and products are covered by the absolute slack of 3.).
   Rows whose computed ||x||_2 is not below n_big = 2^126 / max_j max(A_j, B_j) (large norms, inf, NaN) pass
   everything: below it no partial sum of 1. or 2. can overflow, above it nothing is claimed.
The per-(m, j) decision is reduced to "any row m passes" per column j: the kernel then computes the column's
exact gate for all M rows, so every row's packed entries are exactly gate_pack's (bitwise where both sum in the
same order: the kernels here mirror `_k1_tiled` (M > 1) and `_k1_gemv` (M = 1) block for block).

How tight: for Gaussian weights and inputs the Cauchy-Schwarz radius is ~ (s / sqrt(12)) sqrt(d) ||x|| against a
gate spread ||w|| ||x|| / sqrt(d): their ratio is ~ 0.009 sqrt(d) for per-row int8 absmax (0.4 at d = 2048, 0.8
at d = 8192) and ~4x that for e4m3. A weight outlier (the synth bias channel) blows up the per-row absmax scale:
hold such channels exactly (`exact_cols`, `outlier_columns`) or use groups. eval/research/bench_screen.py measures the
pass fraction against the active fraction.

Memory (`ScreenWeights.nbytes`): the copy is F d bytes (half of bf16 W_gate), + 12 bytes per (row, group)
(scale, R, m: fp32), + 4 bytes per row (C), + the exact channels (F k x 2 bytes).

Research code, not shipped: no backend runs it (eval/research/README.md has what it measured and why it stays
out). It builds on the shipped kernels (sparsify.kernels: twell_triton's epilogue and helpers, the layout of
twell_reference) and is imported as `gate_screen` with this folder on sys.path (bench_screen.py, the tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparsify.kernels.twell_reference import DECODE_SLOTS, DECODE_TILE, TwellPacked, n_tiles
from sparsify.kernels.twell_triton import (
    ENT_CODES, GEMV_BLOCK_K, HAS_TRITON, default_entries, next_pow2, require_triton, theta_args, tl, triton,
)

if HAS_TRITON:
    from sparsify.kernels.twell_triton import _k1_epilogue

U_ACC = 2.0**-23  # assumed unit roundoff of every fp32 operation of the gate / screen GEMMs (see 3. above)
SLACK = 2.0**-6  # relative slack on every evaluated norm and on the radius
EST_REL = 2.0**-20  # |est| slack: one product and two sums of the estimate rounded
ABS_L2 = 2.0**-55  # absolute slack on ||x||_2 (flushed squares: 2 d 2^-126 <= 2^-110 under the square root)
ABS_L1 = 2.0**-100  # absolute slack on ||x||_1 and on U (flushed products and sums)
MAX_D = 1 << 15  # gamma_A <= gamma(2d + 16) <= 2^-7 and the norm slack above hold up to here
KINDS = ("int8", "fp8")
QMAX = {"int8": 127.0, "fp8": 448.0}
MAX_EXACT = 64  # exact channels the kernel handles (one block)


def gamma(n: int, u: float = U_ACC) -> float:
    return n * u / (1.0 - n * u)


def _up32(t: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounded UP (toward +inf), after a relative inflation of 2^-30 that covers the float64
    rounding of the sums that produced t."""
    t = t * (1.0 + 2.0**-30)
    f = t.float()
    return torch.where(f.double() < t, torch.nextafter(f, torch.full_like(f, math.inf)), f)


@dataclass
class ScreenWeights:
    """A layer's screen: q [F, d] int8 / float8_e4m3fn (zeros on the exact channels), and per (row, group)
    float32 [F, G] scale, rq (R: ||e||_2, rounded up), mq (m: max |e|, rounded up); err_round [F] (C_j, the
    coefficient of ||x'||_2 in the rounding term; c_exact: that of X_j = sum_K |w_ji x_i|);
    exact channels: exact_cols [k] int32 (sorted), w_exact [F, k] (W_gate's values, its dtype), keep [d] float32
    (0 on exact channels, 1 elsewhere). group = columns per group (d when per row)."""

    kind: str
    q: torch.Tensor
    scale: torch.Tensor
    rq: torch.Tensor
    mq: torch.Tensor
    err_round: torch.Tensor
    group: int
    n_big: float
    exact_cols: torch.Tensor | None = None
    w_exact: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    c_exact: float = 0.0  # c_X: gamma(d+4) + gamma_A, the coefficient of X_j = sum_K |w_ji x_i|

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def n_groups(self) -> int:
        return self.scale.shape[1]

    def nbytes(self) -> dict:
        """Bytes of the screen: the copy, the per-row / per-group terms, the exact channels; and the ratio of
        the total to a bf16 W_gate of the same shape."""
        f, d = self.shape
        parts = {"copy": self.q.numel() * self.q.element_size(),
                 "terms": sum(t.numel() * t.element_size() for t in (self.scale, self.rq, self.mq, self.err_round)),
                 "exact": 0 if self.w_exact is None else self.w_exact.numel() * self.w_exact.element_size()
                 + self.exact_cols.numel() * 4 + self.keep.numel() * 4}
        parts["total"] = sum(parts.values())
        parts["vs_bf16_w_gate"] = parts["total"] / (f * d * 2)
        return parts

    def to(self, device) -> "ScreenWeights":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return ScreenWeights(self.kind, mv(self.q), mv(self.scale), mv(self.rq), mv(self.mq), mv(self.err_round),
                             self.group, self.n_big, mv(self.exact_cols), mv(self.w_exact), mv(self.keep),
                             self.c_exact)


def outlier_columns(w_gate: torch.Tensor, k: int, x_calib: torch.Tensor | None = None) -> torch.Tensor:
    """k channels worth holding exactly: the largest rms(x_i) * max_j |w_ji| (x_calib [N, d] of the layer's
    inputs; without it, the largest column absmax of W_gate). Any choice keeps the screen exact; this one aims
    at the channels that inflate per-row scales (weight outliers) or x's norms (massive activations)."""
    score = w_gate.float().abs().amax(0)  # [d]
    if x_calib is not None:
        score = score * x_calib.float().pow(2).mean(0).sqrt()
    return torch.topk(score, k).indices.sort().values.to(torch.int32)


def screen_weights(w_gate: torch.Tensor, kind: str = "int8", group: int | None = None,
                   exact_cols: torch.Tensor | list | None = None, chunk: int = 1024) -> ScreenWeights:
    """The screen of W_gate [F, d]: kind "int8" (absmax / 127 scales, round to nearest) or "fp8" (e4m3fn,
    absmax / 448 scales); group: columns per scale (None: one per row); exact_cols: channels held exactly
    (at most MAX_EXACT). Terms are computed in float64 in chunks of `chunk` rows, on W_gate's device."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {KINDS}")
    f, d = w_gate.shape
    if d > MAX_D:
        raise ValueError(f"d = {d} > {MAX_D}: the screen's slack constants are derived for d <= {MAX_D}")
    gs = d if group is None else int(group)
    ng = -(-d // gs)
    dp = ng * gs
    dev = w_gate.device
    keep = torch.ones(d, dtype=torch.float64, device=dev)
    ex = None
    if exact_cols is not None and len(exact_cols):
        ex = torch.as_tensor(exact_cols, dtype=torch.int64, device=dev).unique().sort().values
        if len(ex) > MAX_EXACT:
            raise ValueError(f"{len(ex)} exact channels > {MAX_EXACT}")
        keep[ex] = 0.0
    qdt = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    q = torch.empty(f, d, dtype=qdt, device=dev)
    scale = torch.empty(f, ng, dtype=torch.float32, device=dev)
    rq, mq = torch.empty_like(scale), torch.empty_like(scale)
    err_round = torch.empty(f, dtype=torch.float32, device=dev)
    big = 0.0
    ga, gb = gamma(d + ng + MAX_EXACT + 4), gamma(d + 4)
    for r0 in range(0, f, chunk):
        w = w_gate[r0:r0 + chunk].double()  # [r, d]
        r = w.shape[0]
        wq = torch.zeros(r, dp, dtype=torch.float64, device=dev)
        wq[:, :d] = w * keep
        wq = wq.view(r, ng, gs)
        amax = wq.abs().amax(-1)  # [r, G]
        s = (amax / QMAX[kind]).float()  # the stored fp32 scale
        s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero group: any scale, q = 0
        s64 = s.double().unsqueeze(-1)
        if kind == "int8":
            qq = torch.round(wq / s64).clamp(-127, 127)
            qv = qq.to(torch.int8)
            deq = qq
        else:
            qv = (wq / s64).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            deq = qv.double()
        what = deq * s64  # [r, G, gs] exact in float64 (24 x 8-bit products)
        e = (wq - what).view(r, dp)[:, :d]  # zero on exact channels
        e_g = (wq - what)  # [r, G, gs]
        q[r0:r0 + r] = qv.view(r, dp)[:, :d]
        scale[r0:r0 + r] = s
        rq[r0:r0 + r] = _up32(e_g.pow(2).sum(-1).sqrt())
        mq[r0:r0 + r] = _up32(e_g.abs().amax(-1))
        a = what.view(r, dp)[:, :d].norm(dim=1)  # ||w-hat_j off K|| (what is 0 on K)
        b = (w * keep).norm(dim=1)  # ||w_j off K||
        err_round[r0:r0 + r] = _up32(gb * b + ga * a)
        wk = (w * (1 - keep)).norm(dim=1)  # the exact channels' part, for the overflow guard
        big = max(big, float((torch.maximum(a, b) + wk).max()))
        del e
    n_big = min(2.0**126 / max(big, 1e-30), 2.0**127)  # a float32 scalar for the kernel
    w_exact = keep32 = None
    if ex is not None:
        w_exact = w_gate[:, ex].contiguous()
        keep32 = keep.float()
        ex = ex.to(torch.int32)
    return ScreenWeights(kind, q, scale, rq, mq, err_round, gs, n_big, ex, w_exact, keep32,
                         c_exact=float(_up32(torch.tensor(ga + gb, dtype=torch.float64))))


def theta_eff(threshold: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | float:
    """theta_e (float64) of 4.: g^ > theta_e is necessary for an active row (relu: 0, strict)."""
    if threshold is None:
        return 0.0
    th = threshold.double()
    if dtype == torch.bfloat16:
        return (th - th.abs() * 2.0**-7 - 2.0**-120).clamp(max=2.0**126)
    if dtype == torch.float16:
        return (th - th.abs() * 2.0**-10 - 2.0**-23).clamp(max=65000.0)
    return th


def screen_terms(x2d: torch.Tensor, sw: ScreenWeights) -> dict:
    """The screen's pieces for inputs x2d [M, d] (torch, float32 estimate, float64 bounds): est [M, F], the
    quantisation terms [M, F] "cs" (R ||x'||_2), "holder" (m ||x'||_1), "group" (sum_g R_g ||x'_g||_2),
    "group_min" (sum_g min(..)), "min" (min(cs, holder) per row), the rounding term "round" [M, F] (C ||x'||_2 + c_X X),
    and per row "l2" [M] (||x||_2), "zero" [M] bool, "big" [M] bool. Every quantisation term is rigorous; the
    kernel uses "min" (per row) or "group_min" (groups)."""
    xf = x2d.float()
    m, d = xf.shape
    f = sw.q.shape[0]
    ng, gs = sw.n_groups, sw.group
    keep = sw.keep if sw.keep is not None else torch.ones(d, device=xf.device)
    xq = xf * keep  # x' (exact channels out)
    deq = sw.q.float()  # [F, d]
    est = torch.zeros(m, f, dtype=torch.float32, device=xf.device)
    x64 = xq.double()
    l2g = torch.zeros(m, ng, dtype=torch.float64, device=xf.device)
    l1g = torch.zeros_like(l2g)
    for g in range(ng):
        sl = slice(g * gs, min(d, (g + 1) * gs))
        est += (xf[:, sl] @ deq[:, sl].t()) * sw.scale[:, g]
        l2g[:, g] = x64[:, sl].pow(2).sum(1).sqrt()
        l1g[:, g] = x64[:, sl].abs().sum(1)
    xk_abs = None
    if sw.w_exact is not None:
        est += xf[:, sw.exact_cols.long()] @ sw.w_exact.float().t()
        xk_abs = xf[:, sw.exact_cols.long()].double().abs() @ sw.w_exact.double().abs().t()  # X [M, F]
    rq, mq = sw.rq.double(), sw.mq.double()  # [F, G]
    l2 = x64.pow(2).sum(1).sqrt()  # [M] ||x'||_2
    l1 = x64.abs().sum(1)
    # per-row R, m from the group terms: ||e||_2 = sqrt(sum R_g^2), max|e| = max m_g (rounded up again)
    r_row = rq.pow(2).sum(1).sqrt() * (1 + 2.0**-40)
    m_row = mq.amax(1)
    full = xf.double().pow(2).sum(1).sqrt()  # ||x||_2
    out = {"est": est, "cs": l2[:, None] * r_row[None, :], "holder": l1[:, None] * m_row[None, :],
           "group": l2g @ rq.t(),
           "round": l2[:, None] * sw.err_round.double()[None, :] + (0 if xk_abs is None else sw.c_exact * xk_abs),
           "l2": full,
           "zero": xf.abs().amax(1) == 0, "big": ~(full < sw.n_big)}
    out["min"] = torch.minimum(out["cs"], out["holder"])
    gm = torch.zeros(m, f, dtype=torch.float64, device=xf.device)
    for g in range(ng):
        gm += torch.minimum(l2g[:, g:g + 1] * rq[None, :, g], l1g[:, g:g + 1] * mq[None, :, g])
    out["group_min"] = gm
    return out


def screen_mask(terms: dict, threshold: torch.Tensor | None, dtype: torch.dtype, bound: str = "min",
                z: float | None = None, d_eff: int | None = None) -> torch.Tensor:
    """Candidates [M, F] bool from screen_terms: NOT (U <= theta_e) with U = est + |est| EST_REL + (quant +
    round) (1 + SLACK) + ABS_L1; zero rows: 0 > theta; big rows: all. bound: a quantisation term of
    screen_terms ("min" per row and "group_min" with groups are the kernel's). z (LOSSY, off by default):
    replace the quantisation term by z R ||x'||_2 / sqrt(d_eff), the size of e.x for errors spread like
    noise, instead of its worst case: rows can be dropped."""
    est = terms["est"].double()
    quant = terms["cs"] * (z / math.sqrt(d_eff)) if z is not None else terms[bound]
    u = est + est.abs() * EST_REL + (quant + terms["round"]) * (1 + SLACK) + ABS_L1
    th = theta_eff(threshold, dtype)
    th = th if isinstance(th, float) else th[None, :]
    passed = ~(u <= th)
    zero_pass = torch.zeros_like(passed) if threshold is None else (0 > threshold.double())[None, :].expand_as(passed)
    passed = torch.where(terms["zero"][:, None], zero_pass, passed)
    return passed | terms["big"][:, None]


def screen_reference(x2d: torch.Tensor, sw: ScreenWeights, threshold: torch.Tensor | None = None,
                     bound: str | None = None) -> torch.Tensor:
    """Candidate mask [M, F] bool in torch: every (m, j) whose exact gate, as the TwELL kernels compute and
    round it, is active (relu: > 0; theta: x's dtype's value > theta_j) is True (module docstring: the proof).
    bound: None = the kernel's ("min" per row, "group_min" with groups), or any rigorous term of screen_terms."""
    terms = screen_terms(x2d, sw)
    if bound is None:
        bound = "min" if sw.n_groups == 1 else "group_min"
    return screen_mask(terms, threshold, x2d.dtype, bound)


def active_mask(x2d: torch.Tensor, w_gate: torch.Tensor, threshold: torch.Tensor | None = None) -> torch.Tensor:
    """[M, F] bool: the rows the TwELL kernels keep (fp32 gate, relu on it, or theta on its x-dtype rounding)."""
    g = x2d.float() @ w_gate.float().t()
    if threshold is None:
        return g > 0
    return g.to(x2d.dtype).float() > threshold


# ------------------------------------------------------------------------------------------------ kernel
if HAS_TRITON:

    @triton.jit
    def _theta_e(th, RND: tl.constexpr):
        """theta_e of the docstring's 4. in fp32 (RND: 1 bf16, 2 fp16, 0 fp32)."""
        if RND == 1:
            return tl.minimum(th - tl.abs(th) * 0.0078125 - 7.52316384526264e-37, 8.507059173023462e37)
        elif RND == 2:
            return tl.minimum(th - tl.abs(th) * 0.0009765625 - 1.1920928955078125e-07, 65000.0)
        else:
            return th

    @triton.jit
    def _q_f32(q, QI8: tl.constexpr, CVT: tl.constexpr):
        """The screen copy's values as fp32 (exact). CVT = 1 with int8: integer add + bitcast + one fp32
        subtract (2^23 + 128 + q is exact in fp32's mantissa), full-rate ops instead of the quarter-rate
        I2F of a plain int8 -> fp32 cast; same values bit for bit. Else Triton's cast."""
        if QI8 and CVT == 1:
            return (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        else:
            return q.to(tl.float32)

    @triton.jit
    def _rank_select(colpass, npass, c, offs_t, CP: tl.constexpr):
        """Chunk c of the tile's passed columns: sel [CP, T] (sel[p, t]: column t is the (c CP + p)-th passed
        one), their positions in the tile [CP] and p_ok [CP] (the chunk's slot p holds a passed column)."""
        rank = tl.cumsum(colpass.to(tl.int32), 0) - 1  # [T]
        want = c * CP + tl.arange(0, CP)  # [CP]
        sel = colpass[None, :] & (rank[None, :] == want[:, None])  # [CP, T]
        idx = tl.sum(tl.where(sel, offs_t[None, :], 0), 1)  # [CP]
        return sel, idx, want < npass

    @triton.jit
    def _dot_k(a_ptrs, b_ptrs, acc, m_ok, cols_ok, D, offs_k, BK: tl.constexpr, IEEE: tl.constexpr):
        """acc + x [BM, D] @ W_gate rows [D, C] (cols_ok: the columns read; the others' loads masked to 0),
        BK columns of D per step, _k1_tiled's loop block for block (the same sums in the same order)."""
        for k in range(0, tl.cdiv(D, BK)):
            k_ok = offs_k < D - k * BK
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & cols_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BK
            b_ptrs += BK
        return acc

    @triton.jit
    def _k1_screened(
        x_ptr, q_ptr, sc_ptr, rq_ptr, mq_ptr, er_ptr, kp_ptr, xc_ptr, wx_ptr, wg_ptr,
        cnt_ptr, col_ptr, val_ptr, th_ptr, pass_ptr, npass_ptr,
        M, F, D, NT, G, KX, stride_xm, stride_qf, stride_wf, stride_wx, n_big, c_exact,
        BLOCK_M: tl.constexpr, T: tl.constexpr, BK1: tl.constexpr, BK2: tl.constexpr, S: tl.constexpr,
        CP: tl.constexpr, GROUPED: tl.constexpr, KP: tl.constexpr, HAS_EX: tl.constexpr, GEMV: tl.constexpr,
        DOT16: tl.constexpr, IEEE: tl.constexpr, ENT: tl.constexpr, HAS_THETA: tl.constexpr, RND: tl.constexpr,
        PASS_OUT: tl.constexpr, QI8: tl.constexpr, CVT: tl.constexpr,
    ):
        """One program per tile of T columns: phase 1 screens the tile's rows from q (estimate + rigorous radius
        per (m, j)), phase 2 computes the exact gate of the passed columns only and packs it with _k1_epilogue.

        GEMV (M = 1): phase 1 is _k1_gemv's loop on the int8 / fp8 copy (acc [T, BK1] of products, x's norms
        kept as [BK1] vectors: no reduction inside the loop); phase 2 gathers the passed rows, CP at a time
        ([CP, BK2] loads of W_gate rows by index: work and traffic in proportion to the passed rows, not to
        T), each summed as _k1_gemv sums a row (same BK2 lanes: bitwise _k1_gemv's gate when BK2 = its
        BLOCK_K). M > 1: phase 1 is tl.dot on [BLOCK_M, BK1] x [BK1, T]; phase 2 mirrors _k1_tiled
        (CP = T: masked columns) or gathers the passed columns CP (>= 16) at a time into [BK2, CP] dots.
        GROUPED: BK1 = the group size, scales and terms per (row, group)."""
        pid_n = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        offs_t = tl.arange(0, T)
        offs_n = pid_n * T + offs_t
        n_ok = offs_n < F
        rows64 = offs_n.to(tl.int64)
        # ---------------------------------------------------------------- phase 1: estimate and radius
        offs_k1 = tl.arange(0, BK1)
        if GEMV:
            # x's row 0 as [BK1] vectors (the layout the [T, BK1] products broadcast it in); its sums of
            # squares / absolute values / bit maxima accumulate elementwise and are reduced once after the loop
            # (fp32 in any order: the norm slack of 3. covers it); grouped: per group, warp-local sums
            pacc = tl.zeros([T, BK1], dtype=tl.float32)
            est1 = tl.zeros([T], dtype=tl.float32)
            quant1 = tl.zeros([T], dtype=tl.float32)
            vf2 = tl.zeros([BK1], dtype=tl.float32)
            vq2 = tl.zeros([BK1], dtype=tl.float32)
            vq1 = tl.zeros([BK1], dtype=tl.float32)
            vnz = tl.zeros([BK1], dtype=tl.int32)
            for k in range(0, tl.cdiv(D, BK1)):
                kk = k * BK1 + offs_k1
                k_ok = kk < D
                xk = tl.load(x_ptr + kk, mask=k_ok, other=0.0)  # [BK1] x's dtype, row 0
                xf = xk.to(tl.float32)
                if HAS_EX:
                    xq = xf * tl.load(kp_ptr + kk, mask=k_ok, other=0.0)
                else:
                    xq = xf
                if DOT16:  # zero test on the bits: a flush-to-zero compare would call a subnormal x zero
                    bits = xk.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF
                else:
                    bits = xk.to(tl.int32, bitcast=True) & 0x7FFFFFFF
                vnz = tl.maximum(vnz, bits)
                vf2 += xf * xf
                qt = _q_f32(tl.load(q_ptr + rows64[:, None] * stride_qf + kk[None, :],
                                    mask=n_ok[:, None] & k_ok[None, :], other=0.0), QI8, CVT)  # [T, BK1]
                if GROUPED:
                    sq = tl.sum(xq * xq, 0)
                    sa = tl.sum(tl.abs(xq), 0)
                    sg = tl.load(sc_ptr + rows64 * G + k, mask=n_ok, other=0.0)
                    rg = tl.load(rq_ptr + rows64 * G + k, mask=n_ok, other=0.0)
                    mg = tl.load(mq_ptr + rows64 * G + k, mask=n_ok, other=0.0)
                    est1 += tl.sum(qt * xf[None, :], 1) * sg
                    n2 = tl.sqrt(sq) * (1 + 0.015625) + 2.7755575615628914e-17
                    n1 = sa * (1 + 0.015625) + 7.888609052210118e-31
                    quant1 += tl.minimum(rg * n2, mg * n1)
                else:
                    pacc += qt * xf[None, :]
                vq2 += xq * xq
                vq1 += tl.abs(xq)
            l2f = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.sum(vf2, 0)
            l2q = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.sum(vq2, 0)
            l1q = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.sum(vq1, 0)
            nzb = tl.zeros([BLOCK_M], dtype=tl.int32) + tl.max(vnz, 0)
            if GROUPED:
                est = tl.zeros([BLOCK_M, T], dtype=tl.float32) + est1[None, :]
                quant = tl.zeros([BLOCK_M, T], dtype=tl.float32) + quant1[None, :]
            else:
                est = tl.zeros([BLOCK_M, T], dtype=tl.float32) + tl.sum(pacc, 1)[None, :]
        else:
            est = tl.zeros([BLOCK_M, T], dtype=tl.float32)
            quant = tl.zeros([BLOCK_M, T], dtype=tl.float32)
            l2f = tl.zeros([BLOCK_M], dtype=tl.float32)  # ||x||^2
            l2q = tl.zeros([BLOCK_M], dtype=tl.float32)  # ||x'||^2 (exact channels out)
            l1q = tl.zeros([BLOCK_M], dtype=tl.float32)
            nzb = tl.zeros([BLOCK_M], dtype=tl.int32)  # max of |x| bit patterns: 0 iff the row is all (+-)0
            for k in range(0, tl.cdiv(D, BK1)):
                kk = k * BK1 + offs_k1
                k_ok = kk < D
                xk = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                             other=0.0)  # [BM, BK1] x's dtype
                xf = xk.to(tl.float32)
                if HAS_EX:
                    xq = xf * tl.load(kp_ptr + kk, mask=k_ok, other=0.0)[None, :]
                else:
                    xq = xf
                l2f += tl.sum(xf * xf, 1)
                if DOT16:
                    bits = xk.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF
                else:
                    bits = xk.to(tl.int32, bitcast=True) & 0x7FFFFFFF
                nzb = tl.maximum(nzb, tl.max(bits, 1))
                sq = tl.sum(xq * xq, 1)
                sa = tl.sum(tl.abs(xq), 1)
                qb = tl.load(q_ptr + rows64[None, :] * stride_qf + kk[:, None], mask=k_ok[:, None] & n_ok[None, :],
                             other=0.0)  # [BK1, T]
                if DOT16:
                    if QI8 and CVT == 1:
                        p = tl.dot(xk, _q_f32(qb, QI8, CVT).to(xk.dtype))
                    else:
                        p = tl.dot(xk, qb.to(xk.dtype))
                else:
                    p = tl.dot(xf, _q_f32(qb, QI8, CVT), input_precision="ieee")
                if GROUPED:
                    sg = tl.load(sc_ptr + rows64 * G + k, mask=n_ok, other=0.0)
                    rg = tl.load(rq_ptr + rows64 * G + k, mask=n_ok, other=0.0)
                    mg = tl.load(mq_ptr + rows64 * G + k, mask=n_ok, other=0.0)
                    est += p * sg[None, :]
                    n2 = tl.sqrt(sq) * (1 + 0.015625) + 2.7755575615628914e-17
                    n1 = sa * (1 + 0.015625) + 7.888609052210118e-31
                    quant += tl.minimum(rg[None, :] * n2[:, None], mg[None, :] * n1[:, None])
                else:
                    est += p
                l2q += sq
                l1q += sa
        if not GROUPED:
            s = tl.load(sc_ptr + rows64, mask=n_ok, other=0.0)
            r = tl.load(rq_ptr + rows64, mask=n_ok, other=0.0)
            mm = tl.load(mq_ptr + rows64, mask=n_ok, other=0.0)
            est = est * s[None, :]
            n2 = tl.sqrt(l2q) * (1 + 0.015625) + 2.7755575615628914e-17
            n1 = l1q * (1 + 0.015625) + 7.888609052210118e-31
            quant = tl.minimum(r[None, :] * n2[:, None], mm[None, :] * n1[:, None])
        if HAS_EX:  # exact channels: + sum_K w_ji x_i
            kx = tl.arange(0, KP)
            kx_ok = kx < KX
            cols = tl.load(xc_ptr + kx, mask=kx_ok, other=0)
            xe = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=m_ok[:, None] & kx_ok[None, :],
                         other=0.0).to(tl.float32)  # [BM, KP]
            we = tl.load(wx_ptr + rows64[:, None] * stride_wx + kx[None, :], mask=n_ok[:, None] & kx_ok[None, :],
                         other=0.0).to(tl.float32)  # [T, KP]
            est += tl.sum(xe[:, None, :] * we[None, :, :], 2)
            quant += c_exact * tl.sum(tl.abs(xe)[:, None, :] * tl.abs(we)[None, :, :], 2)  # c_X X_j (1. and 2.)
        nf = tl.sqrt(l2f)
        er = tl.load(er_ptr + rows64, mask=n_ok, other=0.0)
        rad = (quant + er[None, :] * (tl.sqrt(l2q) * (1 + 0.015625) + 2.7755575615628914e-17)[:, None]) * (1 + 0.015625)
        u = est + tl.abs(est) * 9.5367431640625e-07 + rad + 7.888609052210118e-31
        if HAS_THETA:
            th = tl.load(th_ptr + offs_n, mask=n_ok, other=0.0)
        else:
            th = tl.zeros([T], dtype=tl.float32)
        passed = ~(u <= _theta_e(th, RND)[None, :])
        passed = tl.where((nzb == 0)[:, None], (0.0 > th)[None, :], passed)
        passed = passed | (~(nf < n_big))[:, None]
        passed = passed & m_ok[:, None] & n_ok[None, :]
        colpass = tl.max(passed.to(tl.int32), 0) > 0  # [T]
        npass = tl.sum(colpass.to(tl.int32), 0)
        if PASS_OUT:
            tl.store(pass_ptr + offs_m[:, None].to(tl.int64) * F + offs_n[None, :], passed.to(tl.int8),
                     mask=m_ok[:, None] & n_ok[None, :])
            tl.store(npass_ptr + pid_n, npass)
        # ------------------------------------------------------ phase 2: exact gate of the passed columns
        # (a column's gate lands in its slot as g + (-0.0) + ... = g bit for bit, signed zeros included)
        offs_k = tl.arange(0, BK2)
        if GEMV:
            gsum = tl.full([T], -0.0, tl.float32)
            for c in range(0, tl.cdiv(npass, CP)):
                sel, idx, p_ok = _rank_select(colpass, npass, c, offs_t, CP)
                w_ptrs = wg_ptr + (pid_n * T + idx).to(tl.int64)[:, None] * stride_wf + offs_k[None, :]  # [CP, BK2]
                acc = tl.zeros([CP, BK2], dtype=tl.float32)
                for k in range(0, tl.cdiv(D, BK2)):
                    k_ok = offs_k < D - k * BK2
                    w = tl.load(w_ptrs, mask=p_ok[:, None] & k_ok[None, :], other=0.0)
                    xk = tl.load(x_ptr + k * BK2 + offs_k, mask=k_ok, other=0.0)
                    acc += w.to(tl.float32) * xk.to(tl.float32)[None, :]
                    w_ptrs += BK2
                g = tl.sum(acc, 1)  # [CP]
                gsum += tl.sum(tl.where(sel, g[:, None], -0.0), 0)
            gate = tl.where(m_ok[:, None], gsum[None, :], 0.0)  # [2, T]
        elif CP == T:  # _k1_tiled's loop, columns that did not pass masked out
            gate = tl.zeros([BLOCK_M, T], dtype=tl.float32)
            if npass > 0:
                a_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
                b_ptrs = wg_ptr + rows64[None, :] * stride_wf + offs_k[:, None]
                gate = _dot_k(a_ptrs, b_ptrs, gate, m_ok, n_ok & colpass, D, offs_k, BK2, IEEE)
        else:  # the passed columns CP at a time
            gate = tl.full([BLOCK_M, T], -0.0, tl.float32)
            for c in range(0, tl.cdiv(npass, CP)):
                sel, idx, p_ok = _rank_select(colpass, npass, c, offs_t, CP)
                a_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
                b_ptrs = wg_ptr + (pid_n * T + idx).to(tl.int64)[None, :] * stride_wf + offs_k[:, None]  # [BK2, CP]
                acc = tl.zeros([BLOCK_M, CP], dtype=tl.float32)
                acc = _dot_k(a_ptrs, b_ptrs, acc, m_ok, p_ok, D, offs_k, BK2, IEEE)
                gate += tl.sum(tl.where(sel[None, :, :], acc[:, :, None], -0.0), 1)  # [BM, T]
        gate = tl.where(colpass[None, :], gate, float("-inf"))  # never active: not computed
        _k1_epilogue(gate, offs_m, offs_n, m_ok, n_ok, pid_n, cnt_ptr, col_ptr, val_ptr, th_ptr, NT, BLOCK_M, T, S,
                     ENT, HAS_THETA, RND)


# The screened K1's launch parameters (gate_pack_screened's overrides; eval/research/bench_screen.py --cuda sweeps them):
# BK1 phase-1 columns per step (per-row screens; grouped: the group), BK2 phase-2 columns per step, CP passed
# rows (M = 1) / columns (M > 1, >= 16; T: masked, no gather) per phase-2 chunk, CVT int8 conversion (1: integer
# trick, 0: cast), num_warps, num_stages. The defaults keep the exact gates bitwise those of today's decode K1
# (M = 1: BK2 = _k1_gemv's BLOCK_K; M > 1: _k1_tiled's blocks, CP = T); other BK2 / CP sum in another order
# (still covered by the bound: any order) and pack the same entries up to fp32 ties at the threshold.
SCREEN_KEYS = ("BK1", "BK2", "CP", "CVT", "num_warps", "num_stages")


def screen_config(m: int, sw: ScreenWeights, device_type: str) -> dict:
    """Blocks of the screened K1: decode tiles T = S = 32; phase 2 mirrors gate_pack's decode K1 (M = 1: the GEMV
    K1 with BLOCK_K GEMV_BLOCK_K, passed rows gathered 8 at a time; else _k1_tiled with BLOCK_M 16,
    BLOCK_K 128, masked columns); phase 1 reads one group per step (per-row scales: 256 columns at M = 1, 128
    else)."""
    gemv = m == 1
    bk2 = GEMV_BLOCK_K if gemv else 128
    grouped = sw.n_groups > 1
    if grouped and (sw.group & (sw.group - 1)):
        raise ValueError(f"group = {sw.group}: the kernel needs a power-of-two group")
    bk1 = sw.group if grouped else (256 if gemv else 128)
    return dict(T=DECODE_TILE, S=DECODE_SLOTS, BLOCK_M=2 if gemv else 16, BK1=bk1, BK2=bk2,
                CP=8 if gemv else DECODE_TILE, CVT=1, GEMV=gemv, GROUPED=grouped, num_warps=4,
                num_stages=2 if device_type == "cpu" else 3)


def gate_pack_screened(x2d: torch.Tensor, w_gate: torch.Tensor, sw: ScreenWeights,
                       threshold: torch.Tensor | None = None, *, entries: str | None = None,
                       return_pass: bool = False, **overrides):
    """K1 with the screen (M <= 16): the decode TwELL packing of gate_pack (same tiles, same words), W_gate rows
    read only where the screen passes them. return_pass: also return the screen's pass mask [M, F] bool and
    the passed columns per tile [NT] int32 (one more store; off in the hot path). overrides: SCREEN_KEYS.
    Host side: a few torch.empty (no launch, no sync), one kernel launch."""
    require_triton()
    m, d = x2d.shape
    f = w_gate.shape[0]
    if m > 16:
        raise ValueError(f"M = {m}: the gate screen is a decode path (M <= 16)")
    if sw.shape != (f, d):
        raise ValueError(f"screen of shape {sw.shape} for W_gate {tuple(w_gate.shape)}")
    bad = set(overrides) - set(SCREEN_KEYS)
    if bad:
        raise ValueError(f"unknown overrides {sorted(bad)}: use {SCREEN_KEYS}")
    entries = entries or default_entries(x2d.dtype)
    cfg = {**screen_config(m, sw, x2d.device.type), **overrides}
    if cfg["GROUPED"] and cfg["BK1"] != sw.group:
        raise ValueError(f"BK1 = {cfg['BK1']}: a grouped screen reads one group (BK1 = {sw.group}) per step")
    if not cfg["GEMV"] and cfg["CP"] != cfg["T"] and cfg["CP"] < 16:
        raise ValueError(f"CP = {cfg['CP']}: at M > 1 the passed-column chunks feed tl.dot (CP >= 16, or T)")
    t, s = cfg.pop("T"), cfg.pop("S")
    nt = n_tiles(f, t)
    cnt = torch.empty(m, nt, dtype=torch.int32, device=x2d.device)
    col = torch.empty(m, nt, s, dtype=torch.int32, device=x2d.device)
    val = torch.empty(m, nt, s, dtype=torch.float32, device=x2d.device) if entries == "split" else cnt
    pas = torch.zeros(m, f, dtype=torch.int8, device=x2d.device) if return_pass else cnt
    npass = torch.zeros(nt, dtype=torch.int32, device=x2d.device) if return_pass else cnt
    th = theta_args(x2d, threshold)
    has_ex = sw.w_exact is not None
    kx = int(sw.exact_cols.numel()) if has_ex else 0
    _k1_screened[(nt,)](
        x2d, sw.q, sw.scale, sw.rq, sw.mq, sw.err_round, sw.keep if has_ex else sw.scale,
        sw.exact_cols if has_ex else cnt, sw.w_exact if has_ex else sw.scale, w_gate,
        cnt, col, val, th["th_ptr"], pas, npass,
        m, f, d, nt, sw.n_groups, kx, x2d.stride(0), sw.q.stride(0), w_gate.stride(0),
        sw.w_exact.stride(0) if has_ex else 0, float(sw.n_big), float(sw.c_exact),
        T=t, S=s, KP=max(2, next_pow2(kx)), HAS_EX=has_ex, DOT16=x2d.dtype != torch.float32,
        IEEE=x2d.dtype == torch.float32, ENT=ENT_CODES[entries], HAS_THETA=th["HAS_THETA"], RND=th["RND"],
        PASS_OUT=return_pass, QI8=sw.kind == "int8", **cfg,
    )
    packed = (TwellPacked(cnt=cnt, col=col, val=val, tile=t, n_cols=f) if entries == "split" else
              TwellPacked(cnt=cnt, col=None, val=None, tile=t, n_cols=f, ent=col, entries=entries))
    if return_pass:
        return packed, pas.bool(), npass
    return packed


def twell_ffn_screened(x2d: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor,
                       sw: ScreenWeights, threshold: torch.Tensor | None = None, **overrides) -> torch.Tensor:
    """The decode TwELL FFN with the screened K1: gate_pack_screened (overrides: SCREEN_KEYS), then the same K2
    as twell_ffn_triton (launches per call: K1, then K2's zero-fill, kernel and output cast, as twell's)."""
    from sparsify.kernels.twell_updown import updown

    packed = gate_pack_screened(x2d, w_gate, sw, threshold, **overrides)
    return updown(x2d, packed, w_gate, w_up, w_down_t, compact=True, threshold=threshold)
