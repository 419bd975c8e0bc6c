"""A fake "auto" for the dispatch tests: a scripted clock, a stand-in TwELL row and the dispatcher on them,
inside an FFNRuntime that dispatches CPU calls (used by test_dispatch, test_ffn_runtime and test_threshold)."""

from __future__ import annotations

from sparsify.kernels import twell_reference as ref
from sparsify.kernels.dispatch import Dispatcher, Policy, TwellProbe, WeightStore
from sparsify.kernels.ffn_runtime import FFNRuntime, dense_rows, twell_rows


class Graph:
    """A captured "graph": replay() calls the function `calls` times; `side` names what it runs."""

    def __init__(self, fn, calls: int, side: str):
        self.fn, self.calls, self.side = fn, calls, side

    def replay(self) -> None:
        for _ in range(self.calls):
            self.fn()


class Clock:
    """Scripted time. ms(fn, n) runs fn once and returns the next time scripted for the side that ran
    (eager: the dispatcher's last_backend; a replay: "graph_dense" / "graph_twell", the order the
    dispatcher captures them in); a side's first call is the loop-length estimate `est`. `times` maps a
    side to a list (one per round) or one number; `order` logs the timed sides; `fail` raises on a side."""

    def __init__(self, times: dict | None = None, est: float = 0.1, fail: str | None = None):
        self.times, self.est, self.fail = times or {}, est, fail
        self.order: list[str] = []
        self.seen: dict[str, int] = {}
        self.captured = 0
        self.dispatcher = None

    def sync(self) -> None:
        pass

    def capture(self, fn, calls: int) -> Graph:
        self.captured += 1
        return Graph(fn, calls, ("graph_dense", "graph_twell")[(self.captured - 1) % 2])

    def ms(self, fn, n: int) -> float:
        fn()
        graph = getattr(fn, "__self__", None)
        side = graph.side if isinstance(graph, Graph) else self.dispatcher.last_backend
        if side == self.fail:
            raise RuntimeError(f"{side} kernel failed")
        i = self.seen.get(side, -1)
        self.seen[side] = i + 1
        if i < 0:
            return self.est
        self.order.append(side)
        t = self.times[side]
        return t[i] if isinstance(t, list) else t


class Kernels:
    """A stand-in TwELL row of the backend table and the dispatcher's probe (no interpreter): the dense FFN (on
    the W_down^T its dispatcher keeps, as the real row reads it) and the gate's active count (threshold too).
    `calls` logs each call (True when it counted for a refresh), `thetas` its threshold; `wrong` garbles the
    output; `spills` is K2's rule."""

    def __init__(self, wrong=None, spills=lambda m, d: False):
        self.wrong, self.spills, self.calls, self.thetas = wrong, spills, [], []

    @staticmethod
    def count(x2d, w_gate, threshold=None):
        return (x2d @ w_gate.t() > (0 if threshold is None else threshold)).sum()

    def __call__(self, auto, x2d, w_gate, w_up, w_down, w_down_t=None, threshold=None, on_count=None):
        self.calls.append(on_count is not None)
        self.thetas.append(threshold)
        if on_count is not None:
            on_count(self.count(x2d, w_gate, threshold))
        y = ref.ffn_dense(x2d, w_gate, w_up, auto.down_t(w_down, w_down_t).t(), threshold)
        return y if self.wrong is None else self.wrong(y)


def dispatcher(times=None, policy=Policy(), capturing=None, kernels=None, **clock) -> Dispatcher:
    """A dispatcher on a fake clock inside a runtime that dispatches CPU calls: its backend table's TwELL row is
    `kernels` (also the probe; default Kernels(); a TwellProbe: the real row, in the interpreter)."""
    clk = Clock(times, **clock)
    kernels = kernels or Kernels()
    d = Dispatcher(clk, WeightStore(), policy, capturing or (lambda: False), kernels)
    twell = twell_rows if isinstance(kernels, TwellProbe) else kernels
    FFNRuntime("auto", dispatcher=d, devices=("cpu",), kernels={("cpu", "dense"): dense_rows, ("cpu", "twell"): twell})
    clk.dispatcher = d
    return d


EAGER_TWELL = {"dense": 1.0, "twell": 0.5, "graph_dense": 1.0, "graph_twell": 0.5}
ALL_DENSE = {"dense": 1.0, "twell": 2.0, "graph_dense": 1.0, "graph_twell": 2.0}
GRAPH_ONLY_TWELL = {"dense": 1.0, "twell": 2.0, "graph_dense": 1.0, "graph_twell": 0.5}


def state(d: Dispatcher, w_gate, bucket: int = 32):
    return d.store.get("states", w_gate)[bucket]
