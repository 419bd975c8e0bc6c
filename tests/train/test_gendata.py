"""sparsify gendata on a tiny model, CPU: same seed same text, refuses an existing output, continues a killed run,
and its folder trains as a data.train entry beside a text file."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sparsify.errors import SparsifyError
from sparsify.train.gendata import gendata, work_dir
from tests.tiny import tiny_model_folder


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("gendata") / "tiny")


def texts(folder):
    return [json.loads(line)["text"] for f in sorted(folder.glob("text-*.jsonl")) for line in f.read_text().splitlines()]


def test_same_seed_same_text_and_a_record(model, tmp_path):
    a = gendata(model, tmp_path / "a", tokens=40, seq_len=8, batch_size=2, seed=3, device="cpu", progress=False)
    b = gendata(model, tmp_path / "b", tokens=40, seq_len=8, batch_size=2, seed=3, device="cpu", progress=False)
    c = gendata(model, tmp_path / "c", tokens=40, seq_len=8, batch_size=2, seed=4, device="cpu", progress=False)
    assert texts(a) == texts(b) and texts(a) != texts(c)
    meta = json.loads((a / "gendata.json").read_text())
    assert meta["tokens"] == 40 and meta["settings"]["seed"] == 3 and meta["settings"]["model"] == str(model)
    assert sum(len(t) > 0 for t in texts(a)) >= len(texts(a)) // 2  # text, not empty samples
    assert not work_dir(a).exists()
    (rate,) = meta["sampling"]  # the sampling speed of the process that sampled: every batch it drew, timed
    assert rate["batches"] == meta["batches"] and rate["tokens"] >= 40 and rate["seconds"] > 0
    assert rate["tokens_per_s"] == pytest.approx(rate["tokens"] / rate["seconds"], rel=0.01)


def test_writes_exactly_the_tokens_asked_and_its_bar_stops_there(model, tmp_path, capsys):
    """`--tokens 2000` wrote 2,571 tokens (whole batches) and the bar ran past its total (issue 32): the samples
    are written in order up to the count, the one reaching it cut there (the start of the sample a longer run
    writes whole), and the bar ends at the count."""
    import re

    a = gendata(model, tmp_path / "a", tokens=37, seq_len=8, batch_size=4, seed=1, device="cpu", progress=True)
    bar = capsys.readouterr().err
    rows = [json.loads(line) for f in sorted(a.glob("text-*.jsonl")) for line in f.read_text().splitlines()]
    assert sum(r["tokens"] for r in rows) == 37 == json.loads((a / "gendata.json").read_text())["tokens"]
    assert all(set(r) == {"text", "prompt", "tokens"} for r in rows)  # the work folder's token ids stay there
    assert "37/37" in bar and max(int(n) for n in re.findall(r"(\d+)/37 ", bar)) == 37
    whole = gendata(model, tmp_path / "b", tokens=400, seq_len=8, batch_size=4, seed=1, device="cpu", progress=False)
    longer = [json.loads(line) for f in sorted(whole.glob("text-*.jsonl")) for line in f.read_text().splitlines()]
    assert rows[:-1] == longer[:len(rows) - 1]
    cut, full = rows[-1], longer[len(rows) - 1]
    assert cut["tokens"] <= full["tokens"] and full["text"].startswith(cut["text"])


def test_a_run_with_every_batch_sampled_before_still_stops_at_the_count(model, tmp_path, monkeypatch):
    """Batches left by a run asked for more tokens (stopped before it finished) cover this one's count: nothing is
    sampled, and the sample reaching the count is cut as a run from scratch cuts it."""
    from sparsify.train import gendata as gd

    whole = gendata(model, tmp_path / "whole", tokens=21, seq_len=8, batch_size=2, device="cpu", progress=False)
    out = tmp_path / "out"
    more = gd.GenSettings(str(model), 64, seq_len=8, batch_size=2)
    gd.sample_batches(more, gd.open_work(work_dir(out), more), 0, 0, "cpu", False)
    monkeypatch.setattr(gd, "sample_batches", lambda *a: pytest.fail("sampled again"))
    gendata(model, out, tokens=21, seq_len=8, batch_size=2, device="cpu", progress=False)
    assert texts(out) == texts(whole) and json.loads((out / "gendata.json").read_text())["tokens"] == 21


def test_quiet_shows_no_bar_of_anyone(model, tmp_path, capsys):
    """-q (progress=False): no gendata bar and none of transformers' loading bars either."""
    gendata(model, tmp_path / "q", tokens=8, seq_len=4, batch_size=2, device="cpu", progress=False)
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "gendata" not in err, err[-500:]


def test_refuses_an_existing_output_and_bad_settings_together(model, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(SparsifyError) as e:
        gendata(model, tmp_path / "out", tokens=0, seq_len=8, top_p=1.5, device="cpu", progress=False)
    msg = str(e.value)
    assert "already exists" in msg and "--tokens 0" in msg and "--top-p 1.5" in msg
    assert list((tmp_path / "out").iterdir()) == []


def test_a_killed_run_continues_where_it_stopped(model, tmp_path):
    """SIGKILL mid-run leaves no OUT, only whole batches in the work folder; the same command continues them and
    writes the text an uninterrupted run writes."""
    whole = gendata(model, tmp_path / "whole", tokens=200, seq_len=8, batch_size=2, device="cpu", progress=False)
    out = tmp_path / "out"
    code = (f"from sparsify.train.gendata import gendata; gendata({str(model)!r}, {str(out)!r}, tokens=10**9, "
            "seq_len=8, batch_size=2, device='cpu', progress=False)")
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    try:
        deadline = time.time() + 120
        while not (work_dir(out) / "batch-000002.jsonl").exists():
            assert proc.poll() is None and time.time() < deadline, "the background run never wrote a batch"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not out.exists() and not list(work_dir(out).glob("*.tmp"))
    gendata(model, out, tokens=200, seq_len=8, batch_size=2, device="cpu", progress=False)
    assert texts(out) == texts(whole) and not work_dir(out).exists()  # both cut at the same 200th token


def test_a_continued_run_must_keep_its_settings(model, tmp_path):
    out = tmp_path / "out"
    work_dir(out).mkdir()
    (work_dir(out) / "settings.json").write_text(json.dumps({"model": str(model), "seed": 9}))
    (work_dir(out) / "batch-000000.jsonl").write_text(json.dumps({"tokens": 8, "text": "x"}) + "\n")
    with pytest.raises(SparsifyError, match="other settings"):
        gendata(model, out, tokens=10, seq_len=8, device="cpu", progress=False)


def test_a_start_that_finished_no_batch_does_not_block_the_corrected_command(model, tmp_path, monkeypatch, capsys):
    """A mistyped model fails after the work folder exists: the fixed command starts over (nothing was sampled),
    and Ctrl-C during sampling says where the finished batches are kept and how to continue."""
    from sparsify.cli import main as cli
    from sparsify.train import gendata as gd

    out = tmp_path / "out"
    assert cli(["gendata", str(tmp_path / "no-such-model"), "-o", str(out), "--tokens", "10", "--device", "cpu",
                "-q"]) == 2
    capsys.readouterr()
    assert (work_dir(out) / "settings.json").exists() and not out.exists()
    saved = json.loads((work_dir(out) / "settings.json").read_text())
    (work_dir(out) / "settings.json").write_text(json.dumps({**saved, "batch_size": 3}))  # as if --batch-size 3
    gendata(model, out, tokens=10, seq_len=8, device="cpu", progress=False)  # none given: the CPU's, not 3
    meta = json.loads((out / "gendata.json").read_text())
    assert meta["settings"]["batch_size"] == gd.CPU_BATCH and not work_dir(out).exists()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(gd, "sample_batches", interrupted)
    assert cli(["gendata", str(model), "-o", str(tmp_path / "b"), "--tokens", "10", "--device", "cpu", "-q"]) == 130
    err = capsys.readouterr().err
    assert f"interrupted; the batches finished so far are kept in {work_dir(tmp_path / 'b')}" in err
    assert "run the same command again to continue" in err and "nothing was left half-written" not in err


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    """The tiny model made to end a document about one token in five: its last MLP's output bias pins the final
    hidden state to one direction (dimension 0), where the EOS token's (tied) embedding stands out."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_model_folder(tmp_path_factory.mktemp("gendata-eos") / "tiny")
    model = AutoModelForCausalLM.from_pretrained(folder, mlp_bias=True)
    eos = AutoTokenizer.from_pretrained(folder).eos_token_id  # (gendata's; the config's generation eos differs)
    with torch.no_grad():
        for layer in model.model.layers:
            for lin in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                lin.bias.zero_()
        model.model.layers[-1].mlp.down_proj.bias[0] = 100.0
        model.model.embed_tokens.weight[eos, 0] = 0.8  # logit ~ sqrt(32) * 0.8 = 4.5 over ~0: P(EOS) ~ 0.2
    model.save_pretrained(folder)
    return folder


def rows_of(folder):
    return [json.loads(line) for f in sorted(folder.glob("text-*.jsonl")) for line in f.read_text().splitlines()]


def test_documents_split_after_each_eos():
    from sparsify.train.gendata import split_documents

    assert split_documents([5, 0, 0, 7, 8, 0, 9], 0) == [[5, 0], [7, 8, 0], [9]]  # a lone EOS makes no document
    assert split_documents([0, 4, 0], 0) == [[4, 0]] and split_documents([3, 4], None) == [[3, 4]]
    assert split_documents([0, 0], 0) == []


def test_rows_go_on_after_eos_as_new_documents_that_fill_the_budget(eos_model, tmp_path):
    """No row stops at EOS: each batch samples batch x seq-len tokens, split at each EOS into documents (the
    first continues the row's prompt, the others have prompt ""); their counts sum to the budget exactly and
    every sampled token is in some document but the lone EOS tokens."""
    from sparsify.train import gendata as gd

    out = gendata(eos_model, tmp_path / "a", tokens=250, seq_len=32, batch_size=4, seed=2, device="cpu",
                  progress=False)
    rows = rows_of(out)
    assert sum(r["tokens"] for r in rows) == 250 and len(rows) > 250 / 32 + 10  # many documents per row
    assert all(r["tokens"] >= 1 and r["prompt"] == "" for r in rows)
    more = gd.GenSettings(str(eos_model), 10**6, seq_len=32, batch_size=4, seed=2)
    work = gd.open_work(work_dir(tmp_path / "b"), more)
    model, tok = gd.load_sampler(more, "cpu", False)
    import torch

    torch.manual_seed(7)
    docs = gd.sample_batch(model, tok, more, ["", "", "", ""], "cpu")
    lone = 0
    torch.manual_seed(7)
    with torch.inference_mode():
        raw = model.generate(input_ids=torch.zeros(4, 1, dtype=torch.long), attention_mask=torch.ones(4, 1, dtype=torch.long),
                             do_sample=True, temperature=0.8, top_p=0.95, top_k=0, max_new_tokens=32, eos_token_id=None,
                             pad_token_id=0)[:, 1:]
    for row in raw.tolist():
        lone += sum(1 for i, t in enumerate(row) if t == 0 and (i == 0 or row[i - 1] == 0))
    assert raw.shape == (4, 32) and sum(d["tokens"] for d in docs) == 4 * 32 - lone
    assert [t for d in docs for t in d["ids"]] == [t for row in raw.tolist() for i, t in enumerate(row)
                                                    if not (t == 0 and (i == 0 or row[i - 1] == 0))]
    assert sum(d["ids"][-1] == 0 for d in docs) >= 4 * 32 // 10 and work.exists()


def fast_loader(monkeypatch, served):
    """gendata's load_sampler with the fast decode regime on CPU (cpu_emulation), counting generate() calls the graph
    loop served."""
    from sparsify.kernels.fast_decode import enable_fast_decode
    from sparsify.train import gendata as gd

    plain = gd.load_sampler

    def load(s, device, progress):
        model, tok = plain(s, device, progress)
        fast = enable_fast_decode(model, compile=False)
        fast.cpu_emulation = True
        served.append(fast)
        return model, tok

    monkeypatch.setattr(gd, "load_sampler", load)


def test_the_fast_sampling_loop_samples_gendata_and_a_killed_run_continues_it(eos_model, tmp_path, monkeypatch):
    """gendata's batches (one-token prompts, unpadded) go through the sampling graph loop: the same seed writes
    the same text, the budget is exact, and a run continued from its batch files writes what one run writes."""
    from sparsify.train import gendata as gd

    served = []
    fast_loader(monkeypatch, served)
    a = gendata(eos_model, tmp_path / "a", tokens=300, seq_len=40, batch_size=4, seed=5, device="cpu", progress=False)
    assert served and served[-1].loops == 3 and served[-1].captures == 1  # 3 batches of 160 tokens, one capture
    b = gendata(eos_model, tmp_path / "b", tokens=300, seq_len=40, batch_size=4, seed=5, device="cpu", progress=False)
    assert rows_of(a) == rows_of(b) and sum(r["tokens"] for r in rows_of(a)) == 300
    out = tmp_path / "c"  # batch 0 sampled by one process, then the rest by another (which captures anew)
    s = gd.GenSettings(str(eos_model), 100, seq_len=40, batch_size=4, seed=5)
    gd.sample_batches(s, gd.open_work(work_dir(out), s), 0, 0, "cpu", False)
    gendata(eos_model, out, tokens=300, seq_len=40, batch_size=4, seed=5, device="cpu", progress=False)
    assert rows_of(out) == rows_of(a)


def test_batch_size_defaults_to_8_on_the_cpu_and_an_unfinished_runs_own(model, tmp_path, capsys):
    """No --batch-size: 8 on the CPU (recorded in gendata.json and printed), and a run continued without one takes
    the batch size it started with (not the default: other batches would be other text)."""
    from sparsify.cli import main as cli_main
    from sparsify.train import gendata as gd

    assert cli_main(["gendata", str(model), "-o", str(tmp_path / "d"), "--tokens", "20", "--seq-len", "4",
                     "--device", "cpu", "-q"]) == 0
    assert json.loads((tmp_path / "d" / "gendata.json").read_text())["settings"]["batch_size"] == gd.CPU_BATCH
    assert "(batch size 8)" in capsys.readouterr().out
    out = tmp_path / "more"
    started = gd.GenSettings(str(model), 64, seq_len=8, batch_size=3)
    gd.sample_batches(started, gd.open_work(work_dir(out), started), 0, 0, "cpu", False)  # a run stopped early
    gendata(model, out, tokens=50, seq_len=8, device="cpu", progress=False)  # continued without --batch-size
    assert json.loads((out / "gendata.json").read_text())["settings"]["batch_size"] == 3


def test_auto_batch_size_is_the_largest_power_of_two_whose_cache_fits():
    """KV cache per row = layers x 2 x KV heads x head dim x positions x element size, + 3 fp32 vocabularies;
    half the memory less the weights; powers of two from 1024 down to 8."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparsify.train.gendata import auto_batch_size

    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    m = LlamaForCausalLM(config).to(torch.bfloat16)
    weights = sum(p.numel() * 2 for p in m.parameters())
    per_row = 3 * 2 * 2 * 16 * (100 + 1) * 2 + 3 * 4 * 1000  # head dim 64 / 4 = 16, seq_len 100
    for rows in (1024, 256, 8):
        fits = 2 * (weights + rows * per_row)
        assert auto_batch_size(m, 100, False, total_memory=fits) == rows
        assert auto_batch_size(m, 100, False, total_memory=fits - 2) == max(8, rows // 2)
    assert auto_batch_size(m, 100, False, total_memory=10**15) == 1024  # never above MAX_AUTO_BATCH
    assert auto_batch_size(m, 100, False, total_memory=weights) == 8  # never below 8
    per_prompted = 3 * 2 * 2 * 16 * (100 + 1 + 512) * 2 + 3 * 4 * 1000
    assert auto_batch_size(m, 100, True, total_memory=2 * (weights + 64 * per_prompted)) == 64


def test_on_cuda_without_a_batch_size_the_model_is_loaded_once_and_sized(model, tmp_path, monkeypatch):
    """The CUDA branch's glue, on the CPU: the model is loaded before the work folder exists, auto_batch_size sizes
    the batch from it, and the same loaded model samples (not loaded a second time)."""
    import sparsify.evaluation.loading as loading
    from sparsify.train import gendata as gd

    real_load, loads, sized = gd.load_sampler, [], []
    monkeypatch.setattr(loading, "pick_device", lambda device: "cuda:0")

    def load(s, device, progress):
        loads.append(device)
        return real_load(s, "cpu", progress)

    def auto(m, seq_len, prompted):
        sized.append((type(m).__name__, seq_len, prompted))
        return 3

    monkeypatch.setattr(gd, "load_sampler", load)
    monkeypatch.setattr(gd, "auto_batch_size", auto)
    real_sample = gd.sample_batches
    monkeypatch.setattr(gd, "sample_batches", lambda s, work, start, have, device, progress, loaded=None:
                        real_sample(s, work, start, have, "cpu", progress, loaded))
    out = gendata(model, tmp_path / "g", tokens=30, seq_len=6, progress=False)
    assert loads == ["cuda:0"] and sized and sized[0][1:] == (6, False)
    assert json.loads((out / "gendata.json").read_text())["settings"]["batch_size"] == 3
