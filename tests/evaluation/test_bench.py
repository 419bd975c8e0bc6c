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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_bench_refuses_without_a_gpu(capsys, tmp_path):
    assert cli(["bench", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
