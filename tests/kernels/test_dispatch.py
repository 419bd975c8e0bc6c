"""The "auto" dispatcher (kernels/dispatch.py), driven on CPU through an injected clock (tests/kernels/fake_auto.py), store, capture query and
TwELL probe, inside an FFNRuntime whose backend table holds a stand-in TwELL row: no GPU, no timing, no module
state touched. `d.entry` is that runtime's run: a call of backend "auto" (the question, then the answer's row)."""

from __future__ import annotations

import pytest
import torch

from sparsify.kernels import twell_reference as ref, twell_updown as tu
from sparsify.kernels.dispatch import Policy, TwellProbe, decide, output_fault

from tests.kernels.fake_auto import ALL_DENSE, EAGER_TWELL, GRAPH_ONLY_TWELL, Kernels, dispatcher, state
from tests.kernels.helpers import FP32, assert_close, make_case

# calibration tests: no graph timing, no untimed dense rule for prefill, exactly 5 rounds
TIMED = Policy(graph_timed_m=0, prefill_max_density=1.0, cal_rounds=(5, 5))


def test_auto_dense_decision_is_a_plain_dense_call():
    """Once a bucket chose dense (eager and graph), the fast path serves it: no W_down^T copy (a cached one
    is freed), only every refresh_dense-th call goes through the slow path to refresh; an in-place change
    of W_gate drops the layer's state."""
    x, wg, wu, wd = make_case(20, 16, 64, 0.9, seed=19)
    d = dispatcher(ALL_DENSE)
    d.down_t(wd)  # as if an earlier twell call had cached it
    want = ref.ffn_dense(x, wg, wu, wd)
    assert torch.equal(d.entry(x, wg, wu, wd), want)  # first call: count + timing
    st = state(d, wg)
    assert (st.decision, st.graph_decision) == ("dense", "dense")
    assert d.store.get("down_t", wd) is None, "W_down^T kept although every bucket of the layer is dense"
    every = d.policy.refresh_dense
    assert st.calls < every  # (calibration's timed calls of the fast path count too)
    for _ in range(every):
        assert torch.equal(d.entry(x, wg, wu, wd), want) and d.last_backend == "dense"
        assert (st.pending is not None) == (st.calls >= every), st.calls  # the every-th call counted the density
    timed = len(d.clock.order)
    with torch.no_grad():
        wg.mul_(1.0)
    assert d.store.get("states", wg) is None
    d.entry(x, wg, wu, wd)
    assert len(d.clock.order) > timed, "the changed layer was not timed again"


def test_auto_fast_path_respects_graph_decision():
    """Eager dense but graph-timed twell: eager calls are answered dense on the hot path (the answer holding
    for eager calls only), captured calls twell."""
    x, wg, wu, wd = make_case(20, 16, 64, 0.9, seed=24)
    capturing = [False]
    d = dispatcher(GRAPH_ONLY_TWELL, capturing=lambda: capturing[0])
    d.entry(x, wg, wu, wd)
    assert (state(d, wg).decision, state(d, wg).graph_decision) == ("dense", "twell")
    eager = d.choose(x, wg, wu, wd)
    assert eager.path == "dense" and eager.calls > 0 and not eager.in_capture
    assert d.twell_in_capture(wg, 20) and not d.twell_in_capture(wg, 40)
    capturing[0] = True
    assert d.choose(x, wg, wu, wd) == ("twell", 0, False, None)
    calls = len(d.sparse.calls)
    assert_close(d.entry(x, wg, wu, wd), ref.ffn_reference(x, wg, wu, wd), what="captured", **FP32)
    assert d.last_backend == "twell" and len(d.sparse.calls) == calls + 1 and d.store.get("down_t", wd) is not None
    with d.dense_in_capture():  # the step check's all-dense twin
        d.entry(x, wg, wu, wd)
        assert d.last_backend == "dense" and d.capture_dense
    assert not d.capture_dense


def test_auto_logs_each_layer_decision_once(caplog):
    """Two layers of one shape deciding differently: refreshes must not re-log (a log-once memory keyed by
    shape would flip at every refresh of either)."""
    x, wg_a, wu, wd = make_case(20, 16, 64, 0.9, seed=28)
    wg_b = wg_a.clone()
    d = dispatcher(dict(EAGER_TWELL), policy=Policy(refresh=8, refresh_dense=8))
    with caplog.at_level("INFO", logger="sparsify.kernels"):
        d.entry(x, wg_a, wu, wd)
        d.clock.times.update(ALL_DENSE)
        d.clock.seen.clear()
        d.entry(x, wg_b, wu, wd)
        for _ in range(16):
            d.entry(x, wg_a, wu, wd)
            assert d.last_backend == "twell"
            d.entry(x, wg_b, wu, wd)
            assert d.last_backend == "dense"
    notes = [r.message for r in caplog.records if "twell_ffn" in r.message]
    assert len(notes) == 2, notes


def test_auto_twell_decision_runs_the_kernels_and_keeps_down_t():
    """The real TwELL path (K1 + K2 in the interpreter) timed and chosen: W_down^T stays cached, and the
    output is the oracle's."""
    x, wg, wu, wd = make_case(20, 16, 64, 0.9, seed=20)
    d = dispatcher(EAGER_TWELL, policy=TIMED, kernels=TwellProbe())
    out = d.entry(x, wg, wu, wd)
    assert d.store.get("down_t", wd) is not None and d.last_backend == "twell"
    assert_close(out, ref.ffn_reference(x, wg, wu, wd), what="auto twell", **FP32)


def test_auto_refreshes_and_retimes_on_drift(caplog):
    """Timed once, then the decision is followed; the density refresh of the refresh-th call sees a 10x
    denser input, so the next call re-times (once), and the decision is logged once. Under capture the
    graph-timed decision runs."""
    x, wg, wu, wd = make_case(20, 16, 64, 0.9, seed=14)
    dense_x = x.clone()
    dense_x[:, 0] = -1000.0  # every gate value positive
    capturing = [False]
    d = dispatcher({"dense": 1.0, "twell": 0.5, "graph_dense": 0.5, "graph_twell": 1.0},
                   policy=Policy(refresh=8), capturing=lambda: capturing[0])
    with caplog.at_level("INFO", logger="sparsify.kernels"):
        d.entry(x, wg, wu, wd)  # calibration (its timed calls count too)
        st = state(d, wg)
        while (st.calls + 1) % d.policy.refresh:
            d.entry(x, wg, wu, wd)
        d.entry(dense_x, wg, wu, wd)  # the refresh-th call counts this input's density
    assert st.decision == "twell" and st.graph_decision == "dense" and st.density == pytest.approx(0.1, abs=0.05)
    assert d.sparse.calls[-1] and st.pending is not None, "the refresh-th call did not count the density"
    assert sum("-> twell" in r.message for r in caplog.records) == 1, "the backend is logged once"
    rounds = len(d.clock.order)
    d.entry(x, wg, wu, wd)
    assert st.retunes == 1 and len(d.clock.order) > rounds
    capturing[0] = True
    d.entry(x, wg, wu, wd)
    assert d.last_backend == "dense", "under graph capture the graph-timed decision is used"


@pytest.mark.parametrize("dense,twell,want", [
    # paired ratios .9 1.25 .95 .93 .93 -> median .93: twell, although median(twell) / median(dense) = 1.25
    ([1.0, 2.0, 2.0, 3.0, 3.0], [0.9, 2.5, 1.9, 2.8, 2.8], "twell"),
    # paired ratios .99 .99 .99 .99 .25 -> median .99: dense, although the medians' ratio is 0.495
    ([2.0, 2.0, 1.0, 1.0, 2.0], [1.98, 1.98, 0.99, 0.99, 0.5], "dense"),
])
def test_auto_calibration_decides_on_paired_ratios(dense, twell, want):
    """Both sides are timed through the entry (dense: the fast path; twell: the dispatcher's twell path)
    with the decision forced, alternating their order every round, decided on the median paired ratio."""
    x, wg, wu, wd = make_case(20, 16, 64, 0.9, seed=31)
    d = dispatcher({"dense": dense, "twell": twell}, policy=TIMED)
    out = d.entry(x, wg, wu, wd)
    st = state(d, wg)
    assert st.decision == want and st.graph_decision == want and not st.timing, st.times
    assert d.clock.order == ["dense", "twell", "twell", "dense"] * 2 + ["dense", "twell"], d.clock.order
    assert st.times["ratio"] == pytest.approx(sorted(t / s for t, s in zip(twell, dense))[2])
    # the twell side ran what the hot path runs afterwards (the output check, one warm-up call, one
    # estimate and 5 timed loops of one call), the dense side never did
    assert len(d.sparse.calls) == 8 + (want == "twell") and not any(d.sparse.calls), d.sparse.calls
    assert torch.equal(out, ref.ffn_dense(x, wg, wu, wd))


def test_auto_decide_spread_rule_for_launch_bound_twell():
    """Eager twell launch-bound (> cpu_bound x its graph time): a 5% win inside a 20% spread is dense."""
    dense, twell = [1.05] * 5, [1.0, 0.9, 1.1, 1.0, 1.0]  # ratio median 0.952, spread 0.2
    assert decide(dense, twell)[0] == "twell"
    assert decide(dense, twell, graph_twell=[0.9] * 5)[0] == "twell"  # GPU-bound: spread ignored
    choice, info = decide(dense, twell, graph_twell=[0.5] * 5)
    assert choice == "dense" and info["cpu_bound"] and info["spread"] == pytest.approx(0.2)
    steady = [0.8, 0.79, 0.81, 0.8, 0.8]  # a 24% win, 2.5% spread: still twell when launch-bound
    assert decide(dense, steady, graph_twell=[0.3] * 5)[0] == "twell"
    assert decide([1.0] * 5, [0.975] * 5)[0] == "dense"  # 2.5% is inside the margin


@pytest.mark.parametrize("wrong, fault", [
    (lambda y: y * 1.01, None),  # rounding-sized differences: timed as usual
    (lambda y: torch.zeros_like(y), "max |twell - dense|"),  # lost output
    (lambda y: torch.cat([y[:-1], y[-1:] + 2 * y.abs().max()]), "max |twell - dense|"),  # one garbled row
    (lambda y: torch.where(torch.arange(y.numel()).view_as(y) == 3, float("nan"), y), "non-finite"),
])
def test_auto_calibration_checks_twell_output_before_timing(caplog, wrong, fault):
    """A twell path whose output is not the dense FFN's (a kernel fault on some GPU / Triton build) is never
    timed or chosen: the layer stays dense and an error names the layer and the fault."""
    x, wg, wu, wd = make_case(20, 16, 64, 0.9, seed=33)
    d = dispatcher({"dense": [1.0] * 5, "twell": [0.5] * 5}, policy=TIMED, kernels=Kernels(wrong=wrong))
    with caplog.at_level("ERROR", logger="sparsify.kernels"):
        out = d.entry(x, wg, wu, wd)
    st = state(d, wg)
    if fault is None:
        assert st.decision == "twell" and len(d.clock.order) == 10 and not caplog.records
    else:
        assert st.decision == st.graph_decision == "dense" and d.clock.order == [] and len(d.sparse.calls) == 1
        assert fault in st.times["rule"] and "disagrees with dense" in caplog.text and "(64, 16)" in caplog.text
        assert torch.equal(out, ref.ffn_dense(x, wg, wu, wd))


def test_auto_gives_buckets_whose_k2_spills_to_dense_untimed():
    """A bucket whose K2 would spill goes dense for both regimes, the twell path never run, not even for
    the output check; K2 spills above the decode M from DECODE_CHUNKED_MIN_D on."""
    big = tu.DECODE_CHUNKED_MIN_D
    assert tu.k2_spills(17, big) and not tu.k2_spills(16, big) and not tu.k2_spills(17, big - 1)
    x, wg, wu, wd = make_case(20, 16, 64, 0.9, seed=35)
    d = dispatcher({"dense": [1.0] * 5, "twell": [0.5] * 5}, policy=TIMED,
                   kernels=Kernels(spills=lambda m, dd: m > 16 and dd >= 16))
    out = d.entry(x, wg, wu, wd)
    st = state(d, wg)
    assert st.decision == st.graph_decision == "dense" and st.times["rule"] == "K2 spills at M = 20, d = 16"
    assert d.sparse.calls == [] and d.clock.order == []
    assert torch.equal(out, ref.ffn_dense(x, wg, wu, wd))
    x, wg, wu, wd = make_case(20, 8, 64, 0.9, seed=36)  # below that d: timed, and twell wins here
    d.entry(x, wg, wu, wd)
    assert state(d, wg).decision == "twell" and d.sparse.calls


def test_prefill_above_one_percent_density_goes_dense_untimed():
    """Above M = graph_timed_m a bucket denser than 1% goes dense untimed; a sparser one is timed; a decode
    bucket is timed (eager and graph replay) at any density."""
    x, wg, wu, wd = make_case(257, 16, 128, 0.95, seed=37)
    d = dispatcher(GRAPH_ONLY_TWELL)
    d.entry(x, wg, wu, wd)
    st = state(d, wg, 512)
    assert (st.decision, st.graph_decision, d.clock.order) == ("dense", "dense", [])
    assert "prefill density" in st.times["rule"]
    x, wg, wu, wd = make_case(257, 16, 128, 0.995, seed=37)
    d.entry(x, wg, wu, wd)
    assert d.clock.order and state(d, wg, 512).decision == "dense"
    x, wg, wu, wd = make_case(8, 16, 128, 0.95, seed=37)
    d.entry(x, wg, wu, wd)
    assert (state(d, wg, 8).decision, state(d, wg, 8).graph_decision) == ("dense", "twell")
    assert "graph_twell" in d.clock.order


def test_auto_fault_check_scale():
    y = torch.tensor([[1.0, -2.0], [0.5, 0.0]])
    assert output_fault(y + 0.1, y) is None  # 5% of max |y|: rounding-sized
    assert "max |twell" in output_fault(y + 1.0, y)
    big = torch.tensor([[10.0, -3.0], [1.0, 0.5], [0.001, 0.0]])
    lost = big.clone()
    lost[1] = 0  # a small row lost: 10% of the largest row, its own size off
    assert output_fault(lost, big).startswith("row 1: max |twell - dense| = 1 ")
    assert output_fault(big + torch.tensor([[0.2], [0.02], [0.05]]), big) is None  # rounding-sized; row 2 floored
    assert output_fault(big.reshape(1, 3, 2), big.reshape(1, 3, 2)) is None  # [B, L, d] as well
    assert output_fault(y, torch.full_like(y, float("inf"))) is None  # dense not finite: nothing judged
    assert output_fault(torch.zeros(0, 2), torch.zeros(0, 2)) is None


def test_auto_calibration_failure_keeps_no_forced_decision():
    x, wg, wu, wd = make_case(20, 16, 64, 0.9, seed=32)
    d = dispatcher({"dense": 1.0}, policy=TIMED, fail="twell")
    with pytest.raises(RuntimeError, match="twell kernel failed"):
        d.entry(x, wg, wu, wd)
    st = state(d, wg)
    assert st.decision is None and st.graph_decision is None and not st.timing


class Event:
    def __init__(self, done: bool = False):
        self.done = done

    def query(self) -> bool:
        return self.done


def test_auto_refresh_cadence_and_held_retune():
    """A twell bucket refreshes its density every `refresh` calls (never while a count is in flight),
    through the same twell path as the hot path; a drift read while calibrating does not re-time."""
    x, wg, wu, wd = make_case(20, 16, 64, 0.9, seed=33)
    d = dispatcher(EAGER_TWELL)
    every = d.policy.refresh
    assert every == 256 and d.policy.refresh_dense == 256
    d.entry(x, wg, wu, wd)  # calibration, then the hot path
    st = state(d, wg)
    event, refreshed = Event(), []

    def calls(n: int) -> None:
        for _ in range(n):
            d.entry(x, wg, wu, wd)
            if d.sparse.calls[-1]:
                refreshed.append(st.calls)
                if st.pending[1] is not event:
                    st.pending = (st.pending[0], event, st.pending[2])  # the count stays in flight

    calls(2 * every)
    assert refreshed == [every], "refresh while the first count is in flight"
    event.done = True
    calls(every)
    assert refreshed == [every, 3 * every], refreshed
    for timing, retunes in ((True, 0), (False, 1)):  # a completed count 4x denser than at the last timing
        st.pending, st.density0, st.timing = (torch.tensor(400), Event(True), 1000), 0.1, timing
        d.entry(x, wg, wu, wd)
        assert st.retunes == retunes, "no re-timing starts while timing"
        st.timing = False


def test_held_answers_keep_the_refresh_period_in_real_calls():
    """A caller holding an answer's calls runs them without asking and reports them (used) before it asks
    again: auto refreshes the density at the same real calls as without held answers; an answer left unused
    costs nothing (the next call is no refresh). Dense answers of a bucket dense in both regimes hold for
    captured calls too; twell answers, and dense ones where graph replay chose twell, for eager calls only;
    a captured call of a bucket due for re-timing holds nothing."""
    x, wg, wu, wd = make_case(20, 16, 64, 0.9, seed=41)
    every, total = Policy().refresh_dense, 3 * Policy().refresh_dense + 7
    refreshes = {}
    for held in (False, True):
        d = dispatcher(ALL_DENSE)
        d.entry(x, wg, wu, wd)  # calibration: dense in both regimes
        st, seen, left, given, asked = state(d, wg), [], 0, 0, 0
        for i in range(total):
            if left:
                left -= 1  # the module's own dense expression: auto never sees this call
                continue
            d.used(wg, 20, given - left)
            answer = d.choose(x, wg, wu, wd)
            asked += 1
            if answer.on_count is not None:  # (what the dense row does on a refresh)
                seen.append(i)
                answer.on_count(Kernels.count(x, wg))
            given = left = answer.calls if held else 0
        refreshes[held] = seen
        if held:
            assert asked <= 5, f"{asked} questions for {total} calls of the layer"
    assert refreshes[True] == refreshes[False] and len(refreshes[True]) == 3
    calls = st.calls
    assert answer[:3] == ("dense", every - 1 - calls % every, True)  # (the last question was a refresh)
    d.used(wg, 20, 0)  # an answer abandoned unused (a backend switch, another shape) changes nothing
    answer = d.choose(x, wg, wu, wd)
    assert answer.on_count is None and st.calls == calls + 1
    capturing = [True]
    d.capturing = lambda: capturing[0]
    st.retune = True  # due for re-timing (which a captured call never starts): nothing held
    assert d.choose(x, wg, wu, wd) == ("dense", 0, False, None)
    d = dispatcher(EAGER_TWELL)
    d.entry(x, wg, wu, wd)
    answer = d.choose(x, wg, wu, wd)
    assert answer.path == "twell" and answer.calls == d.policy.refresh - 1 - state(d, wg).calls % d.policy.refresh
    assert answer.in_capture is False
    d = dispatcher(GRAPH_ONLY_TWELL)  # eager dense, graph replay twell: held for eager calls only
    d.entry(x, wg, wu, wd)
    answer = d.choose(x, wg, wu, wd)
    assert answer.path == "dense" and answer.calls > 0 and answer.in_capture is False


def test_decisions_report_each_bucket_of_a_layer():
    """Dispatcher.decisions (bench's per-layer report): per M bucket the eager and graph decisions, the density
    and why; nothing for a layer never called."""
    x, wg, wu, wd = make_case(20, 16, 64, 0.9, seed=43)
    d = dispatcher(GRAPH_ONLY_TWELL)
    assert d.decisions(wg) == {}
    d.entry(x, wg, wu, wd)
    got = d.decisions(wg)
    assert list(got) == [32] and (got[32]["eager"], got[32]["graph"]) == ("dense", "twell")
    assert got[32]["ratio"] == pytest.approx(2.0) and got[32]["graph_ratio"] == pytest.approx(0.5)
    assert 0 < got[32]["density"] < 1 and "rule" not in got[32]
