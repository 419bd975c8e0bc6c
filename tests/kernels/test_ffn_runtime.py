"""The FFN runtime (kernels/ffn_runtime.py): one owner per model for the backend, auto's decisions, the held answers,
the backend table and the step check's twin, found through the one registry by every copy of the bundle (CPU;
auto runs on a fake clock (tests/kernels/fake_auto.py), dispatching CPU calls to a stand-in TwELL row)."""

from __future__ import annotations

import __future__
import copy
import importlib
import logging
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from sparsify.folder.format import shipped_code_files
from sparsify.kernels import ffn_runtime as fr, modeling_sparsify as ms, registry, twell_ops, twell_reference as ref
from sparsify.kernels.dispatch import Policy

from tests.kernels.helpers import make_case
from tests.kernels.fake_auto import ALL_DENSE, EAGER_TWELL, GRAPH_ONLY_TWELL, dispatcher, state

KERNEL_DIR = Path(fr.__file__).parent
FFN_FILES = ("ffn_runtime", "twell_ops", "dispatch", "modeling_sparsify", "decode_capture", "fast_decode")


# ------------------------------------------------------------------------------------------- house rules
def _immutable(value) -> bool:
    if isinstance(value, tuple):
        return all(_immutable(v) for v in value)
    return isinstance(value, (str, bytes, int, float, complex, bool, type(None), frozenset, types.MappingProxyType,
                              torch.dtype))


def mutable_globals(module) -> list[str]:
    """Module-level names of `module` bound to something that can hold state, other than the registry and what
    it holds: modules, classes, functions, loggers, immutable values and Triton's kernel objects (JIT functions,
    autotuners: their compile and tuning caches are Triton's) pass; anything else (a dict, a set, an object, a
    method bound to one) is listed."""
    reg = sys.modules[registry.REGISTRY]
    slots = [v for v in vars(reg).values() if isinstance(v, types.SimpleNamespace)]
    held = {id(reg), *(id(s) for s in slots), *(id(v) for s in slots for v in vars(s).values())}
    interpreter = sys.modules.get("triton.runtime.interpreter")  # copies its globals into a module it runs
    held |= {id(v) for v in vars(interpreter).values()} if interpreter is not None else set()
    plain = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, logging.Logger,
             __future__._Feature)
    return [name for name, v in vars(module).items()
            if not name.startswith("__") and id(v) not in held and not isinstance(v, plain) and not _immutable(v)
            and type(v).__module__ != "typing" and not type(v).__module__.startswith("triton.")]


def test_no_module_level_mutable_state_but_the_registry():
    """No file of the bundle (every one a model folder ships) holds state of its own at module level: no mutable
    values; the registry is the one process-wide store."""
    bad = {}
    names = [f.stem for f in shipped_code_files()]
    assert {"registry", "twell_triton", "twell_updown", "decode_attention", *FFN_FILES} <= set(names), names
    for name in names:
        module = importlib.import_module(f"sparsify.kernels.{name}")
        found = mutable_globals(module)  # (no `global` rebinding either: a house rule, tests/test_house.py)
        if found:
            bad[name] = found
    assert not bad, bad
    probe = types.ModuleType("probe")  # the check itself sees state
    probe.cache, probe.names, probe.obj, probe.ok = {}, {"a"}, fr.FFNLayer(), ("a", 1, frozenset())
    probe.bound = twell_ops.auto_dispatcher().dense_in_capture
    assert mutable_globals(probe) == ["cache", "names", "obj", "bound"]


def test_backends_are_declared_once():
    assert twell_ops.BACKENDS is ms.BACKENDS is fr.BACKENDS  # (declared in ffn_runtime only: tests/test_house.py)


# ------------------------------------------------------------------------- a model's layers on a fake auto
def sparse_layer(runtime, seed: int = 41, cls=ms.SparseMLP):
    """(x [20, 16], a SparseMLP on `runtime` with weights [64, 16] / [16, 64], 90% of the gate values <= 0)."""
    x, wg, wu, wd = make_case(20, 16, 64, 0.9, seed=seed)
    mlp = torch.nn.Module()
    for name, w in (("gate_proj", wg), ("up_proj", wu), ("down_proj", wd)):
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight = torch.nn.Parameter(w, requires_grad=False)
        setattr(mlp, name, linear)
    return x, cls(mlp, runtime=runtime)


def fake_runtime(times, backend: str = "auto", **kwargs) -> fr.FFNRuntime:
    """A runtime whose auto is tests/kernels/fake_auto.py's (fake clock) and whose layers take its backend table on CPU, the
    TwELL row a stand-in (Kernels: the dense FFN, its calls logged)."""
    d = dispatcher(times, **kwargs)
    return fr.FFNRuntime(backend, dispatcher=d, devices=("cpu",),
                         kernels={("cpu", "dense"): fr.dense_rows, ("cpu", "twell"): d.sparse})


def counted_questions(runtime) -> list:
    """Count the layer calls that ask (the others ran on a held answer): the shapes the dispatcher was asked,
    not counting the questions its calibration's timed calls ask inside one."""
    seen, choose, depth = [], runtime.dispatcher.choose, [0]

    def counting(x2d, *args):
        if not depth[0]:
            seen.append(tuple(x2d.shape))
        depth[0] += 1
        try:
            return choose(x2d, *args)
        finally:
            depth[0] -= 1

    runtime.dispatcher.choose = counting
    return seen


def refreshes_at(runtime, now: list) -> list:
    """The call numbers (now[0] when asked) of the questions whose answer asks for a density refresh."""
    seen, choose = [], runtime.dispatcher.choose

    def refreshes_seen(*args):
        answer = choose(*args)
        if answer.on_count is not None:
            seen.append(now[0])
        return answer

    runtime.dispatcher.choose = refreshes_seen
    return seen


@torch.no_grad()
def test_grants_keep_the_refresh_period_in_real_calls():
    """Through the runtime: holding answers, a decided-dense layer asks auto a handful of times in 3 refresh
    periods, and auto refreshes the density at the same real calls as without held answers; every output is the
    dense FFN's; the layer's path stays the answering call's."""
    every = Policy().refresh_dense
    total, refreshes, entries = 3 * every + 7, {}, {}
    for grants in (False, True):
        runtime = fake_runtime(ALL_DENSE)
        runtime.grants = grants
        x, mlp = sparse_layer(runtime)
        want = ref.ffn_dense(x, *mlp.weights())
        now = [0]
        seen, calls = refreshes_at(runtime, now), counted_questions(runtime)
        for now[0] in range(total):
            assert torch.equal(mlp(x), want)
        assert mlp.last_path == "twell_ffn:dense"
        refreshes[grants], entries[grants] = seen, len(calls)
    assert refreshes[True] == refreshes[False] and len(refreshes[True]) == 3, refreshes
    assert entries[False] == total and entries[True] <= 5, entries


@torch.no_grad()
def test_a_switch_or_another_shape_ends_the_grant_and_reports_its_calls():
    runtime = fake_runtime(ALL_DENSE)
    x, mlp = sparse_layer(runtime)
    mlp(x)  # calibrates, then takes a grant
    st, rec = state(runtime.dispatcher, mlp.gate_weight()), mlp.ffn_layer
    assert rec.given > 10 and rec.left == rec.given and rec.in_capture
    for _ in range(7):
        mlp(x)
    calls = st.calls
    runtime.set_backend("auto")  # any switch ends grants: the 7 calls count
    assert (rec.given, rec.left, st.calls) == (0, 0, calls + 7)
    mlp(x)  # through auto again (a new grant)
    for _ in range(3):
        mlp(x)
    calls = st.calls
    mlp(x[:9])  # another shape (bucket 16, calibrated anew): the grant's 3 calls count first
    assert st.calls == calls + 3 and rec.shape == (9, 16)
    runtime.set_backend("dense")
    assert mlp.ffn_backend == "dense" and mlp.auto_decisions()[32]["eager"] == "dense"
    with pytest.raises(ValueError, match="backend must be one of"):
        runtime.set_backend("fast")


@torch.no_grad()
def test_a_twell_answer_holds_and_runs_the_tables_twell_row():
    """A layer auto decided twell for holds that answer up to the refresh: its calls run the backend table's
    TwELL row without asking (eager calls only: a captured one asks); the refresh-th call asks and its row counts
    the density."""
    runtime = fake_runtime(EAGER_TWELL)
    row = runtime.kernels["cpu", "twell"]
    x, mlp = sparse_layer(runtime)
    calls = counted_questions(runtime)
    want = ref.ffn_dense(x, *mlp.weights())
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-6)  # calibrates, answers twell
    st, rec = state(runtime.dispatcher, mlp.gate_weight()), mlp.ffn_layer
    assert mlp.last_path == "twell_ffn:twell" and rec.answer == "twell" and rec.left == rec.given > 0
    assert rec.in_capture is False and len(calls) == 1
    ran = len(row.calls)
    for _ in range(rec.left):
        torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-6)
    assert len(calls) == 1 and len(row.calls) == ran + rec.given and not any(row.calls[ran:])
    mlp(x)  # the refresh: asks, and the TwELL row counts the density
    assert len(calls) == 2 and row.calls[-1] and st.pending is not None
    assert st.calls % runtime.dispatcher.policy.refresh == 0


def bare(runtime, x, wg, wu, wd, threshold=None, backend: str = "auto"):
    """A bare twell_ffn call (no model) on `runtime`, as twell_ops.twell_ffn makes on the process runtime."""
    return runtime.twell_ffn(x, wg, wu, wd, backend, None, threshold)


@torch.no_grad()
def test_bare_auto_calls_hold_the_answer_and_keep_the_refresh_period():
    """twell_ffn(backend="auto") outside a model: the answer holds for the calls up to the refresh as a layer's
    grant does (a few questions in 3 refresh periods, the density refreshed at the same real calls as when every
    call asks), every output the dense FFN's, last_backend the answer's; a held twell answer runs the TwELL row."""
    every = Policy().refresh_dense
    total, refreshes, entries = 3 * every + 7, {}, {}
    x, wg, wu, wd = make_case(20, 16, 64, 0.9, seed=43)
    want = ref.ffn_dense(x, wg, wu, wd)
    for grants in (False, True):
        runtime = fake_runtime(ALL_DENSE)
        runtime.grants = grants
        now = [0]
        seen, calls = refreshes_at(runtime, now), counted_questions(runtime)
        for now[0] in range(total):
            assert torch.equal(bare(runtime, x, wg, wu, wd), want)
        assert runtime.last_backend == "dense"
        refreshes[grants], entries[grants] = seen, len(calls)
    assert refreshes[True] == refreshes[False] and len(refreshes[True]) == 3, refreshes
    assert entries[False] == total and entries[True] <= 5, entries
    runtime = fake_runtime(EAGER_TWELL)
    row, calls = runtime.kernels["cpu", "twell"], counted_questions(runtime)
    torch.testing.assert_close(bare(runtime, x, wg, wu, wd), want, rtol=1e-5, atol=1e-6)
    ran = len(row.calls)
    for _ in range(5):
        torch.testing.assert_close(bare(runtime, x, wg, wu, wd), want, rtol=1e-5, atol=1e-6)
    assert len(calls) == 1 and len(row.calls) == ran + 5 and runtime.last_backend == "twell"


@torch.no_grad()
def test_a_bare_held_answer_ends_when_an_argument_changes():
    """Any argument unlike the asking call's asks again, and the held calls that ran are reported first: W_gate
    edited in place (auto decides anew), another x shape or dtype, other W_up / W_down / threshold objects, a
    forced backend, gradients; a W_gate that is gone takes its held answer with it."""
    runtime = fake_runtime(ALL_DENSE)
    calls = counted_questions(runtime)
    x, wg, wu, wd = make_case(20, 16, 64, 0.9, seed=44)
    theta = torch.zeros(64)
    bare(runtime, x, wg, wu, wd)
    st = state(runtime.dispatcher, wg)
    for _ in range(3):
        bare(runtime, x, wg, wu, wd)
    before = st.calls
    bare(runtime, x[:9], wg, wu, wd)  # another shape: asks, after reporting the 3 held calls
    assert len(calls) == 2 and st.calls == before + 3
    changes = [lambda: bare(runtime, x, wg, wu.clone(), wd), lambda: bare(runtime, x, wg, wu, wd.clone()),
               lambda: bare(runtime, x, wg, wu, wd, theta), lambda: bare(runtime, x.double(), *(w.double() for w in
                                                                                          (wg, wu, wd))),
               lambda: bare(runtime, x[:9], wg, wu, wd)]
    for change in changes:
        bare(runtime, x, wg, wu, wd)  # asks (the last call had other arguments), then holds
        asked = len(calls)
        bare(runtime, x, wg, wu, wd)  # held
        change()
        assert len(calls) == asked + 1
    bare(runtime, x, wg, wu, wd)
    asked = len(calls)
    wg.mul_(1.0)  # in place: a new version of W_gate
    bare(runtime, x, wg, wu, wd)
    assert len(calls) == asked + 1 and len(runtime.dispatcher.decisions(wg)) == 1
    asked = len(calls)
    y = bare(runtime, x, wg, wu, wd, backend="twell")  # forced: the table's TwELL row, no question to auto
    assert runtime.last_backend == "twell" and len(calls) == asked
    torch.testing.assert_close(y, ref.ffn_dense(x, wg, wu, wd), rtol=1e-5, atol=1e-6)
    bare(runtime, x, wg, wu, wd)  # auto again: its answer still holds
    assert runtime.last_backend == "dense" and len(calls) == asked
    with torch.enable_grad():
        wq = wg.clone().requires_grad_()
        bare(runtime, x, wq, wu, wd)  # no question: gradients run the dense torch path
        assert runtime.dispatcher.last_backend == "dense" and id(wq) not in runtime.held
    held = len(runtime.held)
    w2 = wg.clone()
    bare(runtime, x, w2, wu, wd)
    assert len(runtime.held) == held + 1
    del w2
    assert len(runtime.held) == held


@torch.no_grad()
def test_an_eager_only_grant_leaves_captured_calls_to_auto():
    """Eager dense, graph replay twell: the grant covers eager calls only; a captured call runs auto's graph
    decision (twell) and takes no grant; step-check helpers see the twell layer."""
    capturing = [False]
    runtime = fake_runtime(GRAPH_ONLY_TWELL, capturing=lambda: capturing[0])
    x, mlp = sparse_layer(runtime)
    calls = counted_questions(runtime)
    mlp(x)
    assert mlp.ffn_layer.given > 0 and mlp.ffn_layer.in_capture is False and runtime.twell_in_step(20)
    mlp(x)
    assert len(calls) == 1
    capturing[0] = True
    ran = len(runtime.dispatcher.sparse.calls)
    y = mlp(x)
    assert len(calls) == 2 and mlp.last_path == "twell_ffn:twell" and len(runtime.dispatcher.sparse.calls) == ran + 1
    torch.testing.assert_close(y, ref.ffn_dense(x, *mlp.weights()), rtol=1e-5, atol=1e-6)
    with runtime.dense_in_capture():  # the step check's twin: the layer's torch path, no call into auto
        assert torch.equal(mlp(x), mlp.torch_ffn(x)) and mlp.last_path == "torch" and len(calls) == 2
    runtime.set_backend("twell")
    assert not runtime.twell_in_step(20)


@torch.no_grad()
def test_compiled_calls_reach_their_own_runtime_through_the_op():
    """Under torch.compile a layer's call is the op sparsify::ffn carrying its runtime's key: the op (registered
    once, by whichever copy came first) runs that runtime's dispatcher, not another model's."""
    a, b = fake_runtime(ALL_DENSE), fake_runtime(ALL_DENSE)
    (x, mlp_a), (_, mlp_b) = sparse_layer(a, seed=1), sparse_layer(b, seed=2)
    targets = []

    def record(gm, example_inputs):
        targets.extend(n for n in gm.graph.nodes if n.op == "call_function" and "sparsify" in str(n.target))
        return gm.forward

    torch._dynamo.reset()
    try:
        y = torch.compile(mlp_b, backend=record, fullgraph=True)(x)
    finally:
        torch._dynamo.reset()
    assert [str(n.target).removesuffix(".default") for n in targets] == [f"sparsify.{fr.OP}"]
    assert targets[0].args[-1] == b.key
    assert a.dispatcher.decisions(mlp_a.gate_weight()) == {} and a.last_backend is None
    assert b.decisions(mlp_b)[32]["eager"] == "dense" and b.last_backend == "dense"
    assert torch.equal(y, ref.ffn_dense(x, *mlp_b.weights()))
    assert registry.SLOT.runtimes[b.key] is b


def test_a_copied_model_gets_a_runtime_of_its_own():
    runtime = fake_runtime(ALL_DENSE)
    model = torch.nn.Module()
    x, model.mlp = sparse_layer(runtime)
    model.ffn_runtime = runtime
    twin = copy.deepcopy(model)
    rt = twin.ffn_runtime
    assert rt is not runtime and rt.key != runtime.key and registry.SLOT.runtimes[rt.key] is rt
    assert rt.layers == [twin.mlp] and twin.mlp.runtime is rt and twin.mlp.ffn_layer is not model.mlp.ffn_layer
    ms.set_ffn_backend(twin, "dense")
    assert (model.mlp.ffn_backend, twin.mlp.ffn_backend) == ("auto", "dense")
    with torch.no_grad():
        torch.testing.assert_close(twin.mlp(x), model.mlp(x))


def test_sparsify_mlps_puts_a_model_on_one_runtime():
    model = torch.nn.Module()
    _, model.a = sparse_layer(None)
    model.b = torch.nn.Module()
    for name, w in (("gate_proj", (64, 16)), ("up_proj", (64, 16)), ("down_proj", (16, 64))):
        setattr(model.b, name, torch.nn.Linear(w[1], w[0], bias=False))
    assert ms.sparsify_mlps(model) == 1
    assert model.b.runtime is model.ffn_runtime and model.a.runtime is not model.ffn_runtime  # (a: built alone)
    ms.set_ffn_backend(model, "twell")  # every runtime in the model
    assert (model.a.ffn_backend, model.b.ffn_backend) == ("twell", "twell")
    with pytest.raises(AttributeError):
        model.b.ffn_backend = "dense"  # one owner: the runtime (set_ffn_backend)


def test_a_second_copy_of_the_bundle_reuses_the_first_ones_runtime_code(tmp_path, monkeypatch):
    """A flat copy imported like a model folder's: its own modules, but the first copy's runtime classes, op and
    process runtime (the registry's), so its models' state lives where the op and bench look."""
    pkg = tmp_path / "second_bundle_copy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for path in sorted(KERNEL_DIR.glob("*.py")):
        if path.name != "__init__.py":
            shutil.copy(path, pkg / path.name)
    monkeypatch.syspath_prepend(str(tmp_path))
    second = importlib.import_module("second_bundle_copy.ffn_runtime")
    ops = importlib.import_module("second_bundle_copy.twell_ops")
    modeling = importlib.import_module("second_bundle_copy.modeling_sparsify")
    second_registry = importlib.import_module("second_bundle_copy.registry")
    assert second is not fr and second_registry is not registry and second_registry.SLOT is registry.SLOT
    assert second.FFNRuntime is fr.FFNRuntime and second.FFNLayer is fr.FFNLayer
    assert ops.auto_dispatcher() is twell_ops.auto_dispatcher()
    assert modeling.SparseMLP is not ms.SparseMLP
    _, mlp = sparse_layer(None, cls=modeling.SparseMLP)
    assert type(mlp.runtime) is fr.FFNRuntime and registry.SLOT.runtimes[mlp.runtime.key] is mlp.runtime
    assert second.runtime_of(types.SimpleNamespace(ffn_runtime=mlp.runtime)) is mlp.runtime
