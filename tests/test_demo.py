"""The README's first command: `sparsify demo`, end to end offline, with CPU-small settings."""

import json
import subprocess
import sys

import pytest


def demo(out, *args):
    cmd = [sys.executable, "-m", "sparsify", "demo", "-o", str(out), "--limit", "2", "--text-tokens", "256", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_demo_runs_whole_pipeline_quietly_and_reuses_only_stages_with_the_same_settings(tmp_path, monkeypatch, capsys):
    out = tmp_path / "demo"
    first = demo(out, "--steps", "2", "-q")
    # -q: no stage lines, no progress bar of any stage or library, no step or validation lines: the summary only
    assert "[1/3]" not in first.stdout and "[3/3]" not in first.stdout and "Full report:" in first.stdout
    assert f"Fine-tuned model: {out / 'ft' / 'model'}" in first.stdout and "perplexity: sparsify eval's" in first.stdout
    for noise in ("it/s]", "s/it]", "s/stage", "Converting and de-quantizing", "validation perplexity", "step 2/2"):
        assert noise not in first.stderr, (noise, first.stderr[-3000:])
    report = json.loads((out / "report" / "report.json").read_text())
    rows = {r["name"]: r for r in report["models"]}
    assert set(rows) == {"orig", "relu", "ft"}
    assert rows["orig"]["sparsity"]["summary"]["zeros"] == 0.0
    assert rows["relu"]["sparsity"]["summary"]["zeros"] > 0.5  # the swap alone zeroes most of h
    ppl = {k: next(iter(r["perplexity"].values()))["perplexity"] for k, r in rows.items()}
    assert ppl["relu"] > 10 * ppl["orig"]  # the bare swap breaks the model, as the demo says
    assert (out / "report" / "report.md").is_file()
    model = out / "ft" / "model"
    assert json.loads((model / "config.json").read_text())["sparsify"]["steps"] == 2
    assert not (out / "ft" / "checkpoints").exists()  # the run finished: no checkpoint (12 bytes/parameter) left
    # Reuse is decided before the eval stage, which the run above checked: the runs below record its calls instead.
    evaluated = _skip_eval(monkeypatch)
    from sparsify.demo import demo as run_demo

    run_demo(out, steps=2, limit=2, text_tokens=256, progress=False)  # the same settings again: every stage reused
    again = capsys.readouterr().out
    assert "[1/3] convert: reusing" in again and "[2/3] finetune: reusing" in again
    assert f"[3/3] eval: reusing {out / 'report'}" in again and evaluated == []  # (issue 40: it redid the eval)
    assert f"Full report: {out / 'report' / 'report.md'}" in again and "relu   " in again  # the summary, from it
    run_demo(out, steps=2, limit=3, text_tokens=256, progress=False)  # another eval setting: only the eval is redone
    other = capsys.readouterr().out
    assert "[2/3] finetune: reusing" in other and "[3/3] eval original" in other and len(evaluated) == 1
    run_demo(out, steps=3, limit=2, text_tokens=256, progress=False)  # other settings: the fine-tune is redone
    longer = capsys.readouterr().out
    assert "[1/3] convert: reusing" in longer and "[2/3] finetune 3 steps" in longer
    assert 'its "validation perplexity": python-howto-heldout.txt cut into non-overlapping 128-token' in longer
    assert "[3/3] eval original" in longer  # the report (limit 2) is older than the model it would describe
    assert json.loads((model / "config.json").read_text())["sparsify"]["steps"] == 3
    assert not (out / "ft" / "checkpoints").exists()
    assert [models for models, _ in evaluated] == [["orig=smollm2-135m-gguf", f"relu={out / 'relu'}",
                                                    f"ft={model}"]] * 2
    assert [kw["limit"] for _, kw in evaluated] == [3, 2]


def test_summary_says_which_perplexity_each_line_is_and_where_the_fine_tuned_model_is(tmp_path, capsys):
    """The demo printed `validation perplexity 153.47` at step 20 and 135.47 in its summary for the same model,
    explained only far below in the README, and its summary did not say where the model was (issue 32): the summary
    names its measure, puts the finetune log's own numbers beside it with theirs, and gives the model's folder."""
    from sparsify.demo import _print_summary

    ft = tmp_path / "ft"
    ft.mkdir()
    records = [{"step": 0, "tokens": 0, "val_loss": 8.63, "val_ppl": 5609.856}, {"step": 5, "loss": 13.2},
               {"step": 20, "tokens": 10240, "val_loss": 5.03, "val_ppl": 153.473}]
    (ft / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = lambda ppl: {"python-howto-heldout.txt": {"perplexity": ppl, "bits_per_byte": 1.5, "tokens": 2047,  # noqa: E731
                                                     "window": 1024}}
    report = {"models": [{"name": name, "perplexity": text(ppl), "sparsity": {"summary": {"zeros": 0.7, "nnz_mean": 390.0}}}
                         for name, ppl in (("orig", 14.04), ("relu", 5122.88), ("ft", 135.47))]}
    _print_summary(report, tmp_path / "report", ft)
    printed = capsys.readouterr().out
    assert "ft            135.47" in printed
    assert ("perplexity: sparsify eval's, 2047 tokens of python-howto-heldout.txt scored in sliding 1024-token windows "
            "(past the first window, each token with at least 512 tokens of context)") in printed
    assert ('The finetune lines\' "validation perplexity" (relu 5609.86 at step 0, ft 153.47 at step 20) is finetune\'s '
            "own measure of the same text: python-howto-heldout.txt cut into non-overlapping 128-token windows (the "
            "first 16), each token with 64 tokens of context on average, so it reads higher.") in printed
    assert f"Fine-tuned model: {ft / 'model'}" in printed and f"Full report: {tmp_path / 'report' / 'report.md'}" in printed


def _skip_eval(monkeypatch) -> list:
    """Replace the eval stage by a recorder of its calls (models, keyword arguments); returns the record."""
    import importlib

    calls = []

    def record(models, **kw):
        calls.append((models, kw))
        return {"models": []}

    monkeypatch.setattr(importlib.import_module("sparsify.evaluation.evaluate"), "evaluate", record)
    return calls


def test_a_stopped_finetune_stops_the_demo_with_its_exit_code_and_how_to_continue(tmp_path, monkeypatch):
    """A Ctrl-C / SIGTERM that finetune honours ends the demo there (no eval of a half-trained model, exit 128 + the
    signal), with the demo's way to continue rather than finetune's --resume."""
    import importlib
    import signal

    from sparsify import cli
    from sparsify.sources import SMOLLM2_ALIAS
    from sparsify.train.distributed import RunStopped

    def fake_convert(source, out, **kw):
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"model_type": "llama", "sparsify": {"source": SMOLLM2_ALIAS}}))

    def stopped(recipe, **kw):
        raise RunStopped("the run stopped after step 7 (3,584 tokens) and saved checkpoint X; continue with the "
                         "same command and --resume.", signal.SIGTERM)

    def no_eval(*a, **kw):
        raise AssertionError("the demo went on to evaluate after the stop")

    convert, finetune, evaluate = (importlib.import_module(f"sparsify.{m}")
                                   for m in ("folder.convert", "train.finetune", "evaluation.evaluate"))
    monkeypatch.setattr(importlib.import_module("sparsify.demo"), "smollm2_gguf", lambda: tmp_path / "m.gguf")

    monkeypatch.setattr(convert, "convert", fake_convert)
    monkeypatch.setattr(finetune, "finetune", stopped)
    monkeypatch.setattr(evaluate, "evaluate", no_eval)
    with pytest.raises(RunStopped) as caught:
        from sparsify.demo import demo as run_demo

        run_demo(tmp_path / "d", quiet=True)
    assert "after step 7" in str(caught.value) and "--resume" not in str(caught.value)
    assert "sparsify demo" in str(caught.value)
    monkeypatch.setattr(sys, "argv", ["sparsify"])
    assert cli.main(["demo", "-o", str(tmp_path / "d"), "-q"]) == 128 + signal.SIGTERM
