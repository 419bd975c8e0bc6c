"""Folders written by earlier versions keep loading next to this version's bundle. Issue 31: the FFN runtime replaced
the shared `sparsify::twell_ffn` op and `sparsify_twell_ffn_auto` dispatcher, which folders written at 9d2915f still
carry. Issue 42: registry API 2 (its own slot and op `sparsify::ffn_2`; the runtime <-> SparseMLP interface changed)
beside API 1's slot and `sparsify::ffn`, which folders written at e16df80 carry. tests/data/folders_<commit>.tar.xz
hold two folders each, with and without thresholds (tars: fixtures, frozen code of an earlier version, not source of
this one; folders_9d2915f.README.md says how they were made, the same way for both)."""

from __future__ import annotations

import tarfile
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sparsify.folder.convert import convert

from tests.tiny import make_source

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"

# Run in a fresh process per import order: the old copies register their op and publish their dispatcher.
CHECK = textwrap.dedent("""
    import sys
    from pathlib import Path

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    kind, order, old_relu, old_thr, new = sys.argv[1], sys.argv[2], *map(Path, sys.argv[3:6])
    load = lambda folder: AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    if order == "new_first":
        import sparsify.kernels.modeling_sparsify
        models = {"new": load(new), "old_relu": load(old_relu), "old_thr": load(old_thr)}
    else:
        models = {"old_relu": load(old_relu), "old_thr": load(old_thr)}
        import sparsify.kernels.modeling_sparsify
        models["new"] = load(new)

    from sparsify.evaluation.loading import ffn_backend, ffn_backend_of, installed_modeling
    from sparsify.families import mlp_modules
    from sparsify.kernels import ffn_runtime, registry, twell_ops
    from sparsify.kernels.twell_reference import ffn_reference, threshold_act

    mods = {k: sys.modules[type(m).__module__] for k, m in models.items()}
    assert mods["old_relu"] is not mods["new"] and isinstance(models["new"].ffn_runtime, ffn_runtime.FFNRuntime)
    if kind == "9d2915f":  # before the runtime: one shared op and dispatcher of their own, both old folders
        old_ops = sys.modules[mods["old_relu"].twell_ffn.__module__]
        old_ffn, old_last = old_ops.twell_ffn, old_ops.last_backend
        assert not hasattr(mods["old_relu"], "FFNRuntime") and not hasattr(models["old_relu"], "ffn_runtime")
        assert sys.modules["sparsify_twell_ffn_auto"].auto is old_ops.AUTO is sys.modules[mods["old_thr"].twell_ffn.__module__].AUTO
        assert hasattr(torch.ops.sparsify, "twell_ffn") and hasattr(torch.ops.sparsify, ffn_runtime.OP)
        assert not hasattr(torch.ops.sparsify, "twell_ffn_threshold")  # the old op takes thresholds: never displaced
    else:  # API 1: its own registry slot, shared runtime class and op, beside API 2's
        slots = sys.modules[registry.REGISTRY]
        old_class = slots.api1.classes["FFNRuntime"]
        assert registry.API == 2 and old_class is not ffn_runtime.FFNRuntime is slots.api2.classes["FFNRuntime"]
        assert type(models["old_relu"].ffn_runtime) is type(models["old_thr"].ffn_runtime) is old_class
        assert hasattr(torch.ops.sparsify, "ffn") and hasattr(torch.ops.sparsify, ffn_runtime.OP) and ffn_runtime.OP != "ffn"
        old_process = slots.api1.process or sys.modules[mods["old_relu"].__name__.rpartition(".")[0] + ".ffn_runtime"].process_runtime()
        old_ffn = lambda a, wg, wu, wd, backend, threshold: old_process.twell_ffn(a, wg, wu, wd, backend, None, threshold)
        old_last = lambda: old_process.last_backend

    class ThetaAct(torch.nn.Module):
        def __init__(self, theta):
            super().__init__()
            self.theta = theta

        def forward(self, g):
            return threshold_act(g, self.theta)

    def stock(folder, thetas=None):
        model = AutoModelForCausalLM.from_pretrained(folder).eval()  # transformers' own Llama, ReLU
        for mlp, theta in zip(mlp_modules(model), thetas or []):
            mlp.act_fn = ThetaAct(theta)
        return model

    saved = load_file(old_thr / "model.safetensors")
    thetas = [saved[f"model.layers.{i}.mlp.threshold"] for i in range(2)]
    assert all(t.dtype == torch.float32 and bool((t > 0).any()) for t in thetas)
    assert all(torch.equal(m.threshold, t) for m, t in zip(mlp_modules(models["old_thr"]), thetas))
    refs = {"old_relu": stock(old_relu), "old_thr": stock(old_relu, thetas), "new": stock(new)}
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = {k: m(ids).logits for k, m in refs.items()}
        assert (want["old_thr"] - want["old_relu"]).abs().max() > 1e-3, "the thresholds change nothing"
        for key, model in models.items():
            torch.testing.assert_close(model(ids).logits, want[key], rtol=0, atol=1e-5, msg=key)
            assert {m.last_path for m in mlp_modules(model)} == {"torch"}, key
            assert ffn_backend_of(model) == "auto", key
            for backend in ("dense", "twell", "auto"):
                model.set_ffn_backend(backend)
                assert {m.ffn_backend for m in mlp_modules(model)} == {backend} and ffn_backend_of(model) == backend
                torch.testing.assert_close(model(ids).logits, want[key], rtol=0, atol=1e-5, msg=key)
            with ffn_backend(model, "dense") as switchable:
                assert switchable and ffn_backend_of(model) == "dense"
            assert ffn_backend_of(model) == "auto"
        # the old folders' weights under this version's code: the same function
        again = installed_modeling().SparseLlamaForCausalLM.from_pretrained(old_thr).eval()
        torch.testing.assert_close(again(ids).logits, want["old_thr"], rtol=0, atol=1e-5)

        # the ops, compiled, each copy through its own: the old op runs the old dispatcher, ours the registry's
        gen = torch.Generator().manual_seed(1)
        x, wg, wu, wd = (torch.randn(*s, generator=gen) for s in ((3, 8), (20, 8), (20, 8), (8, 20)))
        th = torch.rand(20, generator=gen)
        ref = ffn_reference(x, wg, wu, wd, th)
        for fn in (old_ffn, twell_ops.twell_ffn):
            for backend in ("dense", "twell", "auto"):
                compiled = torch.compile(lambda a: fn(a, wg, wu, wd, backend=backend, threshold=th), backend="eager",
                                         fullgraph=True)
                torch.testing.assert_close(compiled(x), ref, rtol=1e-5, atol=1e-5)
                torch._dynamo.reset()
        assert old_last() == "dense" and twell_ops.last_backend() == "dense"  # (auto on CPU: dense)
    print("ok")
""")


@pytest.mark.parametrize("order", ["old_first", "new_first"])
@pytest.mark.parametrize("kind", ["9d2915f", "e16df80"])
def test_old_folders_load_beside_this_version(kind, order, tmp_path):
    """Two folders written at an earlier commit (thresholds and none: 9d2915f, before the FFN runtime; e16df80,
    registry API 1) and a folder of this version, loaded with trust_remote_code in one process with this
    version's sparsify.kernels, in either order: each computes the stock model's function (thresholds applied),
    set_ffn_backend and the eval helpers work on all three, and the old copies' op and runtime code keep working
    beside this version's, neither touching the other."""
    with tarfile.open(DATA / f"folders_{kind}.tar.xz") as tar:  # relu/ and thr/
        tar.extractall(tmp_path / "old", filter="data")
    for name in ("relu", "thr"):  # (renamed: transformers names a folder's module by its directory)
        (tmp_path / "old" / name).rename(tmp_path / f"old_{name}_{kind}")
    make_source("llama", tmp_path / "src")
    new = convert(tmp_path / "src", tmp_path / "new_folder", progress=False)
    res = subprocess.run([sys.executable, "-c", CHECK, kind, order, str(tmp_path / f"old_relu_{kind}"),
                          str(tmp_path / f"old_thr_{kind}"), str(new)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
