"""The CPU's sparse FFN row (kernels/cpu_sparse.py, issue 43): the dense function exactly (fp32 tight, bf16 at the
dtype's rounding), with and without theta, both MLP layouts, M = 1 and M > 1; the row the runtime's forced and
auto backends pick on the CPU; generate() of a folder with it; a folder in transformers' pipelines. No timings: auto
is driven by a scripted clock, and the tests' process runs Triton's interpreter (conftest), whose CPU row is the
TwELL kernels', so the default table is checked in subprocesses without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from sparsify.folder.convert import convert
from sparsify.kernels import twell_reference as ref
from sparsify.kernels.cpu_sparse import PackedLinear, active_count, gemm, pack, sparse_ffn, sparse_rows
from sparsify.kernels.dispatch import Dispatcher, HostClock, Policy, WeightStore
from sparsify.kernels.ffn_runtime import FFNRuntime, dense_rows
from sparsify.kernels.modeling_sparsify import SparseMLP

from tests.kernels.helpers import FP32, assert_close, make_case
from tests.tiny import thresholded_copy, tiny_model_folder

REPO = Path(__file__).resolve().parents[2]
CPU_TABLE = {("cpu", "dense"): dense_rows, ("cpu", "twell"): sparse_rows}


def theta_for(f: int, seed: int = 3) -> torch.Tensor:
    """theta [F] float32: uniform in [0, 0.3), every 4th 0 (relu), every 7th 1e4 (never active)."""
    theta = torch.rand(f, generator=torch.Generator().manual_seed(seed)) * 0.3
    theta[::4], theta[1::7] = 0.0, 1e4
    return theta


def fused_mlp(d: int, f: int, seed: int = 0) -> SparseMLP:
    """A Phi-3-style gated MLP (one gate_up_proj [2F, d], gate rows first) as a SparseMLP."""
    torch.manual_seed(seed)
    mlp = nn.Module()
    mlp.gate_up_proj = nn.Linear(d, 2 * f, bias=False)
    mlp.down_proj = nn.Linear(f, d, bias=False)
    return SparseMLP(mlp).eval()


def check_dense_function(got, x, wg, wu, wd, theta, what):
    """got is the dense FFN of x: fp32 tight; 16-bit within one rounding step of the dtype at the output's scale of
    the dense expression, and no further from the fp32 oracle than twice the dense expression's own error."""
    want = ref.ffn_dense(x, wg, wu, wd, theta)
    if x.dtype == torch.float32:
        assert_close(got, want, what=what, **FP32)
        return
    assert got.dtype == x.dtype
    assert_close(got, want, rtol=2.0 ** -7, atol=0.0, what=f"{what} vs dense")
    oracle = ref.ffn_reference(x, wg, wu, wd, theta)
    base = (want.float() - oracle).abs().max().item()
    assert_close(got, oracle, rtol=0.0, atol=2 * base + 1e-3 * oracle.abs().max().item(), what=f"{what} vs oracle")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("thresholded", [False, True])
def test_the_sparse_row_computes_the_dense_ffn(dtype, m, thresholded):
    """sparse_rows on x [M, d] and [B, S, d] is the dense expression ffn_dense, theta or not; the case is sparse
    (most gate values off) and theta changes the result (the check is not blind to it)."""
    x, wg, wu, wd = make_case(m, 64, 384, 0.9, seed=m, dtype=dtype)
    theta = theta_for(384) if thresholded else None
    auto = Dispatcher(host=HostClock())
    got = sparse_rows(auto, x, wg, wu, wd, None, theta)
    check_dense_function(got, x, wg, wu, wd, theta, f"M={m} {dtype} theta={thresholded}")
    on = ref.threshold_act(torch.nn.functional.linear(x, wg), theta) != 0
    assert 0 < on.float().mean() < 0.2, "the case should be sparse with some neurons active"
    if thresholded:
        assert not torch.equal(ref.ffn_dense(x, wg, wu, wd, theta), ref.ffn_dense(x, wg, wu, wd))
    x3 = x.reshape(1, m, 64)
    assert torch.equal(sparse_rows(auto, x3, wg, wu, wd, None, theta), got.view(1, m, 64))


@pytest.mark.parametrize("d,f", [(64, 256), (576, 1536), (96, 1000)])
@pytest.mark.parametrize("m", [1, 3, 64])
def test_the_packed_gate_gives_f_linears_bits(d, f, m):
    """bf16: the gate GEMM on W_gate packed once is F.linear bit for bit (the same oneDNN kernel without its
    per-call reorder); where this CPU cannot pack, pack says None and gemm is F.linear itself."""
    gen = torch.Generator().manual_seed(d + f + m)
    w = torch.randn(f, d, generator=gen).to(torch.bfloat16)
    x = torch.randn(m, d, generator=gen).to(torch.bfloat16)
    packed = pack(w)
    assert torch.equal(gemm(x, w, packed), torch.nn.functional.linear(x, w))
    assert pack(w.float()) is None  # float32 packed sums in another order: not the dense function's bits
    if packed is not None:
        assert packed.is_mkldnn and not torch.equal(gemm(x, w * 2, packed), torch.nn.functional.linear(x, w * 2))


def test_the_dispatcher_packs_a_gate_once_per_weight_version():
    """Dispatcher.packed: one packed copy per W_gate version (an in-place update of the weight makes a new one),
    None for weights that do not pack; the sparse row with it gives the bits it gives without it."""
    auto = Dispatcher(host=HostClock())
    x, wg, wu, wd = (t.to(torch.bfloat16) for t in make_case(1, 128, 512, zeros=0.9, seed=4))
    first = auto.packed(wg)
    if first is None:
        pytest.skip("oneDNN has no bf16 linear on this CPU: nothing is packed (test_the_packed_gate_gives_f_linears_bits)")
    assert auto.packed(wg) is first and auto.packed(wg.float()) is None
    unpacked = sparse_ffn(x, wg, wu, ref.transpose_down(wd))
    assert torch.equal(sparse_rows(auto, x, wg, wu, wd), unpacked)
    with torch.no_grad():
        wg.mul_(-1)  # in place: the old packed copy must not serve the new weight
    assert auto.packed(wg) is not first
    assert torch.equal(sparse_rows(auto, x, wg, wu, wd), sparse_ffn(x, wg, wu, ref.transpose_down(wd)))


def test_the_row_follows_a_model_cast_after_its_first_call():
    """A module's `.to(dtype)` keeps its Parameter objects and swaps their storage: the copies the dispatcher keeps
    per weight (W_down^T, the packed gate) are made again, so the cast layer computes its dense function."""
    torch.manual_seed(0)
    layer = nn.Module()
    layer.gate_proj, layer.up_proj = nn.Linear(64, 256, bias=False), nn.Linear(64, 256, bias=False)
    layer.down_proj = nn.Linear(256, 64, bias=False)
    auto = Dispatcher(host=HostClock())
    x = torch.randn(1, 64)
    weights = lambda: (layer.gate_proj.weight, layer.up_proj.weight, layer.down_proj.weight)  # noqa: E731
    with torch.no_grad():
        check_dense_function(sparse_rows(auto, x, *weights()), x, *weights(), None, "float32")
        layer.to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        check_dense_function(sparse_rows(auto, xb, *weights()), xb, *weights(), None, "after .to(bfloat16)")


@pytest.mark.parametrize("zeros", [0.0, 1.0])
def test_the_sparse_row_handles_every_neuron_on_and_off(zeros):
    """All active (the union is every neuron) and none active (the output is zero, as dense gives it)."""
    x, wg, wu, wd = make_case(5, 32, 96, zeros, seed=1)
    for rows in (x[:1], x):
        got = sparse_ffn(rows, wg, wu, ref.transpose_down(wd))
        check_dense_function(got, rows, wg, wu, wd, None, f"zeros={zeros} M={rows.shape[0]}")
    if zeros == 1.0:
        assert not sparse_ffn(x, wg, wu, ref.transpose_down(wd)).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("thresholded", [False, True])
def test_the_sparse_row_on_a_fused_gate_up_layer(dtype, thresholded):
    """Phi-3's layout: the runtime hands the row views of gate_up_proj (SparseMLP.weights); the row gives the layer's
    own torch expression."""
    mlp = fused_mlp(48, 160).to(dtype)
    if thresholded:
        mlp = SparseMLP(mlp, threshold=True)  # (wraps the same projections, with a threshold buffer)
        mlp.threshold.copy_(theta_for(160))
    wg, wu, wd = mlp.weights()
    assert wg.data_ptr() == mlp.gate_up_proj.weight.data_ptr() and wu.shape == wg.shape == (160, 48)
    x = torch.randn(2, 3, 48, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        want = mlp.torch_ffn(x)
        got = sparse_rows(Dispatcher(host=HostClock()), x, wg, wu, wd, None, mlp.threshold)
    check_dense_function(got, x, wg, wu, wd, mlp.threshold, f"fused {dtype}")
    assert_close(got, want, rtol=2.0 ** -7 if dtype != torch.float32 else 2e-5, atol=1e-5, what="vs torch_ffn")


def test_the_density_probe_counts_what_the_row_keeps():
    x, wg, _, _ = make_case(6, 32, 128, 0.8, seed=2)
    theta = theta_for(128)
    for t in (None, theta):
        want = int((ref.threshold_act(x @ wg.t(), t) != 0).sum())
        assert int(active_count(x, wg, t)) == want


class ScriptedHost(HostClock):
    """The CPU side of a dispatcher with scripted time: a call costs `times[path]` ms, the path being what the
    dispatcher's last answer ran (its calibration forces each path in turn)."""

    def __init__(self, times: dict):
        self.times, self.dispatcher = times, None

    def ms(self, fn, n: int) -> float:
        fn()
        return self.times[self.dispatcher.last_backend]


def spy_table(log: list) -> dict:
    def row(*args):
        log.append("sparse")
        return sparse_rows(*args)
    return {("cpu", "dense"): dense_rows, ("cpu", "twell"): row}


@pytest.mark.parametrize("twell_ms, faster", [(1.0, "twell"), (3.0, "dense"), (1.9, "dense")])
def test_auto_on_the_cpu_picks_the_row_from_its_timings(twell_ms, faster):
    """backend auto on a CPU runtime: the bucket is timed on the host clock (no graph regime) and the sparse row runs
    where it timed faster by the host's margin (Policy.host_margin: 0.95 of dense's time is not enough there), dense
    elsewhere; the forced backend "twell" always runs the sparse row."""
    assert Policy().host_margin < 0.95 < Policy().margin
    host = ScriptedHost({"twell": twell_ms, "dense": 2.0})
    auto = Dispatcher(store=WeightStore(), host=host)
    host.dispatcher = auto
    log: list = []
    rt = FFNRuntime("auto", dispatcher=auto, devices=("cpu",), kernels=spy_table(log))
    x, wg, wu, wd = make_case(1, 32, 128, 0.9, seed=4)
    y = rt.run(x, wg, wu, wd)
    check_dense_function(y, x, wg, wu, wd, None, "auto's first call")
    log.clear()
    for _ in range(3):
        rt.run(x, wg, wu, wd)
    decision = rt.dispatcher.decisions(wg)[1]
    assert decision["eager"] == decision["graph"] == faster and "graph_ratio" not in decision
    assert log == (["sparse"] * 3 if faster == "twell" else [])
    log.clear()
    rt.run(x, wg, wu, wd, backend="twell")
    rt.run(x, wg, wu, wd, backend="dense")
    assert log == ["sparse"]


def tiny_folder(tmp_path: Path) -> Path:
    tiny_model_folder(tmp_path / "src")
    return convert(tmp_path / "src", tmp_path / "out", progress=False)


def packed_layers(model) -> int:
    return sum(type(m).__name__ == "PackedLinear" for m in model.modules())  # (the folder's copy's class)


def cpu_sparse_model(folder: Path):
    """The folder loaded, its runtime on the CPU's sparse row (what a process without Triton's interpreter has)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    model.ffn_runtime.devices = ("cuda", "cpu")
    model.ffn_runtime.kernels = CPU_TABLE
    return model


@pytest.mark.parametrize("thresholded", [False, True])
def test_generate_gives_the_same_tokens_with_the_sparse_row(tmp_path, thresholded):
    from sparsify.families import mlp_modules

    folder = tiny_folder(tmp_path)
    if thresholded:
        thresholded_copy(folder, tmp_path / "thr")
        folder = tmp_path / "thr"
    model = cpu_sparse_model(folder)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    out = {}
    with torch.no_grad():
        for backend in ("dense", "twell"):
            model.set_ffn_backend(backend)
            out[backend] = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                          do_sample=False, pad_token_id=0)
            assert {m.last_path for m in mlp_modules(model)} == {"torch" if backend == "dense" else "twell_ffn:twell"}
    assert torch.equal(out["dense"], out["twell"])
    assert out["dense"].shape[1] == 9 + 12


def test_packed_linears_change_speed_not_bits(tmp_path):
    """The first generate() on the CPU in bf16 packs the layers outside the FFNs (the FFNs' own projections stay
    the runtime's; a forward alone packs nothing): logits and greedy tokens are the unpacked model's bit for bit,
    the state dict is unchanged, an in-place weight update is seen; pack_cpu_linears(False) gives back plain
    nn.Linear layers and generate() then leaves them so."""
    from sparsify.families import mlp_modules

    model = cpu_sparse_model(tiny_folder(tmp_path)).to(torch.bfloat16)
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(0))
    keys = list(model.state_dict())
    layers = len(model.model.layers)

    def generate():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              pad_token_id=0)

    with torch.no_grad():
        plain = model(input_ids=ids).logits
        assert packed_layers(model) == 0
        tokens = generate()
        assert packed_layers(model) == 4 * layers + 1  # q, k, v, o per layer and the LM head
        assert all(type(p) is nn.Linear for m in mlp_modules(model) for p in m.projections())
        assert torch.equal(model(input_ids=ids).logits, plain)
        assert list(model.state_dict()) == keys
        assert model.pack_cpu_linears(False) == 4 * layers + 1
        assert torch.equal(generate(), tokens) and packed_layers(model) == 0  # the same tokens unpacked; none packed
        assert model.pack_cpu_linears() == 4 * layers + 1
        assert torch.equal(generate(), tokens)
        head = model.lm_head
        packed = head.__dict__.get("packed_cpu")
        if pack(head.weight) is not None:
            assert packed is not None and packed[1].is_mkldnn
        head.weight.mul_(2)  # in place (the tied embedding too): the next call packs the new weight
        twice = model(input_ids=ids).logits
        assert model.pack_cpu_linears(False) == 4 * layers + 1
        assert torch.equal(model(input_ids=ids).logits, twice) and not torch.equal(twice, plain)
    assert "packed_cpu" not in head.__dict__ and type(head) is nn.Linear


@pytest.mark.parametrize("case", ["float32", "pack_cpu false"])
def test_generate_packs_nothing_in_float32_or_when_the_folder_says_so(tmp_path, case):
    folder = tiny_folder(tmp_path)
    if case == "pack_cpu false":
        config = json.loads((folder / "config.json").read_text())
        config["sparsify"]["pack_cpu"] = False
        (folder / "config.json").write_text(json.dumps(config))
    model = cpu_sparse_model(folder)
    model = model if case == "float32" else model.to(torch.bfloat16)
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert packed_layers(model) == 0


def test_a_packed_linear_with_a_bias_and_gradients():
    """PackedLinear is nn.Linear's function: bias included (bf16, bit for bit, on the packed path where this CPU
    packs), float32, oneDNN switched off and gradients (the bias's alone too) on F.linear; a cast, a deepcopy and
    weights made under inference_mode work after a packed call."""
    import copy
    import warnings

    torch.manual_seed(0)
    layer = nn.Linear(96, 200).to(torch.bfloat16)
    x = torch.randn(3, 96).to(torch.bfloat16)
    want = layer(x)
    strided = torch.randn(2, 96, 5).to(torch.bfloat16).transpose(1, 2)  # non-contiguous [2, 5, 96]
    want_strided = torch.nn.functional.linear(strided, layer.weight, layer.bias)
    packs = pack(layer.weight) is not None
    layer.__class__ = PackedLinear
    with torch.no_grad():
        assert torch.equal(layer(x), want) and (layer.__dict__["packed_cpu"][1] is not None) == packs
        assert torch.equal(layer(strided), want_strided) and torch.equal(layer(x[:, None]), want[:, None])
        with warnings.catch_warnings():  # (flags() notes that TF32 on oneDNN is for Intel GPUs)
            warnings.simplefilter("ignore", UserWarning)
            gen = torch.Generator().manual_seed(0)  # (a case where the two paths' bits differ here)
            big = nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
            big.weight.copy_(torch.randn(1536, 576, generator=gen))
            big.__class__ = PackedLinear
            xb = torch.randn(1, 576, generator=gen).to(torch.bfloat16)
            big(xb)  # packed (where this CPU packs)
            with torch.backends.mkldnn.flags(enabled=False):
                assert torch.equal(big(xb), torch.nn.functional.linear(xb, big.weight))
    assert copy.deepcopy(layer).weight.equal(layer.weight)  # (the opaque packed copy is not pickled)
    layer.weight.requires_grad_(False)
    layer(x).float().sum().backward()  # only the bias trains: F.linear, so its gradient arrives
    assert layer.bias.grad is not None and layer.bias.grad.abs().sum() > 0
    layer.float()
    assert "packed_cpu" not in layer.__dict__
    assert torch.equal(layer(x.float()), torch.nn.functional.linear(x.float(), layer.weight, layer.bias))
    with torch.inference_mode():
        frozen = nn.Linear(96, 40).to(torch.bfloat16)
        frozen.__class__ = PackedLinear
        assert torch.equal(frozen(x), torch.nn.functional.linear(x, frozen.weight, frozen.bias))


def run_without_interpreter(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip().splitlines()[-1]


def test_the_default_table_runs_the_sparse_row_on_the_cpu():
    """Outside Triton's interpreter the table's ("cpu", "twell") row is the CPU's sparse row and the CPU is one of
    a runtime's default devices (its layers take the table, auto dispatches there)."""
    code = ("from sparsify.kernels import ffn_runtime as fr, cpu_sparse; "
            "print(fr.BACKEND_TABLE[('cpu', 'twell')] is cpu_sparse.sparse_rows, fr.FFNRuntime().devices)")
    assert run_without_interpreter(code) == "True ('cuda', 'cpu')"


def test_a_folder_generates_on_the_cpu_through_the_table_by_default(tmp_path):
    """generate() of a folder on the CPU, nothing set: backend auto takes the table in every layer (its answer
    depends on its timings), and its greedy tokens are dense's and the forced sparse row's."""
    folder = tiny_folder(tmp_path)
    code = (
        "import torch; from transformers import AutoModelForCausalLM; from sparsify.families import mlp_modules; "
        f"m = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval(); "
        "ids = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(0)); "
        "g = lambda: m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, "
        "pad_token_id=0); "
        "a = g(); auto = sorted({l.last_path.split(':')[0] for l in mlp_modules(m)}); backend = m.ffn_runtime.backend; "
        "decided = all(1 in l.auto_decisions() for l in mlp_modules(m)); "
        "m.set_ffn_backend('twell'); b = g(); paths = sorted({l.last_path for l in mlp_modules(m)}); "
        "m.set_ffn_backend('dense'); c = g(); "
        "print(backend, auto, decided, paths, torch.equal(a, b), torch.equal(a, c))")
    assert run_without_interpreter(code) == "auto ['twell_ffn'] True ['twell_ffn:twell'] True True"


def test_a_folder_runs_in_a_transformers_pipeline_without_an_error(tmp_path):
    """pipeline("text-generation", model=FOLDER, trust_remote_code=True) logs no "not supported" error (the class
    carries its base's name, which the pipeline checks) and generates."""
    import logging

    from transformers import pipeline

    folder = tiny_folder(tmp_path)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    library = logging.getLogger("transformers")  # (transformers' loggers do not propagate to the root)
    library.addHandler(handler)
    try:
        pipe = pipeline("text-generation", model=str(folder), trust_remote_code=True)
        out = pipe("the cat", max_new_tokens=4, do_sample=False)
    finally:
        library.removeHandler(handler)
    errors = [r.getMessage()[:300] for r in records if r.levelno >= logging.ERROR]
    assert not errors, errors
    assert type(pipe.model).__qualname__ == "SparseLlamaForCausalLM"
    assert out[0]["generated_text"].startswith("the cat")
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_sparsify.SparseLlamaForCausalLM"
