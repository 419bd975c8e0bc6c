"""Preflight: every problem of a recipe found before any work, each with its fix; the messages are the interface."""

import json
from pathlib import Path

import pytest

from sparsify.errors import SparsifyError
from sparsify.train.config import DataSection
from sparsify.train.preflight import data_path_problems, load_recipe, source_problems

REPO = Path(__file__).resolve().parents[2]
SMOLLM2 = REPO / "recipes" / "smollm2-135m.yaml"


def test_source_problems_found_without_reading_text(tmp_path, monkeypatch):
    """Every missing or mixed entry; the one that the recipe's data.fetch gets comes with the command, the one it
    does not get with the usual hint; a prepared folder alone is fine."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.csv").write_text("x")
    cfg = DataSection(train=["a.txt", "gone/*.txt", "hub:x/y"], validation=["*", "also-gone.txt"],
                      fetch="mkdir gone\necho hi > gone/a.txt")
    problems = source_problems(cfg)
    assert len(problems) == 3, problems
    assert problems[0].startswith(f"data.train 'gone/*.txt': matches no file yet (relative to the current folder "
                                  f"{tmp_path}). This recipe's data.fetch gets it: run it once from {tmp_path}")
    assert problems[0].endswith("\n      mkdir gone\n      echo hi > gone/a.txt")
    assert problems[1].startswith("data.validation: data source '*' holds files of types ['.csv', '.txt']")
    assert problems[2].startswith("data.validation: 'also-gone.txt' matches no file") and "fetch" not in problems[2]
    assert "give existing files or globs" in problems[2]
    assert "is a folder: name its files with a glob" in source_problems(DataSection(train=[str(tmp_path)]))[0]
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "meta.json").write_text(json.dumps({"format": "sparsify-tokens/1", "sources": [{"entry": "a.txt"}]}))
    assert source_problems(DataSection(train=[str(prepared)])) == []


def test_missing_data_that_the_fetch_gets_is_one_problem_with_the_command(tmp_path, monkeypatch):
    """The shipped recipe before its fetch: one problem naming every missing entry and the command that gets them
    all, without the per-entry advice (globs, Hub datasets) that one fetch makes moot. An entry the command does
    not get keeps its own problem and hint."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SparsifyError) as e:
        load_recipe(SMOLLM2)
    msg = str(e.value)
    assert msg.startswith(f"recipe {SMOLLM2} has 1 problem(s):\n  - data.train 'data/docs/train/*.txt', "
                          "'data/general/train/*.txt'; data.heldout.general 'data/general/heldout/*.txt'; "
                          "data.heldout.docs 'data/docs/heldout/*.txt'; data.heldout.fiction "
                          "'data/ood/text/fiction_austen.txt'; data.heldout.news 'data/ood/text/news_reports.txt'; "
                          "data.heldout.dialogue 'data/ood/text/dialogue_wesnoth.txt'; data.heldout.postgres_docs "
                          "'data/ood/text/docs_postgresql.txt': 8 entries match no file yet"), msg
    # run from elsewhere: the fetch's scripts are the checkout's (it said "run it once from" here, where they are not)
    assert ("This recipe's data.fetch gets all of them: it calls eval/corpus/get-corpus.sh, eval/corpus/get-ood.sh, "
            f"which are in the sparsify checkout, not here: run it once from {REPO}, then run this command from "
            "there") in msg
    assert "\n      mkdir -p data/debian" in msg and msg.count("data.fetch") == 1
    assert "give existing files" not in msg and "hub:NAME" not in msg
    with pytest.raises(SparsifyError) as e:
        load_recipe(SMOLLM2, ["data.train=[data/docs/train/*.txt, mytext/*.txt]", "data.weights=[1, 1]"])
    msg = str(e.value)
    assert "has 2 problem(s)" in msg and "7 entries match no file yet" in msg, msg
    assert "data.train: 'mytext/*.txt' matches no file" in msg and "give existing files or globs" in msg


def test_overlap_and_heldout_problems_found_without_reading_text(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t").mkdir()
    for name in ("a.txt", "b.txt", "v.txt"):
        (tmp_path / "t" / name).write_text("x")
    (tmp_path / "t" / "v.txt").rename(tmp_path / "v.txt")
    (tmp_path / "link.txt").symlink_to(tmp_path / "t" / "b.txt")
    cfg = DataSection(train=["t/*.txt"], validation=[str(tmp_path / "v.txt")],
                      heldout={"general": ["link.txt", "t/a.txt"], "val": ["./v.txt"], "gone": ["h/*.txt"]},
                      fetch="get-it")
    problems = [msg for _, msg in data_path_problems(cfg)]
    assert len(problems) == 3, problems
    assert problems[0].startswith("data.heldout.gone: 'h/*.txt' matches no file") and "get-it" not in problems[0]
    assert problems[1].startswith(f"data.heldout.general: 2 file(s) are also training files (data.train 't/*.txt'): "
                                  f"{tmp_path}/t/a.txt, {tmp_path}/t/b.txt.")  # the link resolves to b.txt
    assert "python -m sparsify.train.corpus_split" in problems[1]
    assert problems[2].startswith("data.heldout.val: 1 file(s) are also validation files (data.validation")


def test_where_to_run_the_fetch_follows_its_scripts(tmp_path, monkeypatch):
    """data.fetch calls scripts by relative paths: here when they are here; else the checkout that has them; else
    (installed from a wheel, no checkout) a clone of the repository."""
    from sparsify.train.preflight import _fetch_where

    monkeypatch.chdir(tmp_path)
    fetch = "ROOT=$PWD/data bash eval/corpus/get-corpus.sh && python -m sparsify.train.corpus_split a b"
    assert _fetch_where(fetch).startswith(f"it calls eval/corpus/get-corpus.sh, which is in the sparsify checkout, "
                                          f"not here: run it once from {REPO}")
    monkeypatch.setattr("sparsify.sources.source_checkout", lambda: None)
    assert "come with the sparsify repository, not the installed package" in _fetch_where(fetch)
    (tmp_path / "eval" / "corpus").mkdir(parents=True)
    (tmp_path / "eval" / "corpus" / "get-corpus.sh").write_text("true\n")
    assert _fetch_where(fetch) == f"run it once from {tmp_path}, then run this command again"
    assert _fetch_where("mkdir gone && echo hi > gone/a.txt") == f"run it once from {tmp_path}, then run this " \
        "command again"  # no script: here


def test_a_folder_given_as_the_recipe_is_called_a_folder(tmp_path):
    with pytest.raises(SparsifyError, match=f"recipe {tmp_path}: a folder, not a recipe file; pass a YAML recipe"):
        load_recipe(tmp_path)
