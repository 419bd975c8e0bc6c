"""Grouped-query attention in one-token decode steps (fast_decode.decode_sdpa): the KV heads attended as they
are, never a copy of the cache per query head, with transformers' sdpa result."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sparsify.kernels import fast_decode as fd
from sparsify.kernels.decode_attention import CROP_BLOCK_N, decode_attention_crop


def _tiny(heads=4, kv=2, seed=0, attn="sdpa"):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256)
    return LlamaForCausalLM._from_config(cfg, attn_implementation=attn).eval()


class _Module(torch.nn.Module):  # what the attention function reads off its module
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.training = groups, True, False


@pytest.mark.parametrize("mode", ["fold", "enable_gqa", "crop"])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float-per-head", "longer"])
def test_decode_step_equals_transformers_sdpa(monkeypatch, mode, mask_kind):
    """One query token, 8 query heads on 2 KV heads: decode_sdpa equals sdpa_attention_forward (which repeats
    the KV heads) for no mask, a boolean padding mask, an additive mask per head, and a mask longer than the
    keys (sliced); the fold mode hands SDPA queries of shape [B, Hkv, groups, D], never repeated keys."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    monkeypatch.setattr(fd, "GQA_DECODE", mode)
    g = torch.Generator().manual_seed(3)
    B, H, KV, L, D = 3, 8, 2, 11, 16
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = torch.randn(B, KV, L, D, generator=g), torch.randn(B, KV, L, D, generator=g)
    mask = None
    if mask_kind == "bool":
        mask = torch.ones(B, 1, 1, L, dtype=torch.bool)
        mask[0, ..., :4] = False  # row 0 left-padded
    elif mask_kind == "float-per-head":
        mask = torch.randn(B, H, 1, L, generator=g)
    elif mask_kind == "longer":
        mask = torch.ones(B, 1, 1, L + 5, dtype=torch.bool)
        mask[1, ..., 2] = False
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, *args, **kwargs):
        seen.append((tuple(query.shape), tuple(key.shape), kwargs.get("enable_gqa", False)))
        return sdpa(query, key, *args, **kwargs)

    module = _Module(H // KV)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    got, _ = fd.decode_sdpa(module, q, k, v, mask, scaling=0.3)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    ref_mask = None if mask is None else mask[..., :L]
    ref = sdpa(q, repeat_kv(k, H // KV), repeat_kv(v, H // KV), attn_mask=ref_mask, scale=0.3).transpose(1, 2)
    stock, _ = sdpa_attention_forward(module, q, k, v, ref_mask, scaling=0.3)
    assert got.shape == (B, 1, H, D)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, stock, rtol=1e-5, atol=1e-6)
    if mode == "crop" and mask_kind in ("bool", "longer"):  # the crop kernel serves boolean masks: no SDPA call
        assert seen == []
    else:  # crop without a boolean mask falls back to enable_gqa
        assert seen == [((B, KV, H // KV, D), (B, KV, L, D), False)] if mode == "fold" else \
            seen == [((B, H, 1, D), (B, KV, L, D), True)]


def test_prefill_and_ungrouped_calls_are_transformers_own(monkeypatch):
    """More than one query token (prefill), or one KV head per query head: transformers' function runs."""
    import transformers.integrations.sdpa_attention as sa

    calls = []
    real = sa.sdpa_attention_forward
    monkeypatch.setattr(sa, "sdpa_attention_forward", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    q = torch.randn(2, 4, 5, 8)
    fd.decode_sdpa(_Module(2), q, torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8), None)
    fd.decode_sdpa(_Module(1), q[:, :, :1], torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), None)
    assert calls == [(2, 4, 5, 8), (2, 4, 1, 8)]


@pytest.mark.parametrize("mode", ["fold", "enable_gqa", "crop"])
def test_fast_decode_switches_gqa_models_and_generates_the_same_tokens(tmp_path, monkeypatch, mode):
    """enable_fast_decode puts a GQA model on sdpa onto DECODE_SDPA; its greedy tokens on a static cache (the
    graph loop, emulated on CPU) are transformers' own sdpa ones; the saved config does not name it (a fresh
    process loads the folder on plain sdpa)."""
    monkeypatch.setattr(fd, "GQA_DECODE", mode)
    served = []
    crop = fd.decode_attention_crop
    monkeypatch.setattr(fd, "decode_attention_crop", lambda *a: served.append(crop(*a) is not None) or crop(*a))
    ref, model = _tiny(), _tiny()
    fast = fd.enable_fast_decode(model)
    fast.cpu_emulation = True
    assert fast.attention == fd.DECODE_SDPA == model.config._attn_implementation
    assert all(layer.self_attn.config._attn_implementation == fd.DECODE_SDPA for layer in model.model.layers)
    ids = torch.randint(0, 97, (3, 7), generator=torch.Generator().manual_seed(1))
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                        cache_implementation="static", pad_token_id=0)
    got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert fast.loops == 1 and fast.replays > 0
    assert torch.equal(want, got)
    assert (mode == "crop") == bool(served) and all(served)  # crop: the kernel served every decode step
    model.save_pretrained(tmp_path)
    assert "sparsify" not in json.dumps(json.loads((tmp_path / "config.json").read_text()))


@pytest.mark.parametrize("heads, kv, attn", [(4, 4, "sdpa"), (4, 2, "eager")])
def test_models_without_grouping_or_on_another_attention_keep_theirs(heads, kv, attn):
    model = _tiny(heads, kv, attn=attn)
    assert fd.enable_fast_decode(model).attention is None
    assert model.config._attn_implementation == attn


def _crop_case(B, KV, G, L, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, KV * G, 1, D, generator=g).to(dtype)
    k, v = (torch.randn(B, KV, L, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("G, L, D", [(3, 150, 64), (4, 2 * CROP_BLOCK_N, 16), (2, 37, 32)])
def test_crop_kernel_equals_sdpa_and_never_uses_masked_blocks(G, L, D):
    """The crop kernel against SDPA on the repeated KV heads (fp32): a static cache filled to different lengths per
    row (row 0 to 70 positions: its later blocks wholly masked), a left-padded row, a row with one position, a
    hole spanning a whole block; NaN written into every masked position changes nothing (masked positions are
    never loaded); a mask broadcast over the batch; bf16 within bf16 rounding."""
    from transformers.integrations.sdpa_attention import repeat_kv

    B, KV = 4, 2
    q, k, v = _crop_case(B, KV, G, L, D, torch.float32, seed=G + L)
    mask = torch.zeros(B, 1, 1, L, dtype=torch.bool)
    mask[0, ..., :min(70, L)] = True
    mask[1, ..., 5:] = True  # left padding
    mask[2, ..., 0] = True
    mask[3] = True
    mask[3, ..., -1] = False
    if L > 2 * CROP_BLOCK_N:
        mask[3, ..., CROP_BLOCK_N:2 * CROP_BLOCK_N] = False  # a whole block in the middle
    want = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, G), repeat_kv(v, G), attn_mask=mask,
                                                            scale=0.2)
    dirty_k, dirty_v = k.clone(), v.clone()
    hidden = ~mask[:, 0, 0, :]
    dirty_k[hidden.unsqueeze(1).expand(B, KV, L)] = float("nan")
    dirty_v[hidden.unsqueeze(1).expand(B, KV, L)] = float("nan")
    got = decode_attention_crop(q, dirty_k, dirty_v, mask, 0.2)
    assert got is not None and got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    empty = torch.zeros(B, 1, 1, L, dtype=torch.bool)  # nothing to attend: 0, as SDPA
    torch.testing.assert_close(decode_attention_crop(q, k, v, empty), torch.zeros_like(q))
    torch.testing.assert_close(torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, G), repeat_kv(v, G),
                                                                              attn_mask=empty), torch.zeros_like(q))
    shared = torch.ones(1, 1, 1, L, dtype=torch.bool)
    shared[..., : L // 3] = False
    want = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, G), repeat_kv(v, G), attn_mask=shared)
    torch.testing.assert_close(decode_attention_crop(q, k, v, shared), want, rtol=1e-5, atol=1e-5)  # scale 1/sqrt(D)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    got = decode_attention_crop(qb, kb, vb, mask, 0.2)
    want = torch.nn.functional.scaled_dot_product_attention(qb.float(), repeat_kv(kb.float(), G),
                                                            repeat_kv(vb.float(), G), attn_mask=mask, scale=0.2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2.0**-6, atol=2e-2)


def test_crop_kernel_declines_what_it_does_not_serve():
    """None (the caller runs SDPA) for: no mask, a float mask, a per-head mask, a head size not a power of two
    >= 16, more than one query token."""
    q, k, v = _crop_case(2, 2, 2, 20, 16, torch.float32, seed=1)
    ok = torch.ones(2, 1, 1, 20, dtype=torch.bool)
    assert decode_attention_crop(q, k, v, ok) is not None
    assert decode_attention_crop(q, k, v, None) is None
    assert decode_attention_crop(q, k, v, ok.float()) is None
    assert decode_attention_crop(q, k, v, torch.ones(2, 4, 1, 20, dtype=torch.bool)) is None
    q12, k12, v12 = _crop_case(2, 2, 2, 20, 12, torch.float32, seed=2)
    assert decode_attention_crop(q12, k12, v12, ok) is None
    assert decode_attention_crop(q.expand(2, 4, 3, 16), k, v, ok) is None


@pytest.mark.gpu
def test_gpu_crop_kernel_equals_sdpa_at_gendata_shapes_under_a_graph():
    """bf16 on CUDA at gendata's SmolLM2 shape (9 query heads on 3 KV heads, head size 64, a 768-position cache)
    and batch 256, each row filled to its own length (1..768), against SDPA in fp32 on the same bf16 values;
    replayed from a CUDA graph after the cache and mask change in place, as the decode loop does."""
    from transformers.integrations.sdpa_attention import repeat_kv

    torch.manual_seed(0)
    B, KV, G, L, D = 256, 3, 3, 768, 64
    q = torch.randn(B, KV * G, 1, D, device="cuda").bfloat16()
    k, v = (torch.randn(B, KV, L, D, device="cuda").bfloat16() for _ in range(2))
    mask = torch.zeros(B, 1, 1, L, dtype=torch.bool, device="cuda")

    def fill(seed):
        lengths = torch.randint(1, L + 1, (B,), generator=torch.Generator().manual_seed(seed)).cuda()
        mask.copy_((torch.arange(L, device="cuda") < lengths[:, None])[:, None, None, :])

    def want():
        return torch.nn.functional.scaled_dot_product_attention(q.float(), repeat_kv(k.float(), G),
                                                                repeat_kv(v.float(), G), attn_mask=mask, scale=0.125)

    fill(1)
    got = decode_attention_crop(q, k, v, mask, 0.125)
    torch.testing.assert_close(got.float(), want(), rtol=2.0**-7, atol=1e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention_crop(q, k, v, mask, 0.125)
    fill(2)
    k.copy_(torch.randn_like(k, dtype=torch.float32).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), want(), rtol=2.0**-7, atol=1e-2)


@pytest.mark.gpu
def test_gpu_crop_decode_sdpa_under_torch_compile():
    """decode_sdpa in crop mode through torch.compile (how decode steps run) equals SDPA on the repeated heads."""
    from transformers.integrations.sdpa_attention import repeat_kv

    torch.manual_seed(1)
    B, KV, G, L, D = 64, 3, 3, 768, 64
    q = torch.randn(B, KV * G, 1, D, device="cuda").bfloat16()
    k, v = (torch.randn(B, KV, L, D, device="cuda").bfloat16() for _ in range(2))
    mask = (torch.arange(L, device="cuda") < torch.randint(1, L + 1, (B, 1), device="cuda"))[:, None, None, :]
    old, fd.GQA_DECODE = fd.GQA_DECODE, "crop"
    try:
        step = torch.compile(lambda q, k, v, m: fd.decode_sdpa(_Module(G), q, k, v, m, scaling=0.125)[0])
        got = step(q, k, v, mask)
    finally:
        fd.GQA_DECODE = old
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), repeat_kv(k.float(), G), repeat_kv(v.float(), G),
                                                            attn_mask=mask, scale=0.125).transpose(1, 2)
    torch.testing.assert_close(got.float(), want, rtol=2.0**-7, atol=1e-2)
