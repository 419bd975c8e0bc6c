"""The exported modeling code (CPU): which FFN backend a loaded model starts with, thresholded folders."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from sparsify.evaluation.loading import installed_modeling
from sparsify.families import THRESHOLD_ACT, family_for, mlp_modules
from sparsify.folder.convert import convert
from sparsify.kernels.twell_reference import threshold_act

from tests.tiny import make_source
from tests.tiny import thresholded_copy


@pytest.mark.parametrize("recorded, expected", [(None, "auto"), (0.90, "auto"), (0.985, "auto"),
                                                ({"ffn_backend": "twell", "sparsity": 0.5}, "twell"),
                                                ({"ffn_backend": "dense", "sparsity": 0.99}, "dense")])
def test_default_backend_is_auto_unless_pinned(recorded, expected, tmp_path):
    """The dispatcher decides per layer and regime from measured sparsity; a folder may pin a backend."""
    make_source("llama", tmp_path / "src")
    out = convert(tmp_path / "src", tmp_path / "out", progress=False)
    config = json.loads((out / "config.json").read_text())
    if isinstance(recorded, dict):
        config["sparsify"].update(recorded)
    elif recorded is not None:
        config["sparsify"]["sparsity"] = recorded
    (out / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert {m.ffn_backend for m in mlp_modules(model)} == {expected}
    model.set_ffn_backend("auto")
    assert {m.ffn_backend for m in mlp_modules(model)} == {"auto"}
    with pytest.raises(ValueError, match="backend must be one of"):
        model.set_ffn_backend("fast")


def test_every_copy_of_the_bundle_shares_one_runtime_code(tmp_path):
    """sparsify.kernels and a folder's copy (trust_remote_code) in one process: the folder's modules are distinct,
    but its model's runtime is an instance of the first copy's FFNRuntime, registered in the one registry under
    its key (what the op looks up), and both copies share the process runtime (bare twell_ffn calls)."""
    import subprocess
    import sys
    from pathlib import Path

    make_source("llama", tmp_path / "src")
    out = convert(tmp_path / "src", tmp_path / "out", progress=False)
    code = ("import sys; import sparsify.kernels.ffn_runtime as first, sparsify.kernels.twell_ops; "
            "from sparsify.kernels import registry; "
            "from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True); "
            "pkg = type(m).__module__.rpartition('.')[0]; rt_mod = sys.modules[pkg + '.ffn_runtime']; "
            "slot = registry.SLOT; "
            "print(rt_mod is not first, type(m.ffn_runtime) is first.FFNRuntime is rt_mod.FFNRuntime, "
            "slot.runtimes[m.ffn_runtime.key] is m.ffn_runtime, rt_mod.process_runtime() is first.process_runtime(), "
            "all(l.runtime is m.ffn_runtime for l in m.ffn_runtime.layers), len(m.ffn_runtime.layers))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-6:] == ["True"] * 5 + ["2"]


# ------------------------------------------------------------------------ thresholded folders (theta per neuron)
class ThetaAct(torch.nn.Module):
    """g * [g > theta]: the thresholded activation put into a stock model (the reference for SparseMLP)."""

    def __init__(self, theta):
        super().__init__()
        self.register_buffer("theta", theta)

    def forward(self, g):
        return threshold_act(g, self.theta)


def stock_with_thetas(relu_folder, thetas):
    """The stock class of a ReLU folder with each MLP's activation replaced by ThetaAct(theta of its layer)."""
    model = AutoModelForCausalLM.from_pretrained(relu_folder).eval()
    for mlp, theta in zip(mlp_modules(model), thetas):
        setattr(mlp, "act_fn" if hasattr(mlp, "act_fn") else "activation_fn", ThetaAct(theta))
    return model


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "phi3"])
def test_thresholded_folder_loads_with_its_thresholds(model_type, tmp_path):
    """A folder with thetas, loaded through the installed class and through trust_remote_code: the buffers hold
    the saved float32 values, the model computes the stock model with g * [g > theta] (CPU torch path, plain
    autograd), the config keeps THRESHOLD_ACT, and save_pretrained writes the same folder back."""
    make_source(model_type, tmp_path / "src")
    relu = convert(tmp_path / "src", tmp_path / "relu", progress=False)
    thetas = thresholded_copy(relu, tmp_path / "thr")
    config = json.loads((tmp_path / "thr" / "config.json").read_text())
    family = family_for(config)
    field = family.act_field
    assert config[field] == THRESHOLD_ACT and config["sparsify"]["threshold"] == {"mode": "neuron"}
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = stock_with_thetas(relu, thetas)(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(relu).eval()(ids).logits
    assert (want - plain).abs().max() > 1e-3, "the thresholds change nothing: the test is blind"
    installed = getattr(installed_modeling(), f"Sparse{family.causal_lm}")
    for model in (installed.from_pretrained(tmp_path / "thr"),
                  AutoModelForCausalLM.from_pretrained(tmp_path / "thr", trust_remote_code=True)):
        model.eval()
        assert getattr(model.config, field) == THRESHOLD_ACT
        assert [m.threshold.dtype for m in mlp_modules(model)] == [torch.float32] * len(thetas)
        assert all(torch.equal(m.threshold, t) for m, t in zip(mlp_modules(model), thetas))
        assert "model.layers.0.mlp.threshold" in model.state_dict()
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=1e-5)
        assert {m.last_path for m in mlp_modules(model)} == {"torch"}
    model.train()  # the torch path's gradients: those of the stock model with ThetaAct
    model(ids).logits.square().mean().backward()
    stock = stock_with_thetas(relu, thetas).train()
    stock(ids).logits.square().mean().backward()
    mlp_name = "gate_up_proj" if model_type == "phi3" else "gate_proj"
    got, ref_grad = (getattr(mlp_modules(m)[0], mlp_name).weight.grad for m in (model, stock))
    torch.testing.assert_close(got, ref_grad, rtol=1e-4, atol=1e-6)
    model.save_pretrained(tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again[field] == THRESHOLD_ACT and again["sparsify"]["threshold"] == {"mode": "neuron"}


def test_threshold_stays_float32_under_any_model_dtype(tmp_path):
    make_source("llama", tmp_path / "src")
    thetas = thresholded_copy(convert(tmp_path / "src", tmp_path / "relu", progress=False), tmp_path / "thr")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "thr", trust_remote_code=True, dtype=torch.bfloat16)

    def exact(what):
        for m, t in zip(mlp_modules(model), thetas):
            assert m.threshold.dtype == torch.float32 and torch.equal(m.threshold, t), what

    exact("bf16 load")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    for what, cast in (("half", lambda m: m.half()), ("to bf16", lambda m: m.to(torch.bfloat16)),
                       ("double", lambda m: m.double()), ("float", lambda m: m.float()),
                       ("to cpu bf16", lambda m: m.to("cpu", torch.bfloat16))):
        cast(model)
        exact(what)
    model = installed_modeling().SparseLlamaForCausalLM.from_pretrained(tmp_path / "thr", dtype=torch.float16)
    exact("fp16 load")
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert model.float()(ids).logits.dtype == torch.float32


def test_stock_transformers_refuses_a_thresholded_folder(tmp_path):
    make_source("llama", tmp_path / "src")
    thresholded_copy(convert(tmp_path / "src", tmp_path / "relu", progress=False), tmp_path / "thr")
    with pytest.raises(KeyError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "thr")


def test_folder_without_thresholds_gets_no_buffer_and_missing_ones_load_as_zero(tmp_path, caplog):
    """A folder written without thresholds: no buffer, no state-dict key. A thresholded config whose weights lack
    them: zeros (plain ReLU) and a warning naming the layers, never uninitialised memory."""
    make_source("llama", tmp_path / "src")
    relu = convert(tmp_path / "src", tmp_path / "relu", progress=False)
    model = AutoModelForCausalLM.from_pretrained(relu, trust_remote_code=True)
    assert all(m.threshold is None for m in mlp_modules(model))
    assert not any("threshold" in k for k in model.state_dict())
    config = json.loads((relu / "config.json").read_text())
    config["hidden_act"], config["sparsify"]["threshold"] = THRESHOLD_ACT, {"mode": "layer"}
    (relu / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="sparsify"):
        model = installed_modeling().SparseLlamaForCausalLM.from_pretrained(relu)
    assert all(torch.equal(m.threshold, torch.zeros(80)) for m in mlp_modules(model))
    assert "no thresholds for model.layers.0.mlp, model.layers.1.mlp" in caplog.text
