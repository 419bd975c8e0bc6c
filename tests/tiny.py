"""Tiny real models for tests: a byte-level BPE trained on the sample text and a two-layer ReLU Llama, saved as a
model folder. No downloads; a second or so on CPU."""

from pathlib import Path

import torch

TEXT = Path(__file__).parent / "data" / "sample_text.txt"


def tiny_tokenizer():
    """A small byte-level BPE trained on the sample text: real offsets, no downloads, milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT.read_text()], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def tiny_llama(seed: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=300, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, hidden_act="relu",
                      max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def tiny_model_folder(folder: Path, seed: int = 0) -> Path:
    """A tiny ReLU Llama with its tokenizer, saved as a Hugging Face folder."""
    tok = tiny_tokenizer()
    tiny_llama(seed, len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
