"""Training FFN with a packed activation save: forward + backward of y = down(relu(gate(x)) * up(x)) that
keeps for backward only a bitmask of the active slots and the gate/up values there (no dense [M, F] tensor).
With a threshold theta [F] (float32) the activation is g * [g > theta] instead of relu (the active slots are
those with g > theta_j, g compared as the dtype holds it, as twell_reference.threshold_act): the gradient is
the exact one of that expression, zero at g <= theta (no straight-through estimate).

Legend: M = tokens (rows of x), d = hidden size, F = intermediate size, C = capacity (packed values per row),
R = spill rows (dense side buffer), NW = ceil(F / 32) mask words per row, e = bytes per element of the dtype.
Weights in nn.Linear layout: w_gate, w_up [F, d], w_down [d, F].

    sparse_ffn_train(x, w_gate, w_up, w_down, normalization=, capacity=, threshold=) -> (y, l1, nnz, fired)

y = relu(x Wg^T) * (x Wu^T) Wd^T, l1 = sum|h| / M ("sum_hidden": sum over F, mean over tokens, the paper's
code and sparsity.normalization's default) or mean|h| ("mean"), nnz = count of h != 0, fired [F] bool = neuron j had
h != 0 in some row. The gradient of l1 (whatever coefficient multiplies it outside, per layer or global)
is folded into dh at the active slots: dh += dl1 / M * sign(h).

Why this design (what dense autograd saves, and what we save instead)
- Dense autograd of the expression saves relu(gate), up and h: 3 [M, F] tensors, 3 M F e bytes per layer
  (plus x and the weights, which every design needs). Only slots with gate > 0 carry gradient:
  dgate = dh * up * 1[gate > 0], dup = dh * relu(gate), h = relu(gate) * up; so the gate and up values at
  the active slots (and where they are) determine every gradient.
- Saved here (besides x and the weights, which dense autograd also keeps):
    mask  [M, NW] int32   bit b of word w: gate[r, 32 w + b] > 0 (the exact active pattern of EVERY row)
    vals  [2, M, C] dtype the first C active gate values (vals[0]) and up values (vals[1]) of each row,
          in column order: the entry of column j is at the rank of j among the row's active columns
    slot  [M] int32       -1: the row fits in C; 0 <= s < R: its full gate/up row is side[s]; s >= R:
          its gate/up row is recomputed in backward from x (a fused GEMM in the backward kernel)
    side  [max(R, 1), 2F] dtype  full gate | up rows of the first R rows that overflowed C
  bytes = M (4 NW + 2 C e + 4) + 2 max(R, 1) F e: 5-15% of dense autograd's at 90-99% zeros (kernels/NOTES.md).
  A bitmask instead of per-entry column indices: F / 8 bytes per row against 2 bytes per active slot
  (int16), smaller at <= 94% zeros, larger at 99% (1 KB vs 0.16 KB per row at F = 8192, still 2-3% of
  dense); what decides is the backward: with the mask, a program sweeping a block of columns knows
  where each entry sits (rank = prefix count of the mask bits) and expands the packed values into the
  dense tile with one gathered load, no search and no scatter. The running rank also makes the row's
  count implicit (nothing else to save).
- Overflow (a row with more than C active slots) is lossless and needs no host sync: each program counts
  its rows, takes slots for its overflowing rows with one atomic add on a device counter, copies the
  rows it got a slot < R for into the side buffer (a second sweep over those rows only) and marks the
  rest for recompute. Backward first launches `_bwd_recompute` (one program per row block; a block without
  a marked row exits after loading its slots): marked rows get gate/up from x by tl.dot over d, written
  into the backward's own dup / h buffers, which the unpack kernel reads back before overwriting them (no
  extra memory, no MMA operands in the streaming kernel). In the worst case (every row beyond R) that is a
  Triton GEMM of the whole layer: slower, still exact. Which rows land in the side buffer depends on the
  atomic order; a recomputed gate/up value may differ from the forward's cuBLAS one by an ulp (the
  forward's mask stays authoritative for the active pattern).
- Compute stays on dense tensor-core GEMMs (cuBLAS through torch): forward gate, up (x Wg^T, x Wu^T),
  y = h Wd^T; backward dh = dy Wd, dWd = dy^T h, dX = dgate Wg + dup Wu (one addmm), dWg = dgate^T x,
  dWu = dup^T x. "Hybrid" here means every row runs the dense GEMMs and only the saved state is packed;
  the GEMMs are the same calls dense autograd makes, so y and the gradients match it to the dtype's
  rounding (h, dgate, dup are rounded exactly as torch rounds them). Transient [M, F] tensors exist only
  inside forward / backward of one layer: gate, up, h in forward; dh (overwritten in place by dgate),
  dup, h in backward.
- Two streaming Triton kernels replace dense autograd's elementwise ops: forward `_fwd_pack` (per row block, a
  sweep over F: h = relu(g) * u written for the down GEMM, the mask words, the packed values, the row's
  count of h != 0 and sum |h|, fired neurons by benign racy stores of 1); backward `_bwd_unpack` (the same
  sweep: expand mask + values (+ side / recompute), add the L1 gradient, write dgate over dh, dup and h).
  Sparse compute (SpMM / SDDMM on the active slots) would be needed to beat dense at 99% zeros; it is
  not done here (kernels/NOTES.md).
- torch.library custom ops (`sparsify::ffn_train_fwd`, `sparsify::ffn_train_bwd`, with register_fake and
  register_autograd) so torch.compile traces them as opaque nodes (fullgraph: no graph break); eager calls
  go through a torch.autograd.Function over the same impl functions (no custom-op dispatch cost). DDP and
  FSDP2 see an ordinary autograd node, and activation checkpointing (non-reentrant) recomputes the forward
  with identical saved shapes (C and R are Python ints fixed by the caller).
- Autocast: the wrapper casts x and the weights to the autocast dtype exactly like F.linear under autocast
  (the op itself runs with autocast off); fp32 without autocast. bf16/fp16/fp32 all supported on CUDA.
- Backends: "triton" (CUDA; or CPU with TRITON_INTERPRET=1, fp32 only: the tests), "torch" (the same
  packed format in plain torch: the reference, and what runs on CPU without the interpreter), "auto".

Imports: torch, optional triton, stdlib, and the kernel bundle's twell_reference (threshold_act, the one
definition of the thresholded activation); this directory never imports the rest of the sparsify package.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from ..twell_reference import threshold_act

try:  # the module must import (and the torch backend work) without triton
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - machines without triton
    triton = None
    tl = None
    HAS_TRITON = False

NORMALIZATIONS = ("sum_hidden", "mean")
BACKENDS = ("auto", "triton", "torch")
WORD = 32  # mask bits per int32 word
# Spill rows: a dense side buffer of max(SPILL_MIN, M // SPILL_DIV) rows. With the capacity at ~1.25x the
# per-row p99 of non-zeros, ~1% of rows overflow (sparsify.train.packed_ffn): M / 32 leaves 3x room before
# any row needs the recompute path, for 2 M F e / 32 bytes (6% of one dense [M, F] tensor).
SPILL_DIV = 32
SPILL_MIN = 16
# Kernel blocks (rows x columns per step of the sweep; BF a multiple of 32: whole mask words): the fastest of
# eval/bench/bench_train_ffn.py's sweep (kernels/NOTES.md, "Training kernels")
FWD_CONFIG = {"BM": 32, "BF": 128, "num_warps": 4}
BWD_CONFIG = {"BM": 32, "BF": 64, "num_warps": 4}
# The recompute GEMM of rows beyond the side buffer (rare: a correctness path, not tuned)
RECOMPUTE_CONFIG = {"BM": 16, "BF": 64, "BK": 64, "num_warps": 4}
INTERPRET_CONFIG = {"BM": 16, "BF": 64, "BK": 16, "num_warps": 4}  # the CPU interpreter: small programs


def default_capacity(f: int) -> int:
    """F / 4 rounded up to a multiple of 16 (at most F): safe from ~80% zeros with a spread of per-row counts."""
    return min(f, 16 * math.ceil(f / 4 / 16))


def default_spill_rows(m: int) -> int:
    return max(SPILL_MIN, m // SPILL_DIV)


def mask_words(f: int) -> int:
    return (f + WORD - 1) // WORD


def saved_bytes_formula(m: int, f: int, capacity: int, spill_rows: int, element_size: int) -> int:
    """Bytes this op saves for backward beyond x and the weights: mask + values + slot + side buffer."""
    return m * (4 * mask_words(f) + 2 * capacity * element_size + 4) + 2 * max(spill_rows, 1) * f * element_size


def _denominator(m: int, f: int, normalization: str) -> int:
    return m if normalization == "sum_hidden" else m * f


def _use_triton(x: torch.Tensor, backend: str) -> bool:
    if backend == "torch":
        return False
    interp = x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and x.dtype == torch.float32
    ok = HAS_TRITON and (x.is_cuda or interp)
    if backend == "triton" and not ok:
        raise RuntimeError(
            f"backend='triton' needs triton and a CUDA tensor (or a CPU fp32 tensor with TRITON_INTERPRET=1 set "
            f"before triton is imported); got {x.dtype} on {x.device}, triton "
            f"{'present' if HAS_TRITON else 'missing'}.")
    return ok


def _config(x: torch.Tensor, base: dict) -> dict:
    return dict(INTERPRET_CONFIG) if x.device.type == "cpu" else dict(base)


# ------------------------------------------------------------------------------------------------ kernels
if HAS_TRITON:
    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr):
        if IEEE:  # fp32 inputs: true fp32 products (tf32 would lose 13 bits)
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _fwd_pack(
        g_ptr, u_ptr, h_ptr, mask_ptr, vals_ptr, side_ptr, slot_ptr, ctr_ptr, nnz_ptr, act_ptr, l1_ptr, fired_ptr,
        th_ptr, M, F, C, R, NW, UP_OFF,
        BM: tl.constexpr, BF: tl.constexpr, HAS_THETA: tl.constexpr,
    ):
        """Rows [pid BM, pid BM + BM) of g, u [M, F] (contiguous): h = relu(g) * u -> h_ptr, mask words, the
        first C active (g, u) pairs -> vals [2, M, C], per row: count of h != 0 (nnz_ptr), of g > 0
        (act_ptr), sum |h| in fp32 (l1_ptr); fired [F] uint8 set to 1 where some h != 0 (racy stores of the
        same value: no atomics). Overflowing rows (count > C) take slots from ctr_ptr; the first R copy
        their whole g | u row to side [R, 2F]; slot_ptr gets -1 (fits) or the slot. HAS_THETA: active is
        g > theta (th_ptr [F] float32, one load per column block) instead of g > 0, h = g * u there."""
        pid = tl.program_id(0)
        rows = pid * BM + tl.arange(0, BM)  # [BM]
        row_ok = rows < M
        r64 = rows.to(tl.int64)
        cols0 = tl.arange(0, BF)
        shift = cols0 % 32  # [BF] bit of each column within its mask word
        widx = tl.arange(0, BF // 32)  # [BF/32]
        run = tl.zeros([BM], dtype=tl.int32)  # active slots so far (= rank of the next one)
        nz = tl.zeros([BM], dtype=tl.int32)
        l1 = tl.zeros([BM], dtype=tl.float32)
        for c0 in range(0, F, BF):
            cols = c0 + cols0  # [BF]
            col_ok = cols < F
            m2 = row_ok[:, None] & col_ok[None, :]  # [BM, BF]
            off = r64[:, None] * F + cols[None, :]
            g = tl.load(g_ptr + off, mask=m2, other=0.0)  # [BM, BF] dtype
            u = tl.load(u_ptr + off, mask=m2, other=0.0)
            if HAS_THETA:  # g as the dtype holds it against float32 theta (the torch path's comparison)
                th = tl.load(th_ptr + cols, mask=col_ok, other=0.0)  # [BF]
                act = (g.to(tl.float32) > th[None, :]) & m2
            else:
                act = g > 0
            h = tl.where(act, g.to(tl.float32) * u.to(tl.float32), 0.0).to(h_ptr.dtype.element_ty)  # one rounding
            tl.store(h_ptr + off, h, mask=m2)
            hnz = h != 0
            nz += tl.sum(hnz.to(tl.int32), 1)
            l1 += tl.sum(tl.abs(h.to(tl.float32)), 1)
            fired = tl.max(hnz.to(tl.int32), 0)  # [BF]
            tl.store(fired_ptr + cols, fired.to(fired_ptr.dtype.element_ty), mask=col_ok & (fired > 0))
            a = act.to(tl.int32)
            words = tl.sum(tl.reshape(a << shift[None, :], (BM, BF // 32, 32)), 2)  # [BM, BF/32] distinct bits
            w_col = c0 // 32 + widx
            tl.store(mask_ptr + r64[:, None] * NW + w_col[None, :], words.to(tl.int32),
                     mask=row_ok[:, None] & (w_col < NW)[None, :])
            pos = run[:, None] + tl.cumsum(a, 1) - 1  # [BM, BF] rank among the row's active slots
            keep = act & (pos < C)
            voff = r64[:, None] * C + pos
            tl.store(vals_ptr + voff, g, mask=keep)
            tl.store(vals_ptr + UP_OFF + voff, u, mask=keep)
            run += tl.sum(a, 1)
        tl.store(nnz_ptr + rows, nz, mask=row_ok)
        tl.store(act_ptr + rows, run, mask=row_ok)
        tl.store(l1_ptr + rows, l1, mask=row_ok)
        over = (run > C) & row_ok
        oi = over.to(tl.int32)
        n_over = tl.sum(oi, 0)
        slot = tl.full([BM], -1, tl.int32)
        if n_over > 0:  # rare: one atomic per row block with overflowing rows
            base = tl.atomic_add(ctr_ptr, n_over)
            slot = tl.where(over, base + tl.cumsum(oi, 0) - 1, -1)
            spill = over & (slot < R)
            if tl.sum(spill.to(tl.int32), 0) > 0:  # second sweep, loads predicated to the spilled rows
                s64 = tl.maximum(slot, 0).to(tl.int64)
                for c0 in range(0, F, BF):
                    cols = c0 + cols0
                    m2 = spill[:, None] & (cols < F)[None, :]
                    off = r64[:, None] * F + cols[None, :]
                    soff = s64[:, None] * (2 * F) + cols[None, :]
                    tl.store(side_ptr + soff, tl.load(g_ptr + off, mask=m2, other=0.0), mask=m2)
                    tl.store(side_ptr + soff + F, tl.load(u_ptr + off, mask=m2, other=0.0), mask=m2)
        tl.store(slot_ptr + rows, slot, mask=row_ok)

    @triton.jit
    def _bwd_recompute(
        g_ptr, u_ptr, slot_ptr, x_ptr, wg_ptr, wu_ptr, M, F, D, R, stride_x, stride_w,
        BM: tl.constexpr, BF: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
    ):
        """Gate and up rows of rows [pid BM, pid BM + BM) marked for recompute (slot >= R), x @ W^T with tl.dot
        over d, rounded to the dtype as a GEMM output, written to g_ptr / u_ptr [M, F] (the backward's dup and
        h buffers, which _bwd_unpack reads back before overwriting them). A row block without such a row
        returns after one load of its slots: the usual case costs one tiny launch."""
        pid = tl.program_id(0)
        rows = pid * BM + tl.arange(0, BM)
        rec = tl.load(slot_ptr + rows, mask=rows < M, other=-1) >= R  # [BM]
        if tl.sum(rec.to(tl.int32), 0) > 0:
            r64 = rows.to(tl.int64)
            dt = g_ptr.dtype.element_ty
            for c0 in range(0, F, BF):
                cols = c0 + tl.arange(0, BF)
                col_ok = cols < F
                c64 = cols.to(tl.int64)
                acc_g = tl.zeros([BM, BF], dtype=tl.float32)
                acc_u = tl.zeros([BM, BF], dtype=tl.float32)
                for k0 in range(0, D, BK):
                    ks = k0 + tl.arange(0, BK)
                    k_ok = ks < D
                    xa = tl.load(x_ptr + r64[:, None] * stride_x + ks[None, :], mask=rec[:, None] & k_ok[None, :],
                                 other=0.0)  # [BM, BK]
                    wmask = col_ok[None, :] & k_ok[:, None]
                    wg = tl.load(wg_ptr + c64[None, :] * stride_w + ks[:, None], mask=wmask, other=0.0)  # [BK, BF]
                    wu = tl.load(wu_ptr + c64[None, :] * stride_w + ks[:, None], mask=wmask, other=0.0)
                    acc_g = _dot(xa, wg, acc_g, IEEE)
                    acc_u = _dot(xa, wu, acc_u, IEEE)
                off = r64[:, None] * F + cols[None, :]
                m2 = rec[:, None] & col_ok[None, :]
                tl.store(g_ptr + off, acc_g.to(dt), mask=m2)
                tl.store(u_ptr + off, acc_u.to(dt), mask=m2)

    @triton.jit
    def _bwd_unpack(
        dh_ptr, du_ptr, h_ptr, mask_ptr, vals_ptr, side_ptr, slot_ptr, coef_ptr,
        M, F, C, R, NW, UP_OFF,
        BM: tl.constexpr, BF: tl.constexpr,
    ):
        """Rows [pid BM, pid BM + BM): dh [M, F] (read, then overwritten with dgate), du [M, F] and h [M, F]
        (written) from the mask, the packed values, the side buffer and, for rows marked for recompute, the
        gate / up rows _bwd_recompute left in du / h. L1: dh + round(coef * sign(h)) at active slots,
        coef = dl1 / denominator (fp32 scalar on the device: no host sync). No tl.dot here (the recompute
        is a separate launch): no shared memory for MMA operands, so more programs fit per SM."""
        pid = tl.program_id(0)
        rows = pid * BM + tl.arange(0, BM)
        row_ok = rows < M
        r64 = rows.to(tl.int64)
        cols0 = tl.arange(0, BF)
        widx = tl.arange(0, BF // 32)
        bit = tl.arange(0, 32)
        dt = h_ptr.dtype.element_ty
        slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1)  # [BM]
        packed = slot < 0
        spill = (slot >= 0) & (slot < R)
        rec = slot >= R
        s64 = tl.maximum(slot, 0).to(tl.int64)
        coef = tl.load(coef_ptr)  # fp32 scalar
        run = tl.zeros([BM], dtype=tl.int32)
        for c0 in range(0, F, BF):
            cols = c0 + cols0
            col_ok = cols < F
            m2 = row_ok[:, None] & col_ok[None, :]
            w_col = c0 // 32 + widx
            words = tl.load(mask_ptr + r64[:, None] * NW + w_col[None, :],
                            mask=row_ok[:, None] & (w_col < NW)[None, :], other=0)  # [BM, BF/32]
            a = tl.reshape((words[:, :, None] >> bit[None, None, :]) & 1, (BM, BF))  # [BM, BF] 0/1
            act = a != 0
            pos = run[:, None] + tl.cumsum(a, 1) - 1
            run += tl.sum(a, 1)
            pk = act & packed[:, None]
            voff = r64[:, None] * C + pos
            g = tl.load(vals_ptr + voff, mask=pk, other=0.0).to(tl.float32)  # [BM, BF] gathered from the row
            u = tl.load(vals_ptr + UP_OFF + voff, mask=pk, other=0.0).to(tl.float32)
            sp = act & spill[:, None]
            soff = s64[:, None] * (2 * F) + cols[None, :]
            g = tl.where(sp, tl.load(side_ptr + soff, mask=sp, other=0.0).to(tl.float32), g)
            u = tl.where(sp, tl.load(side_ptr + soff + F, mask=sp, other=0.0).to(tl.float32), u)
            off = r64[:, None] * F + cols[None, :]
            rr = act & rec[:, None]  # recomputed rows: the forward's mask decides activity (g > 0 or g > theta >= 0)
            g = tl.where(rr, tl.maximum(tl.load(du_ptr + off, mask=rr, other=0.0).to(tl.float32), 0.0), g)
            u = tl.where(rr, tl.load(h_ptr + off, mask=rr, other=0.0).to(tl.float32), u)
            dh = tl.load(dh_ptr + off, mask=m2, other=0.0).to(tl.float32)
            h = (g * u).to(dt)  # 0 at inactive slots (g = u = 0 there)
            hf = h.to(tl.float32)
            sgn = tl.where(hf > 0, 1.0, tl.where(hf < 0, -1.0, 0.0))
            # as autograd of the dense expression: dh_total = dh + dtype(coef * sign(h)), rounded to the dtype
            dht = (dh + (coef * sgn).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            dg = tl.where(act, dht * u, 0.0)
            dup = tl.where(act, dht * g, 0.0)
            tl.store(dh_ptr + off, dg.to(dt), mask=m2)
            tl.store(du_ptr + off, dup.to(dt), mask=m2)
            tl.store(h_ptr + off, h, mask=m2)


# ------------------------------------------------------------------------------------------------ torch path
def pack_mask(act: torch.Tensor) -> torch.Tensor:
    """[M, F] bool -> [M, NW] int32 words (bit b of word w = column 32 w + b)."""
    m, f = act.shape
    nw = mask_words(f)
    a = F.pad(act.to(torch.int64), (0, nw * WORD - f)).view(m, nw, WORD)
    w = (a << torch.arange(WORD, device=act.device)).sum(-1)  # [M, NW] in [0, 2^32)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def unpack_mask(words: torch.Tensor, f: int) -> torch.Tensor:
    """[M, NW] int32 -> [M, F] bool."""
    m, nw = words.shape
    bits = (words.to(torch.int64)[:, :, None] >> torch.arange(WORD, device=words.device)) & 1
    return bits.view(m, nw * WORD)[:, :f].bool()


def _fwd_torch(x, w_gate, w_up, w_down, capacity: int, spill_rows: int, normalization: str, threshold=None):
    """The forward in plain torch, same outputs and packed format as the Triton path (overflow slots in row
    order). No host sync (scatters to a trash slot instead of boolean indexing)."""
    m, f = x.shape[0], w_gate.shape[0]
    g = F.linear(x, w_gate)  # [M, F]
    u = F.linear(x, w_up)
    act = g > (0 if threshold is None else threshold)
    h = threshold_act(g, threshold) * u  # [M, F] dtype, as dense autograd computes it
    y = F.linear(h, w_down)
    hnz = h != 0
    nnz_rows = hnz.sum(1, dtype=torch.int32)  # [M]
    act_rows = act.sum(1, dtype=torch.int32)
    l1 = h.abs().float().sum() / _denominator(m, f, normalization)
    fired = hnz.any(0).to(torch.uint8)  # [F]
    mask = pack_mask(act)
    pos = act.cumsum(1) - 1  # [M, F] rank of each active slot
    keep = act & (pos < capacity)
    rows = torch.arange(m, device=x.device)
    dest = torch.where(keep, rows[:, None] * capacity + pos, m * capacity).flatten()  # trash slot M C
    vals = torch.zeros(2, m * capacity + 1, dtype=x.dtype, device=x.device)
    vals[0].scatter_(0, dest, g.flatten())
    vals[1].scatter_(0, dest, u.flatten())
    vals = vals[:, : m * capacity].reshape(2, m, capacity).clone()
    over = act_rows > capacity
    slot = torch.where(over, over.cumsum(0) - 1, -1).to(torch.int32)  # [M]
    dst = torch.where(over & (slot < spill_rows), slot.long(), max(spill_rows, 1))  # trash row
    side = torch.zeros(max(spill_rows, 1) + 1, 2 * f, dtype=x.dtype, device=x.device)
    side.index_copy_(0, dst, torch.cat([g, u], 1))
    return y, l1, nnz_rows, act_rows, fired, mask, vals, side[: max(spill_rows, 1)].clone(), slot


def _gate_up_dense(x, w_gate, w_up, mask, vals, side, slot, spill_rows: int):
    """Dense [M, F] act(gate) and up rebuilt from the saved state (the torch backward's unpack): the forward's
    mask decides the active slots (relu or threshold alike)."""
    f, capacity = w_gate.shape[0], vals.shape[-1]
    act = unpack_mask(mask, f)
    pos = (act.cumsum(1) - 1).clamp(0, capacity - 1)
    g = vals[0].gather(1, pos)  # [M, F]
    u = vals[1].gather(1, pos)
    spill = ((slot >= 0) & (slot < spill_rows))[:, None]
    rec = (slot >= spill_rows)[:, None]
    s = slot.clamp(0, side.shape[0] - 1).long()
    g = torch.where(spill, side[s, :f], torch.where(rec, F.linear(x, w_gate).relu(), g))
    u = torch.where(spill, side[s, f:], torch.where(rec, F.linear(x, w_up), u))
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    return act, torch.where(act, g, zero), torch.where(act, u, zero)


def _bwd_torch(dy, coef, x, w_gate, w_up, w_down, mask, vals, side, slot, spill_rows: int):
    act, g, u = _gate_up_dense(x, w_gate, w_up, mask, vals, side, slot, spill_rows)
    h = g * u  # [M, F] (g > 0: the kept gate value at active slots)
    dh = dy @ w_down  # [M, F]
    dh = dh + (coef * torch.sign(h.float())).to(dh.dtype)
    zero = torch.zeros((), dtype=dh.dtype, device=dh.device)
    dgate = torch.where(act, dh * u, zero)
    dup = torch.where(act, dh * g, zero)
    return _bwd_gemms(dy, x, w_gate, w_up, dgate, dup, h)


def _bwd_gemms(dy, x, w_gate, w_up, dgate, dup, h):
    """dX, dWg, dWu, dWd from dense dgate, dup, h [M, F]: the GEMMs dense autograd runs (dX in one addmm)."""
    dwd = dy.t() @ h  # [d, F]
    dx = torch.addmm(dgate @ w_gate, dup, w_up)  # [M, d]
    dwg = dgate.t() @ x  # [F, d]
    dwu = dup.t() @ x
    return dx, dwg, dwu, dwd


# ------------------------------------------------------------------------------------------------ launchers
def _fwd_triton(x, w_gate, w_up, w_down, capacity: int, spill_rows: int, normalization: str, threshold=None):
    m, f = x.shape[0], w_gate.shape[0]
    dev, dt = x.device, x.dtype
    g = F.linear(x, w_gate)  # [M, F] cuBLAS, the same call as dense autograd's
    u = F.linear(x, w_up)
    h = torch.empty_like(g)
    nw = mask_words(f)
    mask = torch.empty(m, nw, dtype=torch.int32, device=dev)
    vals = torch.empty(2, m, capacity, dtype=dt, device=dev)
    side = torch.empty(max(spill_rows, 1), 2 * f, dtype=dt, device=dev)
    slot = torch.empty(m, dtype=torch.int32, device=dev)
    ctr = torch.zeros(1, dtype=torch.int32, device=dev)
    nnz_rows = torch.empty(m, dtype=torch.int32, device=dev)
    act_rows = torch.empty(m, dtype=torch.int32, device=dev)
    l1_rows = torch.empty(m, dtype=torch.float32, device=dev)
    fired = torch.zeros(f, dtype=torch.uint8, device=dev)
    cfg = _config(x, FWD_CONFIG)
    grid = (triton.cdiv(m, cfg["BM"]),)
    _fwd_pack[grid](g, u, h, mask, vals, side, slot, ctr, nnz_rows, act_rows, l1_rows, fired,
                    g if threshold is None else threshold.contiguous(), m, f, capacity, spill_rows, nw, vals.stride(0),
                    BM=cfg["BM"], BF=cfg["BF"], HAS_THETA=threshold is not None, num_warps=cfg["num_warps"])
    del g, u
    y = F.linear(h, w_down)  # [M, d]
    l1 = l1_rows.sum() / _denominator(m, f, normalization)
    return y, l1, nnz_rows, act_rows, fired, mask, vals, side, slot


def _bwd_triton(dy, coef, x, w_gate, w_up, w_down, mask, vals, side, slot, spill_rows: int):
    m, f, d = x.shape[0], w_gate.shape[0], x.shape[1]
    dh = dy @ w_down  # [M, F]; overwritten with dgate by the kernel
    dup = torch.empty_like(dh)
    h = torch.empty_like(dh)
    cfg = _config(x, BWD_CONFIG)
    rcfg = _config(x, RECOMPUTE_CONFIG)
    _bwd_recompute[(triton.cdiv(m, rcfg["BM"]),)](
        dup, h, slot, x, w_gate, w_up, m, f, d, spill_rows, x.stride(0), w_gate.stride(0),
        BM=rcfg["BM"], BF=rcfg["BF"], BK=rcfg["BK"], IEEE=x.dtype == torch.float32, num_warps=rcfg["num_warps"])
    _bwd_unpack[(triton.cdiv(m, cfg["BM"]),)](
        dh, dup, h, mask, vals, side, slot, coef, m, f, vals.shape[-1], spill_rows, mask.shape[1], vals.stride(0),
        BM=cfg["BM"], BF=cfg["BF"], num_warps=cfg["num_warps"])
    return _bwd_gemms(dy, x, w_gate, w_up, dh, dup, h)


# ------------------------------------------------------------------------------------------------ custom ops
_FWD_NAME, _BWD_NAME = "sparsify::ffn_train_fwd", "sparsify::ffn_train_bwd"


def _fwd_impl(x, w_gate, w_up, w_down, capacity, spill_rows, normalization, backend, threshold=None):
    with torch.autocast(x.device.type, enabled=False):
        if x.shape[0] == 0:
            return _fwd_torch(x, w_gate, w_up, w_down, capacity, spill_rows, normalization, threshold)
        fn = _fwd_triton if _use_triton(x, backend) else _fwd_torch
        return fn(x, w_gate, w_up, w_down, capacity, spill_rows, normalization, threshold)


def _bwd_impl(dy, dl1, x, w_gate, w_up, w_down, mask, vals, side, slot, spill_rows, normalization, backend):
    with torch.autocast(x.device.type, enabled=False):
        # d l1 / d|h| per element, as autograd's mean backward computes it (a division, in fp32)
        coef = (dl1.float() / _denominator(x.shape[0], w_gate.shape[0], normalization)).reshape(1)
        if x.shape[0] > 0 and _use_triton(x, backend):
            return _bwd_triton(dy, coef, x, w_gate, w_up, w_down, mask, vals, side, slot, spill_rows)
        return _bwd_torch(dy, coef, x, w_gate, w_up, w_down, mask, vals, side, slot, spill_rows)


def _define_ops():
    """Register the two ops once, even when several copies of this file are imported."""
    ns = torch.ops.sparsify
    if hasattr(ns, "ffn_train_fwd") and hasattr(ns, "ffn_train_bwd"):
        return ns.ffn_train_fwd, ns.ffn_train_bwd
    try:
        fwd = torch.library.custom_op(_FWD_NAME, mutates_args=())(_fwd_op_schema)
        bwd = torch.library.custom_op(_BWD_NAME, mutates_args=())(_bwd_op_schema)
    except RuntimeError:  # registered meanwhile by another copy of this module
        return ns.ffn_train_fwd, ns.ffn_train_bwd

    @fwd.register_fake
    def _(x, w_gate, w_up, w_down, capacity, spill_rows, normalization, backend, threshold=None):
        m, f, dt = x.shape[0], w_gate.shape[0], x.dtype
        i32 = dict(dtype=torch.int32, device=x.device)
        return (x.new_empty(m, w_down.shape[0]), x.new_empty((), dtype=torch.float32), x.new_empty(m, **i32),
                x.new_empty(m, **i32), x.new_empty(f, dtype=torch.uint8), x.new_empty(m, mask_words(f), **i32),
                x.new_empty(2, m, capacity, dtype=dt), x.new_empty(max(spill_rows, 1), 2 * f, dtype=dt),
                x.new_empty(m, **i32))

    @bwd.register_fake
    def _(dy, dl1, x, w_gate, w_up, w_down, mask, vals, side, slot, spill_rows, normalization, backend):
        return torch.empty_like(x), torch.empty_like(w_gate), torch.empty_like(w_up), torch.empty_like(w_down)

    def setup_context(ctx, inputs, output):
        x, w_gate, w_up, w_down, capacity, spill_rows, normalization, backend, threshold = inputs
        mask, vals, side, slot = output[5:]
        ctx.save_for_backward(x, w_gate, w_up, w_down, mask, vals, side, slot)
        ctx.spill_rows, ctx.normalization, ctx.backend = spill_rows, normalization, backend

    def backward(ctx, dy, dl1, *unused):  # (the mask saved the pattern: no gradient for theta)
        return (*_backward(ctx, dy, dl1, bwd), None, None, None, None, None)

    fwd.register_autograd(backward, setup_context=setup_context)
    return fwd, bwd


def _fwd_op_schema(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, capacity: int,
    spill_rows: int, normalization: str, backend: str, threshold: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor]:
    """(y, l1, nnz per row, active per row, fired, mask, vals, side, slot) for x [M, d] (contiguous)."""
    return _fwd_impl(x, w_gate, w_up, w_down, capacity, spill_rows, normalization, backend, threshold)


def _bwd_op_schema(
    dy: torch.Tensor, dl1: torch.Tensor, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
    w_down: torch.Tensor, mask: torch.Tensor, vals: torch.Tensor, side: torch.Tensor, slot: torch.Tensor,
    spill_rows: int, normalization: str, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw_gate, dw_up, dw_down)."""
    return _bwd_impl(dy, dl1, x, w_gate, w_up, w_down, mask, vals, side, slot, spill_rows, normalization, backend)


def _backward(ctx, dy, dl1, bwd) -> tuple:
    """(dx, dw_gate, dw_up, dw_down) from what forward saved; a missing output gradient counts as zeros. `bwd` is
    the custom op (compiled path) or _bwd_impl itself (eager path)."""
    x, w_gate, w_up, w_down, mask, vals, side, slot = ctx.saved_tensors
    if dy is None:
        dy = x.new_zeros(x.shape[0], w_down.shape[0])
    if dl1 is None:
        dl1 = x.new_zeros((), dtype=torch.float32)
    return bwd(dy.contiguous(), dl1, x, w_gate, w_up, w_down, mask, vals, side, slot, ctx.spill_rows,
               ctx.normalization, ctx.backend)


_fwd_op, _bwd_op = _define_ops()


class _EagerFFN(torch.autograd.Function):
    """The eager path: the same impl functions as the custom ops, without their dispatch (custom-op calls and
    register_autograd cost tens of us of Python per call; a layer here takes two ops). torch.compile traces the custom ops instead (an autograd.Function would be inlined and
    the Triton launches traced)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, capacity, spill_rows, normalization, backend, threshold):
        y, l1, nnz_rows, act_rows, fired, mask, vals, side, slot = _fwd_impl(
            x, w_gate, w_up, w_down, capacity, spill_rows, normalization, backend, threshold)
        ctx.save_for_backward(x, w_gate, w_up, w_down, mask, vals, side, slot)  # (intermediates: no double backward)
        ctx.spill_rows, ctx.normalization, ctx.backend = spill_rows, normalization, backend
        ctx.mark_non_differentiable(nnz_rows, act_rows, fired)
        return y, l1, nnz_rows, act_rows, fired

    @staticmethod
    def backward(ctx, dy, dl1, *unused):
        return (*_backward(ctx, dy, dl1, _bwd_impl), None, None, None, None, None)


# ------------------------------------------------------------------------------------------------ public API
def _check(x, w_gate, w_up, w_down, normalization, capacity, spill_rows, backend, threshold=None) -> None:
    problems = []
    if normalization not in NORMALIZATIONS:
        problems.append(f"normalization={normalization!r} is not one of {NORMALIZATIONS}")
    if backend not in BACKENDS:
        problems.append(f"backend={backend!r} is not one of {BACKENDS}")
    d, f = x.shape[-1], w_gate.shape[0]
    want = {"w_gate": (f, d), "w_up": (f, d), "w_down": (d, f)}
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if tuple(w.shape) != want[name]:
            problems.append(f"{name} has shape {tuple(w.shape)}, expected {want[name]} for x[..., {d}] and F={f} "
                            "(nn.Linear layout: w_gate/w_up [F, d], w_down [d, F])")
        elif w.dtype != x.dtype or w.device != x.device:
            problems.append(f"{name} is {w.dtype} on {w.device} but x is {x.dtype} on {x.device} (outside autocast "
                            "all four must match)")
    if capacity is not None and capacity < 1:
        problems.append(f"capacity={capacity} must be >= 1 (values kept per row)")
    if spill_rows is not None and spill_rows < 0:
        problems.append(f"spill_rows={spill_rows} must be >= 0")
    if threshold is not None and (threshold.dtype != torch.float32 or tuple(threshold.shape) != (f,)
                                  or threshold.device != x.device):
        problems.append(f"threshold is {threshold.dtype} {tuple(threshold.shape)} on {threshold.device}, expected "
                        f"float32 ({f},) on {x.device} (one theta per neuron, float32 whatever x's dtype)")
    if problems:
        raise ValueError("sparse_ffn_train: " + "; ".join(problems) + ".")


def sparse_ffn_train(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    normalization: str = "sum_hidden",
    capacity: int | None = None,
    spill_rows: int | None = None,
    backend: str = "auto",
    row_counts: bool = False,
    threshold: torch.Tensor | None = None,
):
    """The FFN of a ReLU-gated layer for training, saving packed activations (module docstring).

    Args:
        x: [..., d] (bf16/fp16/fp32; under autocast it and the weights are cast like F.linear casts them).
        w_gate, w_up: [F, d]; w_down: [d, F] (nn.Linear weights, no bias).
        normalization: "sum_hidden" (l1 = sum |h| / tokens) or "mean" (l1 = mean |h|), as sparsity.normalization.
        capacity: packed values kept per row (C); rows with more active slots overflow (lossless, slower
            and larger). None: default_capacity(F) = F / 4. Pick ~1.25x the per-row p99 of active slots.
        spill_rows: rows of the dense side buffer for overflowing rows (R); None: max(16, M / 32). Rows
            beyond it are recomputed in backward.
        backend: "auto" (Triton on CUDA, or on CPU under TRITON_INTERPRET=1 in fp32; else torch), "triton",
            "torch" (the reference implementation of the same format).
        row_counts: also return the per-row count of active slots [M] int32 (for choosing the capacity).
        threshold: theta [F] float32 (not cast under autocast): act(g) = g * [g > theta] instead of relu, with
            its exact gradient (zero at g <= theta; none for theta).

    Returns:
        y [..., d] in the compute dtype; l1: fp32 scalar with grad; nnz: int64 scalar, count of h != 0;
        fired: [F] bool, h != 0 in some row; (+ active slots per row [M] int32 with row_counts=True).
    """
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        x, w_gate, w_up, w_down = x.to(dt), w_gate.to(dt), w_up.to(dt), w_down.to(dt)
    _check(x, w_gate, w_up, w_down, normalization, capacity, spill_rows, backend, threshold)
    d, f = x.shape[-1], w_gate.shape[0]
    x2d = x.reshape(-1, d)
    if x2d.stride(-1) != 1 or x2d.stride(0) != d:
        x2d = x2d.contiguous()
    m = x2d.shape[0]
    capacity = min(int(capacity), f) if capacity is not None else default_capacity(f)
    spill_rows = int(spill_rows) if spill_rows is not None else default_spill_rows(m)
    args = (x2d, w_gate.contiguous(), w_up.contiguous(), w_down.contiguous(), capacity, spill_rows, normalization,
            backend, threshold)
    if torch.compiler.is_compiling():  # an opaque node for dynamo / AOTAutograd / inductor
        y, l1, nnz_rows, act_rows, fired = _fwd_op(*args)[:5]
    else:
        y, l1, nnz_rows, act_rows, fired = _EagerFFN.apply(*args)
    # fired holds 0/1 bytes. `!= 0`, not a bool view: inductor cannot lower view(dtype=bool) (torch 2.11)
    out = (y.reshape(*x.shape[:-1], w_down.shape[0]), l1, nnz_rows.sum(dtype=torch.int64), fired != 0)
    return out + (act_rows,) if row_counts else out


def ffn_train_reference(x, w_gate, w_up, w_down, normalization: str = "sum_hidden", threshold=None):
    """The dense expression under plain autograd (the oracle of the tests and the benchmark's baseline):
    (y, l1, nnz, fired) computed as the training MLP computes them from h; threshold: theta [F] or None (relu)."""
    h = threshold_act(F.linear(x, w_gate), threshold) * F.linear(x, w_up)  # [..., F]
    a = h.abs()
    l1 = a.float().sum(-1).mean() if normalization == "sum_hidden" else a.float().mean()
    nz = h != 0
    return F.linear(h, w_down), l1, nz.sum(), nz.flatten(0, -2).any(0)
