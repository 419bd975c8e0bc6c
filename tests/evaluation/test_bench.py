"""sparsify bench (CUDA-only timings): its refusals and its report arithmetic, on CPU."""

import json

import pytest
import torch

from sparsify.evaluation.bench import markdown, speedups
from sparsify.cli import main as cli
from sparsify.errors import SparsifyError


def _row(variant, batch, tok_s, ttft, regime="graphs"):
    return {"regime": regime, "variant": variant, "batch": batch, "prompt": 512, "new_tokens": 256,
            "ttft_ms": ttft, "decode_tok_s": tok_s, "step_ms": 1e3 / tok_s * batch, "step_ms_spread": 0.01,
            "graph_replays_per_call": 254, "greedy_tokens": "equal"}


def test_speedups_pair_sparse_with_dense_of_the_same_case():
    rows = [_row("dense", 1, 100.0, 20.0), _row("sparse", 1, 125.0, 25.0), _row("dense", 8, 400.0, 30.0),
            _row("sparse", 8, 380.0, 30.0), _row("dense", 1, 50.0, 40.0, regime="eager"),
            {"regime": "graphs", "batch": 32, "prompt": 512, "skipped": "out of GPU memory"}]
    # paired prefill rounds: the ratio is the median of per-round ratios (2.0 / 1.0 / 0.5 -> 1.0), not of medians
    rows[0]["prefill_ms_rounds"], rows[1]["prefill_ms_rounds"] = [10.0, 10.0, 5.0], [5.0, 10.0, 10.0]
    # with >= 4 rounds the middle half of the per-round ratios too (ratios 0.8, 0.9, 1.0, 1.1, 1.2, inclusive
    # quartiles 0.9 and 1.1)
    rows[2]["prefill_ms_rounds"], rows[3]["prefill_ms_rounds"] = [8.0, 9.0, 10.0, 11.0, 12.0], [10.0] * 5
    got = {(s["regime"], s["batch"]): s for s in speedups(rows)}
    assert set(got) == {("graphs", 1), ("graphs", 8)}  # the eager case has no sparse row
    assert got[("graphs", 1)]["decode_speedup"] == pytest.approx(1.25)
    assert got[("graphs", 1)]["ttft_speedup"] == pytest.approx(0.8)
    assert got[("graphs", 1)]["prefill_speedup"] == pytest.approx(1.0)
    assert got[("graphs", 8)]["decode_speedup"] == pytest.approx(0.95)
    assert got[("graphs", 1)]["prefill_quartiles"] is None  # (3 rounds: no quartiles)
    assert got[("graphs", 8)]["prefill_speedup"] == pytest.approx(1.0)
    assert got[("graphs", 8)]["prefill_quartiles"] == pytest.approx((0.9, 1.1))
    old = [dict(r, prefill_ms_rounds=None) for r in rows[2:4]]
    assert speedups(old)[0]["prefill_speedup"] is None  # (rows of an older bench.json have no rounds)
    text = markdown({"gpu": "GPU", "provenance": {}, "settings": {"new_tokens": 256},
                     "models": {"m": {"info": "", "rows": rows, "speedups": speedups(rows)}}})
    assert "**1.25x**" in text and "skipped: out of GPU memory" in text
    assert "| graphs | 1 | 512 | **1.25x** | 0.80x | 1.000x |" in text and "| **0.95x** | 1.00x | 1.000x (0.900-1.100) |" in text


def test_report_says_which_backend_each_layer_ran_per_bucket():
    """report.md's per-layer tables: auto's eager and graph decisions per M bucket, counted over layers, with
    the density and why (timing ratios or the rule), from bench.json's string keys as well."""
    layers = [{1: {"eager": "twell", "graph": "twell", "density": 0.043, "ratio": 0.71, "graph_ratio": 0.62},
               512: {"eager": "dense", "graph": "dense", "density": 0.05, "rule": "prefill density > 0.01"}},
              {"1": {"eager": "dense", "graph": "twell", "density": 0.02, "ratio": 1.01, "graph_ratio": 0.8}}]
    text = markdown({"gpu": "GPU", "provenance": {}, "settings": {"new_tokens": 256},
                     "models": {"m": {"info": "", "rows": [], "speedups": [], "layers": layers}}})
    assert "| 1 | 1 of 2 (0) | 2 of 2 (0, 1) | 4.30% |" in text
    assert "| 512 | 0 of 2 | 0 of 2 | 5.00% |" in text
    assert "| 0 | twell / twell 4.3% (ratio 0.71 graph 0.62) | dense / dense 5.0% (prefill density > 0.01) |" in text
    assert "| 1 | dense / twell 2.0% (ratio 1.01 graph 0.80) | - |" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_bench_refuses_without_a_gpu(capsys, tmp_path):
    assert cli(["bench", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_refuses_an_existing_out_before_any_work_and_writes_it_whole(tmp_path, monkeypatch, capsys):
    """Like every stage: an existing --out is refused first (nothing in it changes), --overwrite replaces it whole
    at the end (here with the GPU work faked out: the report of no model), and only when it is a bench folder:
    a folder of other files is refused even with --overwrite, before any work."""
    from sparsify.evaluation import bench as bench_mod

    out = tmp_path / "bench"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert cli(["bench", str(tmp_path), "--out", str(out)]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    monkeypatch.setattr(bench_mod, "gpu_provenance", lambda: {})
    monkeypatch.setattr(bench_mod, "plot", lambda report, path: path.write_text("png"))
    with pytest.raises(SparsifyError, match="holds mine.txt, and is not a bench folder.*deleting them"):
        bench_mod.bench([], out=out, overwrite=True, progress=False)
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    (out / "mine.txt").unlink()
    bench_mod.bench([], out=out, overwrite=True, progress=False)  # an empty folder: replaced
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "decode.png", "report.md"]
    (out / "bench.json").write_text("{}")
    bench_mod.bench([], out=out, overwrite=True, progress=False)  # a bench folder: replaced whole
    assert json.loads((out / "bench.json").read_text())["models"] == {}


def test_paired_prefill_warms_each_variant_and_flips_the_order(monkeypatch):
    """paired_prefill_ms: every round sets each variant, runs one untimed prompt forward, then the timed one,
    in an order that flips every round; one time per variant and round."""
    from types import SimpleNamespace

    from sparsify.evaluation.bench import paired_prefill_ms

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    log, state = [], {"v": None}
    model = SimpleNamespace(base_model=lambda input_ids, use_cache: log.append((state["v"], use_cache)))
    variants = {"dense": lambda: state.update(v="dense"), "sparse": lambda: state.update(v="sparse")}
    got = paired_prefill_ms(model, torch.zeros(1, 4, dtype=torch.long), variants, rounds=3)
    assert {k: len(v) for k, v in got.items()} == {"dense": 3, "sparse": 3}
    assert all(t >= 0 for v in got.values() for t in v)
    order = [v for v, _ in log[::2]]
    assert order == ["dense", "sparse", "sparse", "dense", "dense", "sparse"]
    assert [v for v, _ in log[1::2]] == order and not any(c for _, c in log)  # warm + timed, no cache


def test_bench_on_the_cpu_reports_dense_and_sparse_with_its_threads(tmp_path):
    """`--device cpu`: the same report (dense and sparse in one run, greedy tokens compared, paired prefill rounds),
    regime eager only, the number of torch threads stated; graph regimes are refused there."""
    from sparsify.evaluation import bench as bench_mod
    from sparsify.folder.convert import convert
    from tests.tiny import tiny_model_folder

    with pytest.raises(SparsifyError, match="on the CPU only eager runs"):
        bench_mod.bench([str(tmp_path)], device="cpu", regimes=("compiled",), progress=False)
    tiny_model_folder(tmp_path / "src")
    folder = convert(tmp_path / "src", tmp_path / "out", progress=False)
    threads = torch.get_num_threads()
    try:
        report = bench_mod.bench([f"tiny={folder}"], device="cpu", threads=1, batches=(1,), prompts=(8,),
                                 new_tokens=4, repeats=1, dtype="fp32", progress=False, out=tmp_path / "bench")
    finally:
        torch.set_num_threads(threads)
    assert report["device"] == "cpu" and report["settings"]["threads"] == 1 and "1 torch threads" in report["gpu"]
    rows = report["models"]["tiny"]["rows"]
    assert [(r["regime"], r["variant"]) for r in rows] == [("eager", "dense"), ("eager", "sparse")]
    assert rows[0]["greedy_tokens"] == "equal" and len(rows[0]["prefill_ms_rounds"]) == bench_mod.PREFILL_ROUNDS
    text = (tmp_path / "bench" / "report.md").read_text()
    assert "1 torch threads" in text and "| eager | 1 | 8 | **" in text


def test_bench_on_the_cpu_packs_the_layers_outside_the_ffns_when_asked(tmp_path):
    """`--pack` (CPU only): both variants run with the attention and LM head layers packed, same greedy tokens,
    and the report says so; with --device cuda it is refused before any work."""
    from sparsify.evaluation import bench as bench_mod
    from sparsify.folder.convert import convert
    from tests.tiny import tiny_model_folder

    with pytest.raises(SparsifyError, match="use it with --device cpu"):
        bench_mod.bench([str(tmp_path)], device="cuda", pack=True, progress=False)
    tiny_model_folder(tmp_path / "src")
    folder = convert(tmp_path / "src", tmp_path / "out", progress=False)
    report = bench_mod.bench([f"tiny={folder}"], device="cpu", batches=(1,), prompts=(8,), new_tokens=4, repeats=1,
                             dtype="bf16", progress=False, out=tmp_path / "bench", pack=True)
    rows = report["models"]["tiny"]["rows"]
    assert report["settings"]["packed"] is True and rows[0]["greedy_tokens"] == "equal"
    assert report["models"]["tiny"]["packed_layers"] == 4 * 2 + 1  # q, k, v, o of its 2 layers and the LM head
    stock = bench_mod.bench([f"stock={tmp_path / 'src'}"], device="cpu", batches=(1,), prompts=(8,), new_tokens=4,
                            repeats=1, dtype="bf16", progress=False, pack=True)
    assert stock["models"]["stock"]["packed_layers"] == 4 * 2 + 1  # its FFNs' layers stay F.linear, as ours do
    assert "packed weights (--pack)" in (tmp_path / "bench" / "report.md").read_text()
