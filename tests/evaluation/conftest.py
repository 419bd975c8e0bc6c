"""Shared fixtures: two tiny ReLU Llama folders and a tiny SiLU Llama converted by sparsify."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import tiny_llama, tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory):
    """Two tiny ReLU Llama folders (different weights) with the same tokenizer."""
    tok = tiny_tokenizer()
    root = tmp_path_factory.mktemp("models")
    folders = []
    for seed in (0, 1):
        folder = root / f"tiny{seed}"
        tiny_llama(seed, len(tok)).save_pretrained(folder)
        tok.save_pretrained(folder)
        folders.append(folder)
    return folders


@pytest.fixture(scope="session")
def tiny_sparse_folder(tmp_path_factory):
    """A tiny SiLU Llama converted by sparsify: the remote-code model with SparseMLP (ffn_backend)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparsify.folder.convert import convert

    tok = tiny_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, hidden_act="silu",
                      max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    src = tmp_path_factory.mktemp("silu") / "src"
    LlamaForCausalLM(cfg).save_pretrained(src)
    tok.save_pretrained(src)
    return convert(src, src.parent / "relu", progress=False)
