"""sparsify synth: random-weight folders whose FFN activations have the requested zeros, per layer."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sparsify.cli import main as cli
from sparsify.errors import SparsifyError
from sparsify.folder.synth import measure_zeros, neuron_rates, synth

from tests.tiny import SYNTH_CONFIG as TINY

PHI3 = {"model_type": "phi3", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 400, "hidden_act": "silu",
        "max_position_embeddings": 512, "tie_word_embeddings": True, "pad_token_id": 0}


@pytest.mark.parametrize("config, zeros", [(TINY, 0.9), (TINY, 0.6), (PHI3, 0.95)])
def test_synth_zeros_per_layer_within_one_point_on_fresh_tokens(config, zeros, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    record = synth(tmp_path / "config.json", tmp_path / "out", zeros=zeros, dtype="fp32", progress=False)
    assert all(abs(z - zeros) <= 0.01 for z in record["zeros_per_layer"]), record
    # loads as a normal folder (stock class, dense ReLU) with its tokenizer; measured again on other tokens
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok("<3> <4>").input_ids == [3, 4]
    ids = torch.randint(0, config["vocab_size"], (8, 128), generator=torch.Generator().manual_seed(123))
    measured = measure_zeros(model, ids)
    assert len(measured) == config["num_hidden_layers"]
    assert all(abs(z - zeros) <= 0.01 for z in measured), measured
    saved = json.loads((tmp_path / "out" / "config.json").read_text())["sparsify"]
    assert saved["synthetic"]["zeros_requested"] == zeros and "speed, not quality" in saved["synthetic"]["note"]
    assert abs(saved["sparsity"] - zeros) <= 0.01
    assert str(tmp_path) not in json.dumps(saved), "no machine-local path in the folder's config"


def test_synth_neuron_rates_are_skewed_with_the_requested_mean():
    p = neuron_rates(4096, 0.9, 1.0, torch.Generator().manual_seed(0))
    assert float(p.mean()) == pytest.approx(0.1, abs=1e-6)
    assert float(p.max()) > 5 * float(p.mean()) and float(p.min()) < 0.2 * float(p.mean())
    flat = neuron_rates(64, 0.9, 0.0, torch.Generator().manual_seed(0))
    assert torch.allclose(flat, torch.full_like(flat, 0.1))


def test_synth_keeps_layers_and_refuses_bad_input(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "num_hidden_layers": 6}))
    record = synth(tmp_path, tmp_path / "two", zeros=0.8, layers=2, dtype="bf16", progress=False)
    assert len(record["zeros_per_layer"]) == 2
    assert json.loads((tmp_path / "two" / "config.json").read_text())["num_hidden_layers"] == 2
    with pytest.raises(SparsifyError, match="strictly between 0 and 1"):
        synth(tmp_path, tmp_path / "bad", zeros=1.0, progress=False)
    with pytest.raises(SparsifyError, match="neither a config.json file"):
        synth(tmp_path / "missing.json", tmp_path / "bad", progress=False)
    (tmp_path / "opt").mkdir()
    (tmp_path / "opt" / "config.json").write_text(json.dumps({"model_type": "opt"}))
    with pytest.raises(SparsifyError, match="not gated"):
        synth(tmp_path / "opt", tmp_path / "bad", progress=False)
    assert not (tmp_path / "bad").exists()
    assert cli(["synth", str(tmp_path), "-o", str(tmp_path / "two"), "--zeros", "0.8"]) == 2  # exists: refused
    assert "already exists" in capsys.readouterr().err


def test_synth_refuses_before_building(tmp_path, monkeypatch):
    """An existing output, a config that is not JSON and a CUDA device without CUDA are refused with the fix, before
    any model is built (the build and calibration take minutes at real sizes)."""
    import sparsify.folder.synth as synth_module

    def no_build(*a, **kw):
        raise AssertionError("built a model before refusing")

    monkeypatch.setattr(synth_module, "calibrate", no_build)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "taken").mkdir()
    with pytest.raises(SparsifyError, match="already exists; pass --overwrite"):
        synth(tmp_path, tmp_path / "taken", progress=False)
    (tmp_path / "notjson.json").write_text("model_type: llama\n")
    with pytest.raises(SparsifyError, match="notjson.json is not a JSON model config"):
        synth(tmp_path / "notjson.json", tmp_path / "bad", progress=False)
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(SparsifyError, match="holds JSON but not a config object"):
        synth(tmp_path / "list.json", tmp_path / "bad", progress=False)
    with pytest.raises(SparsifyError, match="'nope' is not a device"):
        synth(tmp_path, tmp_path / "bad", device="nope", progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(SparsifyError, match="no CUDA GPU"):
            synth(tmp_path, tmp_path / "bad", device="cuda", progress=False)
    with pytest.raises(SparsifyError, match="--layers 4: the config has 3 decoder layers; pass at most 3"):
        synth(tmp_path, tmp_path / "bad", layers=4, device="cpu", progress=False)  # (999 built 999 layers)
    # more than the memory available now (a 70B config on a 24 GB machine grew to 16 GB before it was stopped):
    # refused with the number of layers that fits, counted from the config's own parameter count
    params = {n: sum(p.numel() for p in synth_module._random_model(TINY, n, torch.device("meta"), False)
                     .parameters()) for n in (1, 2, 3)}
    per_layer, base = params[2] - params[1], 2 * params[1] - params[2]
    monkeypatch.setattr(synth_module, "available_memory", lambda: synth_module.BUILD_BYTES * (base + 2 * per_layer))
    with pytest.raises(SparsifyError, match=r"needs ~0\.0 GiB .* pass --layers 2 or fewer"):
        synth(tmp_path, tmp_path / "bad", device="cpu", progress=False)
    # room for the embeddings but not for them and one layer: not even --layers 1 (it said "the embeddings alone")
    monkeypatch.setattr(synth_module, "available_memory", lambda: synth_module.BUILD_BYTES * (base + per_layer // 2))
    with pytest.raises(SparsifyError, match="not even one layer fits"):
        synth(tmp_path, tmp_path / "bad", layers=1, device="cpu", progress=False)
    assert not (tmp_path / "bad").exists()
