"""Triton TwELL kernels: K1 gate GEMM + ReLU + TwELL packing, K2 fused up/down reading TwELL.

Legend: M = tokens, d = hidden size, F = intermediate size, T = tile width, S = slots per (row, tile),
NT = ceil(F / T), E = gathered rows per chunk in K2. Layout and overflow rules: twell_reference.py.

- K1 `_k1_r6` (round 6; variant "r6", and "r6c" = r6 + compacted K2, the default for bf16/fp16 prefill):
  TMA loads, NSUB = 2 tiles of T columns per program, and a slot-major epilogue (_k1_epilogue_slots):
  two 64-bit masks per row, then per slot its column (the s-th set bit) and value (tl.gather
  from the accumulator), the row's S words stored together. The per-column scatter of earlier rounds
  spilled registers (eval/results/kernels-h200-r6/).
- K1 `_k1_gate_pack` (round 5; r6's fallback for fp32, M <= 16 and unaligned inputs; variant "r5c" uses it
  everywhere): tiled GEMM x [M, d] @ W_gate^T -> acc [BLOCK_M, T] fp32; the epilogue applies ReLU,
  gives each positive value its slot with a cumulative sum along the tile (no atomics, deterministic)
  and writes cnt/col/val. No dense [M, F] tensor is written.
- K2 `_k2_updown`: one program per (row, split); x row and the fp32 output row stay in registers. It
  walks the row's kept entries E at a time (tile of each entry found from a prefix sum of the counts),
  gathers W_up[j] and W_down^T[j] rows (both loads issued before the reductions),
  h = val * dot(x, W_up[j]) never leaves registers, out += h * W_down^T[j]. Overflowed tiles are
  recomputed densely from W_gate (lossless). SPLIT > 1 (decode) spreads a row's entries over programs
  that add into an fp32 output with atomics.
- Decode (M <= 16): K1 with 32-column tiles and K2 split across programs (above), what twell_ffn_triton
  and auto run; at M = 1, and from d = DECODE_CHUNKED_MIN_D = 8192 on, K2 is `_k2_dec_chunked` (d in chunks through an
  [M, K] scratch: no d-length registers, so no spills). `decode_ffn` (M <= DECODE_MAX_M = 32, routed only up to DECODE_ROUTE_M = 0: it measured
  0.71-0.97x of dense on the H200, kernels/NOTES.md): phase A `_dec_gate_up`
  (gate for all M rows at once, W_up rows of neurons active in any row), phase B `_dec_down` (W_down^T
  rows of neurons with a non-zero h, over d blocks x F splits), `_dec_sum` (the splits' fp32 partials).
  Each weight row is read once for all M rows, nothing spills at d = 8192.
"""

from __future__ import annotations

import torch

from .twell_reference import DECODE_SLOTS, DECODE_TILE, SLOTS, TILE, TwellPacked, n_tiles

try:  # the file must import (and the torch path work) without triton
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    HAS_TRITON = True
    try:  # host-side tensor descriptors (TMA on Hopper): triton >= 3.4; the r6 K1 needs them
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover
        TensorDescriptor = None
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None
    libdevice = None
    TensorDescriptor = None
    HAS_TRITON = False


def _next_pow2(n: int) -> int:
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
    def _pack_words(acc, T: tl.constexpr, ENT: tl.constexpr):
        """[BM, T] fp32 gate values -> int32 words, column = position in the tile."""
        return _pack_cols(acc, tl.arange(0, T)[None, :], ENT)

    @triton.jit
    def _unpack_value(w, ENT: tl.constexpr):
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
    def _k1_gate_pack(
        x_ptr, wg_ptr, cnt_ptr, col_ptr, val_ptr,
        M, F, D, NT, stride_xm, stride_wf,
        BLOCK_M: tl.constexpr, T: tl.constexpr, BLOCK_K: tl.constexpr, S: tl.constexpr,
        MB, GROUP_M: tl.constexpr, IEEE: tl.constexpr, ENT: tl.constexpr, PACK: tl.constexpr,
        EVEN_K: tl.constexpr, EVEN_MN: tl.constexpr,
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

        _k1_epilogue(acc, offs_m, offs_n, m_ok, n_ok, pid_n, cnt_ptr, col_ptr, val_ptr, NT,
                     BLOCK_M, T, S, ENT, PACK)

    @triton.jit
    def _k1_epilogue(acc, offs_m, offs_n, m_ok, n_ok, pid_n, cnt_ptr, col_ptr, val_ptr, NT,
                     BLOCK_M: tl.constexpr, T: tl.constexpr, S: tl.constexpr, ENT: tl.constexpr,
                     PACK: tl.constexpr):
        """ReLU + TwELL packing of acc [BM, T]; slot = rank of the column among the tile's positives."""
        active = (acc > 0) & m_ok[:, None] & n_ok[None, :]  # [BM, T]
        act_i = active.to(tl.int32)
        pos = tl.cumsum(act_i, 1) - 1  # [BM, T]
        cnt = tl.sum(act_i, 1)  # [BM] true count, may exceed S (overflow marker)
        if PACK == 2:  # benchmark diagnostic: scan kept alive, no slot stores
            cnt = tl.max(tl.where(active, pos, -1), 1) + 1
        if PACK == 1:  # PACK=0/2 are benchmark diagnostics that isolate the GEMM / scan cost
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
    def _k1_epilogue_slots(acc, pid_m, tile, M, F, cnt_ptr, ent_ptr, NT,
                           BLOCK_M: tl.constexpr, T: tl.constexpr, S: tl.constexpr, ENT: tl.constexpr,
                           PACK: tl.constexpr, HW: tl.constexpr):
        """Round-6 slot-major epilogue of acc [BM, T] (T <= 128). Per row two 64-bit masks of the positive
        columns (a select and a row sum per element, in the MMA accumulator's register layout: a scan
        along the tile needs a layout conversion through shared memory, and a per-column scatter of
        64-bit addresses spilled registers at 128 x 256 tiles); then per (row, slot) [BM, S]: the column
        of slot s is the s-th set bit, its value is gathered from acc, and the row's S words are stored
        together. Same slots as _k1_epilogue: rank of the column among the tile's positives."""
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, T)
        m_ok = pid_m * BLOCK_M + rows < M
        active = (acc > 0) & (tile * T + cols < F)[None, :]  # [BM, T]
        lo_col = cols < 64
        bit = tl.full([T], 1, tl.int64) << (cols & 63).to(tl.int64)  # [T]
        lo = tl.sum(tl.where(active & lo_col[None, :], bit[None, :], 0), 1)  # [BM] distinct bits: sum = or
        hi = tl.sum(tl.where(active & (cols >= 64)[None, :], bit[None, :], 0), 1)  # [BM]
        n_lo = _popc64(lo, HW)
        cnt = n_lo + _popc64(hi, HW)  # [BM] true count, may exceed S (overflow marker)
        if PACK == 1:  # (PACK 0, a benchmark diagnostic: the GEMM and the counts only)
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
    def _k1_r6_epilogue(acc, pid_m, tile, M, F, cnt_ptr, ent_ptr, NT,
                        BLOCK_M: tl.constexpr, T: tl.constexpr, S: tl.constexpr, ENT: tl.constexpr,
                        PACK: tl.constexpr, HW: tl.constexpr, RANK: tl.constexpr):
        """Epilogue of one tile (tile < NT): RANK 2 slot-major (the default), 0 the scan of round 5."""
        if RANK == 2:
            _k1_epilogue_slots(acc, pid_m, tile, M, F, cnt_ptr, ent_ptr, NT, BLOCK_M, T, S, ENT, PACK, HW)
        else:
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = tile * T + tl.arange(0, T)
            _k1_epilogue(acc, offs_m, offs_n, offs_m < M, offs_n < F, tile, cnt_ptr, ent_ptr, cnt_ptr, NT,
                         BLOCK_M, T, S, ENT, PACK)

    @triton.jit
    def _k1_r6(
        x_desc, wg_desc, cnt_ptr, ent_ptr, M, F, D, NT,
        BLOCK_M: tl.constexpr, T: tl.constexpr, BLOCK_K: tl.constexpr, S: tl.constexpr,
        MB, GROUP_M: tl.constexpr, ENT: tl.constexpr, PACK: tl.constexpr, NSUB: tl.constexpr,
        RANK: tl.constexpr, HW: tl.constexpr, FLATTEN: tl.constexpr,
    ):
        """Round-6 K1 (16-bit inputs, packed entries): TMA loads; NSUB tiles of T columns per program
        (one x K-slice feeds NSUB MMAs: NSUB = 2 is a 128 x 256 GEMM tile); persistent when launched on
        fewer programs than output tiles (each program walks tiles a grid apart; FLATTEN lets the
        pipeliner prefetch the next tile's loads during this tile's epilogue). RANK: 2 = slot-major
        epilogue (the default), 0 = the scan epilogue of round 5 (timings: kernels/NOTES.md)."""
        tl.static_assert(RANK == 0 or RANK == 2, "RANK is 0 (scan) or 2 (slot-major)")
        n_groups = tl.cdiv(NT, NSUB)
        num_tiles = tl.cdiv(M, BLOCK_M) * n_groups
        for tid in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN):
            pid_m, group = _grouped_tile(tid, M, n_groups, BLOCK_M, GROUP_M)
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
            _k1_r6_epilogue(acc0, pid_m, t0, M, F, cnt_ptr, ent_ptr, NT, BLOCK_M, T, S, ENT, PACK, HW, RANK)
            if NSUB == 2 and t0 + 1 < NT:  # the last group may hold one tile only
                _k1_r6_epilogue(acc1, pid_m, t0 + 1, M, F, cnt_ptr, ent_ptr, NT, BLOCK_M, T, S, ENT, PACK, HW,
                                RANK)

    @triton.jit
    def _k2_entries(col_ptr, val_ptr, row, NT, S: tl.constexpr, p, K, cum, start, tiles,
                    T: tl.constexpr, ENT: tl.constexpr):
        """Column (int64) and relu(gate) of the row's entries of rank p [E]; tile found by prefix sum."""
        p_ok = p < K
        t = tl.sum((cum[None, :] <= p[:, None]).to(tl.int32), 1)  # [E] tile of each entry
        st = tl.sum(tl.where(tiles[None, :] == t[:, None], start[None, :], 0), 1)  # [E]
        slot = (row * NT + t) * S + (p - st)  # [E]
        if ENT == 0:
            j = tl.load(col_ptr + slot, mask=p_ok, other=0).to(tl.int64)
            g = tl.load(val_ptr + slot, mask=p_ok, other=0.0)
        else:  # one 32-bit word per entry: half the index bytes
            w = tl.load(col_ptr + slot, mask=p_ok, other=0)
            j = (t * T + (w & 0xFFFF)).to(tl.int64)
            g = _unpack_value(w, ENT)
        return j, g, p_ok

    @triton.jit
    def _k2_compact_row(col_ptr, val_ptr, sj_ptr, sg_ptr, row, NT, KMAX, sc, start, tiles,
                        T: tl.constexpr, S: tl.constexpr, ENT: tl.constexpr):
        """Copy the row's kept entries to scratch in rank order: tile t's slot s goes to start[t] + s."""
        slots = tl.arange(0, S)
        valid = slots[None, :] < sc[:, None]  # [NT_PAD, S]
        src = (row * NT + tiles[:, None]) * S + slots[None, :]  # [NT_PAD, S]
        if ENT == 0:
            jj = tl.load(col_ptr + src, mask=valid, other=0)
            gg = tl.load(val_ptr + src, mask=valid, other=0.0)
        else:
            w = tl.load(col_ptr + src, mask=valid, other=0)
            jj = tiles[:, None] * T + (w & 0xFFFF)
            gg = _unpack_value(w, ENT)
        dst = row * KMAX + start[:, None] + slots[None, :]  # [NT_PAD, S]
        tl.store(sj_ptr + dst, jj, mask=valid)
        tl.store(sg_ptr + dst, gg, mask=valid)

    @triton.jit
    def _k2_list(sj_ptr, sg_ptr, base, p, K):
        """Column (int64) and value of the compacted entries of rank p [E]."""
        p_ok = p < K
        j = tl.load(sj_ptr + base + p, mask=p_ok, other=0).to(tl.int64)
        g = tl.load(sg_ptr + base + p, mask=p_ok, other=0.0)
        return j, g, p_ok

    @triton.jit
    def _k2_updown(
        x_ptr, cnt_ptr, col_ptr, val_ptr, wg_ptr, wu_ptr, wdt_ptr, out_ptr,
        D, F, NT, stride_xm, stride_om,
        T: tl.constexpr, S: tl.constexpr, NT_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
        E: tl.constexpr, SPLIT: tl.constexpr, ENT: tl.constexpr,
        sj_ptr, sg_ptr, KMAX, COMPACT: tl.constexpr,
    ):
        # COMPACT (round-5 variant, SPLIT == 1): a prologue copies the row's kept entries, in rank order,
        # to a per-row scratch list (global column int32, value fp32), so the main loop reads E
        # contiguous entries per chunk like a plain indexed gather, without the per-chunk tile lookup.
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        x = tl.load(x_ptr + row * stride_xm + offs_d, mask=d_ok, other=0.0).to(tl.float32)  # [BD]

        tiles = tl.arange(0, NT_PAD)
        cnt = tl.load(cnt_ptr + row * NT + tiles, mask=tiles < NT, other=0)  # [NT_PAD]
        ovf = cnt > S
        sc = tl.where(ovf, 0, cnt)  # entries to read from slots
        cum = tl.cumsum(sc, 0)  # [NT_PAD] inclusive end of each tile's entries
        start = cum - sc
        K = tl.sum(sc, 0)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        lane = tl.arange(0, E)
        step = E * SPLIT
        # (col, val) of the first chunk; inside the loop the next chunk's pair is fetched while the
        # current chunk's weight rows are in flight (one memory latency per chunk instead of two)
        if COMPACT:
            _k2_compact_row(col_ptr, val_ptr, sj_ptr, sg_ptr, row, NT, KMAX, sc, start, tiles, T, S, ENT)
            tl.debug_barrier()  # the scratch stores of all threads are visible to the loads below
            j, g, p_ok = _k2_list(sj_ptr, sg_ptr, row * KMAX, split * E + lane, K)
        else:
            j, g, p_ok = _k2_entries(col_ptr, val_ptr, row, NT, S, split * E + lane, K, cum, start, tiles, T, ENT)
        for k0 in range(split * E, K, step):
            m2 = p_ok[:, None] & d_ok[None, :]
            wu = tl.load(wu_ptr + j[:, None] * D + offs_d[None, :], mask=m2, other=0.0)  # [E, BD]
            wd = tl.load(wdt_ptr + j[:, None] * D + offs_d[None, :], mask=m2, other=0.0)  # [E, BD]
            if COMPACT:
                jn, gn, pn_ok = _k2_list(sj_ptr, sg_ptr, row * KMAX, k0 + step + lane, K)
            else:
                jn, gn, pn_ok = _k2_entries(
                    col_ptr, val_ptr, row, NT, S, k0 + step + lane, K, cum, start, tiles, T, ENT)
            h = g * tl.sum(wu.to(tl.float32) * x[None, :], 1)  # [E] never leaves registers
            acc += tl.sum(h[:, None] * wd.to(tl.float32), 0)
            j, g, p_ok = jn, gn, pn_ok

        n_ovf = tl.sum(ovf.to(tl.int32), 0)
        if n_ovf > 0:  # lossless path: recompute overflowed tiles densely (rare by design)
            for tt in range(split, NT, SPLIT):
                ct = tl.load(cnt_ptr + row * NT + tt)
                if ct > S:
                    for c in range(0, T, E):
                        jj = tt * T + c + lane  # [E]
                        j_ok = jj < F
                        m2 = j_ok[:, None] & d_ok[None, :]
                        rows = jj.to(tl.int64)[:, None] * D + offs_d[None, :]
                        wg = tl.load(wg_ptr + rows, mask=m2, other=0.0)  # [E, BD]
                        wu = tl.load(wu_ptr + rows, mask=m2, other=0.0)
                        wd = tl.load(wdt_ptr + rows, mask=m2, other=0.0)
                        g = tl.maximum(tl.sum(wg.to(tl.float32) * x[None, :], 1), 0.0)
                        h = g * tl.sum(wu.to(tl.float32) * x[None, :], 1)  # [E]
                        acc += tl.sum(h[:, None] * wd.to(tl.float32), 0)

        out_ptrs = out_ptr + row * stride_om + offs_d
        if SPLIT > 1:
            tl.atomic_add(out_ptrs, acc, mask=d_ok)
        else:
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=d_ok)

    @triton.jit
    def _k2_dec_chunked(
        x_ptr, cnt_ptr, col_ptr, val_ptr, wu_ptr, wdt_ptr, out_ptr, hs_ptr, js_ptr,
        D, NT, KMAX, stride_xm, stride_om,
        T: tl.constexpr, S: tl.constexpr, NT_PAD: tl.constexpr, BD: tl.constexpr, E: tl.constexpr,
        SPLIT: tl.constexpr, ENT: tl.constexpr,
    ):
        """K2 for decode at any d (updown_decode_chunked): nothing of length d stays in registers.

        Program (row, split) takes the row's entries of rank split * E + lane + k * E * SPLIT. Pass 1:
        u = W_up[j] . x over d in BD chunks, h = relu(g) * u, stored with j to the row's scratch (hs, js:
        [M, KMAX], rank order). Pass 2: for each BD chunk of d, sum over the program's entries of
        h * W_down^T[j, chunk], one fp32 atomic add per chunk. W_up and W_down^T rows are read once; x and
        the scratch come back from L2. Slots must hold every entry (S >= T: decode tiles cannot overflow)."""
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        tiles = tl.arange(0, NT_PAD)
        cnt = tl.load(cnt_ptr + row * NT + tiles, mask=tiles < NT, other=0)  # [NT_PAD]
        cum = tl.cumsum(cnt, 0)
        start = cum - cnt
        K = tl.sum(cnt, 0)
        lane = tl.arange(0, E)
        step = E * SPLIT
        offs = tl.arange(0, BD)
        for k0 in range(split * E, K, step):  # pass 1: h of this program's entries
            j, g, p_ok = _k2_entries(col_ptr, val_ptr, row, NT, S, k0 + lane, K, cum, start, tiles, T, ENT)
            u = tl.zeros([E], dtype=tl.float32)
            for d0 in range(0, D, BD):
                d_ok = d0 + offs < D
                xc = tl.load(x_ptr + row * stride_xm + d0 + offs, mask=d_ok, other=0.0).to(tl.float32)  # [BD]
                wu = tl.load(wu_ptr + j[:, None] * D + (d0 + offs)[None, :], mask=p_ok[:, None] & d_ok[None, :],
                             other=0.0)  # [E, BD]
                u += tl.sum(wu.to(tl.float32) * xc[None, :], 1)
            tl.store(hs_ptr + row * KMAX + k0 + lane, g * u, mask=p_ok)
            tl.store(js_ptr + row * KMAX + k0 + lane, j.to(tl.int32), mask=p_ok)
        tl.debug_barrier()  # the scratch stores of all threads are visible to the loads below
        if split * E < K:  # pass 2 (a program without entries adds nothing)
            for d0 in range(0, D, BD):
                d_ok = d0 + offs < D
                acc = tl.zeros([BD], dtype=tl.float32)
                for k0 in range(split * E, K, step):
                    p = k0 + lane
                    p_ok = p < K
                    h = tl.load(hs_ptr + row * KMAX + p, mask=p_ok, other=0.0)  # [E]
                    j = tl.load(js_ptr + row * KMAX + p, mask=p_ok, other=0).to(tl.int64)
                    wd = tl.load(wdt_ptr + j[:, None] * D + (d0 + offs)[None, :],
                                 mask=p_ok[:, None] & d_ok[None, :], other=0.0)  # [E, BD]
                    acc += tl.sum(h[:, None] * wd.to(tl.float32), 0)
                tl.atomic_add(out_ptr + row * stride_om + d0 + offs, acc, mask=d_ok)

    # ------------------------------------------------------------------ decode (M <= DECODE_MAX_M)
    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr):
        if IEEE:  # fp32 inputs: true fp32 products (tf32 would lose 13 bits)
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _dec_rows_dot(x_ptrs, w_ptrs, w_ok, m_ok, offs_k, D, BLOCK_M: tl.constexpr, E: tl.constexpr,
                      BK: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr):
        """x [BM, d] @ W[E rows, d]^T -> [BM, E] fp32, over d in BK blocks; w_ptrs [BK, E] point at the
        rows' first block. Rows where w_ok is false are never loaded (predicated off: no bytes move)."""
        acc = tl.zeros([BLOCK_M, E], dtype=tl.float32)
        for k in range(0, tl.cdiv(D, BK)):
            if EVEN_D:
                xk = tl.load(x_ptrs + k * BK, mask=m_ok[:, None], other=0.0)  # [BM, BK]
                wk = tl.load(w_ptrs + k * BK, mask=w_ok[None, :], other=0.0)  # [BK, E]
            else:
                k_ok = offs_k < D - k * BK
                xk = tl.load(x_ptrs + k * BK, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                wk = tl.load(w_ptrs + k * BK, mask=k_ok[:, None] & w_ok[None, :], other=0.0)
            acc = _dot(xk, wk, acc, IEEE)
        return acc

    @triton.jit
    def _dec_gate_up(
        x_ptr, wg_ptr, wu_ptr, g_ptr, h_ptr,
        M, F, D, stride_xm, stride_wg, stride_wu, stride_gm, stride_hm,
        BLOCK_M: tl.constexpr, E: tl.constexpr, BK: tl.constexpr, GATE_IN: tl.constexpr,
        EVEN_D: tl.constexpr, IEEE: tl.constexpr,
    ):
        """Decode phase A: neurons [pid * E, pid * E + E) for all M rows at once.

        g = x @ W_gate[chunk]^T [BM, E] (or read from g_ptr when GATE_IN: a cuBLAS gate); a neuron is
        active when any row has g > 0; u = x @ W_up[chunk]^T loads W_up rows of active neurons only
        (masked-off rows are predicated loads: no bytes move); h = relu(g) * u -> h_ptr [M, F]
        (x's dtype, every (row < M, neuron < F) written, zeros included). Rows >= M are padding for
        tl.dot (x loads masked to 0)."""
        pid = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        offs_e = pid * E + tl.arange(0, E)  # [E] neurons of this program
        offs_k = tl.arange(0, BK)
        m_ok = offs_m < M
        e_ok = offs_e < F
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
        rows_e = offs_e.to(tl.int64)[None, :]  # [1, E]
        if GATE_IN:
            g = tl.load(g_ptr + offs_m[:, None] * stride_gm + offs_e[None, :],
                        mask=m_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)  # [BM, E]
        else:
            g = _dec_rows_dot(x_ptrs, wg_ptr + rows_e * stride_wg + offs_k[:, None], e_ok, m_ok, offs_k, D,
                              BLOCK_M, E, BK, EVEN_D, IEEE)
        act = (tl.max(((g > 0) & m_ok[:, None]).to(tl.int32), 0) > 0) & e_ok  # [E] any row positive
        u = tl.zeros([BLOCK_M, E], dtype=tl.float32)
        if tl.sum(act.to(tl.int32), 0) > 0:  # a chunk with no active neuron reads no W_up at all
            u = _dec_rows_dot(x_ptrs, wu_ptr + rows_e * stride_wu + offs_k[:, None], act, m_ok, offs_k, D,
                              BLOCK_M, E, BK, EVEN_D, IEEE)
        h = tl.maximum(g, 0.0) * u  # [BM, E] fp32, rounded once to x's dtype below
        tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_e[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & e_ok[None, :])

    @triton.jit
    def _dec_down(
        h_ptr, wdt_ptr, out_ptr, M, F, D, F_PER, stride_hm, stride_wd, stride_om, stride_os,
        BLOCK_M: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr,
    ):
        """Decode phase B: out[:, d block] (+)= h[:, F range] @ W_down^T[F range, d block].

        Program (pid_d, pid_s) walks neurons [pid_s * F_PER, +F_PER) (F_PER a multiple of BF) in chunks
        of BF; a W_down^T row is loaded only if some row of h is non-zero at that neuron. Writes fp32
        partial sums to out_ptr + pid_s * stride_os (summed by _dec_sum), or, with one split, the
        output in its dtype."""
        pid_d = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = pid_d * BD + tl.arange(0, BD)  # [BD]
        m_ok = offs_m < M
        d_ok = offs_d < D
        acc = tl.zeros([BLOCK_M, BD], dtype=tl.float32)
        f0 = pid_s * F_PER
        for f in range(f0, tl.minimum(f0 + F_PER, F), BF):
            offs_f = f + tl.arange(0, BF)  # [BF]
            f_ok = offs_f < F
            h = tl.load(h_ptr + offs_m[:, None] * stride_hm + offs_f[None, :],
                        mask=m_ok[:, None] & f_ok[None, :], other=0.0)  # [BM, BF]
            live = tl.max((h != 0).to(tl.int32), 0) > 0  # [BF] neurons with a non-zero h in some row
            wd = tl.load(wdt_ptr + offs_f.to(tl.int64)[:, None] * stride_wd + offs_d[None, :],
                         mask=live[:, None] & d_ok[None, :], other=0.0)  # [BF, BD]
            acc = _dot(h, wd, acc, IEEE)
        ptrs = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_d[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _dec_sum(part_ptr, out_ptr, D, SPLIT, stride_ps, stride_pm, stride_om, BLOCK: tl.constexpr):
        """out[row, block] = sum over the SPLIT fp32 partials, in split order (deterministic)."""
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < D
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(0, SPLIT):
            acc += tl.load(part_ptr + s * stride_ps + row * stride_pm + offs, mask=ok, other=0.0)
        tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: use backend='dense' (or install triton>=3.6).")


ENT_CODES = {"split": 0, "bf16": 1, "fp16": 2}
# What twell_ffn_triton runs for M > DECODE_ROUTE_M (decode_ffn up to that): a K1 then K2 reading per-row
# compacted entry lists. "r6c" (the default): the round-6 K1 (_k1_r6: TMA, 128 x 256 tiles, slot-major
# epilogue) where it applies (bf16/fp16, 16-byte aligned, M > 16), else the round-5 K1; "r5c": the
# round-5 K1 (_k1_gate_pack, autotuned on CUDA for M > 16) everywhere, which is what r6c falls back to.
# Compaction needs an [M, n_tiles * S] scratch list per call (int32 + fp32; 134 MB at M = 16384,
# F = 8192) from torch's caching allocator. Removed variants (r4, r5tma, and r5 / r6 without compaction)
# and their measurements: kernels/NOTES.md, "Variants removed".
VARIANTS = ("r6c", "r5c")
DEFAULT_VARIANT = "r6c"


def split_variant(variant: str) -> tuple[str, bool]:
    """(K1 variant for gate_pack, whether K2 reads compacted lists) of a twell_ffn_triton variant."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not one of {VARIANTS}")
    return variant[:2], True


def default_entries(dtype: torch.dtype) -> str:
    """Slot encoding: one packed word per entry for 16-bit inputs, split col/val otherwise (fp32)."""
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16" if dtype == torch.bfloat16 else "fp16"
    return "split"


def k1_config(m: int, d: int) -> dict:
    """Block sizes for K1 by token count (decode uses narrow tiles so F/32 programs fill the GPU)."""
    if m <= 16:
        return dict(BLOCK_M=16, T=DECODE_TILE, S=DECODE_SLOTS, BLOCK_K=128, num_warps=4, num_stages=4)
    if m <= 128:
        return dict(BLOCK_M=64, T=TILE, S=SLOTS, BLOCK_K=64, num_warps=4, num_stages=4)
    # round-2 sweep (H200, M = 16384, 99% skewed): 64/64/4 warps/4 stages 1.66 ms (d 2048) and 5.11 ms
    # (d 4096) against 1.87 / 5.52 ms for 128/64/8 warps/3 stages
    return dict(BLOCK_M=64, T=TILE, S=SLOTS, BLOCK_K=64, num_warps=4, num_stages=4)


# Round 5: K1 for M > 16 is autotuned on the GPU over these (keyed on d, F and the M bucket). The
# round-4 default is first; the others trade tile height (epilogue work per W_gate tile load),
# K depth and pipelining. 16/32-row tiles only matter for small prefill buckets.
K1_TUNE = [
    (64, 64, 4, 4), (128, 64, 8, 3), (128, 64, 4, 4), (64, 128, 4, 3), (128, 32, 8, 4), (32, 128, 4, 4),
]  # (BLOCK_M, BLOCK_K, num_warps, num_stages)


def _even_k(a) -> bool:
    return a["D"] % a["BLOCK_K"] == 0


def _even_mn(a) -> bool:
    return a["M"] % a["BLOCK_M"] == 0 and a["F"] % a["T"] == 0


_k1_tuned = None


def _tma_blocks(nargs) -> None:
    """Autotune pre-hook: give the descriptors the block shapes of the config being run."""
    nargs["x_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["wg_desc"].block_shape = [TILE, nargs["BLOCK_K"]]


def _tma_ok(x2d: torch.Tensor, w_gate: torch.Tensor) -> bool:
    """Descriptors need 16-byte aligned bases and row strides."""
    return TensorDescriptor is not None and all(
        t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (x2d, w_gate))


def _k1_autotuned():
    """The autotuned K1 (built lazily: triton.autotune benchmarks on the GPU, never in the interpreter)."""
    global _k1_tuned
    if _k1_tuned is None:
        configs = [triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=w, num_stages=st)
                   for bm, bk, w, st in K1_TUNE]
        heur = triton.heuristics({"EVEN_K": _even_k, "EVEN_MN": _even_mn})(_k1_gate_pack)
        _k1_tuned = triton.autotune(configs=configs, key=["D", "F", "MB"])(heur)
    return _k1_tuned


def gate_pack(
    x2d: torch.Tensor, w_gate: torch.Tensor, *, entries: str | None = None, variant: str = "r5",
    autotune: bool | None = None, **overrides,
) -> TwellPacked:
    """K1: relu(x2d @ w_gate.T) packed as TwELL. x2d [M, d] row-contiguous, w_gate [F, d] contiguous.

    entries: slot encoding ("split", "bf16", "fp16"; default from the dtype). variant "r5" runs
    _k1_gate_pack, autotuned on CUDA for M > 16 unless block sizes are given in `overrides`; "r6" runs
    _k1_r6 (autotuned over R6_TUNE; overrides: R6_DEFAULT keys) where its conditions hold (16-bit inputs
    with packed entries, M > 16, TMA-aligned tensors), else r5. autotune=True forces the autotuned
    launch (tests drive it in the interpreter with a stand-in benchmark).
    """
    if variant not in ("r5", "r6"):
        raise ValueError(f"variant={variant!r} is not 'r5' or 'r6'")
    _require_triton()
    m, d = x2d.shape
    f = w_gate.shape[0]
    entries = entries or default_entries(x2d.dtype)
    cfg = {**k1_config(m, d), **overrides}
    # r6 needs 16-bit inputs with packed entries, prefill tiles and TMA-aligned tensors; otherwise r5 runs
    if (variant == "r6" and x2d.dtype in (torch.bfloat16, torch.float16) and entries != "split"
            and cfg["T"] == TILE and _tma_ok(x2d, w_gate)):
        nt = n_tiles(f, TILE)
        cnt = torch.empty(m, nt, dtype=torch.int32, device=x2d.device)  # [M, NT]
        ent = torch.empty(m, nt, SLOTS, dtype=torch.int32, device=x2d.device)  # [M, NT, S] packed words
        _gate_pack_r6(x2d, w_gate, cnt, ent, entries, overrides, autotune)
        return TwellPacked(cnt=cnt, col=None, val=None, tile=TILE, n_cols=f, ent=ent, entries=entries)
    tuned = (x2d.is_cuda and m > 16 and cfg["T"] == TILE
             and not {"BLOCK_M", "BLOCK_K", "num_warps", "num_stages"} & overrides.keys())
    tuned = tuned if autotune is None else autotune
    if x2d.device.type == "cpu":  # interpreter: few large blocks run fastest
        cfg["BLOCK_K"] = max(cfg["BLOCK_K"], min(128, _next_pow2(d)))
    t, s = cfg["T"], cfg["S"]
    nt = n_tiles(f, t)
    cnt = torch.empty(m, nt, dtype=torch.int32, device=x2d.device)  # [M, NT]
    col = torch.empty(m, nt, s, dtype=torch.int32, device=x2d.device)  # [M, NT, S] col or packed word
    val = torch.empty(m, nt, s, dtype=torch.float32, device=x2d.device) if entries == "split" else cnt
    args = (x2d, w_gate, cnt, col, val, m, f, d, nt, x2d.stride(0), w_gate.stride(0))
    # MB keys the autotuner (a constant otherwise, so it never causes a recompilation)
    common = dict(T=t, S=s, MB=min(_next_pow2(m), 1 << 16) if tuned else 16, GROUP_M=8, IEEE=(x2d.dtype == torch.float32),
                  ENT=ENT_CODES[entries], PACK=int(cfg.get("PACK", 1)))
    if tuned:
        _k1_autotuned()[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * nt,)](*args, **common)
    else:
        bm, bk = cfg["BLOCK_M"], cfg["BLOCK_K"]
        _k1_gate_pack[(triton.cdiv(m, bm) * nt,)](
            *args, BLOCK_M=bm, BLOCK_K=bk, **common, EVEN_K=(d % bk == 0), EVEN_MN=(m % bm == 0 and f % t == 0),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    if entries == "split":
        return TwellPacked(cnt=cnt, col=col, val=val, tile=t, n_cols=f)
    return TwellPacked(cnt=cnt, col=None, val=None, tile=t, n_cols=f, ent=col, entries=entries)


# Round 6 (eval/results/kernels-h200-r6/k1-sweep-{2,3}.md): the fastest K1 at M = 16384 in all four target
# cases was 128 x 256 GEMM tiles (NSUB 2), 8 warps, 4 stages, the rank-2 epilogue (1.25-1.47x the cuBLAS
# gate GEMM over two sweeps, 255 registers, no spills; round 5's best K1 was 1.65-1.91x). R6_TUNE adds shapes for smaller M
# (fewer, smaller programs) that the autotuner picks per (d, F, M bucket).
R6_DEFAULT = dict(BLOCK_M=128, BLOCK_K=64, NSUB=2, num_warps=8, num_stages=4, RANK=2, PERSIST=0, FLATTEN=False)
R6_TUNE = [(128, 64, 2, 8, 4), (128, 64, 2, 8, 3), (128, 128, 1, 8, 3), (64, 64, 1, 4, 4), (64, 128, 1, 4, 3)]
_R6_BLOCKS = {"BLOCK_M", "BLOCK_K", "NSUB", "num_warps", "num_stages", "RANK", "PERSIST", "FLATTEN"}
_k1_r6_tuned = None


def _k1_r6_autotuned():
    global _k1_r6_tuned
    if _k1_r6_tuned is None:
        configs = [triton.Config({"BLOCK_M": bm, "BLOCK_K": bk, "NSUB": nsub}, num_warps=w, num_stages=st,
                                 pre_hook=_tma_blocks) for bm, bk, nsub, w, st in R6_TUNE]
        _k1_r6_tuned = triton.autotune(configs=configs, key=["D", "F", "MB"])(_k1_r6)
    return _k1_r6_tuned


def _gate_pack_r6(x2d, w_gate, cnt, ent, entries, overrides: dict, autotune: bool | None = None):
    """Launch the round-6 K1 (_k1_r6) into cnt [M, NT] / ent [M, NT, S]. Autotuned over R6_TUNE on CUDA
    unless `overrides` sets block keys (R6_DEFAULT fills the rest; autotune=True/False forces either);
    PERSIST = n > 0 runs n programs per SM (2 stand-in SMs in the interpreter), each looping over output
    tiles. Returns Triton's launch result (on GPU the compiled kernel: the sweep reads its registers and
    spills)."""
    m, d = x2d.shape
    f = w_gate.shape[0]
    nt = cnt.shape[1]
    common = dict(T=TILE, S=SLOTS, GROUP_M=8, ENT=ENT_CODES[entries], PACK=int(overrides.get("PACK", 1)),
                  HW=x2d.is_cuda)
    if autotune or (autotune is None and x2d.is_cuda and not _R6_BLOCKS & overrides.keys()):
        descs = (TensorDescriptor.from_tensor(x2d, [64, 64]), TensorDescriptor.from_tensor(w_gate, [TILE, 64]))
        return _k1_r6_autotuned()[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(nt, meta["NSUB"]),)](
            *descs, cnt, ent, m, f, d, nt, MB=min(_next_pow2(m), 1 << 16), RANK=R6_DEFAULT["RANK"],
            FLATTEN=False, **common)
    cfg = {**R6_DEFAULT, **overrides}
    bm, bk, nsub = cfg["BLOCK_M"], cfg["BLOCK_K"], cfg["NSUB"]
    progs = triton.cdiv(m, bm) * triton.cdiv(nt, nsub)
    if cfg["PERSIST"]:
        sms = torch.cuda.get_device_properties(x2d.device).multi_processor_count if x2d.is_cuda else 2
        progs = min(progs, sms * int(cfg["PERSIST"]))
    descs = (TensorDescriptor.from_tensor(x2d, [bm, bk]), TensorDescriptor.from_tensor(w_gate, [TILE, bk]))
    return _k1_r6[(progs,)](
        *descs, cnt, ent, m, f, d, nt, BLOCK_M=bm, BLOCK_K=bk, MB=16, NSUB=nsub, RANK=int(cfg["RANK"]),
        FLATTEN=bool(cfg["FLATTEN"]), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **common)


def k1_best_config(d: int, f: int, m: int, variant: str = "r5") -> dict | None:
    """The autotuner's pick for (d, F, M bucket), if it has tuned that key (for the benchmark log)."""
    tuner = _k1_r6_tuned if variant == "r6" else _k1_tuned
    if tuner is None:
        return None
    for key, cfg in tuner.cache.items():
        if tuple(key[:3]) == (d, f, min(_next_pow2(m), 1 << 16)):
            return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return None


def k2_config(m: int, d: int) -> dict:
    """E rows per gather chunk, warps, and decode split.

    Round-1 sweep (H200, M = 16384, 99% skewed, eval/results/kernels-h200-r1.json): at d = 2048,
    E = 4 / 4 warps took 2.57 ms against 4.49 ms for E = 8 / 8 warps; at d = 4096, E = 4 with 4 or 8
    warps were best (8.34 / 8.38 ms), larger E was slower (register pressure).
    """
    bd = _next_pow2(d)
    e = 8 if bd <= 1024 else 4
    warps = 4
    split = 1
    if m <= K2_SPLIT_MAX_M:  # decode: spread each row's entries over programs so more SMs pull rows
        split = max(2, min(64, 256 // max(m, 1)))
    return dict(E=e, num_warps=warps, SPLIT=split)


def _slot_ptrs(packed: TwellPacked) -> tuple[torch.Tensor, torch.Tensor]:
    """K2's (col_ptr, val_ptr): the packed words and a placeholder, or the split col / val tensors."""
    return (packed.col, packed.val) if packed.entries == "split" else (packed.ent, packed.cnt)


def updown(
    x2d: torch.Tensor, packed: TwellPacked, w_gate: torch.Tensor, w_up: torch.Tensor,
    w_down_t: torch.Tensor, *, compact: bool = False, chunked: bool | None = None, **overrides,
) -> torch.Tensor:
    """K2: (unpack(packed) * (x2d @ w_up.T)) @ w_down_t -> [M, d] in x2d's dtype. w_down_t is [F, d].

    compact=True (variants r6c / r5c; ignored when K2 splits rows, M <= 16): per-row compacted entry
    lists before the gather loop. chunked: when K2 splits rows, run updown_decode_chunked (True), the
    split _k2_updown (False), or choose by M and d (None: chunked at M <= DECODE_CHUNKED_MAX_M, and at
    any decode M from d = DECODE_CHUNKED_MIN_D on, unless block overrides are given)."""
    _require_triton()
    m, d = x2d.shape
    f = w_up.shape[0]
    cfg = {**k2_config(m, d), **overrides}
    split = cfg["SPLIT"]
    if chunked is None:
        chunked = split > 1 and (m <= DECODE_CHUNKED_MAX_M or d >= DECODE_CHUNKED_MIN_D) and not overrides
    if chunked and split > 1 and _chunked_ok(x2d, packed, w_up, w_down_t):
        return updown_decode_chunked(x2d, packed, w_up, w_down_t)  # (DECODE_CHUNKED_MIN_D says why)
    nt = packed.n_tiles
    out = torch.zeros(m, d, dtype=torch.float32, device=x2d.device) if split > 1 else (
        torch.empty(m, d, dtype=x2d.dtype, device=x2d.device))
    extra = dict(sj_ptr=packed.cnt, sg_ptr=packed.cnt, KMAX=0, COMPACT=False)  # unused placeholders
    if compact and split == 1:  # scratch lists [M, NT * S]: only the kept entries are written
        kmax = nt * packed.slots
        extra = dict(sj_ptr=torch.empty(m, kmax, dtype=torch.int32, device=x2d.device),
                     sg_ptr=torch.empty(m, kmax, dtype=torch.float32, device=x2d.device),
                     KMAX=kmax, COMPACT=True)
    _k2_updown[(m, split)](
        x2d, packed.cnt, *_slot_ptrs(packed), w_gate, w_up, w_down_t, out,
        d, f, nt, x2d.stride(0), out.stride(0),
        T=packed.tile, S=packed.slots, NT_PAD=_next_pow2(nt), BLOCK_D=_next_pow2(d),
        E=cfg["E"], SPLIT=split, ENT=ENT_CODES[packed.entries], num_warps=cfg["num_warps"], **extra,
    )
    return out.to(x2d.dtype) if split > 1 else out


def _chunked_ok(x2d: torch.Tensor, packed: TwellPacked, w_up: torch.Tensor, w_down_t: torch.Tensor) -> bool:
    """updown_decode_chunked's preconditions: tiles that cannot overflow, row-contiguous tensors."""
    d = x2d.shape[1]
    return (packed.slots >= packed.tile and x2d.stride(-1) == 1
            and all(t.stride(-1) == 1 and t.stride(0) == d for t in (w_up, w_down_t)))


def updown_decode_chunked(
    x2d: torch.Tensor, packed: TwellPacked, w_up: torch.Tensor, w_down_t: torch.Tensor, *,
    E: int = 8, BD: int = 1024, SPLIT: int | None = None, num_warps: int = 4,
) -> torch.Tensor:
    """K2 for decode without the d-length registers of `updown`'s split path (_k2_dec_chunked), which
    spills at d = 8192 (kernels/NOTES.md): -> [M, d] in x2d's dtype. `updown` routes decode K2 here at
    M = 1 and from d = DECODE_CHUNKED_MIN_D on (DECODE_CHUNKED_MAX_M says why; E = 8 from the same sweep).
    SPLIT (programs per row) defaults to about four programs per SM over the M rows, at most 512. packed
    must hold every entry (decode tiles: S >= T)."""
    _require_triton()
    m, d = x2d.shape
    if packed.slots < packed.tile:
        raise ValueError(f"updown_decode_chunked needs tiles that cannot overflow (S >= T); got T={packed.tile}, "
                         f"S={packed.slots}: use updown")
    for name, t in (("x2d", x2d), ("w_up", w_up), ("w_down_t", w_down_t)):
        if t.stride(-1) != 1 or (t is not x2d and t.stride(0) != d):
            raise ValueError(f"{name} must be contiguous [.., {d}] (strides {tuple(t.stride())})")
    nt = packed.n_tiles
    kmax = nt * packed.slots
    split = SPLIT or max(1, min(512, -(-4 * _sm_count(x2d.device) // m)))
    out = torch.zeros(m, d, dtype=torch.float32, device=x2d.device)
    hs = torch.empty(m, kmax, dtype=torch.float32, device=x2d.device)  # [M, KMAX] h of each entry
    js = torch.empty(m, kmax, dtype=torch.int32, device=x2d.device)  # [M, KMAX] its neuron
    _k2_dec_chunked[(m, split)](
        x2d, packed.cnt, *_slot_ptrs(packed), w_up, w_down_t, out, hs, js,
        d, nt, kmax, x2d.stride(0), out.stride(0),
        T=packed.tile, S=packed.slots, NT_PAD=_next_pow2(nt), BD=min(BD, _next_pow2(d)), E=E, SPLIT=split,
        ENT=ENT_CODES[packed.entries], num_warps=num_warps,
    )
    return out.to(x2d.dtype)


# ---------------------------------------------------------------------------------------- decode
# Decode (M <= DECODE_MAX_M rows): two Triton phases that share every weight row across the M rows.
#   phase A (_dec_gate_up), grid cdiv(F, E): g = x W_gate[chunk]^T, neuron active if g > 0 in any row,
#     u = x W_up[chunk]^T over active neurons only, h = relu(g) * u -> [M, F] in x's dtype (the dense
#     path rounds h to that dtype too).
#   phase B (_dec_down), grid cdiv(d, BD) x SPLIT: out[:, d block] = sum over F of h[:, f] W_down^T[f],
#     W_down^T rows loaded only where some row of h is non-zero; SPLIT > 1 writes fp32 partials that
#     _dec_sum adds up in a fixed order (deterministic, no atomics, no zero-fill) and casts.
# Bytes (b = bytes per weight element, U = neurons active in some row, n_d = cdiv(d, BD)):
#   dense:   3 F d b (every weight once).
#   phase A: F d b (W_gate, HBM) + U d b (W_up, HBM) + cdiv(F, E) M d b per loop (x, from L2)
#            + M F b (h written).
#   phase B: U d b (W_down^T, HBM) + n_d M F b (h re-read per d block, L2) + SPLIT M d 4 (partials, L2).
#   So at 90% zeros and M = 1 (U ~ F / 10): 1.2 F d b against dense's 3 F d b; U grows with M (the
#   union of the rows' active sets) and with it both gathers; x and h traffic stays in L2.
# Lossless by construction: no slots, nothing to overflow (a row with every neuron active reads every
# W_up / W_down^T row, like dense). No host synchronisation, no data-dependent host control flow:
# capturable in CUDA graphs. Why not the prefill K2 at decode: one program per (row, split) holds the
# x row, an fp32 output row and [E, next_pow2(d)] weight chunks in 128 threads' registers; at d = 8192
# that is ~640 fp32 values per thread: the sm_90 cubin of _k2_updown spills (7.3 KB stack frame,
# 15.7 KB of spill stores; `python eval/bench_decode.py --compile-report`), and each of the M rows
# gathers its own copy of a shared neuron's rows.
DECODE_MAX_M = 32
# Up to this M twell_ffn_triton (and auto's twell path) run decode_ffn; above it K1 + K2. 0: decode_ffn is
# not routed. On the H200 (eval/results/generate-h200/decode/, CUDA graphs, skewed, bf16) decode_ffn ran at
# 0.71-0.97x of dense at every shape, M = 1..32 and 85-99% zeros, where the K1 + K2 decode path (32-column
# tiles, split K2) had measured 1.6-2.1x at M = 1 on 2048x8192 and 4096x14336: the older path stays.
DECODE_ROUTE_M = 0
# Where a decode K2 (updown's split path, M <= 16) runs updown_decode_chunked instead of _k2_updown: at
# M <= DECODE_CHUNKED_MAX_M at every d, and at every decode M from d = DECODE_CHUNKED_MIN_D on.
# _k2_updown holds the x row and an fp32 output row of length d in registers: its sm_90 build spills at
# d = 8192 (255 registers, 1052 B of spill stores), where it ran 0.42x of dense on the H200 (M = 1, 90%
# zeros), 0.12x at M = 8. The chunked K2 keeps nothing of length d in registers (56, no spills at
# 8192 x 28672; eval/results/decode-compile-sm90/). Timed on the H200 (eval/results/generate-h200/chunked/,
# 90% zeros, skewed, CUDA graphs), K1 + chunked K2 with E = 8 over dense, against K1 + the split K2:
#   M = 1:  8192 x 28672 1.72x vs 0.42x, 4096 x 14336 1.78x vs 1.65x, 2048 x 8192 1.82x vs 1.65x;
#   M = 8:  8192 x 28672 0.90x vs 0.12x, 4096 x 14336 1.15x vs 1.19x, 2048 x 8192 1.10x vs 1.11x.
# So chunked wherever the split K2 spills, and at M = 1; at M = 8 below d = 8192 the two tie and the split
# K2 stays. "auto" times the whole twell path against dense per layer anyway (dense where twell loses).
DECODE_CHUNKED_MAX_M = 1
DECODE_CHUNKED_MIN_D = 8192
K2_SPLIT_MAX_M = 16  # up to this M, K2 splits each row over programs (k2_config) and may run chunked


def k2_spills(m: int, d: int) -> bool:
    """Whether K2 at this M and d is the one-program-per-row _k2_updown at a d where it spills (the chunked
    K2 serves decode M only): on the H200 it took 79.5 ms against dense's 0.35 ms at 8192 x 28672, M = 32,
    90% zeros (eval/results/generate-h200/chunked/grid/). "auto" gives such buckets to dense untimed."""
    return m > K2_SPLIT_MAX_M and d >= DECODE_CHUNKED_MIN_D


_SMS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 132 (the H200) elsewhere, so CPU runs pick the
    same configs as the GPU."""
    if device.type != "cuda":
        return 132
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


def decode_config(m: int, d: int, f: int, sms: int = 132, elem: int = 2) -> dict:
    """Block sizes of the decode phases for M rows, hidden d, intermediate F, `sms` SMs, `elem`-byte weights.

    Phase A: E neurons per program, the largest of 128/64/32/16 that still gives >= 3 programs per SM
    (enough loads in flight to stream W_gate at HBM speed: 8192x28672 -> E 64, 448 programs; 4096x14336
    -> 32, 448; 2048x8192 -> 16, 512), but E >= M, so the x rows each program re-reads from L2 are at
    most its own weight bytes (M = 32 at 2048x8192 -> E 32, 256 programs). BK keeps one stage's weight
    tile at 8-16 KB (E x BK x b: 64 x 128, or 16/32 x 256); stages fill ~96 KB of shared memory (two
    programs per SM). BLOCK_M = 16 (tl.dot's minimum) up to M = 16, else 32.
    Phase B: BD = 128 output columns (a neuron's W_down^T row segment is 256 contiguous bytes in bf16),
    BF = 64 neurons per chunk (a 16 KB tile); SPLIT splits F so that cdiv(d, BD) x SPLIT fills ~4
    programs per SM (8192 -> 64 x 9, 2048 -> 16 x 32), with SPLIT x M <= 256 (the fp32 partials, written
    and re-read through L2, stay <= 1 KB per output column: 8 MB at d = 8192) and >= 1 chunk per split.
    These are reasoned, not swept: `eval/bench_decode.py --sweep` times alternatives on the H200.
    """
    bm = 16 if m <= 16 else 32
    e_min = max(16, _next_pow2(m))
    e = next((c for c in (128, 64, 32, 16) if c >= e_min and -(-f // c) >= 3 * sms), e_min)
    e = min(e, max(16, _next_pow2(f)))
    bk = min(128 if e >= 64 else 256, max(16, _next_pow2(d)))
    stages_a = max(2, min(4, (96 << 10) // ((e + bm) * bk * elem)))
    bd = min(128, max(16, _next_pow2(d)))
    bf = min(64, max(16, _next_pow2(f)))
    n_d = -(-d // bd)
    split = max(1, min(-(-4 * sms // n_d), -(-f // bf), 256 // _next_pow2(m)))
    stages_b = max(2, min(4, (96 << 10) // ((bf * bd + bm * bf) * elem)))
    return dict(BLOCK_M=bm, E=e, BK=bk, warps_a=4, stages_a=stages_a,
                BD=bd, BF=bf, SPLIT=split, warps_b=4, stages_b=stages_b)


def decode_ffn(
    x2d: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor, *,
    gate: str = "fused", **overrides,
) -> torch.Tensor:
    """relu(x2d @ w_gate.T) * (x2d @ w_up.T) @ w_down_t -> [M, d] in x2d's dtype, for M <= DECODE_MAX_M.

    x2d [M, d] with unit column stride; w_gate, w_up, w_down_t [F, d] with unit column stride
    (w_down_t = transpose_down(w_down)). gate: "fused" (phase A computes the gate itself, W_gate read
    once) or "cublas" (F.linear computes it first: one more launch, phase A then reads only W_up).
    overrides: keys of decode_config. Two or three launches, no host synchronisation.
    """
    _require_triton()
    m, d = x2d.shape
    f = w_gate.shape[0]
    if not 1 <= m <= DECODE_MAX_M:
        raise ValueError(f"decode_ffn takes 1..{DECODE_MAX_M} rows, got M={m}; use twell_ffn_triton.")
    if gate not in ("fused", "cublas"):
        raise ValueError(f"gate={gate!r} is not 'fused' or 'cublas'")
    for name, t in (("x2d", x2d), ("w_gate", w_gate), ("w_up", w_up), ("w_down_t", w_down_t)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride along d (got strides {tuple(t.stride())}); pass .contiguous()")
    cfg = {**decode_config(m, d, f, _sm_count(x2d.device), w_gate.element_size()), **overrides}
    bm, e, bk = cfg["BLOCK_M"], cfg["E"], cfg["BK"]
    ieee = x2d.dtype == torch.float32
    h = torch.empty(m, f, dtype=x2d.dtype, device=x2d.device)  # [M, F]
    g = torch.nn.functional.linear(x2d, w_gate) if gate == "cublas" else h  # [M, F] (else unused)
    _dec_gate_up[(triton.cdiv(f, e),)](
        x2d, w_gate, w_up, g, h, m, f, d, x2d.stride(0), w_gate.stride(0), w_up.stride(0), g.stride(0),
        h.stride(0), BLOCK_M=bm, E=e, BK=bk, GATE_IN=gate == "cublas", EVEN_D=d % bk == 0, IEEE=ieee,
        num_warps=cfg["warps_a"], num_stages=cfg["stages_a"])
    bd, bf = cfg["BD"], cfg["BF"]
    f_per = triton.cdiv(triton.cdiv(f, cfg["SPLIT"]), bf) * bf  # neurons per split, whole chunks
    split = triton.cdiv(f, f_per)  # no empty split
    out = torch.empty(m, d, dtype=x2d.dtype, device=x2d.device)  # [M, d]
    dst = out if split == 1 else torch.empty(split, m, d, dtype=torch.float32, device=x2d.device)  # [S, M, d]
    _dec_down[(triton.cdiv(d, bd), split)](
        h, w_down_t, dst, m, f, d, f_per, h.stride(0), w_down_t.stride(0), dst.stride(-2),
        dst.stride(0) if split > 1 else 0, BLOCK_M=bm, BF=bf, BD=bd, IEEE=ieee,
        num_warps=cfg["warps_b"], num_stages=cfg["stages_b"])
    if split > 1:
        block = min(1024, _next_pow2(d))
        _dec_sum[(m, triton.cdiv(d, block))](dst, out, d, split, dst.stride(0), dst.stride(1), out.stride(0),
                                            BLOCK=block, num_warps=4)
    return out


def twell_ffn_triton(
    x2d: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor,
    variant: str = DEFAULT_VARIANT,
) -> torch.Tensor:
    """The whole sparse FFN on [M, d]: decode_ffn for M <= DECODE_ROUTE_M, else K1 (gate + pack) then K2
    (fused up/down). variant: see gate_pack (prefill only)."""
    k1, compact = split_variant(variant)
    if 0 < x2d.shape[0] <= DECODE_ROUTE_M:
        return decode_ffn(x2d, w_gate, w_up, w_down_t)
    packed = gate_pack(x2d, w_gate, variant=k1)
    return updown(x2d, packed, w_gate, w_up, w_down_t, compact=compact)
