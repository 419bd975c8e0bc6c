"""Benchmark: training FFN with packed saved activations (kernels/twell_train.py) against dense autograd.

On the H200 (eval/device/device_env.sh makes `sparsify.kernels` importable):
  cd repo && source eval/device/device_env.sh
  PYTHONPATH=$PWD PYTHONUNBUFFERED=1 python eval/bench/bench_train_ffn.py --tests --out $OUT/train-ffn.json
  (--tests: the GPU tests of tests/test_train_kernels.py first, results in the JSON; --part op / --part model
  run one half; --no-sweep skips the kernel block sweep)
CPU dry run of every code path (Triton interpreter, fp32, tiny shapes):
  python eval/bench/bench_train_ffn.py --smoke --out /tmp/b.json

Part "op": one FFN layer, d x F in {576x1536, 2048x8192}, M = 16384 tokens, bf16 (x and weights bf16 leaves),
zeros in --zeros with a skewed pattern: per-neuron firing rates log-normal (sparsify.folder.synth.neuron_rates, sigma
--skew), made by the GEMM itself (x[:, 0] = 1, W_gate[:, 0] = -b_j with b_j = |W_gate[j, 1:]| ndtri(1 - p_j),
x Gaussian: neuron j fires with probability p_j). Functions, forward + backward of loss = <y, dy> + c l1:
  dense           the dense expression under autograd with the L1 term and the training MLP's stats (nnz,
                  fired): what `sparsify finetune` runs per layer today (eager)
  dense_compiled  the same under torch.compile (finetune's train.compile=true)
  dense_ffn       y only (no L1, no stats), eager: the floor of what dense autograd must do
  packed          sparse_ffn_train (Triton kernels + cuBLAS GEMMs), capacity = the rule of
                  sparsify.train.packed_ffn (1.25 x per-row p99 of active slots, on its grid)
Timed in interleaved rounds (rotating order; CUDA events around a loop of n calls; medians; ratios are medians
of per-round paired ratios). Saved bytes through saved_tensors_hooks (each storage once), excluding and
including x and the weights; peak memory above the inputs for one forward + backward.
--sweep (default on GPU) first times `packed` at 2048x8192 / 90% over the kernels' block configs and keeps the
fastest for the rest of the run (reported).

Part "model": a SmolLM2-135M-shaped Llama (30 layers, d 576, F 1536, 9 heads / 3 kv heads, vocab 49152; random
weights made sparse by sparsify.folder.synth at --model-zeros, or --model FOLDER) trained --steps steps (after
--warm steps: compile, capacity update) with and without PackedFFN(mode="twell"), bf16 autocast, the same
torch.compile setting, AdamW, CE + 1e-4 x L1 from the training MLPs (sparsify.train.mlp), random tokens [--batch, --seq]:
tokens/s (median step time) and peak memory (torch.cuda.max_memory_allocated over the timed steps).

Prints a table last (TABLE) and writes every row with its conditions to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
if "--smoke" in sys.argv and shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_kernels import git_commit  # noqa: E402  (eval/bench/, this script's folder, is on sys.path)
from timing import Clock, interleaved, med, paired  # noqa: E402

SHAPES = "576x1536,2048x8192"
ZEROS = "0.5,0.75,0.9,0.99"
SWEEP_FWD = [dict(BM=bm, BF=bf, num_warps=w) for bm in (16, 32) for bf in (64, 128, 256) for w in (4, 8)]
SWEEP_BWD = [dict(BM=bm, BF=bf, num_warps=w) for bm in (16, 32) for bf in (64, 128, 256) for w in (4, 8)]
# SmolLM2-135M's architecture (eval/configs/smollm2-135m.json, the file `sparsify synth` reads), ReLU swapped in
SMOLLM2_135M = {**json.loads((ROOT / "eval" / "configs" / "smollm2-135m.json").read_text()), "hidden_act": "relu"}
TINY = {**SMOLLM2_135M, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}


# --------------------------------------------------------------------------------------------------- timing
# timing.interleaved's measurement here: two warm calls (compile, allocator), loops of ~--target-ms, <= 50 calls
TIMING = dict(max_calls=50, warm=2)


def peak_mb(fn, cuda: bool) -> float | None:
    """Peak allocated MB above what was allocated before one call (GPU only)."""
    if not cuda:
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def env_info() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    import transformers

    commit = git_commit()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton_version, "transformers": transformers.__version__,
            "python": platform.python_version(), "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


# --------------------------------------------------------------------------------------------------- op part
def make_layer(m: int, d: int, f: int, zeros: float, skew: float, device, dtype, seed: int = 0):
    """x [M, d] and weights (leaves requiring grad) with skewed honest sparsity (module docstring)."""
    from sparsify.folder.synth import neuron_rates

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=gen)
    x[:, 0] = 1.0
    w_gate = torch.randn(f, d, generator=gen) / d**0.5
    w_up = torch.randn(f, d, generator=gen) / d**0.5
    w_down = torch.randn(d, f, generator=gen) / f**0.5
    p = neuron_rates(f, zeros, skew, gen).float()  # [F] firing probability of each neuron, mean 1 - zeros
    z = torch.special.ndtri((1.0 - p).clamp(1e-9, 1 - 1e-9).double()).float()
    norm = w_gate[:, 1:].norm(dim=1)
    w_gate[:, 0] = -torch.where(p > 0, norm * z, torch.full_like(norm, 1e4))
    leaf = lambda t: t.to(device=device, dtype=dtype).requires_grad_()  # noqa: E731
    return leaf(x), leaf(w_gate), leaf(w_up), leaf(w_down)


def dense_ffn_only(x, w_gate, w_up, w_down):
    return (F.linear(torch.relu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down),)


def step_fn(forward, x, weights, dy, coef):
    """forward + backward of <y, dy> + coef * l1 (l1 the second output when there is one)."""
    params = [x, *weights]

    def step():
        out = forward(x, *weights)
        outs, grads = [out[0]], [dy]
        if len(out) > 1:
            outs.append(out[1])
            grads.append(coef)
        return torch.autograd.grad(outs, params, grads)
    return step


def layer_stats(x, w_gate, capacity_rule) -> dict:
    """Zeros and the per-row distribution of active slots the layer actually has; the capacity rule's pick."""
    with torch.no_grad():
        act = (F.linear(x, w_gate) > 0).sum(1).float()  # [M]
    m, f = x.shape[0], w_gate.shape[0]
    p99 = float(torch.quantile(act, 0.99))
    cap = capacity_rule(1.25 * p99, f)
    return {"zeros": 1 - float(act.sum()) / (m * f), "nnz_row_mean": float(act.mean()), "nnz_row_p99": p99,
            "nnz_row_max": float(act.max()), "capacity": cap, "overflow_rows": int((act > cap).sum())}


def op_case(d, f, m, zeros, args, ctx) -> dict:
    from sparsify.kernels.train import twell_train as tt
    from sparsify.train.packed_ffn import capacity_grid, dense_saved_bytes, saved_bytes

    device, dtype, clock = ctx["device"], ctx["dtype"], ctx["clock"]
    x, w_gate, w_up, w_down = make_layer(m, d, f, zeros, args.skew, device, dtype)
    weights = (w_gate, w_up, w_down)
    row = {"part": "op", "d": d, "F": f, "M": m, "zeros_target": zeros, "dtype": str(dtype).replace("torch.", ""),
           **layer_stats(x, w_gate, capacity_grid)}
    cap = row["capacity"]
    dy = torch.randn(m, d, device=device, dtype=dtype)
    coef = torch.tensor(1e-3, device=device)
    packed = lambda *a: tt.sparse_ffn_train(*a, capacity=cap)  # noqa: E731
    fns = {"dense": step_fn(tt.ffn_train_reference, x, weights, dy, coef),
           "packed": step_fn(packed, x, weights, dy, coef),
           "dense_ffn": step_fn(dense_ffn_only, x, weights, dy, coef)}
    if ctx["compiled"] is not None:
        fns["dense_compiled"] = step_fn(ctx["compiled"], x, weights, dy, coef)
    errors: dict = {}
    t = interleaved(fns, clock, errors, rounds=args.rounds, target_ms=args.target_ms, **TIMING)
    row.update({f"{k}_ms": med(v) for k, v in t.items()})
    for base in ("dense", "dense_compiled", "dense_ffn"):
        r = paired(t, "packed", base)
        if r is not None:
            row[f"packed_over_{base}"] = r  # time ratio: < 1 means packed is faster
    inputs = (x, *weights)
    measured = [("dense", tt.ffn_train_reference), ("packed", packed)]
    if ctx["compiled"] is not None:  # inductor's partitioner may recompute instead of saving: measured too
        measured.append(("dense_compiled", ctx["compiled"]))
    for name, fwd in measured:
        try:
            sb = saved_bytes(lambda fwd=fwd: fwd(*inputs), exclude=inputs)
            row[f"{name}_saved_mb"] = sb["activations"] / 2**20  # beyond x and the weights
            row[f"{name}_saved_all_mb"] = sb["total"] / 2**20  # x and weights included
            row[f"{name}_peak_mb"] = peak_mb(fns[name], ctx["cuda"]) if name in fns else None
        except Exception as e:  # noqa: BLE001
            errors[f"{name}_saved"] = f"{type(e).__name__}: {e}"[:500]
    row["dense_saved_formula_mb"] = dense_saved_bytes(m, f, x.element_size()) / 2**20
    packed_formula = tt.saved_bytes_formula(m, f, cap, tt.default_spill_rows(m), x.element_size())
    row["packed_saved_formula_mb"] = packed_formula / 2**20
    if "dense_saved_mb" in row and "packed_saved_mb" in row:
        row["saved_reduction"] = 1 - row["packed_saved_mb"] / row["dense_saved_mb"]
    row["check"] = correctness(x, weights, dy, packed, tt)
    if args.profile and ctx["cuda"]:
        row["profile"] = {name: kernel_table(fn) for name, fn in fns.items()}
        for name, table_rows in row["profile"].items():
            print(f"{d}x{f} {zeros:.0%} {name}: " + "; ".join(f"{k} {us:.0f} us x{n:g}" for k, us, n in table_rows[:12]),
                  flush=True)
    if errors:
        row["errors"] = errors
    return row


def kernel_table(fn, calls: int = 3) -> list:
    """[(kernel name, GPU us per call, launches per call)] of fn under torch.profiler, largest first, with a
    "total" row first: where a step's GPU time goes (which kernel the packed path adds)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us, n = {}, {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            key = e.name[:90]
            us[key] = us.get(key, 0.0) + e.time_range.elapsed_us() / calls
            n[key] = n.get(key, 0) + 1 / calls
    rows = sorted(((k, us[k], n[k]) for k in us), key=lambda r: -r[1])
    return [("total", sum(us.values()), sum(n.values())), *rows]


def correctness(x, weights, dy, packed, tt) -> dict:
    """Max relative error of packed and of dense (both in the run's dtype) against dense autograd in fp32: the
    packed path should be at most ~the dense path's own rounding error."""
    coef = torch.tensor(0.5, device=x.device)
    x32 = x.detach().float().requires_grad_()
    w32 = [w.detach().float().requires_grad_() for w in weights]
    ref = step_fn(tt.ffn_train_reference, x32, w32, dy.float(), coef)()
    out = {}
    for name, fn in (("dense", tt.ffn_train_reference), ("packed", packed)):
        got = step_fn(fn, x, weights, dy, coef)()
        out[name] = max(float((g.float() - r).abs().max() / r.abs().max().clamp(min=1e-30)) for g, r in zip(got, ref))
    return out


def sweep(args, ctx) -> dict:
    """Time `packed` at 2048 x 8192 (smoke: the first shape) / 90% zeros over block configs of each kernel
    (the other kernel at its default); keep the fastest of each."""
    from sparsify.kernels.train import twell_train as tt
    from sparsify.train.packed_ffn import capacity_grid

    d, f = (2048, 8192) if ctx["cuda"] else parse_shapes(args.shapes)[0]
    x, w_gate, w_up, w_down = make_layer(args.m, d, f, 0.9, args.skew, ctx["device"], ctx["dtype"])
    cap = layer_stats(x, w_gate, capacity_grid)["capacity"]
    dy = torch.randn(args.m, d, device=ctx["device"], dtype=ctx["dtype"])
    step = step_fn(lambda *a: tt.sparse_ffn_train(*a, capacity=cap), x, (w_gate, w_up, w_down), dy,
                   torch.tensor(1e-3, device=ctx["device"]))
    result = {"shape": f"{d}x{f}", "fwd": [], "bwd": []}
    for which, configs, target in (("fwd", SWEEP_FWD, tt.FWD_CONFIG), ("bwd", SWEEP_BWD, tt.BWD_CONFIG)):
        default = dict(target)
        fns, errors = {}, {}
        for cfg in (configs if ctx["cuda"] else configs[:2]):
            name = json.dumps(cfg, sort_keys=True)

            def run(cfg=cfg):
                target.clear()
                target.update(cfg)
                return step()
            fns[name] = run
        t = interleaved(fns, ctx["clock"], errors, rounds=max(3, args.rounds // 2), target_ms=args.target_ms,
                        **TIMING)
        ranked = sorted((med(v), k) for k, v in t.items())
        result[which] = [{"config": json.loads(k), "ms": ms} for ms, k in ranked]
        if errors:
            result[f"{which}_errors"] = errors
        target.clear()
        target.update(json.loads(ranked[0][1]) if ranked and ctx["cuda"] else default)
        result[f"{which}_chosen"] = dict(target)
    return result


def parse_shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s]


def op_part(args, ctx, report) -> None:
    from sparsify.kernels.train import twell_train as tt

    if args.sweep:
        report["sweep"] = sweep(args, ctx)
        print("sweep:", json.dumps({k: v for k, v in report["sweep"].items() if k.endswith("chosen")}), flush=True)
    report["kernel_configs"] = {"fwd": dict(tt.FWD_CONFIG), "bwd": dict(tt.BWD_CONFIG)}
    for d, f in parse_shapes(args.shapes):
        ctx["compiled"] = None
        if args.compile:  # one compiled dense function per shape (zeros change no shape: no recompile)
            ctx["compiled"] = torch.compile(tt.ffn_train_reference, dynamic=False, backend=args.compile_backend)
        for zeros in (float(z) for z in args.zeros.split(",")):
            tic = time.perf_counter()
            row = op_case(d, f, args.m, zeros, args, ctx)
            row["wall_s"] = round(time.perf_counter() - tic, 1)
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
        torch._dynamo.reset()


# --------------------------------------------------------------------------------------------------- model part
def build_model_folder(args, ctx) -> Path:
    """A sparse random SmolLM2-135M-shaped ReLU folder made by sparsify.folder.synth (fp32 weights), or --model."""
    if args.model:
        return Path(args.model)
    from sparsify.folder.synth import synth

    folder = Path(args.workdir) / f"synth-{'tiny' if args.smoke else 'smollm2-135m'}-z{args.model_zeros}"
    if not (folder / "config.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        cfg_file = folder.parent / f"{folder.name}.config.json"
        cfg_file.write_text(json.dumps(TINY if args.smoke else SMOLLM2_135M))
        synth(cfg_file, folder, zeros=args.model_zeros, dtype="fp32", device=str(ctx["device"]), seed=0,
              calib_tokens=1024 if args.smoke else 8192, overwrite=True, progress=False)
    return folder


def train_variant(folder: Path, mode: str, args, ctx) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from sparsify.train.config import SparsitySection
    from sparsify.train.mlp import TrainMLPs
    from sparsify.train.objective import SparsityCounts
    from sparsify.train.packed_ffn import PackedFFN

    device, clock, cuda = ctx["device"], ctx["clock"], ctx["cuda"]
    torch.manual_seed(0)
    try:  # finetune's attention choice (causal SDPA without a mask) when this version has it
        from sparsify.train.finetune import training_attention

        attn = training_attention(AutoConfig.from_pretrained(folder), args.seq)
    except ImportError:
        attn = "sdpa"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn).to(device)
    model.config.use_cache = False
    model.train()
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mlps, counts = TrainMLPs(model, SparsitySection(normalization="sum_hidden")), SparsityCounts()
    packed = PackedFFN(mlps.layers, mode)
    if args.compile and not args.smoke:
        model.compile(backend=args.compile_backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if cuda else {}))
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(4)]
    losses, times, zeros = [], [], None
    peak = None

    def step(i: int):
        nonlocal zeros
        batch = batches[i % len(batches)].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            mlps.start()
            logits = model(input_ids=batch[:, :-1]).logits
            terms = mlps.take()
            counts.add_forward(terms.nonzeros, terms.fired, tokens=batch[:, :-1].numel())
            l1 = terms.l1.mean()
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()) + 1e-4 * l1
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats = counts.step_stats()
        return loss, stats

    for i in range(args.warm):
        loss, stats = step(i)
        losses.append(loss.item())
        if i == 0:  # what the trainer does at a logged step: capacity from the measured counts
            zeros = stats.zeros
            packed.update(zeros, stats.nonzeros)
    clock.sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.steps):
        times.append(clock.loop_ms(lambda: step(args.warm + i), 1))
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**30
    ms = med(times)
    row = {"part": "model", "mode": mode, "tokens_per_s": args.batch * args.seq / ms * 1e3, "step_ms": ms,
           "peak_gb": peak, "loss_first": losses[0], "loss_warm_last": losses[-1],
           "zeros_mean": sum(zeros) / len(zeros), "zeros_min": min(zeros), "packed_layers": len(packed.packed_layers),
           "capacity": sorted(set(packed.capacities)) if packed.layers else None,
           "batch": args.batch, "seq": args.seq, "compile": args.compile and not args.smoke,
           "checkpointing": args.checkpointing}
    mlps.restore()
    del model, opt
    torch._dynamo.reset()
    if cuda:
        torch.cuda.empty_cache()
    return row


def model_part(args, ctx, report) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder = build_model_folder(args, ctx)
    report["model_folder"] = str(folder)
    for mode in ("dense", "twell"):
        tic = time.perf_counter()
        try:
            row = train_variant(folder, mode, args, ctx)
        except Exception as e:  # noqa: BLE001 - the other variant still runs
            row = {"part": "model", "mode": mode, "error": f"{type(e).__name__}: {e}"[:1000]}
            if args.smoke:
                raise
        row["wall_s"] = round(time.perf_counter() - tic, 1)
        report["rows"].append(row)
        print(json.dumps(row), flush=True)


# --------------------------------------------------------------------------------------------------- report
def table(report: dict) -> str:
    ops = [r for r in report["rows"] if r["part"] == "op"]
    lines = []
    if "tests" in report:
        lines.append(f"GPU tests: returncode {report['tests']['returncode']}: "
                     f"{(report['tests']['tail'].strip().splitlines() or [''])[-1]}")
    lines += ["TABLE  forward+backward of one FFN layer (time ratio packed / dense: < 1 = faster; target <= 1.05 at "
             "90%, 99% 2048x8192 <= 0.77 stretch; saved MB beyond x and weights, target >= 50% smaller)",
             f"{'d x F':>10} {'M':>6} {'zeros':>6} {'C':>5} {'dense ms':>9} {'compiled':>9} {'ffn-only':>9} "
             f"{'packed ms':>9} {'p/dense':>8} {'p/comp':>7} {'saved MB dense/comp -> packed':>30} {'-%':>6} "
             f"{'+x,w MB d->p':>18}"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in ops:
        lines.append(
            f"{r['d']}x{r['F']:<5} {r['M']:>6} {r['zeros']:>6.3f} {r['capacity']:>5} {fmt(r.get('dense_ms'), '9.3f')} "
            f"{fmt(r.get('dense_compiled_ms'), '9.3f')} {fmt(r.get('dense_ffn_ms'), '9.3f')} "
            f"{fmt(r.get('packed_ms'), '9.3f')} {fmt(r.get('packed_over_dense'), '8.3f')} "
            f"{fmt(r.get('packed_over_dense_compiled'), '7.3f')} "
            f"{fmt(r.get('dense_saved_mb'), '8.1f')} / {fmt(r.get('dense_compiled_saved_mb'), '8.1f')} -> "
            f"{fmt(r.get('packed_saved_mb'), '8.1f')} "
            f"{fmt(r.get('saved_reduction') and 100 * r['saved_reduction'], '6.1f')} "
            f"{fmt(r.get('dense_saved_all_mb'), '8.1f')} -> {fmt(r.get('packed_saved_all_mb'), '7.1f')}"
            + (f"  errors: {sorted(r['errors'])}" if r.get("errors") else ""))
    models = [r for r in report["rows"] if r["part"] == "model"]
    if models:
        lines.append("TABLE  whole model (SmolLM2-135M shapes unless --model), bf16 autocast, same compile setting")
        lines.append(f"{'mode':>6} {'tokens/s':>10} {'step ms':>8} {'peak GB':>8} {'loss step 0':>11} "
                     f"{'zeros':>6} {'packed':>6} {'capacity':>12}")
        for r in models:
            if "error" in r:
                lines.append(f"{r['mode']:>6} failed: {r['error'][:200]}")
                continue
            lines.append(f"{r['mode']:>6} {r['tokens_per_s']:>10.0f} {r['step_ms']:>8.1f} {fmt(r['peak_gb'], '8.2f')} "
                         f"{r['loss_first']:>11.4f} {r['zeros_mean']:>6.3f} {r['packed_layers']:>6} "
                         f"{str(r['capacity']):>12}")
        d, p = (next((r for r in models if r["mode"] == k and "error" not in r), None) for k in ("dense", "twell"))
        if d and p:
            lines.append(f"twell / dense: tokens/s x{p['tokens_per_s'] / d['tokens_per_s']:.3f}"
                         + (f", peak memory x{p['peak_gb'] / d['peak_gb']:.3f}" if d["peak_gb"] else ""))
    return "\n".join(lines)


def run_tests(report: dict) -> None:
    """pytest -m gpu tests/train/test_packed_ffn.py (time-limited); a failure is reported, the bench goes on."""
    tic = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                               str(ROOT / "tests" / "train" / "test_packed_ffn.py")], capture_output=True, text=True,
                              timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        report["tests"] = {"returncode": proc.returncode, "tail": (proc.stdout + proc.stderr)[-3000:]}
    except subprocess.TimeoutExpired:
        report["tests"] = {"returncode": None, "tail": "timed out after 300 s"}
    report["tests"]["wall_s"] = round(time.perf_counter() - tic, 1)
    print("tests:", report["tests"]["returncode"], report["tests"]["tail"].strip().splitlines()[-1:], flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton interpreter): every code path")
    p.add_argument("--part", default="all", choices=["all", "op", "model"])
    p.add_argument("--tests", action="store_true", help="run the GPU tests of tests/test_train_kernels.py first")
    p.add_argument("--shapes", default=SHAPES, help="d x F list (default %(default)s)")
    p.add_argument("--m", type=int, default=16384, help="tokens per layer call")
    p.add_argument("--zeros", default=ZEROS, help="fractions of zeros (default %(default)s)")
    p.add_argument("--skew", type=float, default=1.0, help="log-normal sigma of per-neuron firing rates")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--target-ms", type=float, default=25.0, help="length of one timed loop")
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=None,
                   help="time the kernels' block configs first and keep the fastest (default: on GPU)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the dense baseline and the model (default: on GPU)")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--model", default=None, help="a model folder for the model part (default: synth SmolLM2-135M)")
    p.add_argument("--model-zeros", type=float, default=0.9)
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "sparsify-bench-train-ffn"),
                   help="where the synth model folder goes (default %(default)s; reused when present)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8, help="timed training steps per variant")
    p.add_argument("--warm", type=int, default=3, help="untimed steps first (compile; capacity set after step 1)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing in the model part")
    p.add_argument("--profile", action="store_true",
                   help="op part: also a torch.profiler table of each function's kernels (GPU time per call)")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("no CUDA GPU: run with --smoke for the CPU dry run", file=sys.stderr)
        return 2
    if args.smoke:
        args.shapes, args.m, args.zeros, args.rounds, args.target_ms = "32x96", 64, "0.9", 3, 1.0
        args.batch, args.seq, args.steps, args.warm = 2, 16, 2, 2
        if args.compile is None:  # the op part's compile path without a C++ build; the model part eager (the
            args.compile, args.compile_backend = True, "aot_eager"  # compiled packed model: tests/test_train_kernels)
    args.sweep = cuda if args.sweep is None else args.sweep
    args.compile = cuda if args.compile is None else args.compile
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    args.warm = max(1, args.warm)
    ctx = {"cuda": cuda, "device": torch.device("cuda" if cuda else "cpu"),
           "dtype": torch.bfloat16 if cuda else torch.float32, "clock": Clock(cuda)}
    report = {"env": env_info(), "args": vars(args), "rows": []}
    tic = time.perf_counter()
    if args.tests:
        run_tests(report)
    if args.part in ("all", "op"):
        op_part(args, ctx, report)
    if args.part in ("all", "model"):
        model_part(args, ctx, report)
    report["wall_s"] = round(time.perf_counter() - tic, 1)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    print(f"wrote {out} ({report['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
