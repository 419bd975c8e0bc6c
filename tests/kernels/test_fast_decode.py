"""Fast decode (static cache + decode steps replayed from graphs) and the step check, on CPU.

CUDA graphs need a GPU; `cpu_emulation` runs the same capture/replay bookkeeping on CPU tensors (a replay is
then a forward call on the captured input buffers), so what can go wrong outside the graph itself is tested
here: static-cache equivalence, input buffers, undoing the warm-up step, graph reuse across calls.
"""

import json
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from sparsify.folder.synth import synth
from sparsify.kernels.fast_decode import fast_decode_of

from tests.tiny import SYNTH_CONFIG as TINY


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast")
    (root / "config.json").write_text(json.dumps(TINY))
    synth(root / "config.json", root / "model", zeros=0.9, dtype="fp32", progress=False)
    model = AutoModelForCausalLM.from_pretrained(root / "model", trust_remote_code=True, dtype=torch.float32).eval()
    assert fast_decode_of(model).compile  # folders compile their decode step by default (on CUDA, or emulated)
    fast_decode_of(model).compile = False  # these tests check the capture flow; one test below compiles
    return model


@pytest.mark.parametrize("loop", [True, False], ids=["greedy-loop", "transformers-loop"])
def test_fast_decode_equals_eager_dynamic_cache_and_reuses_its_graph(tiny, loop):
    """Both fast paths (the greedy graph loop; transformers' loop with the forward replayed) give the eager
    dynamic-cache tokens; the reused cache keeps its graph across calls, another batch size gets its own."""
    ids = torch.randint(3, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))
    fast = fast_decode_of(tiny)
    fast.cpu_emulation = False  # plain CPU: transformers' default dynamic cache, eager
    ref = tiny.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    fast.cpu_emulation, fast.loop = True, loop
    fast.drop_graphs()  # (the module's model: start without earlier tests' graphs)
    fast.cache = fast.cache_key = None
    captures, replays, loops = fast.captures, fast.replays, fast.loops
    try:
        got = tiny.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        # token 1 from the prefill, token 2 from an eager warm-up step, then 22 replays of one capture
        assert (fast.captures - captures, fast.replays - replays, fast.loops - loops) == (1, 22, int(loop))
        again = tiny.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)  # same cache reused: no new capture
        assert fast.captures - captures == 1 and fast.replays - replays == 22 + 23
        other = tiny.generate(ids[:1], max_new_tokens=24, min_new_tokens=24, do_sample=False)  # another batch: another cache
        assert fast.captures - captures == 2
        torch.manual_seed(0)
        sampled = tiny.generate(ids, max_new_tokens=8, do_sample=True, top_k=5)  # transformers' loop
        assert sampled.shape == (2, 15)
    finally:
        fast.cpu_emulation, fast.loop = False, True
    assert torch.equal(ref, got) and torch.equal(ref, again) and torch.equal(ref[:1], other)


def top2_gap(scores) -> float:
    """Smallest gap between the two best logits over the steps and rows of a greedy run (finite ones): the
    static-cache and dynamic-cache paths sum in different orders (~2e-8 apart here), so token equality
    is a fair test only well above that."""
    gaps = []
    for s in scores:
        top = s.topk(2, dim=-1).values
        ok = torch.isfinite(top[:, 1])
        gaps += (top[:, 0] - top[:, 1])[ok].tolist()
    return min(gaps)


def test_greedy_loop_stops_and_pads_like_transformers(tiny):
    ids = torch.randint(3, TINY["vocab_size"], (3, 5), generator=torch.Generator().manual_seed(3))
    fast = fast_decode_of(tiny)
    plain = tiny.generate(ids, max_new_tokens=80, do_sample=False)
    eos = int(plain[0, 5 + 3])  # a token row 0 emits early: an end-of-sequence id for this test
    # no eos, then eos ids (the graph of the first call must not be replayed without the eos mask), then others
    for kwargs in ({"eos_token_id": None, "pad_token_id": 1}, {"eos_token_id": eos, "pad_token_id": 1, "min_new_tokens": 9},
                   {"eos_token_id": [eos, 7], "min_new_tokens": 30}):
        out = tiny.generate(ids, max_new_tokens=80, do_sample=False, output_scores=True, return_dict_in_generate=True,
                            **kwargs)
        assert top2_gap(out.scores) > 1e-5, "a near-tie between logits: choose another prompt seed"
        ref = out.sequences
        fast.cpu_emulation = True
        loops = fast.loops
        try:
            got = tiny.generate(ids, max_new_tokens=80, do_sample=False, **kwargs)
        finally:
            fast.cpu_emulation = False
        assert fast.loops == loops + 1
        assert torch.equal(ref, got), (kwargs, ref, got)


def test_fast_decode_keeps_out_of_what_it_cannot_replay(tiny):
    fast = fast_decode_of(tiny)
    ids = torch.tensor([[1, 2, 3]])
    fast.cpu_emulation = True
    try:
        # a user-chosen dynamic cache, gradients on, several tokens at once: never captured
        assert fast.cache_of((), {"input_ids": ids[:, :1], "cache": None}) is None
        captures = fast.captures
        tiny.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="dynamic")
        assert fast.captures == captures
        loops = fast.loops  # a padded batch (or a pad id in the prompt) keeps transformers' loop
        padded = tiny.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
                               max_new_tokens=5, do_sample=False)
        assert fast.loops == loops and padded.shape == (2, 8)
        assert tiny.enable_fast_decode(False) is fast and not fast.enabled  # the documented switch
        tiny.generate(ids, max_new_tokens=5, do_sample=False)
        assert fast.captures == captures + 1
    finally:
        fast.enabled, fast.cpu_emulation = True, False


def test_a_backend_switch_gets_its_own_graph(tiny):
    """Graphs bake in the FFN backend: after set_ffn_backend the next call captures anew."""
    ids = torch.randint(3, TINY["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(3))
    fast = fast_decode_of(tiny)
    fast.cpu_emulation = True
    try:
        for loop in (True, False):
            fast.loop = loop
            tiny.set_ffn_backend("dense")
            tiny.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
            captures = fast.captures
            tiny.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
            assert fast.captures == captures
            tiny.set_ffn_backend("auto")
            tiny.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
            assert fast.captures == captures + 1
    finally:
        fast.cpu_emulation, fast.loop = False, True
        tiny.set_ffn_backend("auto")


def test_compiled_decode_gives_the_same_tokens_and_falls_back_when_compiling_fails(tiny, caplog):
    """compile=True: decode steps (and so the captured step) run through torch.compile (dynamo traces the
    whole forward on the static cache, no graph break), tokens unchanged; a compiler that fails leaves
    a warning and the uncompiled path, with the same tokens."""
    from torch._dynamo.utils import counters

    ids = torch.randint(3, TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(4))
    fast = fast_decode_of(tiny)
    ref = tiny.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)

    def failing(gm, example_inputs):
        raise RuntimeError("compiler unavailable")

    torch._dynamo.reset()
    counters.clear()
    fast.cpu_emulation = True
    try:
        for loop in (True, False):
            fast.loop = loop
            assert tiny.enable_fast_decode(compile=True) is fast and fast.compile
            fast.set_compile(True, backend="eager")
            got = tiny.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
            assert torch.equal(ref, got) and fast.compile and fast.compile_error is None
        assert counters["stats"]["unique_graphs"] >= 2 and not counters["graph_break"]
        for loop in (True, False):
            fast.loop = loop
            fast.set_compile(True, backend=failing)
            fast.drop_graphs()  # (graphs captured above would be replayed without compiling)
            torch._dynamo.reset()
            caplog.clear()
            with caplog.at_level("WARNING", logger="sparsify"):
                got = tiny.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
            assert torch.equal(ref, got)
            assert not fast.compile and "compiler unavailable" in fast.compile_error
            assert "torch.compile of the decode step failed" in caplog.text
    finally:
        fast.cpu_emulation, fast.loop = False, True
        fast.set_compile(False)
        torch._dynamo.reset()


@pytest.mark.parametrize("loop", ["greedy", "transformers"])
@pytest.mark.parametrize("times, kept", [([2.0, 1.0], "dense"), ([1.0, 2.0], "twell"), ([1.0, 1.005], "dense")])
def test_step_check_keeps_the_faster_of_the_twell_step_and_its_dense_twin(tiny, times, kept, loop):
    """A captured decode step with TwELL layers (the greedy loop's step, or the forward transformers' loop
    replays) is captured again all dense; the dense twin is kept unless the TwELL step is >= 1% faster;
    tokens are the same either way; no check without free cache room for the timed replays."""
    fast = fast_decode_of(tiny)
    captured, graphs = [], []
    saved = fast.capture, fast.step_timer, fast.twell_in_step

    def capture(*args):  # records whether each capture ran inside the model runtime's dense_in_capture
        captured.append(tiny.ffn_runtime.dispatcher.capture_dense)
        graphs.append(saved[0](*args))
        return graphs[-1]

    fast.capture, fast.twell_in_step = capture, lambda batch: True
    fast.step_timer = lambda graphs, undo: (undo(), times)[1]
    try:
        for prompt, new, checked in ((6, 10, True), (250, 6, False)):  # 250 + 6 fills a 256-position cache
            ids = torch.randint(3, TINY["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(5))
            ref = tiny.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            fast.cpu_emulation, fast.loop = True, loop == "greedy"
            fast.drop_graphs(), fast.step_checks.clear(), captured.clear(), graphs.clear()
            fast.cache = fast.cache_key = None
            got = tiny.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            checks, loops, entries = list(fast.step_checks), list(fast._loops.values()), list(fast._graphs.values())
            fast.cpu_emulation, fast.loop = False, True
            assert torch.equal(ref, got)
            if checked:
                assert captured == [False, True]
                assert checks == [{"loop": loop, "batch": 1, "twell_ms": times[0], "dense_ms": times[1], "kept": kept}]
                want = graphs[1 if kept == "dense" else 0]
                if loop == "greedy":
                    (step,) = loops  # the step replayed is the graph kept
                    assert step.graph is want[0]
                else:
                    (entry,) = entries  # the forward replayed, and the logits it returns, are the kept graph's
                    assert (entry.graph, entry.output) == want
            else:
                assert captured == [False] and checks == []
    finally:
        fast.cpu_emulation, fast.loop = False, True
        fast.drop_graphs(), fast.step_checks.clear()
        fast.capture, fast.step_timer, fast.twell_in_step = saved


def test_dense_twin_of_a_compiled_step_traces_the_torch_modules(tiny):
    """The step check's all-dense twin (dense_in_capture) takes each auto MLP's plain torch path, and a
    compiled forward traced before it is traced again (dynamo guards on the flag): the twin then runs the
    nn.Linear modules that inductor fuses as in the dense model, not the opaque op's dense branch."""
    import sys

    mod = sys.modules[type(tiny).__module__]  # the folder's modeling_sparsify.py
    runtime = tiny.ffn_runtime
    mlps = [m for m in tiny.modules() if isinstance(m, mod.SparseMLP)]
    x = torch.randn(1, 3, TINY["hidden_size"])
    graphs = []

    def record(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    torch._dynamo.reset()
    try:
        compiled = torch.compile(mlps[0], backend=record)
        with torch.no_grad():
            outside = compiled(x)
            assert mlps[0].kernel_reason(x) == "input is not on a CUDA device" and len(graphs) == 1
            with runtime.dense_in_capture():
                assert [m.kernel_reason(x) for m in mlps] == [mod.TWIN] * len(mlps)
                twin = compiled(x)
            tiny.set_ffn_backend("twell")  # a forced backend is not the dispatcher's to override
            with runtime.dense_in_capture():
                assert mlps[0].kernel_reason(x) != mod.TWIN
    finally:
        tiny.set_ffn_backend("auto")
        torch._dynamo.reset()
    assert len(graphs) == 2, "the twin reused the graph traced outside dense_in_capture"
    assert not any("sparsify" in t for t in graphs[1]) and any("linear" in t for t in graphs[1])
    assert torch.equal(outside, twin)


def test_compiled_step_through_the_twell_op_is_one_graph(tiny, monkeypatch):
    """On the kernel path (faked here on CPU: auto dispatches CPU calls, on decisions set by the test), with the
    dispatcher's per-layer state already set by an eager prefill, dynamo traces the whole decode step as one
    graph: no break at each FFN (reading W_gate._version while tracing used to split the step at every layer)."""
    import sys

    from torch._dynamo.utils import counters

    mod = sys.modules[type(tiny).__module__]  # the folder's modeling_sparsify.py
    auto = tiny.ffn_runtime.dispatcher  # the dispatcher of the model's runtime
    dispatch, store = sys.modules[type(auto).__module__], auto.store
    ids = torch.randint(3, TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(6))
    ref = tiny.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    monkeypatch.setattr(tiny.ffn_runtime, "devices", ("cpu",))  # the CUDA path, on CPU
    monkeypatch.setattr(auto, "capturing", lambda: False)  # (a CPU build of torch cannot ask CUDA)
    gates = [m.gate_weight() for m in tiny.modules() if isinstance(m, mod.SparseMLP)]
    for w in gates:  # as an eager CUDA prefill leaves it: every bucket decided (dense: no CUDA clock needed)
        store.put("states", w, {1 << b: dispatch.LayerState(decision="dense", graph_decision="dense", density=0.1,
                                                            density0=0.1) for b in range(8)})
    fast = fast_decode_of(tiny)
    fast.cpu_emulation = True
    fast.set_compile(True, backend="eager")
    fast.drop_graphs()
    fast.cache = fast.cache_key = None
    torch._dynamo.reset()
    counters.clear()
    try:
        got = tiny.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert fast.compile and fast.compile_error is None
        assert {m.last_path for m in tiny.modules() if isinstance(m, mod.SparseMLP)} == {"twell_ffn:dense"}  # prefill
    finally:
        fast.cpu_emulation = False
        fast.set_compile(False)
        fast.drop_graphs()
        for w in gates:
            store.drop("states", w)
        torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] == 1  # the greedy step's forward, whole
    assert torch.equal(ref, got)


def test_auto_decided_dense_skips_the_op_until_the_refresh(tiny, monkeypatch):
    """Once auto decided dense for a bucket, a SparseMLP runs its torch expression without asking the dispatcher
    until its next density refresh (auto dispatches CPU calls here, on decisions set by the test); another
    shape, a backend switch, and a captured call where graph replay chose twell ask; greedy tokens are
    unchanged."""
    import sys

    from sparsify.kernels.twell_reference import ffn_dense

    mod = sys.modules[type(tiny).__module__]  # the folder's modeling_sparsify.py
    rt = tiny.ffn_runtime
    auto = rt.dispatcher
    dispatch = sys.modules[type(auto).__module__]
    calls = []
    choose = auto.choose

    def counted(x2d, *args):  # the runtime's question to auto, counted
        calls.append(tuple(x2d.shape))
        return choose(x2d, *args)

    ids = torch.randint(3, TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(7))
    ref = tiny.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    monkeypatch.setattr(rt, "devices", ("cpu",))  # the CUDA path, on CPU
    monkeypatch.setattr(auto, "choose", counted)
    monkeypatch.setattr(auto, "capturing", lambda: False)  # (a CPU build of torch cannot ask CUDA)
    monkeypatch.setattr(auto, "policy", dispatch.Policy(drift=1e9))  # no re-timing: it needs a CUDA clock
    mlps = [m for m in tiny.modules() if isinstance(m, mod.SparseMLP)]

    def decided(graph: str = "dense"):
        tiny.set_ffn_backend("auto")  # (ends any grant)
        for m in mlps:
            auto.store.put("states", m.gate_weight(), {
                1 << b: dispatch.LayerState(decision="dense", graph_decision=graph, density=0.1, density0=0.1)
                for b in range(8)})

    try:
        decided()
        mlp, every = mlps[0], auto.policy.refresh_dense
        x = torch.randn(1, 3, TINY["hidden_size"])
        with torch.no_grad():
            for _ in range(2 * every + 50):
                assert torch.equal(mlp(x), mlp.torch_ffn(x))
            assert len(calls) == 3 and mlp.last_path == "twell_ffn:dense", calls  # the first call, then each refresh
            mlp(torch.randn(1, 5, TINY["hidden_size"]))  # another shape: through the entry
            tiny.set_ffn_backend("dense")
            tiny.set_ffn_backend("auto")
            mlp(x)  # the grant ended with the switch
            assert len(calls) == 5
            decided(graph="twell")  # captured calls would run twell: the grant holds for eager calls only
            capturing = [False]  # one flag for the runtime's question and auto's
            monkeypatch.setattr(auto, "capturing", lambda: capturing[0])
            ran_twell = []
            twell = lambda auto, x2d, wg, wu, wd, wd_t=None, threshold=None, on_count=None: (  # noqa: E731
                ran_twell.append(1), ffn_dense(x2d, wg, wu, wd, threshold))[1]  # the TwELL row, on CPU
            monkeypatch.setattr(rt, "kernels", {**rt.kernels, ("cpu", "twell"): twell})
            for _ in range(4):
                assert torch.equal(mlp(x), mlp.torch_ffn(x))
            assert len(calls) == 6 and mlp.ffn_layer.in_capture is False  # the first call took an eager-only answer
            capturing[0] = True
            for _ in range(2):
                mlp(x)  # captured: through the entry every time, where auto runs its graph decision, twell
            assert len(calls) == 8 and len(ran_twell) == 2 and mlp.last_path == "twell_ffn:twell"
            capturing[0] = False
            for _ in range(2):
                mlp(x)  # eager again: the first call asks (a captured twell answer held nothing), the next holds
            assert len(calls) == 9 and len(ran_twell) == 2
            decided()
            calls.clear()
            got = tiny.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert torch.equal(ref, got)
        assert len(calls) == 2 * len(mlps), calls  # per layer the prefill and the first decode step; 4 steps skip it
    finally:
        for m in mlps:
            auto.store.drop("states", m.gate_weight())
        tiny.set_ffn_backend("auto")


SAMPLE = {"do_sample": True, "temperature": 1.3, "top_p": 0.6, "top_k": 0}


def warming_capture(fn, undo, cuda):
    """capture_call as on CUDA, in cpu_emulation: fn() runs once (the warm-up, drawing noise too), is undone, and
    an EagerReplay stands in for the graph."""
    from sparsify.kernels.decode_capture import EagerReplay

    fn()
    undo()
    replay = EagerReplay(fn)
    return replay, replay


def fresh(fast):
    fast.drop_graphs()
    fast.cache = fast.cache_key = None


def test_sampling_loop_same_seed_same_tokens_whether_it_captures_or_replays(tiny):
    """do_sample with temperature / top-p / top_k 0 runs the sampling graph loop (not transformers'): the same
    seed gives the same tokens in a call that captures the step (its warm-up draws are undone) and in one that
    replays it; another seed gives others; rows draw their own tokens."""
    ids = torch.randint(3, TINY["vocab_size"], (3, 5), generator=torch.Generator().manual_seed(8))
    fast = fast_decode_of(tiny)
    saved = fast.capture
    fast.cpu_emulation, fast.capture = True, warming_capture
    fresh(fast)
    loops, captures = fast.loops, fast.captures
    try:
        runs = []
        for seed in (0, 0, 1):
            torch.manual_seed(seed)
            runs.append(tiny.generate(ids, max_new_tokens=16, **SAMPLE))
        assert fast.loops - loops == 3 and fast.captures - captures == 1  # captured in the first call only
    finally:
        fast.cpu_emulation, fast.capture = False, saved
        fresh(fast)
    first, again, other = runs
    assert first.shape == (3, 21) and torch.equal(first[:, :5], ids)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert len({tuple(r) for r in first[:, 5:].tolist()}) == 3


def test_sampling_loop_compiles_its_nucleus_step_and_falls_back_when_that_fails(tiny, caplog):
    """With compile on, the sampling loop's nucleus step is nucleus_keep through torch.compile (made once, its
    first call in the prefill), with the tokens of the eager step for the same seed; a compiler that fails
    leaves a warning, the eager step and the same tokens."""
    ids = torch.randint(3, TINY["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(9))
    fast = fast_decode_of(tiny)
    nucleus_keep = sys.modules[type(fast).__module__].nucleus_keep  # (the folder's own copy of fast_decode)
    traced = []

    def eager_compiler(gm, example_inputs):  # an eager "compiler" that records what it is given
        traced.append("amax" in gm.code)  # (nucleus_keep's graph has it; the forward's has not)
        return gm.forward

    def failing(gm, example_inputs):
        raise RuntimeError("compiler unavailable")

    def draw(compiler):
        fast.set_compile(compiler is not None, backend=compiler)
        fresh(fast)
        torch._dynamo.reset()
        torch.manual_seed(0)
        return tiny.generate(ids, max_new_tokens=10, **SAMPLE)

    fast.cpu_emulation = True
    try:
        ref = draw(None)
        assert fast.keep_fn() is nucleus_keep
        got = draw(eager_compiler)
        assert fast.keep_fn() is not nucleus_keep and fast.keep_fn() is fast.keep_fn() and fast.keep_error is None
        assert traced.count(True) == 1 and traced.count(False) >= 1  # the step once, the forward too
        with caplog.at_level("WARNING", logger="sparsify"):
            again = draw(failing)
        assert "compiler unavailable" in fast.keep_error and "nucleus step failed" in caplog.text
        assert fast.keep_fn() is nucleus_keep
    finally:
        fast.cpu_emulation = False
        fast.set_compile(False)
        fresh(fast)
        torch._dynamo.reset()
    assert torch.equal(ref, got) and torch.equal(ref, again)


def test_sampling_plan_serves_only_what_the_loop_draws_exactly(tiny):
    """top_k unset (transformers reads 50), min_p, temperature 0, a padded batch: transformers' loop, as before."""
    from sparsify.kernels.fast_decode import sampling_plan

    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    plan = sampling_plan(tiny, (ids,), {"max_new_tokens": 4, **SAMPLE})
    assert plan is not None and plan[1:] == (4, 0, plan[3], plan[4], (1.3, 0.6))
    for bad in ({"top_k": None}, {"top_k": 5}, {"temperature": 0.0}, {"top_p": 0.0}, {"min_p": 0.1},
                {"attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])}, {"do_sample": False}):
        assert sampling_plan(tiny, (ids,), {"max_new_tokens": 4, **SAMPLE, **bad}) is None, bad
    fast = fast_decode_of(tiny)
    fast.cpu_emulation = True
    loops = fast.loops
    try:
        tiny.generate(ids, max_new_tokens=4, do_sample=True, temperature=0.8, top_p=0.9)  # top_k unset
        tiny.generate(ids, max_new_tokens=4, **SAMPLE)
    finally:
        fast.cpu_emulation = False
        fresh(fast)
    assert fast.loops == loops + 1


@pytest.mark.parametrize("temperature, top_p", [(1.3, 0.6), (0.7, 0.95), (2.0, 0.3)])
def test_every_sampled_token_is_in_the_top_p_nucleus_of_its_step(tiny, temperature, top_p):
    """Each token the sampling loop draws (the prefill's and every step's, captured or not) lies in the nucleus
    transformers' TemperatureLogitsWarper + TopPLogitsWarper keep for the logits of that step."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    ids = torch.randint(3, TINY["vocab_size"], (4, 5), generator=torch.Generator().manual_seed(9))
    fast = fast_decode_of(tiny)
    plain, logits = fast.forward, []

    def recording(**kwargs):  # the loop's forward (prefill and decode steps), its last-position logits kept
        out = plain(**kwargs)
        logits.append(out.logits[:, -1, :].detach().clone())
        return out

    fast.cpu_emulation, fast.forward = True, recording
    fresh(fast)
    try:
        torch.manual_seed(2)
        got = tiny.generate(ids, max_new_tokens=20, do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    finally:
        fast.cpu_emulation, fast.forward = False, plain
        fresh(fast)
    assert len(logits) == 20
    sizes, outside = [], []
    for i, step in enumerate(logits):
        scores = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, step.float()))
        allowed = torch.isfinite(scores)
        sizes += allowed.sum(1).tolist()
        outside += [(i, r) for r, t in enumerate(got[:, 5 + i].tolist()) if not allowed[r, t]]
    assert not outside, outside
    assert max(sizes) > 1  # (a nucleus of more than the top token: a draw, not an argmax)


def test_sampling_at_a_tiny_temperature_is_greedy(tiny):
    ids = torch.randint(3, TINY["vocab_size"], (3, 5), generator=torch.Generator().manual_seed(10))
    out = tiny.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, output_scores=True,
                        return_dict_in_generate=True)
    assert top2_gap(out.scores) > 1e-5, "a near-tie between logits: choose another prompt seed"
    fast = fast_decode_of(tiny)
    fast.cpu_emulation = True
    fresh(fast)
    try:
        greedy = tiny.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        cold = tiny.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=True, temperature=1e-7, top_p=0.9,
                             top_k=0)
    finally:
        fast.cpu_emulation = False
        fresh(fast)
    assert torch.equal(out.sequences, greedy) and torch.equal(greedy, cold)


def warper_keeps(logits: torch.Tensor, temperature: float, top_p: torch.Tensor) -> torch.Tensor:
    """[B, V] the tokens transformers' TemperatureLogitsWarper + TopPLogitsWarper keep, at top_p's fp32 value (the
    loop holds top_p as an fp32 tensor; so both compare against the same 1 - top_p)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    scores = TopPLogitsWarper(float(top_p))(None, TemperatureLogitsWarper(temperature)(None, logits.clone()))
    return torch.isfinite(scores)


def mass_at_or_below(logits: torch.Tensor, temperature: float, row: int, token: int) -> float:
    """The float64 mass of the tokens at or below `token`'s probability in `row` (the exact side of the
    boundary test, to tell a real disagreement from fp32 rounding)."""
    probs = torch.softmax(logits[row].double() / temperature, -1)
    return probs[probs <= probs[token]].sum().item()


def test_nucleus_keeps_what_transformers_keeps_and_top_p_one_keeps_every_token():
    """Random rows (three logit scales, one dominant token, a nearly flat row) at several vocab sizes, temperatures
    and top-p: the kept set is TopPLogitsWarper's, but for two kinds of token. Tokens whose fp32 probability ties
    with the last one the warper keeps stay (the flat row's tie in fp32 at V = 49152: the documented superset). And
    a token may differ where the exact mass at or below it lies within fp32 rounding of 1 - top_p (two sums of up
    to 49152 fp32 terms in different orders: none with this seed, ~1e-7 apart in other draws, bound 1e-6); those
    must stay rare. Each row's threshold is the fp32 value of its boundary token, found to the last bit: with one
    halving fewer (29) this test fails."""
    from sparsify.kernels.fast_decode import nucleus

    gen = torch.Generator().manual_seed(11)
    rows = compared = 0
    rounding, tied = [], 0
    for vocab in (300, 4099, 49152):
        logits = torch.cat([torch.randn(8, vocab, generator=gen) * s for s in (1.0, 3.0, 8.0)]
                           + [torch.randn(1, vocab, generator=gen).index_fill_(1, torch.tensor([7]), 25.0),
                              torch.randn(1, vocab, generator=gen) * 1e-3])  # [26, V]
        for temperature in (0.7, 1.6):
            for p in (0.01, 0.5, 0.95, 0.999, 1.0):
                top_p = torch.tensor(p)
                probs, keep = nucleus(logits, torch.tensor(temperature), top_p)
                assert keep.dtype == torch.bool and keep.shape == probs.shape == logits.shape
                if p == 1.0:  # (generate() adds no top-p warper at 1.0; the warper would drop zero probabilities)
                    assert bool(keep.all()), (vocab, temperature)
                    continue
                ref = warper_keeps(logits, temperature, top_p)
                rows, compared = rows + ref.shape[0], compared + 1
                last = torch.where(ref, probs, 2.0).amin(1)  # [B] the smallest probability the warper keeps
                for r, c in (keep != ref).nonzero().tolist():
                    if keep[r, c] and probs[r, c] == last[r]:
                        tied += 1
                        continue
                    gap = mass_at_or_below(logits, temperature, r, c) - (1 - float(top_p))
                    assert abs(gap) < 1e-6, (vocab, temperature, p, r, c, gap, bool(keep[r, c]))
                    rounding.append((vocab, temperature, p, r, c, gap))
    assert compared == 24 and len(rounding) <= rows // 100, rounding
    assert tied > 0  # (the superset case did occur)


def test_nucleus_keeps_every_token_tied_at_the_boundary():
    """Tied probabilities on the boundary all stay (the mass strictly above each is below top_p): a superset of
    the subset a sort (TopPLogitsWarper) keeps; a flat row keeps every token at any top_p."""
    from sparsify.kernels.fast_decode import nucleus

    one = torch.tensor(1.0)
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2, 0.0]])).nan_to_num(neginf=-1e4)  # [1, 5]
    top_p = torch.tensor(0.5)  # 0.4 < 0.5 < 0.4 + 0.2: the boundary falls inside the tie
    keep = nucleus(logits, one, top_p)[1]
    sorted_keep = warper_keeps(logits, 1.0, top_p)
    assert keep.tolist() == [[True, True, True, True, False]]
    assert bool((keep | ~sorted_keep).all()) and int(sorted_keep.sum()) < 4  # the sort keeps part of the tie
    flat = torch.zeros(2, 64)
    for p in (0.01, 0.5, 0.99):
        assert bool(nucleus(flat, one, torch.tensor(p))[1].all()), p


def test_nucleus_at_top_p_near_one_resolves_a_long_tail_of_tiny_probabilities():
    """Top-p near 1 on a long tail of tiny, distinct probabilities: the boundary lies where the mass below is
    about 1 - top_p; as a mass above (~1) fp32 cannot tell hundreds of tail tokens apart there, as a mass below
    it can, so the kept set is the exact one, token for token. The tail's probabilities are distinct multiples of
    2^-40, so every sum of them below 2^-16 (each one nucleus_keep takes near the boundary) is exact in fp32, in
    whatever order torch's CPU kernels add (issue 40: a softmax tail, as this test had, put the boundary token
    ~2e-11 from 1 - top_p, under the rounding of a fp32 sum). At top_p 1 every token stays although a float cumsum
    of the sorted probabilities reaches 1 before the tail ends."""
    from sparsify.kernels.fast_decode import nucleus, nucleus_keep

    one = torch.tensor(1.0)
    tail = torch.arange(1, 49153, dtype=torch.float64) * 2.0**-40  # [V-2] ascending, distinct, exact in fp32
    head = (1 - tail.sum()) / 2  # two tokens hold the rest
    probs = torch.cat([head.expand(2), tail])  # [V] float64
    top_p = torch.tensor(0.999999)
    cut = 1 - float(top_p)  # = the fp32 1 - top_p nucleus_keep compares with (exact: Sterbenz)
    keep = nucleus_keep(probs.float()[None], top_p)[0]
    below = torch.cumsum(tail, 0)  # [V-2] mass at or below each tail token, exact in float64
    want = torch.cat([torch.ones(2, dtype=torch.bool), below > cut])
    assert 1000 < int((~want).sum()) < 48000  # the boundary inside the tail: part of it kept
    assert bool((below[~want[2:]] < 2.0**-16).all())  # (the sums that decide it are exact in fp32)
    assert torch.equal(keep, want), (~keep).sum() - (~want).sum()
    boundary = int((~want).sum())  # the smallest kept tail token's index
    above = (1 - below[boundary - 300: boundary + 300]).float()  # as masses above, in fp32
    assert above.unique().numel() < 600 // 20  # (what a fp32 "mass above < top_p" test would have to separate)
    tail = torch.cat([torch.zeros(1, 2), torch.full((1, 49152), -9.0)], 1)
    full = torch.softmax(tail, -1).sort(descending=True).values.numpy()
    # (what a plain "mass above < top_p" test would drop), summed in a defined order: numpy's cumsum adds one
    # float32 after another, where torch's order (and so its rounding) depends on the CPU's vector width
    assert bool((np.cumsum(full, -1, dtype=np.float32) - full >= 1).any())
    assert bool(nucleus(tail, one, one)[1].all())


def test_nucleus_with_zero_and_subnormal_probabilities():
    """Probabilities that underflow to fp32 subnormals or to 0 (very negative logits), and a top token of
    probability exactly 1 (the top of the bisection's range): the nucleus is still TopPLogitsWarper's; top_p 1
    keeps every token, zeros too."""
    from sparsify.kernels.fast_decode import nucleus

    one = torch.tensor(1.0)
    mixed = torch.cat([torch.tensor([[0.0, -0.5, -1.0, -3.0]]), torch.linspace(-100.0, -88.0, 40)[None],
                       torch.full((1, 20), -1e4)], 1)  # [1, 64]
    alone = torch.cat([torch.zeros(1, 1), torch.linspace(-100.0, -88.0, 40)[None], torch.full((1, 23), -1e4)], 1)
    logits = torch.cat([mixed, alone])  # [2, 64]
    probs = torch.softmax(logits, -1)
    tiny = torch.finfo(torch.float32).tiny
    assert bool(((probs > 0) & (probs < tiny)).any(1).all()) and bool((probs == 0).any(1).all())
    assert probs[1, 0] == 1.0
    for p in (0.01, 0.5, 0.9, 0.999999):
        top_p = torch.tensor(p)
        keep = nucleus(logits, one, top_p)[1]
        assert torch.equal(keep, warper_keeps(logits, 1.0, top_p)), p
        assert keep[1].tolist() == [True] + [False] * 63
    assert bool(nucleus(logits, one, one)[1].all())


def test_nucleus_rows_have_their_own_thresholds():
    """Each row of a batch gets its own threshold: the batch's nucleus is the rows' nuclei, each alone."""
    from sparsify.kernels.fast_decode import nucleus

    gen = torch.Generator().manual_seed(13)
    logits = torch.cat([torch.randn(1, 500, generator=gen) * s for s in (0.1, 1.0, 2.0, 4.0)]
                       + [torch.zeros(1, 500).index_fill_(1, torch.tensor([3]), 30.0)])  # [5, 500]
    t, top_p = torch.tensor(1.0), torch.tensor(0.9)
    keep = nucleus(logits, t, top_p)[1]
    assert len(set(keep.sum(1).tolist())) == 5 and keep.sum(1)[-1] == 1
    for r in range(logits.shape[0]):
        assert torch.equal(keep[r: r + 1], nucleus(logits[r: r + 1], t, top_p)[1]), r


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_nucleus_and_sampling_compile_in_one_graph(backend):
    """torch.compile traces the nucleus and the draw whole (fullgraph: no graph break, no host sync) and gives
    the same kept set, and the same tokens for the same seed."""
    import torch._dynamo

    from sparsify.kernels.fast_decode import nucleus, sample_tokens

    gen = torch.Generator().manual_seed(14)
    logits = torch.randn(6, 1000, generator=gen) * 3
    t, top_p = torch.tensor(0.8), torch.tensor(0.9)
    torch._dynamo.reset()
    try:
        keep = torch.compile(nucleus, backend=backend, fullgraph=True)(logits, t, top_p)[1]
        assert torch.equal(keep, nucleus(logits, t, top_p)[1])
        torch.manual_seed(3)
        got = torch.compile(sample_tokens, backend=backend, fullgraph=True)(logits, t, top_p)
        assert bool(keep.gather(1, got[:, None]).all())
        if backend == "eager":  # (inductor draws its own random stream)
            torch.manual_seed(3)
            assert torch.equal(got, sample_tokens(logits, t, top_p))
    finally:
        torch._dynamo.reset()


def test_sample_tokens_draws_in_proportion_to_the_nucleus():
    """The exponential race draws each nucleus token with its renormalised probability, never one outside;
    top_p 1 draws every token."""
    from sparsify.kernels.fast_decode import sample_tokens

    logits = torch.log(torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])).expand(40_000, 6)
    torch.manual_seed(12)
    counts = torch.bincount(sample_tokens(logits, torch.tensor(1.0), torch.tensor(0.75)), minlength=6)
    assert counts[3:].sum() == 0  # 0.4 + 0.25 < 0.75 <= 0.8: the nucleus is the first three
    freq = counts[:3].float() / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.4, 0.25, 0.15]) / 0.8, atol=0.01), freq
    counts = torch.bincount(sample_tokens(logits, torch.tensor(1.0), torch.tensor(1.0)), minlength=6)
    assert torch.allclose(counts.float() / counts.sum(), logits[0].exp(), atol=0.01), counts
