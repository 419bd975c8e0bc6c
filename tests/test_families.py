"""Every supported family, tiny random config, no downloads:
convert -> stock load and trust_remote_code load -> logits equal the source model with its gate
activation replaced by ReLU; weights bit-identical to the source."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from sparsify.families import FAMILIES, family_for, mlp_modules
from sparsify.folder.convert import convert

from tests.tiny import FAMILY_CONFIG, make_source

def relu_reference(model):
    """The source model with each gated MLP's activation replaced by ReLU: the function convert promises."""
    for mlp in mlp_modules(model):
        for attr in ("act_fn", "activation_fn"):
            if hasattr(mlp, attr):
                setattr(mlp, attr, torch.nn.ReLU())
    return model.eval()


@pytest.mark.parametrize("model_type", [f.model_type for f in FAMILIES])
def test_family_convert_and_load(model_type, tmp_path):
    family = [f for f in FAMILIES if f.model_type == model_type][0]
    source = make_source(model_type, tmp_path / "src")
    out = convert(tmp_path / "src", tmp_path / "out", progress=False)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model_type
    assert config[family.act_field] == "relu"
    assert config["sparsify"]["source_activation"] == getattr(source.config, family.act_field)

    src_weights = load_file(tmp_path / "src" / "model.safetensors")
    out_weights = load_file(out / "model.safetensors")
    assert src_weights.keys() == out_weights.keys()
    for k in src_weights:
        assert torch.equal(src_weights[k], out_weights[k]), k
    assert (tmp_path / "src" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()

    ids = torch.randint(0, FAMILY_CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = relu_reference(source)(ids).logits
        silu = AutoModelForCausalLM.from_pretrained(tmp_path / "src").eval()(ids).logits
        stock = AutoModelForCausalLM.from_pretrained(out).eval()
        remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
        stock_logits, remote_logits = stock(ids).logits, remote(ids).logits
    assert type(stock).__name__ == family.causal_lm
    # the sparse class carries the base's __name__ (what pipelines check), Sparse<Base> as its __qualname__ (Phi-3:
    # transformers subclasses a remote class with its own prepare_inputs_for_generation, under the same __name__)
    assert type(remote).__name__ == family.causal_lm and type(remote) is not type(stock)
    assert "Sparse" + family.causal_lm in [c.__qualname__ for c in type(remote).__mro__]
    assert getattr(stock.config, family.act_field) == "relu"
    assert not torch.allclose(silu, ref, atol=1e-3), "test is blind: ReLU and the source activation agree"
    torch.testing.assert_close(stock_logits, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(remote_logits, ref, rtol=0, atol=1e-5)
    assert all(type(m).__name__ == "SparseMLP" for m in mlp_modules(remote))
    assert {m.last_path for m in mlp_modules(remote)} == {"torch"}  # CPU: dense torch path


def test_family_for_rejects_with_supported_list():
    with pytest.raises(Exception, match=r"not a supported gated-MLP family.*Llama"):
        family_for({"model_type": "falcon"})
    with pytest.raises(Exception, match=r"not gated"):
        family_for({"model_type": "gpt2"})
    with pytest.raises(Exception, match=r"hidden_act='tanh'"):
        family_for({"model_type": "llama", "hidden_act": "tanh"})


def test_threshold_activation_name_is_the_shipped_codes_and_a_known_one():
    """The families table accepts a thresholded folder's activation field, spelled as the shipped modeling code
    spells it (that file cannot import sparsify, so both define the string)."""
    from sparsify.families import THRESHOLD_ACT, thresholded
    from sparsify.kernels.modeling_sparsify import THRESHOLD_ACT as SHIPPED

    assert THRESHOLD_ACT == SHIPPED and "trust_remote_code=True" in THRESHOLD_ACT
    config = {"model_type": "gemma2", "hidden_activation": THRESHOLD_ACT, "sparsify": {"threshold": {"mode": "layer"}}}
    assert family_for(config).name == "Gemma 2" and thresholded(config)
    assert not thresholded({"model_type": "llama", "sparsify": {}}) and not thresholded({"model_type": "llama"})
