"""Perplexity against a plain forward, sliding windows scoring each token once, the profile through SparseMLP."""

from __future__ import annotations

import math
import pytest
import torch

from sparsify.evaluation import activations as prof
from sparsify.evaluation import loading as ld
from sparsify.evaluation import perplexity as ppl
from sparsify.families import mlp_modules
from tests.tiny import TEXT, thresholded_copy


def test_text_pass_equals_plain_forward_when_the_text_fits(tiny_folders):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_folders[0]).eval()
    tok = AutoTokenizer.from_pretrained(tiny_folders[0])
    text = TEXT.read_text()[:400]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        loss = model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    r = ppl.text_pass(model, tok, text, window=256, max_tokens=None, recorder=None)
    assert r["tokens"] == len(ids) - 1
    assert r["nll"] == pytest.approx(loss, rel=1e-5)
    assert r["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert r["bytes"] == len(text.encode())
    assert r["bits_per_byte"] == pytest.approx(loss * (len(ids) - 1) / math.log(2) / len(text.encode()), rel=1e-5)


def test_sliding_windows_score_and_profile_each_token_once(tiny_folders):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_folders[0]).eval()
    tok = AutoTokenizer.from_pretrained(tiny_folders[0])
    recorder = prof.SparsityRecorder(model)
    r = ppl.text_pass(model, tok, TEXT.read_text(), window=64, max_tokens=300, recorder=recorder)
    recorder.remove()
    assert r["tokens"] == 299  # every token but the first predicted exactly once
    assert recorder.summary()["tokens"] == 300  # every position's h counted exactly once
    full = ppl.text_pass(model, tok, TEXT.read_text(), window=256, max_tokens=300, recorder=None)
    assert r["nll"] > 0 and abs(r["nll"] - full["nll"]) / full["nll"] < 0.1  # less context, same ballpark


def test_converted_model_profiles_through_its_sparse_mlp(tiny_sparse_folder):
    model, tok = ld.load_model(ld.ModelSpec("t", str(tiny_sparse_folder)), "cpu", "auto")
    assert [type(m).__name__ for m in mlp_modules(model)] == ["SparseMLP"] * 2
    model.set_ffn_backend("auto")
    perplexity, profile = ppl.texts_section(model, tok, [TEXT], window=128, max_tokens=200)
    assert profile["tokens"] == 200 and len(profile["layers"]) == 2
    assert (profile["tile"], profile["slots"]) == (128, 16)  # the kernels' prefill layout, recorded
    assert all(m.ffn_backend == "auto" for m in mlp_modules(model))  # restored after the dense-path profile
    assert perplexity["sample_text.txt"]["tokens"] == 199


def test_thresholded_folder_loads_installed_code_and_profiles_h_above_theta(tmp_path, tiny_sparse_folder):
    """A folder with per-neuron thresholds: `sparsify eval`'s loader builds it with the installed classes (bf16
    asked: the thresholds stay float32), and the profile counts h != 0 of g [g > theta] * up, fewer
    non-zeros than the same weights without thresholds."""
    thetas = thresholded_copy(tiny_sparse_folder, tmp_path / "thr", scale=0.05)
    spec = ld.ModelSpec("t", str(tmp_path / "thr"))
    model, tok = ld.load_model(spec, "cpu", "bf16")
    assert spec.code == "installed" and next(model.parameters()).dtype == torch.bfloat16
    assert all(m.threshold.dtype == torch.float32 and torch.equal(m.threshold, t)
               for m, t in zip(mlp_modules(model), thetas))
    plain, _ = ld.load_model(ld.ModelSpec("p", str(tiny_sparse_folder)), "cpu", "bf16")
    nnz = {}
    for name, m in (("thr", model), ("plain", plain)):
        _, profile = ppl.texts_section(m, tok, [TEXT], window=128, max_tokens=100)
        nnz[name] = profile["summary"]["nnz_mean"]
    recorder = prof.SparsityRecorder(model)  # h itself: zero wherever g <= theta
    gates = []
    handle = mlp_modules(model)[0].gate_proj.register_forward_hook(lambda mod, a, out: gates.append(out))
    with torch.no_grad():
        model(torch.tensor([tok(TEXT.read_text()[:300])["input_ids"][:50]]))
    handle.remove()
    recorder.remove()
    g = gates[0][0].float()  # [t, F], bf16 values
    assert recorder.layers[0].result()["nnz_mean"] == pytest.approx(float((g > thetas[0]).sum(1).float().mean()))
    assert 0 < nnz["thr"] < 0.9 * nnz["plain"], nnz
