"""Tiny real models for tests: a byte-level BPE trained on the sample text and a two-layer ReLU Llama, saved as a
model folder; tiny configs for synth and for every family. No downloads; a second or so on CPU."""

from pathlib import Path

import torch

TEXT = Path(__file__).parent / "data" / "sample_text.txt"
# a config for `sparsify synth` (a SiLU Llama of 3 layers; synth makes it a ReLU folder of chosen sparsity)
SYNTH_CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 384, "num_hidden_layers": 3,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "hidden_act": "silu",
                "max_position_embeddings": 512, "tie_word_embeddings": False}
# a tiny config of every supported family (make_source)
FAMILY_CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
# family-specific extras a tiny config needs
FAMILY_EXTRA = {
    "gemma2": dict(sliding_window=16, query_pre_attn_scalar=8),
    "gemma3_text": dict(sliding_window=16, query_pre_attn_scalar=8),
}


def make_source(model_type: str, folder):
    """A tiny random model of the family `model_type` (FAMILY_CONFIG; weights ~ N(0, 0.2), norms included) saved
    to `folder`: a source for convert. Returns the model."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    torch.manual_seed(0)
    config = CONFIG_MAPPING[model_type](**FAMILY_CONFIG, **FAMILY_EXTRA.get(model_type, {}))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # non-trivial weights everywhere, norms included
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(folder)
    return model


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


def thresholded_copy(folder: Path, out: Path, seed: int = 0, scale: float = 0.5) -> list:
    """`out`: the sparsify folder `folder` with per-neuron thresholds, written the way an export writes one: config
    THRESHOLD_ACT in the family's activation field and `sparsify.threshold`, state dict `<mlp path>.threshold`
    (float32) through save_model_folder. theta uniform in [0, scale) with every 4th at 0 (relu) and every 9th at
    1e4 (never active). Returns the thetas, one [F] tensor per layer."""
    import json
    import shutil

    from sparsify.evaluation.loading import installed_modeling
    from sparsify.families import THRESHOLD_ACT, family_for, mlp_modules
    from sparsify.folder.format import save_model_folder

    src = out.parent / f".{out.name}.relu"
    shutil.copytree(folder, src)
    config = json.loads((src / "config.json").read_text())
    family = family_for(config)
    config[family.act_field] = THRESHOLD_ACT
    config["sparsify"]["threshold"] = {"mode": "neuron"}
    (src / "config.json").write_text(json.dumps(config))
    model = getattr(installed_modeling(), f"Sparse{family.causal_lm}").from_pretrained(src)  # thresholds at 0
    gen = torch.Generator().manual_seed(seed)
    thetas = []
    for mlp in mlp_modules(model):
        theta = torch.rand(mlp.threshold.shape, generator=gen) * scale
        theta[::4], theta[1::9] = 0.0, 1e4
        mlp.threshold.copy_(theta)
        thetas.append(theta)
    tok = None
    if (src / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(src)
    save_model_folder(model, tok, out, provenance={})
    shutil.rmtree(src)
    return thetas
