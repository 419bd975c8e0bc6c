"""lm-eval tasks: local YAML resolution, offline errors, expected warnings dropped, standard errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from sparsify.errors import SparsifyError
from sparsify.evaluation import accuracy as acc

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "eval" / "tasks"


def test_local_task_yaml_resolves_data_files_to_absolute_paths(tmp_path):
    spec = acc.resolve_tasks([str(TASKS / "tech_qa.yaml")], tmp_path)
    assert spec.names == ["sparsify_tech_qa"]
    copied = Path(spec.include_paths[0]) / "tech_qa.yaml"
    text = copied.read_text()
    assert str((TASKS / "tech_qa.jsonl").resolve()) in text
    folder = acc.resolve_tasks([str(TASKS)], tmp_path / "b")
    assert sorted(folder.names) == ["sparsify_cloze_austen", "sparsify_tech_qa", "sparsify_tech_text"]
    assert acc.resolve_tasks(["none"], tmp_path / "c").names == []
    acc.check_tasks(folder)  # the shipped tasks load offline


def test_cloze_task_on_unseen_prose_scores_a_model_offline(tmp_path, tiny_folders):
    """The out-of-distribution cloze task: >= 500 passages, each target a word of the passage seen before its
    end; it loads offline and scores accuracy with its standard error."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [json.loads(line) for line in (TASKS / "cloze_austen.jsonl").read_text().splitlines()]
    assert len(rows) >= 500
    assert all(r["target"].startswith(" ") and r["target"].strip().lower() in r["context"].lower() for r in rows)
    spec = acc.resolve_tasks([str(TASKS / "cloze_austen.yaml")], tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_folders[0]).eval()
    tok = AutoTokenizer.from_pretrained(tiny_folders[0])
    got = acc.accuracy(model, tok, spec, limit=8, batch_size=4)["sparsify_cloze_austen"]
    assert got["samples"] == 8 and 0 <= got["acc"] <= 1 and "acc_stderr" in got


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


def test_hub_tasks_with_the_hub_out_of_reach_say_so_once_before_any_download(tmp_path, monkeypatch):
    """Without HF_*_OFFLINE on a machine that cannot reach the Hub, lm-eval printed five retry lines with Hub URLs
    per file before the error (issue 32): the Hub is now looked up once and the error comes before any download,
    naming the tasks, the cache-only variables and the offline tasks. A typo is still named as one."""
    from lm_eval.tasks import TaskManager

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    lookups = []
    monkeypatch.setattr(acc, "hub_unreachable", lambda: lookups.append(1) or True)

    def download(self, names):
        raise AssertionError(f"lm-eval went on to fetch {names}")

    monkeypatch.setattr(TaskManager, "load", download)
    with pytest.raises(SparsifyError) as e:
        acc.check_tasks(acc.resolve_tasks(None, tmp_path))
    assert lookups == [1]  # once for the seven default tasks
    msg = str(e.value)
    assert msg.startswith(f"tasks {', '.join(acc.PAPER_TASKS)} (the default without --tasks")
    assert "cannot be reached from here" in msg and "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1" in msg
    assert f"--tasks {acc.LOCAL_TASKS}" in msg and "--tasks none" in msg
    assert Path(acc.LOCAL_TASKS).is_absolute() and Path(acc.LOCAL_TASKS).is_dir()  # the checkout's, from anywhere
    with pytest.raises(SparsifyError, match="'no_such_task_xyz' is neither an lm-eval task"):
        acc.check_tasks(acc.resolve_tasks(["arc_easy", "no_such_task_xyz"], tmp_path / "b"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the cache asked for: no lookup, lm-eval reads it at once
    with pytest.raises(SparsifyError, match=r"its data could not be loaded \(AssertionError: lm-eval went on to fetch"):
        acc.check_tasks(acc.resolve_tasks(["arc_easy"], tmp_path / "c"))
    assert lookups == [1]


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


def test_cloze_script_scores_as_lm_eval_does(tmp_path, tiny_folders, capsys):
    """eval/quality/cloze.py (for machines without lm_eval) gives lm-eval's own acc and perplexity on the cloze task."""
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = importlib.util.spec_from_file_location("cloze", TASKS.parent / "quality" / "cloze.py")
    cloze = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(cloze)
    model = AutoModelForCausalLM.from_pretrained(tiny_folders[0]).eval()
    tok = AutoTokenizer.from_pretrained(tiny_folders[0])
    items = [json.loads(line) for line in (TASKS / "cloze_austen.jsonl").read_text().splitlines()][:12]
    ours = cloze.score(model, tok, items, "cpu")
    theirs = acc.accuracy(model, tok, acc.resolve_tasks([str(TASKS / "cloze_austen.yaml")], tmp_path), limit=12,
                          batch_size=4)["sparsify_cloze_austen"]
    assert ours["n"] == theirs["samples"] == 12
    assert ours["acc"] == theirs["acc"]
    assert ours["perplexity"] == pytest.approx(theirs["perplexity"], rel=1e-4)
    capsys.readouterr()
    assert cloze.main([f"a={tiny_folders[0]}", "--limit", "3", "--device", "cpu", "--out", str(tmp_path / "o")]) == 0
    assert json.loads((tmp_path / "o" / "cloze.json").read_text())["models"]["a"]["n"] == 3
    # one forward per item ran 10 minutes on CPU without a word (issue 32): a bar per model, -q hides it
    assert cloze.main([f"a={tiny_folders[0]}", f"b={tiny_folders[1]}", "--limit", "2", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "cloze a: 100%" in err and "cloze b: 100%" in err and " 2/2 " in err
    assert cloze.main([f"a={tiny_folders[0]}", "--limit", "2", "--device", "cpu", "-q"]) == 0
    assert "cloze a" not in capsys.readouterr().err
    for bad, says in ((["--limit", "0"], "--limit 0: must be a positive number"),
                      (["--limit", "-5"], "--limit -5: must be a positive number"),
                      (["--data", str(tmp_path / "none.jsonl")], "no such file")):
        with pytest.raises(SystemExit) as exc:
            cloze.main([f"a={tiny_folders[0]}", "--device", "cpu", *bad])
        assert exc.value.code == 2 and says in capsys.readouterr().err
