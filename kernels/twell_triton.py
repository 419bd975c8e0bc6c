"""Triton K1 of the TwELL FFN: gate GEMM + ReLU + TwELL packing (the K2 that reads it: twell_updown.py).

Legend: M = tokens, d = hidden size, F = intermediate size, T = tile width, S = slots per (row, tile),
NT = ceil(F / T). Layout and overflow rules: twell_reference.py.

Every K1 packs the columns with g > 0, or with a threshold theta [F] (HAS_THETA) those with g > theta_j, g
rounded to the input dtype first (`_in_dtype`, the value the dense path compares); HAS_THETA = 0 compiles
to the code without theta.

- `_k1_tma`, the TMA-tiled K1 (variant "tma", 16-bit prefill, the default): TMA loads, NSUB tiles of T columns
  per program (NSUB = 2: a 128 x 256 GEMM tile) and a slot-major epilogue: two 64-bit masks of a row's positive
  columns, then per slot its column (the s-th set bit) and value (tl.gather from the accumulator), stored
  together.
- `_k1_tiled`, the plain-tiled K1 (variant "tiled"; what "tma" falls back to for fp32, M <= 16 and unaligned
  inputs): pointer loads into a tiled GEMM -> acc [BLOCK_M, T] fp32; the epilogue gives each positive value its
  slot with a cumulative sum along the tile (no atomics, deterministic). Neither writes a dense [M, F] tensor.
- `_k1_gemv`, the GEMV K1 (variant "gemv", M = 1 only; what "tma", auto's K1, runs at M = 1): the same packing
  from a GEMV, W_gate blocks [T, BLOCK_K] times x with fp32 products summed once per tile, no MMA (at M = 1 the
  tl.dot of _k1_tiled pads x to 16 rows and stages W_gate through MMA layouts).
kernels/NOTES.md has the history (the benchmark rounds that produced each) and the measurements.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from .twell_reference import DECODE_SLOTS, DECODE_TILE, SLOTS, TILE, TwellPacked, n_tiles

try:  # the file must import (and the torch path work) without triton
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    HAS_TRITON = True
    try:  # host-side tensor descriptors (TMA on Hopper): triton >= 3.4; the TMA-tiled K1 needs them
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover
        TensorDescriptor = None
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None
    libdevice = None
    TensorDescriptor = None
    HAS_TRITON = False


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


if HAS_TRITON:

    @triton.jit
    def _pack_cols(g, col, ENT: tl.constexpr):
        """fp32 gate values g > 0 and their columns within the tile col (int32, same shape) -> int32 words
        (16-bit value bits << 16 | column)."""
        if ENT == 1:  # bf16, round to nearest even done in integers (the interpreter's cast truncates)
            b = g.to(tl.int32, bitcast=True)
            hi = (b + 0x7FFF + ((b >> 16) & 1)) >> 16  # g > 0 where kept: no sign / NaN cases
        else:  # fp16 (the cast rounds to nearest even on GPU and in the interpreter)
            hi = g.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return (hi << 16) | col

    @triton.jit
    def _in_dtype(g, RND: tl.constexpr):
        """fp32 g rounded to nearest even to the input dtype (RND: 1 bf16, 2 fp16, 0 fp32: g itself), as fp32:
        the gate value the dense path holds, which a threshold compares against. bf16 in integers, as
        _pack_cols (adding to the bit pattern rounds the magnitude, negative values stay negative)."""
        if RND == 1:
            b = g.to(tl.int32, bitcast=True)
            return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        elif RND == 2:
            return g.to(tl.float16).to(tl.float32)
        else:
            return g

    @triton.jit
    def _active(acc, th_ptr, cols, c_ok, HAS_THETA: tl.constexpr, RND: tl.constexpr):
        """[BM, T] bool: which gate values of acc (columns `cols` [T], in range where c_ok) K1 keeps: g > 0, or
        with a threshold g > theta_j on g in the input dtype (theta loaded once per tile)."""
        if HAS_THETA:
            th = tl.load(th_ptr + cols, mask=c_ok, other=0.0)  # [T] float32
            return (_in_dtype(acc, RND) > th[None, :]) & c_ok[None, :]
        return (acc > 0) & c_ok[None, :]

    @triton.jit
    def _pack_words(acc, T: tl.constexpr, ENT: tl.constexpr):
        """[BM, T] fp32 gate values -> int32 words, column = position in the tile."""
        return _pack_cols(acc, tl.arange(0, T)[None, :], ENT)

    @triton.jit
    def unpack_value(w, ENT: tl.constexpr):
        """fp32 value of int32 words (high 16 bits: bf16 or fp16 bits of a non-negative value)."""
        if ENT == 1:  # bf16 bits are the top half of the fp32 bits
            return (w & -65536).to(tl.float32, bitcast=True)
        return (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _grouped_tile(pid, M, NT, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
        """(row block, column tile) of output tile `pid` of cdiv(M, BLOCK_M) x NT in grouped order: GROUP_M
        row blocks share W_gate tiles in L2."""
        num_pid_m = tl.cdiv(M, BLOCK_M)
        group = GROUP_M * NT
        first_m = (pid // group) * GROUP_M
        gsize = tl.minimum(num_pid_m - first_m, GROUP_M)
        return first_m + ((pid % group) % gsize), (pid % group) // gsize

    @triton.jit
    def _k1_tiled(
        x_ptr, wg_ptr, cnt_ptr, col_ptr, val_ptr, th_ptr,
        M, F, D, NT, stride_xm, stride_wf,
        BLOCK_M: tl.constexpr, T: tl.constexpr, BLOCK_K: tl.constexpr, S: tl.constexpr,
        MB, GROUP_M: tl.constexpr, IEEE: tl.constexpr, ENT: tl.constexpr,
        EVEN_K: tl.constexpr, EVEN_MN: tl.constexpr, HAS_THETA: tl.constexpr, RND: tl.constexpr,
    ):
        # MB (the power-of-two bucket of M) is unused in the body: it is the autotuner's key.
        # ENT: slot encoding, 0 = "split" (col int32 + val fp32), 1 = "bf16", 2 = "fp16" (one int32 word
        # per slot in col_ptr: value bits << 16 | column in tile; val_ptr unused)
        pid_m, pid_n = _grouped_tile(tl.program_id(0), M, NT, BLOCK_M, GROUP_M)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        offs_n = pid_n * T + tl.arange(0, T)  # [T] global columns of this tile
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < F
        a_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
        b_ptrs = wg_ptr + offs_n.to(tl.int64)[None, :] * stride_wf + offs_k[:, None]  # [BK, T]
        acc = tl.zeros([BLOCK_M, T], dtype=tl.float32)
        for k in range(0, tl.cdiv(D, BLOCK_K)):
            if EVEN_K and EVEN_MN:  # no masks: lets the loads pipeline freely
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            elif EVEN_K:
                a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < D - k * BLOCK_K
                a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K

        _k1_epilogue(acc, offs_m, offs_n, m_ok, n_ok, pid_n, cnt_ptr, col_ptr, val_ptr, th_ptr, NT, BLOCK_M, T, S,
                     ENT, HAS_THETA, RND)

    @triton.jit
    def _gemv_gate(x_ptr, wg_ptr, offs_n, n_ok, D, stride_wf, T: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
        """[T] fp32 gate values x . W_gate[offs_n] of one row x (x_ptr: its start): acc [T, BLOCK_K] of fp32
        products, summed over BLOCK_K once at the end (the GEMV K1's loop, also the fused decode FFN's)."""
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = wg_ptr + offs_n.to(tl.int64)[:, None] * stride_wf + offs_k[None, :]  # [T, BK]
        acc = tl.zeros([T, BLOCK_K], dtype=tl.float32)
        for k in range(0, tl.cdiv(D, BLOCK_K)):
            if EVEN_K and EVEN_N:  # no masks: the loads pipeline freely
                w = tl.load(w_ptrs)
                xk = tl.load(x_ptr + k * BLOCK_K + offs_k)
            else:
                k_ok = offs_k < D - k * BLOCK_K
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                xk = tl.load(x_ptr + k * BLOCK_K + offs_k, mask=k_ok, other=0.0)
            acc += w.to(tl.float32) * xk.to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
        return tl.sum(acc, 1)

    @triton.jit
    def _k1_gemv(
        x_ptr, wg_ptr, cnt_ptr, col_ptr, val_ptr, th_ptr, F, D, NT, stride_wf,
        T: tl.constexpr, BLOCK_K: tl.constexpr, S: tl.constexpr, ENT: tl.constexpr,
        EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, HAS_THETA: tl.constexpr, RND: tl.constexpr,
    ):
        """K1 at M = 1: one program per column tile; acc [T, BLOCK_K] of fp32 products, summed over BLOCK_K
        once at the end, then _k1_epilogue on two rows (row 1 masked out: no size-1 block dimension)."""
        pid_n = tl.program_id(0)
        offs_n = pid_n * T + tl.arange(0, T)  # [T]
        n_ok = offs_n < F
        g = _gemv_gate(x_ptr, wg_ptr, offs_n, n_ok, D, stride_wf, T, BLOCK_K, EVEN_K, EVEN_N)  # [T]
        offs_m = tl.arange(0, 2)
        m_ok = offs_m < 1
        acc2 = tl.where(m_ok[:, None], g[None, :], 0.0)  # [2, T]
        _k1_epilogue(acc2, offs_m, offs_n, m_ok, n_ok, pid_n, cnt_ptr, col_ptr, val_ptr, th_ptr, NT, 2, T, S, ENT,
                     HAS_THETA, RND)

    @triton.jit
    def _k1_epilogue(acc, offs_m, offs_n, m_ok, n_ok, pid_n, cnt_ptr, col_ptr, val_ptr, th_ptr, NT,
                     BLOCK_M: tl.constexpr, T: tl.constexpr, S: tl.constexpr, ENT: tl.constexpr,
                     HAS_THETA: tl.constexpr, RND: tl.constexpr):
        """ReLU (or theta) + TwELL packing of acc [BM, T]; slot = rank of the column among the tile's active ones."""
        active = _active(acc, th_ptr, offs_n, n_ok, HAS_THETA, RND) & m_ok[:, None]  # [BM, T]
        act_i = active.to(tl.int32)
        pos = tl.cumsum(act_i, 1) - 1  # [BM, T]
        cnt = tl.sum(act_i, 1)  # [BM] true count, may exceed S (overflow marker)
        base = (offs_m.to(tl.int64) * NT + pid_n) * S  # [BM]
        keep = active & (pos < S)
        dst = base[:, None] + pos  # [BM, T]
        if ENT == 0:
            cols = tl.zeros([BLOCK_M, T], dtype=tl.int32) + offs_n[None, :]
            tl.store(col_ptr + dst, cols, mask=keep)
            tl.store(val_ptr + dst, acc, mask=keep)
        else:
            tl.store(col_ptr + dst, _pack_words(acc, T, ENT), mask=keep)  # one word per entry
        tl.store(cnt_ptr + offs_m.to(tl.int64) * NT + pid_n, cnt, mask=m_ok)

    @triton.jit
    def _popc64(v, HW: tl.constexpr):
        """Set bits of int64 v (int32 result). HW: the GPU's popc; else SWAR bit arithmetic (the
        interpreter has no libdevice popc). Arithmetic shifts are harmless: every mask clears the
        sign-extended bits."""
        if HW:
            return libdevice.popc(v)
        v = v - ((v >> 1) & 0x5555555555555555)
        v = (v & 0x3333333333333333) + ((v >> 2) & 0x3333333333333333)
        v = (v + (v >> 4)) & 0x0F0F0F0F0F0F0F0F
        return ((v * 0x0101010101010101) >> 56).to(tl.int32)

    @triton.jit
    def _k1_epilogue_slots(acc, pid_m, tile, M, F, cnt_ptr, ent_ptr, th_ptr, NT,
                           BLOCK_M: tl.constexpr, T: tl.constexpr, S: tl.constexpr, ENT: tl.constexpr,
                           HW: tl.constexpr, HAS_THETA: tl.constexpr, RND: tl.constexpr):
        """Slot-major epilogue of acc [BM, T] (T <= 128). Per row two 64-bit masks of the positive
        columns (a select and a row sum per element, in the MMA accumulator's register layout: a scan
        along the tile needs a layout conversion through shared memory, and a per-column scatter of
        64-bit addresses spilled registers at 128 x 256 tiles); then per (row, slot) [BM, S]: the column
        of slot s is the s-th set bit, its value is gathered from acc, and the row's S words are stored
        together. Same slots as _k1_epilogue: rank of the column among the tile's active ones."""
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, T)
        m_ok = pid_m * BLOCK_M + rows < M
        active = _active(acc, th_ptr, tile * T + cols, tile * T + cols < F, HAS_THETA, RND)  # [BM, T]
        lo_col = cols < 64
        bit = tl.full([T], 1, tl.int64) << (cols & 63).to(tl.int64)  # [T]
        lo = tl.sum(tl.where(active & lo_col[None, :], bit[None, :], 0), 1)  # [BM] distinct bits: sum = or
        hi = tl.sum(tl.where(active & (cols >= 64)[None, :], bit[None, :], 0), 1)  # [BM]
        n_lo = _popc64(lo, HW)
        cnt = n_lo + _popc64(hi, HW)  # [BM] true count, may exceed S (overflow marker)
        slots = tl.arange(0, S)
        valid = (slots[None, :] < tl.minimum(cnt, S)[:, None]) & m_ok[:, None]  # [BM, S]
        in_lo = slots[None, :] < n_lo[:, None]  # [BM, S]
        w = tl.where(in_lo, lo[:, None], hi[:, None])  # [BM, S] int64 mask holding slot s
        k = tl.where(in_lo, slots[None, :], slots[None, :] - n_lo[:, None])  # rank of s inside w
        p = tl.zeros([BLOCK_M, S], dtype=tl.int32)
        for step in tl.static_range(6):  # largest p with popc(w below p) <= k: bits 32,16,..,1
            mid = p + (32 >> step)
            below = _popc64(w & ((tl.full([BLOCK_M, S], 1, tl.int64) << mid.to(tl.int64)) - 1), HW)
            p = tl.where(below <= k, mid, p)
        col = tl.where(valid, tl.where(in_lo, p, p + 64), 0)  # [BM, S] column within the tile
        g = tl.gather(acc, col, 1)  # [BM, S] fp32
        base = ent_ptr + (pid_m * BLOCK_M).to(tl.int64) * NT * S + tile * S  # this tile's row-0 slots
        tl.store(base + (rows * (NT * S))[:, None] + slots[None, :], _pack_cols(g, col, ENT), mask=valid)
        tl.store(cnt_ptr + (pid_m * BLOCK_M + rows).to(tl.int64) * NT + tile, cnt, mask=m_ok)

    @triton.jit
    def _k1_tma(
        x_desc, wg_desc, cnt_ptr, ent_ptr, th_ptr, M, F, D, NT,
        BLOCK_M: tl.constexpr, T: tl.constexpr, BLOCK_K: tl.constexpr, S: tl.constexpr,
        MB, GROUP_M: tl.constexpr, ENT: tl.constexpr, NSUB: tl.constexpr, HW: tl.constexpr,
        HAS_THETA: tl.constexpr, RND: tl.constexpr,
    ):
        """K1 for 16-bit inputs with packed entries: TMA loads; NSUB tiles of T columns per program (one x
        K-slice feeds NSUB MMAs: NSUB = 2 is a 128 x 256 GEMM tile); the slot-major epilogue per tile."""
        n_groups = tl.cdiv(NT, NSUB)
        pid_m, group = _grouped_tile(tl.program_id(0), M, n_groups, BLOCK_M, GROUP_M)
        t0 = group * NSUB
        acc0 = tl.zeros([BLOCK_M, T], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_M, T], dtype=tl.float32)
        for k in range(tl.cdiv(D, BLOCK_K)):
            a = x_desc.load([pid_m * BLOCK_M, k * BLOCK_K])  # [BM, BK]
            b0 = wg_desc.load([t0 * T, k * BLOCK_K])  # [T, BK]
            acc0 = tl.dot(a, tl.trans(b0), acc0)
            if NSUB == 2:
                b1 = wg_desc.load([(t0 + 1) * T, k * BLOCK_K])
                acc1 = tl.dot(a, tl.trans(b1), acc1)
        _k1_epilogue_slots(acc0, pid_m, t0, M, F, cnt_ptr, ent_ptr, th_ptr, NT, BLOCK_M, T, S, ENT, HW, HAS_THETA, RND)
        if NSUB == 2 and t0 + 1 < NT:  # the last group may hold one tile only
            _k1_epilogue_slots(acc1, pid_m, t0 + 1, M, F, cnt_ptr, ent_ptr, th_ptr, NT, BLOCK_M, T, S, ENT, HW,
                               HAS_THETA, RND)


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: use backend='dense' (or install triton>=3.6).")


ENT_CODES = MappingProxyType({"split": 0, "bf16": 1, "fp16": 2})
# twell_ffn_triton's variants, named by their K1 (K2 reads compacted lists in both): "tma" = _k1_tma where it
# applies (else the GEMV K1 at M = 1, the plain-tiled one elsewhere), "tiled" = _k1_tiled everywhere
VARIANTS = ("tma", "tiled")
DEFAULT_VARIANT = "tma"
K1_VARIANTS = (*VARIANTS, "gemv")  # gate_pack's
# _k1_gemv's BLOCK_K: the fastest of 64 / 128 / 256 at M = 1 and 95.7% zeros on all three swept shapes (H200,
# eval/results/generate-h200/decode-parts-0957/)
GEMV_BLOCK_K = 256


def default_entries(dtype: torch.dtype) -> str:
    """Slot encoding: one packed word per entry for 16-bit inputs, split col/val otherwise (fp32)."""
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16" if dtype == torch.bfloat16 else "fp16"
    return "split"


def k1_config(m: int, d: int) -> dict:
    """Block sizes for K1 by token count (decode uses narrow tiles so F/32 programs fill the GPU)."""
    if m <= 16:
        return dict(BLOCK_M=16, T=DECODE_TILE, S=DECODE_SLOTS, BLOCK_K=128, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, T=TILE, S=SLOTS, BLOCK_K=64, num_warps=4, num_stages=4)


# _k1_tiled's autotune configs for M > 16 (keyed on d, F and the M bucket); k1_config's blocks first
K1_TILED_TUNE = (
    (64, 64, 4, 4), (128, 64, 8, 3), (128, 64, 4, 4), (64, 128, 4, 3), (128, 32, 8, 4), (32, 128, 4, 4),
)  # (BLOCK_M, BLOCK_K, num_warps, num_stages)


def _even_k(a) -> bool:
    return a["D"] % a["BLOCK_K"] == 0


def _even_mn(a) -> bool:
    return a["M"] % a["BLOCK_M"] == 0 and a["F"] % a["T"] == 0


def _tma_blocks(nargs) -> None:
    """Autotune pre-hook: give the descriptors the block shapes of the config being run."""
    nargs["x_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["wg_desc"].block_shape = [TILE, nargs["BLOCK_K"]]


def _tma_ok(x2d: torch.Tensor, w_gate: torch.Tensor) -> bool:
    """Descriptors need 16-byte aligned bases and row strides."""
    return TensorDescriptor is not None and all(
        t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (x2d, w_gate))


def theta_args(x2d: torch.Tensor, threshold: torch.Tensor | None) -> dict:
    """The kernels' threshold arguments: th_ptr (theta [F] float32, or a never-read placeholder), HAS_THETA and
    RND (the input dtype theta compares g in: ENT_CODES' numbering)."""
    if threshold is None:
        return dict(th_ptr=x2d, HAS_THETA=False, RND=0)
    return dict(th_ptr=threshold.contiguous(), HAS_THETA=True, RND=ENT_CODES[default_entries(x2d.dtype)])


def gate_pack(
    x2d: torch.Tensor, w_gate: torch.Tensor, *, entries: str | None = None, variant: str = "tiled",
    autotune: bool | None = None, threshold: torch.Tensor | None = None, **overrides,
) -> TwellPacked:
    """K1: relu(x2d @ w_gate.T) packed as TwELL. x2d [M, d] row-contiguous, w_gate [F, d] contiguous.
    threshold: theta [F] float32: pack the columns with g > theta_j instead, g rounded to x2d's dtype.

    entries: slot encoding ("split", "bf16", "fp16"; default from the dtype). variant "tiled" runs
    _k1_tiled, autotuned on CUDA for M > 16 unless block sizes are given in `overrides`; "tma" runs
    _k1_tma (autotuned over K1_TMA_TUNE; overrides: K1_TMA_DEFAULT's keys) where its conditions hold (16-bit
    inputs with packed entries, M > 16, TMA-aligned tensors), at M = 1 (without overrides) _k1_gemv, else
    _k1_tiled; "gemv" runs _k1_gemv at M = 1 (overrides: T, S, BLOCK_K, num_warps, num_stages), else _k1_tiled.
    autotune=True forces the autotuned launch (tests drive it in the interpreter with a stand-in benchmark).
    """
    if variant not in K1_VARIANTS:
        raise ValueError(f"variant={variant!r} is not one of {K1_VARIANTS}")
    require_triton()
    m, d = x2d.shape
    f = w_gate.shape[0]
    entries = entries or default_entries(x2d.dtype)
    if variant == "tma" and m == 1 and not overrides:  # batch-1 decode: the GEMV K1 beat the tiled one there
        variant = "gemv"
    cfg = {**k1_config(m, d), **({"BLOCK_K": GEMV_BLOCK_K} if variant == "gemv" else {}), **overrides}
    # the TMA K1 needs 16-bit inputs with packed entries, prefill tiles and TMA-aligned tensors; else _k1_tiled
    if (variant == "tma" and x2d.dtype in (torch.bfloat16, torch.float16) and entries != "split"
            and cfg["T"] == TILE and _tma_ok(x2d, w_gate)):
        nt = n_tiles(f, TILE)
        cnt = torch.empty(m, nt, dtype=torch.int32, device=x2d.device)  # [M, NT]
        ent = torch.empty(m, nt, SLOTS, dtype=torch.int32, device=x2d.device)  # [M, NT, S] packed words
        _gate_pack_tma(x2d, w_gate, cnt, ent, entries, overrides, autotune, threshold)
        return TwellPacked(cnt=cnt, col=None, val=None, tile=TILE, n_cols=f, ent=ent, entries=entries)
    tuned = (x2d.is_cuda and m > 16 and cfg["T"] == TILE and variant != "gemv"
             and not {"BLOCK_M", "BLOCK_K", "num_warps", "num_stages"} & overrides.keys())
    tuned = tuned if autotune is None else autotune
    if x2d.device.type == "cpu":  # interpreter: few large blocks run fastest
        cfg["BLOCK_K"] = max(cfg["BLOCK_K"], min(128, next_pow2(d)))
    t, s = cfg["T"], cfg["S"]
    nt = n_tiles(f, t)
    cnt = torch.empty(m, nt, dtype=torch.int32, device=x2d.device)  # [M, NT]
    col = torch.empty(m, nt, s, dtype=torch.int32, device=x2d.device)  # [M, NT, S] col or packed word
    val = torch.empty(m, nt, s, dtype=torch.float32, device=x2d.device) if entries == "split" else cnt
    th = theta_args(x2d, threshold)
    if variant == "gemv" and m == 1:
        bk = cfg["BLOCK_K"]
        _k1_gemv[(nt,)](x2d, w_gate, cnt, col, val, th["th_ptr"], f, d, nt, w_gate.stride(0), T=t, BLOCK_K=bk, S=s,
                        ENT=ENT_CODES[entries], EVEN_K=(d % bk == 0), EVEN_N=(f % t == 0), HAS_THETA=th["HAS_THETA"],
                        RND=th["RND"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return _packed(cnt, col, val, t, f, entries)
    args = (x2d, w_gate, cnt, col, val, th.pop("th_ptr"), m, f, d, nt, x2d.stride(0), w_gate.stride(0))
    # MB keys the autotuner (a constant otherwise, so it never causes a recompilation)
    common = dict(T=t, S=s, MB=min(next_pow2(m), 1 << 16) if tuned else 16, GROUP_M=8, IEEE=(x2d.dtype == torch.float32),
                  ENT=ENT_CODES[entries], **th)
    if tuned:
        k1_tiled_autotuned[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * nt,)](*args, **common)
    else:
        bm, bk = cfg["BLOCK_M"], cfg["BLOCK_K"]
        _k1_tiled[(triton.cdiv(m, bm) * nt,)](
            *args, BLOCK_M=bm, BLOCK_K=bk, **common, EVEN_K=(d % bk == 0), EVEN_MN=(m % bm == 0 and f % t == 0),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return _packed(cnt, col, val, t, f, entries)


def _packed(cnt, col, val, t: int, f: int, entries: str) -> TwellPacked:
    """K1's outputs as TwellPacked: split col / val, or one packed word per entry in `col`."""
    if entries == "split":
        return TwellPacked(cnt=cnt, col=col, val=val, tile=t, n_cols=f)
    return TwellPacked(cnt=cnt, col=None, val=None, tile=t, n_cols=f, ent=col, entries=entries)


# The TMA K1 sweep's fastest at M = 16384 (kernels/NOTES.md, eval/k1_sweep.py): 128 x 256 tiles, 8 warps, 4
# stages; K1_TMA_TUNE adds shapes for smaller M that the autotuner picks per (d, F, M bucket).
K1_TMA_DEFAULT = MappingProxyType(dict(BLOCK_M=128, BLOCK_K=64, NSUB=2, num_warps=8, num_stages=4))
K1_TMA_TUNE = ((128, 64, 2, 8, 4), (128, 64, 2, 8, 3), (128, 128, 1, 8, 3), (64, 64, 1, 4, 4), (64, 128, 1, 4, 3))

if HAS_TRITON:  # the autotuned K1s: Triton kernel objects like the kernels they wrap, their picks in their caches
    # (made here, benchmarking only at a launch on the GPU; tests drive them with a stand-in benchmark)
    k1_tiled_autotuned = triton.autotune(key=["D", "F", "MB"], configs=[
        triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=w, num_stages=st) for bm, bk, w, st in K1_TILED_TUNE
    ])(triton.heuristics({"EVEN_K": _even_k, "EVEN_MN": _even_mn})(_k1_tiled))
    k1_tma_autotuned = triton.autotune(key=["D", "F", "MB"], configs=[
        triton.Config({"BLOCK_M": bm, "BLOCK_K": bk, "NSUB": nsub}, num_warps=w, num_stages=st, pre_hook=_tma_blocks)
        for bm, bk, nsub, w, st in K1_TMA_TUNE
    ])(_k1_tma)


def _gate_pack_tma(x2d, w_gate, cnt, ent, entries, overrides: dict, autotune: bool | None = None,
                   threshold: torch.Tensor | None = None):
    """Launch _k1_tma into cnt [M, NT] / ent [M, NT, S] (threshold: theta [F] float32 or None): autotuned over
    K1_TMA_TUNE on CUDA unless `overrides` sets block keys (K1_TMA_DEFAULT fills the rest; autotune=True/False
    forces either). Returns Triton's launch result (on GPU the compiled kernel: the sweep reads its registers and
    spills)."""
    m, d = x2d.shape
    f = w_gate.shape[0]
    nt = cnt.shape[1]
    common = dict(T=TILE, S=SLOTS, GROUP_M=8, ENT=ENT_CODES[entries], HW=x2d.is_cuda, **theta_args(x2d, threshold))
    th_ptr = common.pop("th_ptr")
    if autotune or (autotune is None and x2d.is_cuda and not K1_TMA_DEFAULT.keys() & overrides.keys()):
        descs = (TensorDescriptor.from_tensor(x2d, [64, 64]), TensorDescriptor.from_tensor(w_gate, [TILE, 64]))
        return k1_tma_autotuned[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(nt, meta["NSUB"]),)](
            *descs, cnt, ent, th_ptr, m, f, d, nt, MB=min(next_pow2(m), 1 << 16), **common)
    cfg = {**K1_TMA_DEFAULT, **overrides}
    bm, bk, nsub = cfg["BLOCK_M"], cfg["BLOCK_K"], cfg["NSUB"]
    progs = triton.cdiv(m, bm) * triton.cdiv(nt, nsub)
    descs = (TensorDescriptor.from_tensor(x2d, [bm, bk]), TensorDescriptor.from_tensor(w_gate, [TILE, bk]))
    return _k1_tma[(progs,)](
        *descs, cnt, ent, th_ptr, m, f, d, nt, BLOCK_M=bm, BLOCK_K=bk, MB=16, NSUB=nsub, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **common)


def k1_best_config(d: int, f: int, m: int, variant: str = "tiled") -> dict | None:
    """The autotuner's pick for (d, F, M bucket), if it has tuned that key (for the benchmark log)."""
    if not HAS_TRITON:
        return None
    tuner = k1_tma_autotuned if variant == "tma" else k1_tiled_autotuned
    for key, cfg in tuner.cache.items():
        if tuple(key[:3]) == (d, f, min(next_pow2(m), 1 << 16)):
            return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return None

