"""twell_ffn, the public op: backends, argument checks, the torch fallback, flat copies (CPU; GPU tests marked `gpu`)."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from sparsify.kernels import twell_ops, twell_reference as ref

from tests.kernels.helpers import FP32, assert_close, bf16_rule, make_case

KERNEL_DIR = Path(twell_ops.__file__).parent

@pytest.mark.parametrize("m,d,f", [(257, 72, 130), (3, 129, 257), (20, 16, 64)])
def test_odd_shapes_default_configs(m, d, f):
    x, wg, wu, wd = make_case(m, d, f, 0.9, seed=5)
    out = twell_ops.twell_ffn(x, wg, wu, wd, backend="twell")
    assert twell_ops.last_backend() == "twell"
    assert_close(out, ref.ffn_reference(x, wg, wu, wd), what=f"twell_ffn {m}x{d}x{f}", **FP32)


def test_backends_agree_with_leading_dims():
    x, wg, wu, wd = make_case(12, 40, 300, 0.9, seed=7)
    x3 = x.view(2, 6, 40)
    want = ref.ffn_reference(x3, wg, wu, wd)
    for backend in ("dense", "twell", "auto"):
        got = twell_ops.twell_ffn(x3, wg, wu, wd, backend=backend, w_down_t=twell_ops.transpose_down(wd))
        assert got.shape == (2, 6, 40) and got.dtype == x.dtype
        assert_close(got, want, what=f"backend={backend}", **FP32)
    assert twell_ops.last_backend() == "dense", "auto on CPU must pick the torch path"


def test_gradients_take_the_dense_path():
    x, wg, wu, wd = make_case(4, 16, 64, 0.5, seed=8)
    wg.requires_grad_(True)
    y = twell_ops.twell_ffn(x, wg, wu, wd, backend="twell")
    assert twell_ops.last_backend() == "dense"
    y.sum().backward()
    assert wg.grad is not None and wg.grad.abs().sum() > 0


def test_bad_inputs_name_the_fix():
    x, wg, wu, wd = make_case(2, 16, 64, 0.5)
    with pytest.raises(ValueError, match="backend='fast'.*auto"):
        twell_ops.twell_ffn(x, wg, wu, wd, backend="fast")
    with pytest.raises(ValueError, match=r"w_down has shape \(64, 16\).*nn.Linear"):
        twell_ops.twell_ffn(x, wg, wu, wd.t(), backend="dense")


def test_torch_fallback_without_triton():
    """The kernel files import and compute without triton (as in a CPU-only model folder): the CPU's row of the
    backend table is then its sparse torch row (cpu_sparse.py, issue 43), whatever TRITON_INTERPRET says."""
    code = textwrap.dedent(
        """
        import sys; sys.modules["triton"] = None
        import torch
        from sparsify.kernels import twell_ffn, last_backend, ffn_reference
        from sparsify.kernels.twell_triton import HAS_TRITON
        assert not HAS_TRITON
        gen = torch.Generator().manual_seed(0)
        x, wg, wu, wd = (torch.randn(*s, generator=gen) for s in ((3, 8), (20, 8), (20, 8), (8, 20)))
        y = twell_ffn(x, wg, wu, wd, backend="twell")
        assert last_backend() == "twell", last_backend()
        want = ffn_reference(x, wg, wu, wd)
        assert (y - want).abs().max() <= 1e-5 * want.abs().max(), (y - want).abs().max()
        print("ok")
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


def test_flat_copy_imports_like_a_model_folder(tmp_path, monkeypatch):
    """The export copies the files flat beside modeling code; a second copy must reuse the custom op."""
    pkg = tmp_path / "model_folder_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for path in KERNEL_DIR.glob("*.py"):  # what a model folder holds (shipped_code_files)
        if path.name != "__init__.py":
            shutil.copy(path, pkg / path.name)  # (their imports: tests/test_house.py)
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("model_folder_pkg.twell_ops")
    x, wg, wu, wd = make_case(3, 16, 64, 0.9, seed=9)
    assert_close(mod.twell_ffn(x, wg, wu, wd, backend="twell"), ref.ffn_reference(x, wg, wu, wd),
                 what="flat copy", **FP32)


def test_down_transpose_cache_follows_in_place_updates():
    """The cached W_down^T is keyed by the weight tensor and rebuilt when the weight changes in place."""
    x, wg, wu, wd = make_case(3, 16, 64, 0.5, seed=13)
    first = twell_ops.twell_ffn(x, wg, wu, wd, backend="twell")
    with torch.no_grad():
        wd.mul_(2.0)
    second = twell_ops.twell_ffn(x, wg, wu, wd, backend="twell")
    assert_close(second, 2 * first, what="after w_down.mul_(2)", **FP32)


# ---------------------------------------------------------------- GPU (run on the H200, skipped on CPU)
GPU_SHAPES = [(1, 576, 1536), (5, 2048, 8192), (16, 576, 1536), (300, 576, 1536), (1024, 2048, 8192)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,d,f", GPU_SHAPES)
@pytest.mark.parametrize("zeros", [0.0, 0.99])
def test_gpu_twell_matches_oracle(dtype, m, d, f, zeros):
    x, wg, wu, wd = make_case(m, d, f, zeros, seed=10, dtype=dtype, device="cuda")
    got = twell_ops.twell_ffn(x, wg, wu, wd, backend="twell")
    if dtype == torch.float32:
        assert_close(got, ref.ffn_reference(x, wg, wu, wd), what=f"gpu fp32 {m}x{d}x{f}", rtol=1e-4, atol=1e-4)
    else:
        bf16_rule(got, x, wg, wu, wd, f"gpu {dtype} {m}x{d}x{f} zeros={zeros}")


@pytest.mark.gpu
def test_gpu_auto_dense_layer_keeps_no_down_t():
    """At 0% zeros auto picks dense: afterwards no W_down^T copy is held and calls skip the dispatcher."""
    x, wg, wu, wd = make_case(256, 576, 1536, 0.0, seed=22, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        out = twell_ops.twell_ffn(x, wg, wu, wd)
    assert twell_ops.last_backend() == "dense"
    assert twell_ops.auto_dispatcher().store.get("down_t", wd) is None, "W_down^T kept for an all-dense layer"
    bf16_rule(out, x, wg, wu, wd, "auto dense")


@pytest.mark.gpu
def test_gpu_auto_cuda_graph_and_compile():
    x, wg, wu, wd = make_case(64, 576, 1536, 0.99, seed=12, dtype=torch.bfloat16, device="cuda")
    wdt = twell_ops.transpose_down(wd)
    eager = twell_ops.twell_ffn(x, wg, wu, wd, w_down_t=wdt)  # auto: measures, decides
    assert twell_ops.last_backend() in ("twell", "dense")
    graph = torch.cuda.CUDAGraph()
    static_out = None
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static_out = twell_ops.twell_ffn(x, wg, wu, wd, w_down_t=wdt)
    graph.replay()
    torch.cuda.synchronize()
    bf16_rule(static_out, x, wg, wu, wd, "cuda graph")
    compiled = torch.compile(lambda a: twell_ops.twell_ffn(a, wg, wu, wd, backend="twell", w_down_t=wdt))
    bf16_rule(compiled(x), x, wg, wu, wd, "torch.compile")
    bf16_rule(eager, x, wg, wu, wd, "auto eager")


@pytest.mark.gpu
def test_gpu_auto_calibration_and_refresh_reuse_pinned_buffer_and_event():
    """The real calibration records paired ratios (eager and graph); a twell bucket's refreshes reuse one
    pinned buffer and one event, and read back the density K1 counts."""
    x, wg, wu, wd = make_case(64, 576, 1536, 0.99, seed=34, dtype=torch.bfloat16, device="cuda")
    twell_ops.twell_ffn(x, wg, wu, wd)  # calibrates (M = 64: graph replay timed too)
    st = twell_ops.auto_dispatcher().store.get("states", wg)[64]
    assert {"ratio", "spread", "cpu_bound", "graph_ratio"} <= st.times.keys() and not st.timing, st.times
    st.decision = st.graph_decision = "twell"  # the refresh path under test is the twell one
    st.calls, pinned, event = 0, st.pinned, st.event
    for _ in range(twell_ops.auto_dispatcher().policy.refresh):
        twell_ops.twell_ffn(x, wg, wu, wd)
    assert st.pending is not None
    first = (st.pinned, st.event) if pinned is None else (pinned, event)
    torch.cuda.synchronize()
    st.density = -1.0  # overwritten by the next call's poll of the completed count
    for _ in range(twell_ops.auto_dispatcher().policy.refresh):
        twell_ops.twell_ffn(x, wg, wu, wd)
    assert st.pinned is first[0] and st.event is first[1]
    want = float((torch.nn.functional.linear(x, wg) > 0).float().mean())
    assert st.density == pytest.approx(want, abs=2e-3)
