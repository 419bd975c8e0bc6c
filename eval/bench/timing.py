"""Paired timing: how every benchmark in eval/bench/ times what it compares.

Functions are timed side by side in rounds: each round times every function once, as a loop of back-to-back calls,
in an order that rotates from round to round, so drift (clocks, temperature, other work on the host) falls on all of
them alike. A ratio is the median over rounds of the same round's ratio (`paired`), not a ratio of medians.

    clock = Clock(cuda)
    t = interleaved(fns, clock, errors, budget_ms=2000)   # {name: [ms per call, one per round]}
    paired(t, "twell", "dense")                            # < 1: twell is faster than dense

On a GPU a loop is timed with CUDA events around it (the same loop as the FFN dispatcher's calibration,
kernels/dispatch.py loop_ms), elsewhere with the wall clock.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from sparsify.kernels.dispatch import loop_ms as cuda_loop_ms  # the dispatcher's own timed loop


def med(xs) -> float:
    return statistics.median(xs)


def loop_ms(fn: Callable, n: int, cuda: bool) -> float:
    """ms per call of n back-to-back calls of fn (no warm-up, no synchronisation before)."""
    if cuda:
        return cuda_loop_ms(fn, n)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) * 1e3 / n


class Clock:
    """loop_ms and a synchronisation point for one device (CUDA events on a GPU, the wall clock elsewhere)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def loop_ms(self, fn: Callable, n: int) -> float:
        return loop_ms(fn, n, self.cuda)


def rounds_of(measure: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """{name: [measure[name](), one per round]}: every round measures each name once, the first name rotating."""
    names = list(measure)
    out: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for i in range(len(names)):
            k = names[(i + r) % len(names)]
            out[k].append(measure[k]())
    return out


def interleaved(fns: dict, clock: Clock, errors: dict, *, rounds: int | None = None, budget_ms: float | None = None,
                target_ms: float = 1.0, max_calls: int = 200, warm: int = 1, per_call: dict | None = None,
                min_rounds: int = 3, max_rounds: int = 25) -> dict[str, list[float]]:
    """{name: [ms per call, one per round]} of `fns` timed in rounds (rounds_of).

    Each fn is called `warm` times first (compile, autotune, calibrate); one that raises is dropped from `fns` and
    its error kept in `errors`. A measurement is a loop of about target_ms of calls (1 .. max_calls). `rounds`, or
    as many as fill `budget_ms`, within [min_rounds, max_rounds]. per_call: {name: calls one call of the fn stands
    for} (a CUDA graph of n calls), by which its times are divided."""
    est = {}
    for name, fn in list(fns.items()):
        try:
            for _ in range(warm):
                fn()
            clock.sync()
            est[name] = max(clock.loop_ms(fn, 1), 1e-4)
        except Exception as e:  # noqa: BLE001 - record it and keep timing the others
            errors[name] = f"{type(e).__name__}: {e}"[:400]
            fns.pop(name)
    calls = {k: max(1, min(max_calls, int(target_ms / v))) for k, v in est.items()}
    if rounds is None:
        round_ms = sum(calls[k] * est[k] for k in fns) or 1.0
        rounds = int(max(min_rounds, min(max_rounds, (budget_ms or 0.0) / round_ms)))
    per = per_call or {}
    return rounds_of({k: (lambda k=k: clock.loop_ms(fns[k], calls[k]) / per.get(k, 1)) for k in fns}, rounds)


def paired(t: dict[str, list[float]], num: str, den: str) -> float | None:
    """Median over rounds of t[num] / t[den] in the same round (None when either was not timed)."""
    if not t.get(num) or not t.get(den):
        return None
    return med([a / b for a, b in zip(t[num], t[den])])
