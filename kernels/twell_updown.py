"""Triton K2 of the TwELL FFN: fused up/down reading K1's packing, and `twell_ffn_triton` (K1 then K2).

Legend: M = tokens, d = hidden size, F = intermediate size, T = tile width, S = slots per (row, tile),
NT = ceil(F / T), E = gathered rows per chunk, K = kept entries of a row.

- `_k2_updown`: one program per (row, split); x row and the fp32 output row stay in registers. It walks
  the row's kept entries E at a time, gathers W_up[j] and W_down^T[j] (both loads issued before the
  reductions), h = val * dot(x, W_up[j]) never leaves registers, out += h * W_down^T[j]. Overflowed tiles
  are recomputed densely from W_gate (lossless; with a threshold theta, HAS_THETA, g is kept where g
  rounded to x's dtype > theta_j, as K1 decides). SPLIT > 1 (decode) adds into an fp32 output with atomics.
- `_k2_dec_chunked` (decode at M = 1, and at d >= DECODE_CHUNKED_MIN_D): d in chunks through an [M, K]
  scratch, so nothing of length d stays in registers (the split `_k2_updown` spills at d = 8192). Its
  tiles cannot overflow (S >= T), so a threshold is all in K1's packing.
- `_k12_decode` (twell_ffn_decode_fused, decode rows one by one; routed at M = 1 on the FUSED_ROUTE shapes only,
  where it beat K1 + K2 on an H200): K1's GEMV and K2 in one
  launch. Program (tile, row) computes its T gate values as `_k1_gemv` does, keeps the ones K1 packs, and goes
  straight on with them (up row dot x, then h times the W_down^T row added into the fp32 output with atomics,
  as `_k2_dec_chunked` sums them) while the other tiles still stream W_gate: no packing round trip, no second
  launch waiting for the slowest tile (K2's latency was 17-27% of dense's time at M = 1, kernels/NOTES.md).
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from .registry import SLOT
from .twell_reference import TwellPacked
from .twell_triton import (ENT_CODES, DEFAULT_VARIANT, HAS_TRITON, VARIANTS, default_entries, gate_pack, next_pow2,
                           require_triton, theta_args, tl, triton)

# A decode K2 (M <= K2_SPLIT_MAX_M) runs chunked at M <= DECODE_CHUNKED_MAX_M, and at every decode M from
# d = DECODE_CHUNKED_MIN_D on, where the split _k2_updown spills (the chunked-K2 sweep, kernels/NOTES.md)
DECODE_CHUNKED_MAX_M = 1
DECODE_CHUNKED_MIN_D = 8192
K2_SPLIT_MAX_M = 16  # up to this M, K2 splits each row over programs (k2_config) and may run chunked


def decode_k2_chunked(m: int, d: int) -> bool:
    """Whether the decode K2 at this M and d is updown_decode_chunked (else the split _k2_updown)."""
    return m <= K2_SPLIT_MAX_M and (m <= DECODE_CHUNKED_MAX_M or d >= DECODE_CHUNKED_MIN_D)


def k2_spills(m: int, d: int) -> bool:
    """Whether K2 at this M and d is the one-program-per-row _k2_updown at a d where it spills (the chunked
    K2 serves decode M only; "auto" gives such buckets to dense untimed)."""
    return m > K2_SPLIT_MAX_M and d >= DECODE_CHUNKED_MIN_D


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (kept in the process registry); 132 (the H200) elsewhere, so CPU
    runs pick the same configs as the GPU."""
    if device.type != "cuda":
        return 132
    i = device.index if device.index is not None else torch.cuda.current_device()
    sms = SLOT.sms
    if i not in sms:
        sms[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return sms[i]


if HAS_TRITON:
    from .twell_triton import _active, _gemv_gate, _in_dtype, unpack_value

    @triton.jit
    def _k2_entries(col_ptr, val_ptr, row, NT, S: tl.constexpr, p, K, cum, start, tiles,
                    T: tl.constexpr, ENT: tl.constexpr):
        """Column (int64) and kept gate value of the row's entries of rank p [E]; tile found by prefix sum."""
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
            g = unpack_value(w, ENT)
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
            gg = unpack_value(w, ENT)
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
        th_ptr, HAS_THETA: tl.constexpr, RND: tl.constexpr,
    ):
        # COMPACT (what every twell_ffn_triton variant runs, SPLIT == 1): a prologue copies the row's kept entries,
        # in rank order, to a per-row scratch list (global column int32, value fp32), so the main loop reads E
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
                        g = tl.sum(wg.to(tl.float32) * x[None, :], 1)  # [E]
                        if HAS_THETA:  # K1's decision (on g in x's dtype); the fp32 value is kept, as relu keeps it
                            th = tl.load(th_ptr + jj, mask=j_ok, other=0.0)
                            g = tl.where(_in_dtype(g, RND) > th, g, 0.0)
                        else:
                            g = tl.maximum(g, 0.0)
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
        u = W_up[j] . x over d in BD chunks, h = g * u (g: the packed value), stored with j to the row's scratch (hs, js:
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


    @triton.jit
    def _k12_decode(
        x_ptr, wg_ptr, wu_ptr, wdt_ptr, th_ptr, out_ptr, F, D, stride_xm, stride_om,
        T: tl.constexpr, BLOCK_K: tl.constexpr, E: tl.constexpr, BD: tl.constexpr, EVEN_K: tl.constexpr,
        EVEN_N: tl.constexpr, HAS_THETA: tl.constexpr, RND: tl.constexpr, GQ: tl.constexpr,
    ):
        """K1 and K2 of one row in one program per (tile, row), twell_ffn_decode_fused. The gate: _gemv_gate
        (_k1_gemv's loop); kept: _active, as K1 decides; g as K2 reads it
        from K1's entries (GQ: rounded to x's dtype, as the packed words hold it). Then the tile's kept neurons,
        E at a time in rank order: u = W_up[j] . x over d in BD chunks (the chunked K2's order), h = g u, and
        out[row] += sum_e h_e W_down^T[j_e] per BD chunk (one fp32 atomic add per chunk and E neurons). A tile
        with nothing kept adds nothing."""
        pid_n = tl.program_id(0)
        row = tl.program_id(1).to(tl.int64)
        offs_n = pid_n * T + tl.arange(0, T)  # [T]
        n_ok = offs_n < F
        x_row = x_ptr + row * stride_xm
        g = _gemv_gate(x_row, wg_ptr, offs_n, n_ok, D, D, T, BLOCK_K, EVEN_K, EVEN_N)  # [T]
        offs_m = tl.arange(0, 2)
        m_ok = offs_m < 1  # (two rows, row 1 masked: no size-1 block dimension)
        act2 = _active(tl.where(m_ok[:, None], g[None, :], 0.0), th_ptr, offs_n, n_ok, HAS_THETA, RND) \
            & m_ok[:, None]
        act_i = tl.sum(act2.to(tl.int32), 0)  # [T] 0 / 1
        active = act_i > 0
        rank = tl.cumsum(act_i, 0) - 1  # [T] rank among the tile's kept neurons
        n_act = tl.sum(act_i, 0)
        gq = _in_dtype(g, GQ)  # [T] the value K2 multiplies with
        lane = tl.arange(0, E)
        offs_d = tl.arange(0, BD)
        out_row = out_ptr + row * stride_om
        for k0 in range(0, n_act, E):
            slot = k0 + lane  # [E]
            p_ok = slot < n_act
            sel = (rank[None, :] == slot[:, None]) & active[None, :]  # [E, T]: one column per live slot
            j = tl.sum(tl.where(sel, offs_n[None, :], 0), 1).to(tl.int64)  # [E]
            gj = tl.sum(tl.where(sel, gq[None, :], 0.0), 1)  # [E]
            u = tl.zeros([E], dtype=tl.float32)
            for d0 in range(0, D, BD):
                d_ok = d0 + offs_d < D
                xc = tl.load(x_row + d0 + offs_d, mask=d_ok, other=0.0).to(tl.float32)  # [BD]
                wu = tl.load(wu_ptr + j[:, None] * D + (d0 + offs_d)[None, :], mask=p_ok[:, None] & d_ok[None, :],
                             other=0.0)  # [E, BD]
                u += tl.sum(wu.to(tl.float32) * xc[None, :], 1)
            h = gj * u  # [E] (0 on dead slots: their loads were masked)
            for d0 in range(0, D, BD):
                d_ok = d0 + offs_d < D
                wd = tl.load(wdt_ptr + j[:, None] * D + (d0 + offs_d)[None, :], mask=p_ok[:, None] & d_ok[None, :],
                             other=0.0)  # [E, BD]
                tl.atomic_add(out_row + d0 + offs_d, tl.sum(h[:, None] * wd.to(tl.float32), 0), mask=d_ok)


def k2_config(m: int, d: int) -> dict:
    """E rows per gather chunk (the round-1 and K2 sweeps' pick: larger E spills), warps, and decode split."""
    bd = next_pow2(d)
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
    w_down_t: torch.Tensor, *, compact: bool = False, chunked: bool | None = None,
    threshold: torch.Tensor | None = None, **overrides,
) -> torch.Tensor:
    """K2: (unpack(packed) * (x2d @ w_up.T)) @ w_down_t -> [M, d] in x2d's dtype. w_down_t is [F, d].
    threshold: the theta [F] float32 K1 packed with (overflowed tiles are recomputed with it), or None.

    compact=True (what twell_ffn_triton runs; ignored when K2 splits rows, M <= 16): per-row compacted entry
    lists before the gather loop. chunked: when K2 splits rows, run updown_decode_chunked (True), the
    split _k2_updown (False), or choose by M and d (None: decode_k2_chunked, unless block overrides are
    given)."""
    require_triton()
    m, d = x2d.shape
    f = w_up.shape[0]
    cfg = {**k2_config(m, d), **overrides}
    split = cfg["SPLIT"]
    if chunked is None:
        chunked = split > 1 and decode_k2_chunked(m, d) and not overrides
    if chunked and split > 1 and _chunked_ok(x2d, packed, w_up, w_down_t):
        return updown_decode_chunked(x2d, packed, w_up, w_down_t)
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
        T=packed.tile, S=packed.slots, NT_PAD=next_pow2(nt), BLOCK_D=next_pow2(d),
        E=cfg["E"], SPLIT=split, ENT=ENT_CODES[packed.entries], num_warps=cfg["num_warps"], **extra,
        **theta_args(x2d, threshold),
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
    """K2 for decode without the d-length registers of `updown`'s split path (_k2_dec_chunked): -> [M, d]
    in x2d's dtype. E = 8 is the chunked-K2 sweep's pick. SPLIT (programs per row) defaults to about four
    programs per SM over the M rows, at most 512. packed must hold every entry (decode tiles: S >= T)."""
    require_triton()
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
        T=packed.tile, S=packed.slots, NT_PAD=next_pow2(nt), BD=min(BD, next_pow2(d)), E=E, SPLIT=split,
        ENT=ENT_CODES[packed.entries], num_warps=num_warps,
    )
    return out.to(x2d.dtype)


FUSED_DEFAULT = MappingProxyType(dict(T=32, BLOCK_K=256, E=4, BD=1024, num_warps=4))  # T, BLOCK_K: the GEMV K1's; E, BD: K2's
# (d, F) -> the fused launch that twell_ffn_triton runs at M = 1 in place of K1 + K2: only the shapes where it beat
# K1 + K2 side by side under CUDA graphs (H200, 95.7% zeros; the table: eval/results/decode-fused-h200/). The
# larger decode shapes (4096x14336, 8192x28672) lost at every launch there and stay K1 + K2.
FUSED_ROUTE = MappingProxyType({(2048, 8192): MappingProxyType(dict(E=8))})


def twell_ffn_decode_fused(
    x2d: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor,
    threshold: torch.Tensor | None = None, *, fp32_out: bool = False, **overrides,
) -> torch.Tensor:
    """The sparse FFN of decode rows in one launch (_k12_decode): K1's gate GEMV and K2's up/down per tile, no
    TwELL packing in between. -> [M, d] in x2d's dtype (fp32_out: the float32 sums before that cast); the same
    kept neurons as gate_pack (with `threshold` theta [F] float32: g rounded to x2d's dtype > theta_j) and the
    same h as K2 reads from the packing; the output sums in another fp32 order (atomics). Each row streams
    W_gate once: meant for M = 1 (at M > 1 the rows' programs share W_gate through L2 only). overrides: T,
    BLOCK_K, E, BD, num_warps, num_stages."""
    require_triton()
    m, d = x2d.shape
    f = w_gate.shape[0]
    for name, t in (("x2d", x2d), ("w_gate", w_gate), ("w_up", w_up), ("w_down_t", w_down_t)):
        if t.stride(-1) != 1 or (t is not x2d and t.stride(0) != d):
            raise ValueError(f"{name} must be contiguous [.., {d}] (strides {tuple(t.stride())})")
    cfg = {**FUSED_DEFAULT, **overrides}
    t, bk, bd = cfg.pop("T"), min(cfg.pop("BLOCK_K"), next_pow2(d)), min(cfg.pop("BD"), next_pow2(d))
    out = torch.zeros(m, d, dtype=torch.float32, device=x2d.device)
    th = theta_args(x2d, threshold)
    _k12_decode[(-(-f // t), m)](
        x2d, w_gate, w_up, w_down_t, th["th_ptr"], out, f, d, x2d.stride(0), out.stride(0),
        T=t, BLOCK_K=bk, BD=bd, EVEN_K=(d % bk == 0), EVEN_N=(f % t == 0), HAS_THETA=th["HAS_THETA"],
        RND=th["RND"], GQ=ENT_CODES[default_entries(x2d.dtype)], **cfg,
    )
    return out if fp32_out else out.to(x2d.dtype)


def twell_ffn_triton(
    x2d: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor,
    variant: str = DEFAULT_VARIANT, threshold: torch.Tensor | None = None, on_count=None, fused: bool = True,
) -> torch.Tensor:
    """The whole sparse FFN on [M, d]: K1 (gate + pack) then K2 (fused up/down). variant: VARIANTS, named by K1.
    threshold: theta [F] float32 (h = g [g > theta] * up), or None (relu). At M = 1 on a FUSED_ROUTE shape (with
    the default variant, contiguous weights and `fused`) the fused decode FFN instead: the same kept neurons and
    h, one launch. on_count: called with K1's count of kept gate values (int64 scalar tensor; auto's density
    refresh), which only K1 + K2 make: the fused route is skipped then."""
    if x2d.shape[0] == 1 and variant == DEFAULT_VARIANT and fused and on_count is None:
        launch = FUSED_ROUTE.get((x2d.shape[1], w_gate.shape[0]))
        if launch is not None and all(t.is_contiguous() for t in (x2d, w_gate, w_up, w_down_t)):
            return twell_ffn_decode_fused(x2d, w_gate, w_up, w_down_t, threshold, **launch)
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not one of {VARIANTS}")
    packed = gate_pack(x2d, w_gate, variant=variant, threshold=threshold)
    if on_count is not None:  # int32 sums to int64 in the reduction itself (no cast kernel)
        on_count(packed.cnt.sum())
    return updown(x2d, packed, w_gate, w_up, w_down_t, compact=True, threshold=threshold)
