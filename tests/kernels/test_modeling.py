"""The exported modeling code's defaults (CPU): which FFN backend a loaded model starts with."""

import json

import pytest
from transformers import AutoModelForCausalLM

from sparsify.families import mlp_modules
from sparsify.folder.convert import convert

from tests.test_families import make_source


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


def test_every_copy_of_the_bundle_shares_one_dispatcher(tmp_path):
    """sparsify.kernels and a folder's copy (trust_remote_code) in one process: the op runs the first copy's
    code, so the folder's modules must read that copy's dispatcher (compiled calls decide there)."""
    import subprocess
    import sys
    from pathlib import Path

    make_source("llama", tmp_path / "src")
    out = convert(tmp_path / "src", tmp_path / "out", progress=False)
    code = ("import sys; import sparsify.kernels.twell_ops as first; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True); "
            "ops = sys.modules[sys.modules[type(m).__module__].twell_ffn.__module__]; "
            "print(ops is not first, ops.AUTO is first.AUTO)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-2:] == ["True", "True"]
