"""The kernel benchmark and sweep scripts of eval/bench/ on tiny shapes in the interpreter (their code paths, not timings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparsify.kernels import twell_reference as ref

ROOT = Path(__file__).resolve().parents[2]


def test_paired_timing_rotates_the_order_and_pairs_rounds():
    """eval/bench/timing.py, the one timing helper of the benchmarks: each round measures every function once, the
    first one rotating; a ratio is the median of the same round's ratios; a function failing at warm-up is dropped
    with its error kept; a CUDA graph standing for n calls is divided by n."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("timing", ROOT / "eval" / "bench" / "timing.py")
    timing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timing)
    order = []
    t = timing.rounds_of({k: (lambda k=k: order.append(k) or float(len(order))) for k in "abc"}, 3)
    assert "".join(order) == "abcbcacab" and t["a"] == [1.0, 6.0, 8.0]
    assert timing.paired({"x": [2, 4, 6], "y": [1, 1, 2]}, "x", "y") == 3  # median of 2, 4, 3; not 4 / 1
    assert timing.paired({"x": [1.0]}, "x", "y") is None

    def broken():
        raise RuntimeError("no kernel")

    errors, fns = {}, {"ok": lambda: None, "broken": broken}
    t = timing.interleaved(fns, timing.Clock(False), errors, rounds=2, per_call={"ok": 4})
    assert set(t) == {"ok"} and len(t["ok"]) == 2 and "no kernel" in errors["broken"]


def test_bench_decode_smoke_on_cpu(tmp_path):
    """eval/bench/bench_decode.py's code paths (case builder, correctness gate, timing, JSON + tables) on a tiny
    shape in the interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "eval" / "bench" / "bench_decode.py"), "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads((tmp_path / "decode-bench.json").read_text())["rows"]
    assert [r["M"] for r in rows] == [1, 20]
    for r in rows:
        assert "errors" not in r and "bad" not in r, r
        assert set(r["ms"]) == {"dense", "dense_b", "routed", "split"} | ({"chunked"} if r["M"] <= 16 else set()) \
            | ({"fused"} if r["M"] == 1 else set())
        assert r["rel_err"]["routed"] < 1e-5 and 0 < r["union_frac"] < 1, r["rel_err"]
    assert rows[0]["rel_err"]["fused"] < 1e-5
    assert "dense / routed" in res.stdout and "dense / fused" in res.stdout and (tmp_path / "decode-bench.md").exists()


def test_bench_decode_k1_sweep_smoke_on_cpu(tmp_path):
    """--sweep-k1 on its tiny CPU case: every decode K1 config's FFN (that K1 + the chunked K2) matches the fp32
    reference, the parts (cuBLAS gate GEMV, each K1, K2) are timed without an output check, and every K1 config
    gets a rate against the gate GEMV."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "eval" / "bench" / "bench_decode.py"), "--smoke", "--no-grid", "--sweep-k1",
                          "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (row,) = json.loads((tmp_path / "decode-bench.json").read_text())["sweep"]
    assert row["sweep"] == "sweep_k1" and not row["errors"], row["errors"]
    configs = {k for k in row["ms"] if k.startswith("k1")}  # the FFN with each K1 config
    assert len(configs) >= 5 and set(row["rel_err"]) == configs  # the FFNs are checked, the parts are not
    assert all(e < 1e-5 for e in row["rel_err"].values()), row["rel_err"]
    assert set(row["ms"]) == {"dense", "part:gate-gemv", "part:k2"} | configs | {f"part:{k}" for k in configs}
    assert set(row["k1_rate"]) == configs and all(v > 0 for v in row["k1_rate"].values())
    assert "K1 rate vs the cuBLAS gate GEMV" in (tmp_path / "decode-bench.md").read_text()


def test_bench_decode_fused_sweep_smoke_on_cpu(tmp_path):
    """--sweep-fused on its tiny CPU case: every launch config of the fused decode FFN, the routed path and K1 + K2
    itself match the fp32 reference; the gate GEMV is a part (timed, not checked)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "eval" / "bench" / "bench_decode.py"), "--smoke", "--no-grid",
                          "--sweep-fused", "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (row,) = json.loads((tmp_path / "decode-bench.json").read_text())["sweep"]
    assert row["sweep"] == "sweep_fused" and not row["errors"], row["errors"]
    configs = {k for k in row["rel_err"] if k.startswith("f-")}
    assert len(configs) >= 10 and "f-default" in configs and set(row["rel_err"]) == configs | {"routed", "k1+k2"}
    assert all(e < 1e-5 for e in row["rel_err"].values()), row["rel_err"]
    assert set(row["ms"]) == {"dense", "part:gate-gemv"} | set(row["rel_err"])


def run_sweep_smoke(script: str, out: Path) -> dict:
    """One of the K1 / K2 sweep scripts on its tiny CPU case; its first JSON row."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "eval" / "bench" / script), "--smoke", "--budget-s", "0.2",
                          "--out", str(out)], capture_output=True, text=True, env=env, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads((out / script.replace("_", "-").replace(".py", ".json")).read_text())["rows"][0]


@pytest.mark.slow  # the interpreter runs every config (72 s on 2 busy cores)
def test_k1_sweep_smoke_on_cpu(tmp_path):
    """The K1 sweep (correctness gate against the tiled K1, interleaved timing, JSON)."""
    row = run_sweep_smoke("k1_sweep.py", tmp_path)
    assert not row["mismatch"] and not row["errors"], (row["mismatch"], row["errors"])
    assert {"gate", "k1_tiled"} < row["k1_ms"].keys() and row["best_tma"] and "tma" in row["ffn_ms"]


def test_k1_sweep_same_packing_bound():
    """The sweep's correctness gate allows the fp32 accumulation-order error (absolute: it matters on small
    gate values left by cancellation) and one 16-bit step, and nothing more: a 1% error is caught."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("k1_sweep", ROOT / "eval" / "bench" / "k1_sweep.py")
    ks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ks)
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(16, 64, generator=gen), torch.randn(256, 64, generator=gen) / 8
    gate = x @ w.t()
    small = (gate > 0) & (gate < 1e-2)  # values that cancellation left small
    assert small.any()
    a = ref.twell_pack(gate, tile=64, slots=64, entries="fp16")
    reordered = gate + small * 2 * 64 * 2**-24 * (x.abs() @ w.abs().t())  # within the fp32 reordering bound
    assert ks.same_packing(a, ref.twell_pack(reordered, tile=64, slots=64, entries="fp16"), x, w) is None
    assert "values differ" in ks.same_packing(a, ref.twell_pack(gate * 1.01, tile=64, slots=64, entries="fp16"), x, w)
    shifted = gate + small * 1e-2  # an absolute error larger than the bound, on the small values only
    assert "values differ" in ks.same_packing(a, ref.twell_pack(shifted, tile=64, slots=64, entries="fp16"), x, w)


def test_k2_sweep_smoke_on_cpu(tmp_path):
    """The K2 sweep: every (E, warps) config sums the same entries as the default (to rounding)."""
    row = run_sweep_smoke("k2_sweep.py", tmp_path)
    assert not row["errors"] and len(row["max_diff"]) == 2, row  # the smoke configs
    assert max(row["max_diff"].values()) < 1e-3, row["max_diff"]


def test_bench_smoke_on_cpu(tmp_path):
    """The benchmark script's code paths (every section, JSON + table) on a tiny grid in the interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "eval" / "bench" / "bench_kernels.py"), "--smoke",
                          "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((tmp_path / "kernels-bench.json").read_text())
    rows = data["rows"]
    assert rows and not [r for r in rows if "error" in r], [r.get("error") for r in rows]
    assert {"twell_tma_ms", "twell_tiled_ms", "k2_c_ms", "auto_ms", "k1_ms", "k1_tma_ms", "k2_ms",
            "x_auto", "noise_med", "k1_over_gate"} <= rows[-1].keys()  # rows[-1]: M = 20 (prefill: K1 + K2)
    assert "TARGETS" in res.stdout


def test_bench_auto_overhead_smoke_on_cpu(tmp_path):
    """eval/bench/bench_auto_overhead.py (dense vs auto vs auto without grants, prefill and a decode step on a
    cache) runs end to end on a tiny synth folder, restores the grant, and writes its JSON."""
    from sparsify.folder.synth import synth

    from tests.tiny import SYNTH_CONFIG as TINY

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    synth(tmp_path / "config.json", tmp_path / "model", zeros=0.9, dtype="fp32", progress=False)
    res = subprocess.run([sys.executable, str(ROOT / "eval" / "bench" / "bench_auto_overhead.py"), f"tiny={tmp_path / 'model'}",
                          "--prompt", "16", "--rounds", "3", "--calls", "4", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    row = json.loads((tmp_path / "o" / "auto-overhead.json").read_text())["rows"][0]
    assert set(row["cases"]) == {"prefill", "decode"}
    for case in row["cases"].values():
        assert set(case["ms"]) == {"dense", "auto", "auto_no_grant"} and min(case["ms"].values()) > 0
    assert "| tiny | decode |" in res.stdout


def test_bench_gendata_smoke_on_cpu(tmp_path):
    """eval/bench/bench_gendata.py --cpu --tiny: both paths at both batch sizes, the new one served by the sampling graph
    loop (emulated) with its seed and row checks passing, JSON + table with the new / old ratio."""
    res = subprocess.run([sys.executable, str(ROOT / "eval" / "bench" / "bench_gendata.py"), "--cpu", "--tiny", "--batches", "1",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads((tmp_path / "gendata-bench.json").read_text())["rows"]
    assert [(r["batch"], r["path"]) for r in rows] == [(2, "new"), (2, "old"), (4, "new"), (4, "old")]
    for r in rows:
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0
        if r["path"] == "new":
            assert r["served_by_graph_loop"] == 3 and r["same_seed_same_tokens"] and r["rows_differ"], r
            assert r["tokens"] <= r["sampled"]
        else:
            assert r["served_by_graph_loop"] == 0
    assert "new / old" in res.stdout and (tmp_path / "gendata-bench.md").exists()


def test_bench_gendata_gqa_modes_smoke_on_cpu(tmp_path):
    """eval/bench/bench_gendata.py --gqa-modes fold,enable_gqa on --cpu --tiny: the new path once per mode (a model of its
    own each), the old path once (batch 2, GQA_DECODE fold), each row's `gqa` the mode kernels/fast_decode.py held
    while it ran. tests/tiny.py's Llama is grouped-query (4 query heads, 2 KV heads), so both models decode through
    decode_sdpa, where GQA_DECODE picks the kernel (per_gqa attention). What it covers: the flow per mode, the rows
    and the table. Not which kernel ran: the modes agree up to summation order, and `gqa` is the constant as read
    back after the batches; nor any speed (CPU, emulated graphs)."""
    res = subprocess.run([sys.executable, str(ROOT / "eval" / "bench" / "bench_gendata.py"), "--cpu", "--tiny", "--batches", "1",
                          "--gqa-modes", "fold,enable_gqa", "--old-batch-sizes", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((tmp_path / "gendata-bench.json").read_text())
    assert [(r["batch"], r["path"], r["gqa"]) for r in data["rows"]] == [
        (2, "new", "fold"), (2, "old", "fold"), (4, "new", "fold"), (2, "new", "enable_gqa"), (4, "new", "enable_gqa")]
    for r in data["rows"]:
        assert r["tokens"] > 0 and r["served_by_graph_loop"] == (3 if r["path"] == "new" else 0), r
    assert data["meta"]["gqa_modes"] == ["fold", "enable_gqa"]
    # each mode's model its own (a reused one would count the other mode's loops too): 2 sizes x 3 loop batches
    assert {m: (g["attention"], g["loops"]) for m, g in data["meta"]["per_gqa"].items()} == {
        "fold": ("sparsify_decode_sdpa", 6), "enable_gqa": ("sparsify_decode_sdpa", 6)}
    lines = [line for line in res.stdout.splitlines() if line.startswith(("| 2 |", "| 4 |"))]
    assert [line.split(" | ")[:2] for line in lines] == [["| 2", "fold"], ["| 2", "enable_gqa"], ["| 4", "fold"],
                                                         ["| 4", "enable_gqa"]]


def test_bench_gqa_decode_smoke_on_cpu(tmp_path):
    """eval/bench/bench_gqa_decode.py --smoke: the attention table (three modes, each equal to repeat_kv's output) and
    the step table (three models, the graph loop emulated) on a tiny GQA shape; JSON + table written."""
    out = tmp_path / "gqa"
    res = subprocess.run([sys.executable, str(ROOT / "eval" / "bench" / "bench_gqa_decode.py"), "--smoke", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((out / "gqa-decode.json").read_text())
    (att,) = data["attention"]
    assert att["shape"] == "2:4:2:16:8" and max(att[f"{m}_maxdiff"] for m in ("fold", "enable_gqa")) < 1e-5
    assert [r["batch"] for r in data["steps"]] == [1, 3]
    for r in data["steps"]:
        assert r["fold_same_tokens"] and r["enable_gqa_same_tokens"] and r["sdpa_tok_s"] > 0
    assert "enable_gqa x" in (out / "gqa-decode.md").read_text()


def test_bench_cpu_decode_smoke(tmp_path):
    """eval/bench/bench_cpu_decode.py's FFN and auto sections on a tiny shape without Triton's interpreter (the CPU's
    sparse row): its code paths, JSON and tables, not its timings."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(ROOT / "eval" / "bench" / "bench_cpu_decode.py"), "--sections", "ffn,auto",
                          "--shapes", "64x256", "--ms", "1,4", "--budget-ms", "20", "--threads", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((tmp_path / "cpu-decode.json").read_text())
    assert report["provenance"]["threads"] == 1 and [r["shape"] for r in report["ffn_m1"]] == ["64x256"]
    assert [r["m"] for r in report["auto"]] == [1, 4] and all(r["decision"] in ("twell", "dense") for r in report["auto"])
    assert all(0 < r["active"] < 0.2 for r in report["ffn_m1"]) and report["generate"] == []  # (95.7% zeros)
    assert "| FFN, M = 1, bf16 |" in (tmp_path / "report.md").read_text()
    res = subprocess.run([sys.executable, str(ROOT / "eval" / "bench" / "bench_cpu_decode.py"), "--sections", "ffn"],
                         capture_output=True, text=True, env={**env, "TRITON_INTERPRET": "1"}, timeout=300)
    assert res.returncode != 0 and "unset it" in res.stderr
