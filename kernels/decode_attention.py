"""Grouped-query decode attention that reads only the positions it attends to (fast_decode GQA_DECODE "crop").

A one-token step attends over a static cache whose later positions are still empty and masked. SDPA reads every
position and masks afterwards; `_decode_attn_crop` reads the mask first, BLOCK_N positions at a time, and loads keys
and values only for blocks with a position to attend, so a step at position p of an L-position cache reads about
p / L of it (gendata: 512 new tokens in a 768-position cache, about a third on average). One program per (row, KV
head) serves that head's G query heads as one [GP, D] tile (GP = G padded to 16 rows for tl.dot) with the
flash-attention recurrence in fp32 (running max, rescaled sum and accumulator). Loads are widened to fp32 and the
dots run in tf32 (ieee for fp32 inputs): a 16-bit value is exact in tf32, and the probabilities keep 10 bits where a
16-bit dot would keep 7 or 10 (the interpreter's 16-bit tl.dot is wrong, this one is what it tests). The kernel is
memory-bound: the wider dots cost no bytes. `decode_attention_crop` returns None
where it does not serve (no triton, not CUDA or the interpreter, a mask other than bool [B or 1, 1, 1, L], a head
size that is not a power of two >= 16, strided last dimensions): the caller runs SDPA then.
"""

from __future__ import annotations

import os

import torch

from .twell_triton import HAS_TRITON, next_pow2, tl, triton

CROP_BLOCK_N = 64  # cache positions per block: one mask load decides whether the block's K and V are read
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once: the wrapper runs inside compiled decode steps

if HAS_TRITON:

    @triton.jit
    def _decode_attn_crop(q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, L, scale, s_qb, s_qh, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl,
                          s_mb, s_ml, s_ob, s_oh, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                          BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """Program (row b, KV head hk): out[b, hk*G + g] = softmax(q_g K^T * scale over kept positions) V."""
        b = tl.program_id(0).to(tl.int64)
        hk = tl.program_id(1)
        offs_g = tl.arange(0, GP)
        g_ok = offs_g < G
        offs_d = tl.arange(0, D)
        heads = hk * G + offs_g
        q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=g_ok[:, None],
                    other=0.0).to(tl.float32)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        k_base = k_ptr + b * s_kb + hk * s_kh
        v_base = v_ptr + b * s_vb + hk * s_vh
        for n0 in range(0, L, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            keep = tl.load(m_ptr + b * s_mb + offs_n * s_ml, mask=offs_n < L, other=0) != 0  # [BLOCK_N]
            if tl.max(keep.to(tl.int32), 0) > 0:  # a block with nothing to attend is never read
                k = tl.load(k_base + offs_n[:, None] * s_kl + offs_d[None, :], mask=keep[:, None],
                            other=0.0).to(tl.float32)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = tl.where(keep[None, :], (s * scale).to(tl.float32), float("-inf"))  # [GP, BLOCK_N], fp32 (compiled: fp64 scale)
                m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the block keeps a position
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])
                v = tl.load(v_base + offs_n[:, None] * s_vl + offs_d[None, :], mask=keep[:, None],
                            other=0.0).to(tl.float32)
                if IEEE:
                    pv = tl.dot(p, v, input_precision="ieee")
                else:
                    pv = tl.dot(p, v)
                acc = acc * alpha[:, None] + pv
                l_i = l_i * alpha + tl.sum(p, 1)
                m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row with nothing to attend: 0, as SDPA (torch >= 2.5)
        tl.store(o_ptr + b * s_ob + heads[:, None] * s_oh + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=g_ok[:, None])


def decode_attention_crop(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                          scale: float | None = None) -> torch.Tensor | None:
    """query [B, Hq, 1, D], key / value [B, Hkv, L, D] (Hq = G Hkv), mask bool [B or 1, 1, 1, L] (True: attend)
    -> [B, Hq, 1, D] in query's dtype, or None where the kernel does not serve (see the module's docstring)."""
    on_device = query.is_cuda or _INTERPRET
    if not HAS_TRITON or not on_device or mask is None or mask.dtype != torch.bool or mask.dim() != 4:
        return None
    batch, heads, q_len, d = query.shape
    kv, length = key.shape[1], key.shape[2]
    if (q_len != 1 or heads % kv or d < 16 or d != next_pow2(d) or mask.shape[1:3] != (1, 1)
            or mask.shape[0] not in (1, batch) or mask.shape[3] != length or value.shape != key.shape
            or any(t.stride(-1) != 1 for t in (query, key, value))):
        return None
    groups = heads // kv
    out = torch.empty_like(query)
    m = mask.to(torch.uint8)  # (a copy of batch x length bytes: inductor cannot lower a bool view as uint8)
    _decode_attn_crop[(batch, kv)](
        query, key, value, m, out, length, float(scale if scale is not None else d**-0.5),
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), m.stride(0) if m.shape[0] > 1 else 0, m.stride(3),
        out.stride(0), out.stride(1),
        G=groups, GP=max(16, next_pow2(groups)), D=d, BLOCK_N=CROP_BLOCK_N, IEEE=query.dtype == torch.float32,
    )
    return out
