"""sparsify bench (CUDA-only timings): its refusals and its report arithmetic, on CPU."""

import pytest
import torch

from sparsify.evaluation.bench import markdown, speedups
from sparsify.cli import main as cli


def _row(variant, batch, tok_s, ttft, regime="graphs"):
    return {"regime": regime, "variant": variant, "batch": batch, "prompt": 512, "new_tokens": 256,
            "ttft_ms": ttft, "decode_tok_s": tok_s, "step_ms": 1e3 / tok_s * batch, "step_ms_spread": 0.01,
            "graph_replays_per_call": 254, "greedy_tokens": "equal"}


def test_speedups_pair_sparse_with_dense_of_the_same_case():
    rows = [_row("dense", 1, 100.0, 20.0), _row("sparse", 1, 125.0, 25.0), _row("dense", 8, 400.0, 30.0),
            _row("sparse", 8, 380.0, 30.0), _row("dense", 1, 50.0, 40.0, regime="eager"),
            {"regime": "graphs", "batch": 32, "prompt": 512, "skipped": "out of GPU memory"}]
    got = {(s["regime"], s["batch"]): s for s in speedups(rows)}
    assert set(got) == {("graphs", 1), ("graphs", 8)}  # the eager case has no sparse row
    assert got[("graphs", 1)]["decode_speedup"] == pytest.approx(1.25)
    assert got[("graphs", 1)]["ttft_speedup"] == pytest.approx(0.8)
    assert got[("graphs", 8)]["decode_speedup"] == pytest.approx(0.95)
    text = markdown({"gpu": "GPU", "provenance": {}, "settings": {"new_tokens": 256},
                     "models": {"m": {"info": "", "rows": rows, "speedups": speedups(rows)}}})
    assert "**1.25x**" in text and "skipped: out of GPU memory" in text


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
