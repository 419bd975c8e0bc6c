"""The exported modeling code on CUDA: SparseMLP routes inference through twell_ffn (GPU only)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from sparsify.architectures import mlp_modules
from sparsify.convert import convert

from .test_architectures import make_source


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_remote_code_runs_twell_kernels_on_cuda(model_type, tmp_path):
    make_source(model_type, tmp_path / "src")
    out = convert(tmp_path / "src", tmp_path / "out", progress=False)
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).cuda().eval()
    ids = torch.randint(0, 96, (3, 17), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        model.set_ffn_backend("dense")
        dense = model(ids).logits
        model.set_ffn_backend("twell")
        twell = model(ids).logits
        assert {m.last_path for m in mlp_modules(model)} == {"twell_ffn:twell"}
        model.set_ffn_backend("auto")
        auto = model(ids).logits
        assert {m.last_path for m in mlp_modules(model)} <= {"twell_ffn:twell", "twell_ffn:dense"}
    # fp32 end to end; TF32 matmuls in the kernels give ~1e-3 relative error at most
    scale = dense.abs().max().item()
    assert (twell - dense).abs().max().item() <= 2e-3 * scale
    assert (auto - dense).abs().max().item() <= 2e-3 * scale
    out_ids = model.generate(ids[:1, :4], max_new_tokens=6, do_sample=False)
    assert out_ids.shape == (1, 10)
    # training mode always calls the nn.Linear modules (LoRA / autograd)
    model.train()
    model(ids).logits.sum().backward()
    assert {m.last_path for m in mlp_modules(model)} == {"torch"}
