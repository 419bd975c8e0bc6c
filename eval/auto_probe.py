"""Probe of backend="auto" on one case: what its eager twell path costs next to twell and dense.

Round 5 (kernels/NOTES.md, "Round 5 measured", finding 2) saw auto at 0.136 / 0.196 ms where the bench's
own twell call took 0.099 / 0.102 ms (4096x14336, M = 16, skewed 98% / 99.5% zeros, eager). This script
times, for that case, the variants that separate the suspects, INTERLEAVED: every round times each
variant once as a loop of --calls back-to-back calls (CUDA events), in a rotating order; medians over
--rounds rounds; ratios are medians of the per-round ratios variant / dense (< 1: faster than dense);
"mean" columns keep what a median hides (a refresh costing once per REFRESH calls):
  dense           twell_reference.ffn_dense (what auto's dense fast path runs)
  twell_triton    twell_triton.twell_ffn_triton with W_down^T passed (kernels + launch, no checks)
  twell           twell_ffn(backend="twell") (checks + cached W_down^T lookup)
  auto            twell_ffn(backend="auto") as it calibrated itself (its decision and timings are printed)
  auto_tw         auto with its decision forced to twell, default REFRESH
  auto_tw_norefr  the same with REFRESH = REFRESH_DENSE = 10**9 (never refreshes)
  auto_tw_r16     the same with REFRESH = 16 (round 5's cadence)
  auto_tw_wdt     the same with w_down_t passed (no cache lookup)
Each auto variant has its own copy of W_gate, so its own dispatcher state and call counter; the first
call of each copy is its calibration, whose wall time is reported (calib_ms: the per-layer cost of auto
at this M). Then torch.profiler records --profile-calls calls of twell_triton, twell, auto, auto_tw and
auto_tw_r16 and counts CUDA API calls per call (cudaStreamSynchronize, cudaEventSynchronize,
cudaHostAlloc, cudaMemcpyAsync, launches, ...), with the host ms per call (with and without the profiler).

Inputs are built the way eval/bench_kernels.py builds its skewed honest-sparsity cases (its
make_layer / set_sparsity are imported): x[:, 0] = 1 and W_gate[:, 0] = -b_j, so the gate GEMM makes the
zeros.

Usage on the H200 (eval/device_env.sh makes `sparsify.kernels` importable), ~30-60 s:
  cd repo && source eval/device_env.sh
  PYTHONPATH=$PWD PYTHONUNBUFFERED=1 python eval/auto_probe.py --out $OUT/probe
CPU dry run of every code path (Triton interpreter, tiny shapes; auto runs dense on CPU):
  TRITON_INTERPRET=1 python eval/auto_probe.py --smoke --out /tmp/probe
Writes DIR/auto-probe.json (or the --out path itself when it ends in .json); prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "eval"))

from sparsify.kernels import twell_updown as tu  # noqa: E402  (K2 and twell_ffn_triton)

import bench_kernels as bk  # noqa: E402  (make_layer, set_sparsity, Clock, env_info)

FORCED = ("auto_tw", "auto_tw_norefr", "auto_tw_r16", "auto_tw_wdt")
PROFILED = ("twell_triton", "twell", "auto", "auto_tw", "auto_tw_r16")  # host cost: kernels, checks, dispatcher
API = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaHostAlloc",
       "cudaMemcpyAsync", "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaEventRecord",
       "cudaEventQuery", "cudaStreamIsCapturing", "cudaEventCreateWithFlags", "cudaEventDestroy")


def variants(x, w_gate, w_up, w_down, w_down_t, ops, tt, ffn_dense) -> dict:
    """{name: (fn, the dispatcher its calls use or None, its own W_gate copy or None)}. On CUDA each forced
    variant has its own runtime and Dispatcher (its own policy: REFRESH), called as a model's layer calls it;
    on CPU (the smoke run) every auto variant is twell_ffn(backend="auto"), which runs dense there."""
    from sparsify.kernels.dispatch import Dispatcher, Policy
    from sparsify.kernels.ffn_runtime import FFNRuntime

    policies = {"auto_tw": Policy(), "auto_tw_norefr": Policy(refresh=10**9, refresh_dense=10**9),
                "auto_tw_r16": Policy(refresh=16), "auto_tw_wdt": Policy()}
    own = {k: w_gate.clone() for k in ("auto", *FORCED)}  # separate dispatcher states and call counters
    runtimes = {k: FFNRuntime("auto", dispatcher=Dispatcher(policy=p)) for k, p in policies.items()}
    disp = {"auto": ops.auto_dispatcher(), **{k: rt.dispatcher for k, rt in runtimes.items()}}

    def auto(name, wdt=None):
        if x.is_cuda and name != "auto":  # (a runtime's run: the question, then the answer's row, no checks)
            return lambda: runtimes[name].run(x, own[name], w_up, w_down, wdt)
        return lambda: ops.twell_ffn(x, own[name], w_up, w_down, backend="auto", w_down_t=wdt)

    return {
        "dense": (lambda: ffn_dense(x, w_gate, w_up, w_down), None, None),
        "twell_triton": (lambda: tu.twell_ffn_triton(x, w_gate, w_up, w_down_t), None, None),
        "twell": (lambda: ops.twell_ffn(x, w_gate, w_up, w_down, backend="twell"), None, None),
        **{k: (auto(k, w_down_t if k == "auto_tw_wdt" else None), disp[k], own[k]) for k in ("auto", *FORCED)},
    }


def states(disp, w_gate) -> dict:
    """The dispatcher's per-bucket states of one W_gate copy ({} when auto never reached it, e.g. CPU)."""
    return (disp.store.get("states", w_gate) if disp is not None else None) or {}


def warm(fns: dict, ops, clock) -> dict:
    """First call of every variant (compiles; an auto copy calibrates: its wall ms is the per-layer
    cost), then force the auto_tw* copies to twell. Returns {name: {calib_ms, decision, times}}."""
    info = {}
    for name, (fn, disp, wg) in fns.items():
        clock.sync()
        t0 = time.perf_counter()
        fn()
        clock.sync()
        ms = (time.perf_counter() - t0) * 1e3
        if wg is None:
            continue
        st = next(iter(states(disp, wg).values()), None)
        info[name] = {"calib_ms": ms, "decision": st and st.decision, "graph_decision": st and st.graph_decision,
                      "times": dict(st.times) if st else {}}
        if name in FORCED and st is not None:
            st.decision = st.graph_decision = "twell"
        info[name]["forced_twell"] = name in FORCED and st is not None
    return info


def interleaved(fns: dict, ops, clock, calls: int, rounds: int) -> dict[str, list[float]]:
    """{name: [per-call ms, one per round]}; each round times every variant once, rotating the order."""
    names = list(fns)
    out: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for i in range(len(names)):
            k = names[(i + r) % len(names)]
            out[k].append(clock.loop_ms(fns[k][0], calls))
    return out


def summarize(t: dict[str, list[float]]) -> dict:
    row = {}
    for k, v in t.items():
        row[k] = {"median_ms": statistics.median(v), "mean_ms": statistics.fmean(v), "min_ms": min(v),
                  "max_ms": max(v), "vs_dense": statistics.median([a / b for a, b in zip(v, t["dense"])]),
                  "mean_vs_dense": statistics.fmean(v) / statistics.fmean(t["dense"])}
    return row


def profile(fn, clock, calls: int) -> dict:
    """CUDA API call counts and host ms per call over `calls` calls (plus the same loop unprofiled)."""
    from torch.profiler import ProfilerActivity

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if clock.cuda else [])
    fn()
    clock.sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    plain = (time.perf_counter() - t0) * 1e3 / calls
    clock.sync()
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        profiled = (time.perf_counter() - t0) * 1e3 / calls
        clock.sync()
    events = {e.key: {"count": e.count, "cpu_us": e.cpu_time_total} for e in prof.key_averages()}
    api = {k: v["count"] for k, v in events.items() if k.startswith("cu")}
    top = sorted(events.items(), key=lambda kv: -kv[1]["count"])[:20]
    return {"calls": calls, "host_ms_per_call": plain, "host_ms_per_call_profiled": profiled,
            "api_per_call": {k: api.get(k, 0) / calls for k in API}, "api_counts": api,
            "top_by_count": {k: v["count"] for k, v in top}}


def run_case(d, f, m, sparsity, pattern, args, ctx) -> dict:
    ops, tt, ffn_dense, clock, dev, dt = ctx
    w_gate, w_up, w_down = bk.make_layer(d, f, dev, dt)
    bk.set_sparsity(w_gate, sparsity, pattern)
    w_down_t = ops.transpose_down(w_down)
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(m, d, device=dev, generator=gen).to(dt)
    x[:, 0] = 1.0
    zeros = 1.0 - float((torch.nn.functional.linear(x, w_gate) > 0).float().mean())
    fns = variants(x, w_gate, w_up, w_down, w_down_t, ops, tt, ffn_dense)
    row = {"d": d, "F": f, "M": m, "sparsity": sparsity, "pattern": pattern, "dtype": str(dt),
           "measured_zeros": zeros, "REFRESH": ops.auto_dispatcher().policy.refresh,
           "REFRESH_DENSE": ops.auto_dispatcher().policy.refresh_dense}
    row["auto_state"] = warm(fns, ops, clock)
    t = interleaved(fns, ops, clock, args.calls, args.rounds)
    row["timing"] = summarize(t)
    row["rounds_ms"] = t
    row["profile"] = {}
    for name in PROFILED:
        try:
            row["profile"][name] = profile(fns[name][0], clock, args.profile_calls)
        except Exception as e:  # noqa: BLE001 - a profiler failure must not lose the timings
            row["profile"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return row


def table(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        head = f"{r['d']}x{r['F']} M={r['M']} {r['sparsity'] * 100:.1f}% {r['pattern']} (zeros {r['measured_zeros'] * 100:.2f}%)"
        lines += ["", head, "| variant | median ms | mean ms | x dense (median paired) | mean / mean dense |",
                  "|---|---|---|---|---|"]
        for k, v in r["timing"].items():
            lines.append(f"| {k} | {v['median_ms']:.4f} | {v['mean_ms']:.4f} | {v['vs_dense']:.3f} | {v['mean_vs_dense']:.3f} |")
        for k, s in r["auto_state"].items():
            tm = {a: (round(b, 4) if isinstance(b, float) else b) for a, b in s["times"].items()}
            lines.append(f"  {k}: calib {s['calib_ms']:.1f} ms, decided {s['decision']}/{s['graph_decision']} {tm}")
        for k, p in r["profile"].items():
            if "error" in p:
                lines.append(f"  profile {k}: {p['error']}")
                continue
            api = ", ".join(f"{a} {c:g}" for a, c in p["api_per_call"].items() if c)
            lines.append(f"  profile {k}: host {p['host_ms_per_call']:.4f} ms/call "
                         f"({p['host_ms_per_call_profiled']:.4f} profiled); per call: {api or 'no CUDA API calls'}")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "eval/results")) / "probe",
                   help="folder for auto-probe.json (or a .json path)")
    p.add_argument("--shape", default="4096x14336", help="d x F of the layer")
    p.add_argument("--ms", default="16", help="comma list of M (tokens per call)")
    p.add_argument("--sparsities", default="0.995,0.98", help="comma list of target zero fractions")
    p.add_argument("--pattern", default="skewed", choices=["skewed", "uniform"])
    p.add_argument("--calls", type=int, default=64, help="calls per timed loop")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    p.add_argument("--profile-calls", type=int, default=32, help="calls recorded by torch.profiler")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and loops (CPU with TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.ms, args.sparsities, args.calls, args.rounds, args.profile_calls = "16x64", "20", "0.9", 2, 2, 2
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.time()
    from sparsify.kernels import twell_ops as ops, twell_triton as tt
    from sparsify.kernels.dispatch import loop_ms
    from sparsify.kernels.twell_reference import ffn_dense

    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        print("no CUDA GPU: set TRITON_INTERPRET=1 (with --smoke) for a CPU dry run", file=sys.stderr)
        return 2
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    ctx = (ops, tt, ffn_dense, bk.Clock(cuda, loop_ms), dev, dt)
    meta = {"env": bk.env_info(), "args": {k: str(v) for k, v in vars(args).items()}}
    print(meta["env"], flush=True)
    d, f = map(int, args.shape.split("x"))
    rows = []
    for m in [int(v) for v in args.ms.split(",")]:
        for s in [float(v) for v in args.sparsities.split(",")]:
            rows.append(run_case(d, f, m, s, args.pattern, args, ctx))
            print(f"{d}x{f} M={m} {s}: done ({time.time() - start:.0f} s)", flush=True)
    meta["seconds"] = time.time() - start
    out = args.out if args.out.suffix == ".json" else args.out / "auto-probe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    tmp.replace(out)  # atomic: a reader never sees half a file
    for line in table(rows):
        print(line)
    print(f"\ntotal {meta['seconds']:.0f} s; JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
