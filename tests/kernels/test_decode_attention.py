"""Grouped-query attention in one-token decode steps (fast_decode.decode_sdpa): the KV heads attended as they
are, never a copy of the cache per query head, with transformers' sdpa result."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sparsify.kernels import fast_decode as fd


def _tiny(heads=4, kv=2, seed=0, attn="sdpa"):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256)
    return LlamaForCausalLM._from_config(cfg, attn_implementation=attn).eval()


class _Module(torch.nn.Module):  # what the attention function reads off its module
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.training = groups, True, False


@pytest.mark.parametrize("mode", ["fold", "enable_gqa"])
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


@pytest.mark.parametrize("mode", ["fold", "enable_gqa"])
def test_fast_decode_switches_gqa_models_and_generates_the_same_tokens(tmp_path, monkeypatch, mode):
    """enable_fast_decode puts a GQA model on sdpa onto DECODE_SDPA; its greedy tokens on a static cache (the
    graph loop, emulated on CPU) are transformers' own sdpa ones; the saved config does not name it (a fresh
    process loads the folder on plain sdpa)."""
    monkeypatch.setattr(fd, "GQA_DECODE", mode)
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
    model.save_pretrained(tmp_path)
    assert "sparsify" not in json.dumps(json.loads((tmp_path / "config.json").read_text()))


@pytest.mark.parametrize("heads, kv, attn", [(4, 4, "sdpa"), (4, 2, "eager")])
def test_models_without_grouping_or_on_another_attention_keep_theirs(heads, kv, attn):
    model = _tiny(heads, kv, attn=attn)
    assert fd.enable_fast_decode(model).attention is None
    assert model.config._attn_implementation == attn
