"""eval --speed (CUDA only): backends restored on error, ratios paired by shape, the plumbing with CPU stand-ins."""

from __future__ import annotations

import pytest
import torch

from sparsify.evaluation import loading as ld
from sparsify.evaluation import speed as sp
from sparsify.families import mlp_modules
from tests.tiny import TEXT


def test_speed_section_restores_backends_when_a_run_fails(tiny_sparse_folder, monkeypatch):
    class FakeDevice:
        type = "cuda"

    model, tok = ld.load_model(ld.ModelSpec("t", str(tiny_sparse_folder)), "cpu", "auto")
    before = {m: m.ffn_backend for m in mlp_modules(model)}
    assert "twell" not in before.values()  # the folder default, so a leftover "twell" shows
    monkeypatch.setattr(type(model), "device", property(lambda self: FakeDevice()))
    monkeypatch.setattr(sp, "text_batch", lambda tokens, b, s, device: torch.zeros(b, s, dtype=torch.long))

    def interrupted(model, backends, fn, *args):  # the first shape switches the backend, then Ctrl-C
        model.set_ffn_backend("twell")
        raise KeyboardInterrupt

    monkeypatch.setattr(sp, "_each_backend", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sp.speed_section(model, torch.arange(100), sp.SpeedGrid(batches=(1,), seqs=(8,), decode_batches=(1,)))
    assert {m: m.ffn_backend for m in mlp_modules(model)} == before


def test_speedups_pair_backends_by_shape():
    prefill = [{"backend": b, "batch": 1, "seq": 64, "tokens_per_s": v} for b, v in
               (("dense", 100.0), ("twell", 120.0), ("auto", 125.0))]
    prefill.append({"backend": "dense", "repeat": True, "batch": 1, "seq": 64, "tokens_per_s": 98.0})
    prefill += [{"backend": "dense", "batch": 8, "seq": 64, "tokens_per_s": 400.0},
                {"backend": "twell", "batch": 8, "seq": 64, "error": "out of memory"},
                {"backend": "auto", "batch": 8, "seq": 64, "tokens_per_s": 380.0}]
    decode = [{"backend": "stock", "batch": 1, "tokens_per_s": 50.0}]
    got = sp.speedups(prefill, decode)
    assert got["prefill"] == [
        {"batch": 1, "seq": 64, "twell_over_dense": 1.2, "auto_over_dense": 1.25, "dense_noise": pytest.approx(0.02)},
        {"batch": 8, "seq": 64, "twell_over_dense": None, "auto_over_dense": 0.95, "dense_noise": None}]
    assert got["decode"] == []  # a stock model has nothing to compare


def test_text_batch_uses_consecutive_real_tokens():
    tokens = torch.arange(10)
    batch = sp.text_batch(tokens, 3, 4, "cpu")  # needs 12 tokens: the text repeats
    assert batch.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]


def test_speed_section_plumbing_with_cpu_stand_ins(tiny_sparse_folder, monkeypatch):
    """The CUDA-only code path end to end on CPU: only the CUDA timing/memory calls are replaced (the
    forwards, cache handling, backend switching and ratio building are the real ones). No numbers are
    checked: CPU timings mean nothing; the H200 runs test_speed_section_on_cuda."""
    import time

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return max((other.t - self.t) * 1e3, 1e-6)

    class FakeDevice:
        type = "cuda"

    model, tok = ld.load_model(ld.ModelSpec("t", str(tiny_sparse_folder)), "cpu", "auto")
    before = {m: m.ffn_backend for m in mlp_modules(model)}
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 123 * 2**20)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "stand-in")
    monkeypatch.setattr(type(model), "device", property(lambda self: FakeDevice()))
    text_batch = sp.text_batch
    monkeypatch.setattr(sp, "text_batch", lambda tokens, b, s, device: text_batch(tokens, b, s, "cpu"))
    grid = sp.SpeedGrid(batches=(1, 2), seqs=(16, 4096), decode_batches=(2,), decode_prompt=8, decode_tokens=3, repeats=2)
    speed = sp.speed_section(model, sp.speed_tokens(tok, TEXT), grid)
    assert speed["backends"] == ["dense", "twell", "auto"] and speed["device"] == "stand-in"
    assert [(r["batch"], r["seq"], r["backend"], bool(r.get("repeat"))) for r in speed["prefill"][:4]] == [
        (1, 16, "dense", False), (1, 16, "twell", False), (1, 16, "auto", False), (1, 16, "dense", True)]
    assert {r["seq"] for r in speed["prefill"]} == {16, 256}  # clipped to max_position_embeddings
    assert all("error" not in r and r["peak_mem_gb"] == pytest.approx(123 / 1024) for r in speed["prefill"] + speed["decode"])
    assert all(r["path"] == "torch" for r in speed["prefill"])  # CPU tensors: SparseMLP's torch path
    assert len(speed["decode"]) == 4 and len(speed["speedup"]["prefill"]) == 4 and len(speed["speedup"]["decode"]) == 1
    assert set(speed["ffn_share"]) == {"dense", "twell", "auto"}
    assert all(0 < s["ffn_share"] < 1 for s in speed["ffn_share"].values())
    assert {m: m.ffn_backend for m in mlp_modules(model)} == before  # the folder default, restored


@pytest.mark.gpu
def test_speed_section_on_cuda(tiny_sparse_folder):
    """Run on the H200: every backend measured, ratios formed, the model's own backend restored."""
    model, tok = ld.load_model(ld.ModelSpec("t", str(tiny_sparse_folder)), "cuda", "auto")
    before = {m: m.ffn_backend for m in mlp_modules(model)}
    grid = sp.SpeedGrid(batches=(1, 4), seqs=(64,), decode_batches=(1,), decode_prompt=16, decode_tokens=4, repeats=3)
    speed = sp.speed_section(model, sp.speed_tokens(tok, TEXT), grid)
    assert speed["available"] and speed["backends"] == ["dense", "twell", "auto"]
    rows = speed["prefill"] + speed["decode"]
    # 2 shapes x (dense, twell, auto, dense again) + 1 decode shape x 4
    assert len(speed["prefill"]) == 8 and len(speed["decode"]) == 4
    assert all(r["tokens_per_s"] > 0 and r["peak_mem_gb"] > 0 for r in rows), rows
    assert {r["path"] for r in speed["prefill"] if r["backend"] == "twell"} == {"twell_ffn:twell"}
    assert {r["path"] for r in speed["prefill"] if r["backend"] == "dense"} == {"torch"}
    assert len(speed["speedup"]["prefill"]) == 2 and speed["speedup"]["prefill"][0]["dense_noise"] is not None
    assert set(speed["ffn_share"]) == {"dense", "twell", "auto"} and 0 < speed["ffn_share"]["dense"]["ffn_share"] < 1
    assert {m: m.ffn_backend for m in mlp_modules(model)} == before  # the folder default, restored
