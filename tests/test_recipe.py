"""Recipes: YAML <-> typed dataclasses, overrides, every problem reported at once, --help, shipped recipes."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from sparsify import cli
from sparsify.errors import SparsifyError
from sparsify.recipe import SECTIONS, Recipe, dump_recipe, format_help, load_recipe

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
MINIMAL = {"data": {"train": ["x.txt"]}, "train": {"max_steps": 10}}


def test_overrides_types_and_round_trip():
    r = load_recipe(MINIMAL, ["train.lr=3e-4", "sparsity.l1=2e-2", "train.betas=[0.9, 0.99]", "train.compile=true",
                              "data.train=a.txt,b/*.txt", "train.max_tokens=50_000_000", "train.max_steps=none"])
    assert r.train.lr == 3e-4 and isinstance(r.train.lr, float)  # PyYAML alone reads "3e-4" as a string
    assert r.sparsity.l1 == 0.02 and r.train.betas == [0.9, 0.99] and r.train.compile is True
    assert r.data.train == ["a.txt", "b/*.txt"]
    assert r.train.max_tokens == 50_000_000 and r.train.max_steps is None
    assert load_recipe(yaml.safe_load(dump_recipe(r))) == r
    assert MINIMAL["train"] == {"max_steps": 10}  # the caller's mapping is not modified


def test_bad_recipe_lists_every_problem_with_its_fix(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"sorce": "x"},
        "train": {"lr": "fast", "batch_size": 2.5, "bf16": "maybe", "max_steps": 10},
        "sparsity": {"normalization": "sum"},
        "data": {"train": "a.txt"},
        "optimizer": {"name": "adamw"},
    }))
    with pytest.raises(SparsifyError) as e:
        load_recipe(path, ["train.seq_len=abc", "nodot=1"])
    msg = str(e.value)
    for expected in [
        "has 8 problem(s)",
        "model.sorce: unknown key; did you mean `model.source`?",
        "train.lr: got 'fast' (str); expected float",
        "train.batch_size: got 2.5 (float); expected an integer",
        "train.bf16: got 'maybe' (str); expected true or false",
        "sparsity.normalization: got 'sum' (str); expected one of 'sum_hidden', 'mean'",
        "optimizer: unknown key; valid keys: model, data, sparsity, distill, train, lora, output",
        "train.seq_len: got 'abc' (str); expected int",
        "override 'nodot=1': expected SECTION.KEY=VALUE",
    ]:
        assert expected in msg, f"missing {expected!r} in:\n{msg}"
    assert str(path) in msg and "sparsify finetune --help" in msg


def test_values_checked_once_types_are_right():
    with pytest.raises(SparsifyError) as e:
        load_recipe({"train": {"lr": -1, "betas": [0.9], "seq_len": 0}, "sparsity": {"schedule": "ramp"},
                     "data": {"validation": ["hub:HuggingFaceFW/fineweb-edu"]}})
    msg = str(e.value)
    for expected in ["train.lr: got -1.0; must be > 0", "train.seq_len: got 0; must be > 0",
                     "train.betas: got [0.9]; expected two numbers", "neither max_steps nor max_tokens",
                     "data.train: empty", "sparsity.ramp_steps: 0 with schedule `ramp`",
                     "data.max_tokens: not set while data.train streams a Hub dataset"]:
        assert expected in msg, f"missing {expected!r} in:\n{msg}"


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(SparsifyError, match="no such file"):
        load_recipe(tmp_path / "nope.yaml")
    (tmp_path / "broken.yaml").write_text("train: [unclosed\n")
    with pytest.raises(SparsifyError, match="not valid YAML"):
        load_recipe(tmp_path / "broken.yaml")


def test_help_documents_every_field(capsys):
    text = format_help()
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"{name}.{f.name}: " in text, f"{name}.{f.name} missing from --help"
            assert f.metadata.get("doc"), f"{name}.{f.name} has no help text"
    with pytest.raises(SystemExit):
        cli.main(["finetune", "--help"])
    out = capsys.readouterr().out
    assert "sparsity.normalization: 'sum_hidden' | 'mean' = 'sum_hidden'" in out and "--resume" in out


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_shipped_recipe_is_valid_and_says_how_to_run(path):
    header = path.read_text().split("\n\n")[0]
    assert header.startswith("#") and "sparsify finetune recipes/" + path.name in header
    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe) and recipe.output.dir.startswith("runs/")


def test_all_four_recipes_ship():
    assert {p.name for p in RECIPES} >= {"smollm2-135m.yaml", "llama-3.2-1b.yaml", "qwen2.5-0.5b.yaml",
                                         "mistral-7b-fsdp.yaml"}
