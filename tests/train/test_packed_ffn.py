"""Packed-activation FFN training (kernels/train/twell_train.py, sparsify/train/packed_ffn.py) against dense autograd.

CPU: the Triton kernels run in the interpreter (fp32; conftest sets TRITON_INTERPRET=1), the torch backend is
the same packed format in plain torch. Honest sparsity: x[:, 0] = 1 and W_gate[:, 0] holds a negative
per-neuron bias, so the gate GEMM itself makes the zeros. Special rows: x[:, 1] = +DENSE makes every gate
positive (all-dense row: W_gate[:, 1] > 0), x = 0 makes none active (all-zero row, h = 0), x[:, 1] = -DENSE
makes every gate negative with x != 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sparsify.errors import SparsifyError
from sparsify.families import mlp_modules
from sparsify.kernels.train import twell_train as tt
from sparsify.train.model import checkpoint_activations
from sparsify.train.objective import SparsityCounts
from sparsify.train.packed_ffn import AUTO_OFF, AUTO_ON, PackedFFN, capacity_grid, dense_saved_bytes, saved_bytes

from tests.train.helpers import adamw_steps, l1_of, packed_ffn, tiny_llama

ROOT = Path(__file__).resolve().parents[2]
DENSE = 50.0
# the CPU tests' "triton" cases run the kernels on CPU tensors: the interpreter (GPU runs: the `gpu` test)
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not (tt.HAS_TRITON and INTERP), reason="needs triton with TRITON_INTERPRET=1")


def make_case(m, d, f, zeros, *, rows="", seed=0, device="cpu", margin=True):
    """x [M, d] (requires grad), w_gate, w_up [F, d], w_down [d, F] (leaves); `zeros` of the gate values <= 0
    on ordinary rows. rows: a string with one letter per special row at the end of x: "d" all-dense, "z"
    all-zero (x = 0), "n" all-negative. margin: refuse a case with a gate value within 1e-5 of 0 (its sign
    could differ between two exact computations)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=gen)
    w_gate = torch.randn(f, d, generator=gen) / d**0.5
    w_up = torch.randn(f, d, generator=gen) / d**0.5
    w_down = torch.randn(d, f, generator=gen) / f**0.5
    x[:, 0], x[:, 1] = 1.0, 0.0
    w_gate[:, 0] = 0.0
    w_gate[:, 1] = w_gate[:, 1].abs() + 0.5
    g0 = x @ w_gate.t()  # [M, F] without the bias
    bias = torch.quantile(g0.flatten(), zeros) if 0 < zeros < 1 else (g0.min() - 1 if zeros <= 0 else g0.max() + 1)
    w_gate[:, 0] = -bias
    for i, kind in enumerate(rows):
        r = m - len(rows) + i
        if kind == "z":
            x[r] = 0.0
        else:
            x[r, 1] = DENSE if kind == "d" else -DENSE
    gate = x @ w_gate.t()
    sure = (gate.abs() > 1e-5).logical_or(x.abs().sum(1, keepdim=True) == 0)
    assert not margin or sure.all(), "case too close to zero"
    leaf = lambda t: t.to(device).requires_grad_()  # noqa: E731
    return leaf(x), leaf(w_gate), leaf(w_up), leaf(w_down)


def run(fn, x, w_gate, w_up, w_down, dy, coef, **kw):
    """(y, l1, nnz, fired, grads) of loss = <y, dy> + coef * l1."""
    y, l1, nnz, fired = fn(x, w_gate, w_up, w_down, **kw)
    loss = (y * dy).sum() + coef * l1
    grads = torch.autograd.grad(loss, [x, w_gate, w_up, w_down])
    return y, l1, nnz, fired, grads


def assert_close(got, want, what, rtol=2e-5, atol=1e-5):
    """Max-abs error against atol + rtol * max |want|, with where and how much in the message."""
    got, want = got.detach().float(), want.detach().float()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs()
    bound = atol + rtol * want.abs().max().item()
    if err.numel() and err.max().item() > bound:
        idx = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
        raise AssertionError(f"{what}: max |err| {err.max().item():.3e} > {bound:.3e} at {idx} (got "
                             f"{got[idx].item():.6g}, want {want[idx].item():.6g}; {int((err > bound).sum())} off)")


def check_against_dense(case, *, backend, capacity=None, spill_rows=None, normalization="sum_hidden", coef=0.7,
                        shape=None, threshold=None):
    x, w_gate, w_up, w_down = case
    if shape is not None:
        x = x.reshape(*shape, x.shape[-1])
    dy = torch.randn(*x.shape[:-1], w_down.shape[0], generator=torch.Generator().manual_seed(1))
    want = run(tt.ffn_train_reference, x, w_gate, w_up, w_down, dy, coef, normalization=normalization,
               threshold=threshold)
    got = run(tt.sparse_ffn_train, x, w_gate, w_up, w_down, dy, coef, normalization=normalization,
              capacity=capacity, spill_rows=spill_rows, backend=backend, threshold=threshold)
    assert_close(got[0], want[0], "y")
    assert_close(got[1], want[1], "l1")
    assert got[2].item() == want[2].item(), f"nnz {got[2].item()} != {want[2].item()}"
    assert torch.equal(got[3], want[3]), "fired neurons differ"
    for name, a, b in zip(("dx", "dw_gate", "dw_up", "dw_down"), got[4], want[4]):
        assert_close(a, b, name)
    return got


BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,d,f,zeros", [(1, 16, 48, 0.9), (7, 40, 100, 0.9), (33, 16, 100, 0.5),
                                         (33, 40, 48, 0.97)])
def test_gradients_match_dense_autograd(backend, m, d, f, zeros):
    check_against_dense(make_case(m, d, f, zeros, seed=m), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("capacity,spill_rows", [(2, 64), (2, 3), (1, 0)])
def test_overflowing_rows_are_exact(backend, capacity, spill_rows):
    """Tiny capacity: most rows overflow into the side buffer (spill 64), some beyond it are recomputed in
    backward (spill 3), or every overflowing row is (spill 0); plus all-dense, all-zero and negative rows."""
    case = make_case(33, 40, 100, 0.9, rows="dzdnz", seed=3)
    check_against_dense(case, backend=backend, capacity=capacity, spill_rows=spill_rows)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("zeros", [0.0, 1.0])
def test_all_dense_and_all_zero_inputs(backend, zeros):
    got = check_against_dense(make_case(7, 16, 48, zeros, rows="z"), backend=backend, capacity=16)
    if zeros == 1.0:
        assert got[2].item() == 0 and not got[3].any() and got[1].item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("normalization", ["sum_hidden", "mean"])
def test_l1_term_and_leading_dims(backend, normalization):
    """The L1 gradient folded into dh (both normalisations, a coefficient outside), x as [B, T, d]."""
    case = make_case(33, 16, 48, 0.8, rows="d", seed=5)
    check_against_dense(case, backend=backend, normalization=normalization, coef=3.0, shape=(3, 11))
    check_against_dense(case, backend=backend, normalization=normalization, coef=0.0, capacity=4, spill_rows=1)


def theta_case(m, d, f, *, rows="", seed=0):
    """make_case at 0% zeros (every g of an ordinary row > 0) and theta [F] float32 that cuts most of them:
    every 5th neuron at 0 (relu), every 7th at 1e4 (never active), every 6th exactly at a gate value of row 0
    (strictly greater: cut there), the others at random quantiles of their column."""
    case = make_case(m, d, f, 0.0, rows=rows, seed=seed)
    g = torch.nn.functional.linear(case[0], case[1]).detach()  # [M, F], as both paths compute it
    q = torch.rand(f, generator=torch.Generator().manual_seed(seed + 100)) * 0.4 + 0.5  # [F] in [0.5, 0.9)
    theta = torch.stack([torch.quantile(g[:, j], q[j]) for j in range(f)]).clamp(min=0)
    theta[0::5], theta[1::7] = 0.0, 1e4
    theta[2::6] = g[0, 2::6].clamp(min=0)
    return case, theta.contiguous()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("capacity,spill_rows", [(None, None), (4, 64), (2, 3)])
def test_threshold_forward_and_gradients_are_exact(backend, capacity, spill_rows):
    """h = g [g > theta] * up: packed exactly where g > theta, the gradient of that expression (zero at g <=
    theta), rows fitting, spilled and recomputed, plus all-dense, all-zero and negative rows."""
    case, theta = theta_case(33, 40, 100, rows="dzn", seed=21)
    got = check_against_dense(case, backend=backend, capacity=capacity, spill_rows=spill_rows, threshold=theta)
    plain = check_against_dense(case, backend=backend, capacity=capacity, spill_rows=spill_rows)
    assert got[2].item() < 0.8 * plain[2].item(), "theta cuts nothing: the test is blind"
    g = torch.nn.functional.linear(case[0], case[1]).detach()
    assert got[2].item() == int((torch.where(g > theta, g, 0.0) * (case[0] @ case[2].t()) != 0).sum())


@pytest.mark.parametrize("backend", BACKENDS)
def test_threshold_zero_is_relu_bit_for_bit(backend):
    case = make_case(33, 40, 100, 0.9, rows="dz", seed=22)
    dy = torch.randn(33, 40, generator=torch.Generator().manual_seed(1))
    a = run(tt.sparse_ffn_train, *case, dy, 0.5, capacity=8, spill_rows=2, backend=backend, threshold=torch.zeros(100))
    b = run(tt.sparse_ffn_train, *case, dy, 0.5, capacity=8, spill_rows=2, backend=backend)
    for x, y in zip((*a[:4], *a[4]), (*b[:4], *b[4])):
        assert torch.equal(x, y)


@needs_triton
def test_triton_and_torch_pack_the_same_columns_above_theta():
    (x, w_gate, w_up, w_down), theta = theta_case(33, 40, 100, rows="dz", seed=23)
    args = (x.detach(), w_gate.detach(), w_up.detach(), w_down.detach(), 8, 4, "sum_hidden")
    a, b = (tt._fwd_op(*args, backend, theta) for backend in ("torch", "triton"))
    assert torch.equal(a[5], b[5]) and torch.equal(a[3], b[3])  # mask words, active per row
    assert torch.equal(tt.unpack_mask(b[5], 100), torch.nn.functional.linear(x, w_gate) > theta)


@needs_triton
def test_triton_and_torch_save_the_same_packed_state():
    x, w_gate, w_up, w_down = make_case(33, 40, 100, 0.85, rows="dz", seed=7)
    outs = {b: tt._fwd_op(x.detach(), w_gate.detach(), w_up.detach(), w_down.detach(), 8, 4, "sum_hidden", b)
            for b in ("torch", "triton")}
    (y0, l10, nnz0, act0, fired0, mask0, vals0, side0, slot0) = outs["torch"]
    (y1, l11, nnz1, act1, fired1, mask1, vals1, side1, slot1) = outs["triton"]
    assert torch.equal(mask0, mask1) and torch.equal(act0, act1) and torch.equal(nnz0, nnz1)
    assert torch.equal(fired0, fired1)
    assert torch.equal(tt.unpack_mask(mask1, 100), (x @ w_gate.t() > 0))
    kept = torch.arange(8) < act1.clamp(max=8)[:, None]  # [M, C] valid slots
    for k in range(2):
        assert torch.equal(vals0[k][kept], vals1[k][kept])
    assert torch.equal(slot0 < 0, slot1 < 0) and torch.equal(act1 > 8, slot1 >= 0)
    assert sorted(slot1[slot1 >= 0].tolist()) == list(range(int((slot1 >= 0).sum())))  # slots taken once each
    for r in torch.nonzero((slot1 >= 0) & (slot1 < 4)).flatten().tolist():  # spilled rows: the whole row
        assert torch.equal(side1[slot1[r]], side0[slot0[r]])
    assert_close(y1, y0, "y")


def test_saved_state_is_packed_not_dense():
    """No [M, F] tensor is saved; the extra bytes are the formula's; dense autograd saves 3 M F elements."""
    m, d, f, cap, spill = 33, 16, 100, 16, 4
    x, w_gate, w_up, w_down = make_case(m, d, f, 0.9)
    weights = (w_gate, w_up, w_down)
    packed = saved_bytes(lambda: tt.sparse_ffn_train(x, *weights, capacity=cap, spill_rows=spill, backend="torch"),
                         exclude=(x, *weights))
    dense = saved_bytes(lambda: tt.ffn_train_reference(x, *weights), exclude=(x, *weights))
    assert all(shape != (m, f) for shape, _, _ in packed["tensors"]), packed["tensors"]
    assert packed["activations"] == tt.saved_bytes_formula(m, f, cap, spill, 4)
    assert dense["activations"] == dense_saved_bytes(m, f, 4)
    assert packed["excluded"] == dense["excluded"] == sum(t.numel() * 4 for t in (x, *weights))


def test_activation_checkpointing_and_compile():
    """Non-reentrant checkpointing recomputes the op (same saved shapes); torch.compile(fullgraph) traces the
    custom op with its fake and autograd registrations (backend aot_eager: no C++ build on CI runners)."""
    from torch.utils.checkpoint import checkpoint

    case = make_case(33, 16, 48, 0.9, rows="d", seed=11)
    x, w_gate, w_up, w_down = case
    dy = torch.randn(33, 16, generator=torch.Generator().manual_seed(12))
    want = run(tt.ffn_train_reference, x, w_gate, w_up, w_down, dy, 0.5)

    def ffn(*a):
        return tt.sparse_ffn_train(*a, capacity=8, spill_rows=1)

    ckpt = run(lambda *a: checkpoint(ffn, *a, use_reentrant=False), x, w_gate, w_up, w_down, dy, 0.5)
    compiled = run(torch.compile(ffn, backend="aot_eager", fullgraph=True), x, w_gate, w_up, w_down, dy, 0.5)
    for got in (ckpt, compiled):
        assert_close(got[0], want[0], "y")
        for name, a, b in zip(("dx", "dw_gate", "dw_up", "dw_down"), got[4], want[4]):
            assert_close(a, b, name)


def test_autocast_bf16_matches_dense_autocast():
    """Under autocast the op casts like F.linear (fp32 master weights, bf16 compute); the torch backend in bf16
    on CPU against dense autograd under the same autocast: bf16 rounding only."""
    x, w_gate, w_up, w_down = make_case(33, 40, 100, 0.9, rows="d")
    dy = torch.randn(33, 40, generator=torch.Generator().manual_seed(13))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = run(tt.ffn_train_reference, x, w_gate, w_up, w_down, dy, 0.5)
        got = run(tt.sparse_ffn_train, x, w_gate, w_up, w_down, dy, 0.5, capacity=8, spill_rows=2)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    assert torch.equal(got[0], want[0])  # same cuBLAS/mkl calls, same h rounding
    assert got[2].item() == want[2].item() and torch.equal(got[3], want[3])
    for name, a, b in zip(("dx", "dw_gate", "dw_up", "dw_down"), got[4], want[4]):
        assert a.dtype == torch.float32  # gradients reach the fp32 master weights
        assert_close(a, b, name, rtol=2e-2, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("capacity,spill_rows", [(None, None), (16, 4)])
def test_gpu_matches_dense_within_its_rounding_and_never_syncs(dtype, capacity, spill_rows):
    """CUDA: packed vs the fp32 oracle at most ~2x the error of dense autograd in the same dtype (KERNELS.md's
    bf16 rule); capacity 16 overflows most rows (side buffer + recompute); no host sync in forward + backward."""
    x, w_gate, w_up, w_down = make_case(1000, 256, 1000, 0.9, rows="dzn" * 3, device="cuda", margin=False)
    dy = torch.randn(1000, 256, device="cuda")
    leaf = lambda t: t.detach().to(dtype).requires_grad_()  # noqa: E731
    low = [leaf(t) for t in (x, w_gate, w_up, w_down)]
    ref = run(tt.ffn_train_reference, x, w_gate, w_up, w_down, dy, 0.5)
    dense = run(tt.ffn_train_reference, *low, dy.to(dtype), 0.5)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = run(tt.sparse_ffn_train, *low, dy.to(dtype), 0.5, capacity=capacity, spill_rows=spill_rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got[2].item() == dense[2].item() and torch.equal(got[3], dense[3])
    for name, g, d, r in zip(("y", "l1"), got[:2], dense[:2], ref[:2]):
        err_d = (d.float() - r).abs().max().item()
        assert_close(g, r, f"{name} ({dtype})", rtol=max(2 * err_d / r.abs().max().item(), 1e-5), atol=1e-6)
    for name, g, d, r in zip(("dx", "dw_gate", "dw_up", "dw_down"), got[4], dense[4], ref[4]):
        err_d = (d.float() - r).abs().max().item()
        assert_close(g, r, f"{name} ({dtype})", rtol=max(2 * err_d / r.abs().max().item(), 1e-5), atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_threshold_matches_dense_and_never_syncs(dtype):
    """CUDA with theta: the packed op's mask is the dense expression's (same cuBLAS gate), y and the gradients
    within 2x dense autograd's error against the fp32 oracle; no host sync."""
    (x, w_gate, w_up, w_down), theta = theta_case(1000, 256, 1000, rows="dzn" * 3, seed=24)
    x, w_gate, w_up, w_down = (t.detach().cuda().requires_grad_() for t in (x, w_gate, w_up, w_down))
    theta = theta.cuda()
    dy = torch.randn(1000, 256, device="cuda")
    low = [t.detach().to(dtype).requires_grad_() for t in (x, w_gate, w_up, w_down)]
    ref = run(tt.ffn_train_reference, x, w_gate, w_up, w_down, dy, 0.5, threshold=theta)
    dense = run(tt.ffn_train_reference, *low, dy.to(dtype), 0.5, threshold=theta)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = run(tt.sparse_ffn_train, *low, dy.to(dtype), 0.5, capacity=64, spill_rows=4, threshold=theta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got[2].item() == dense[2].item() and torch.equal(got[3], dense[3])
    for name, g, d, r in zip(("y", "l1", "dx", "dw_gate", "dw_up", "dw_down"), (*got[:2], *got[4]),
                             (*dense[:2], *dense[4]), (*ref[:2], *ref[4])):
        err_d = (d.float() - r).abs().max().item()
        assert_close(g, r, f"{name} ({dtype})", rtol=max(2 * err_d / r.abs().max().item(), 1e-5), atol=1e-6)


def test_bad_arguments_are_named():
    x, w_gate, w_up, w_down = make_case(4, 16, 48, 0.5)
    with pytest.raises(ValueError, match=r"w_down has shape \(48, 16\), expected \(16, 48\)"):
        tt.sparse_ffn_train(x, w_gate, w_up, w_down.t())
    with pytest.raises(ValueError, match="normalization='max'.*capacity=0"):
        tt.sparse_ffn_train(x, w_gate, w_up, w_down, normalization="max", capacity=0)
    for bad in (torch.zeros(48, dtype=torch.bfloat16), torch.zeros(47)):
        with pytest.raises(ValueError, match=r"threshold is .* expected float32 \(48,\)"):
            tt.sparse_ffn_train(x, w_gate, w_up, w_down, threshold=bad)


# ------------------------------------------------------------------------------------------- model integration
def train_steps(model, mode, steps=3, capacity=None, checkpointing=False, normalization="sum_hidden"):
    """A finetune-like loop (training MLPs, CE + coef * L1, AdamW); returns per-step (loss, grads, stats)."""
    if checkpointing:
        checkpoint_activations(model)  # finetune's own switch (non-reentrant)
    model.train()
    mlps, packed = packed_ffn(model, mode, normalization)
    counts = SparsityCounts()
    for layer in packed.layers:
        layer.kernel.capacity = capacity
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 9), generator=gen)
        mlps.start()
        logits = model(input_ids=ids[:, :-1]).logits
        l1 = l1_of(mlps, counts, ids[:, :-1].numel())
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()) + 0.05 * l1
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        stats = counts.step_stats()
        out.append((loss.item(), grads, stats.nonzeros, stats.dead))
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():  # evaluation: the model's own forward, nothing recorded
        model.eval()
        out.append(model(input_ids=ids).logits)
    return out, packed


def assert_trains_alike(packed, dense):
    """train_steps outputs: the same losses, gradients and sparsity stats at every step, and final logits."""
    for step, (a, b) in enumerate(zip(dense[:-1], packed[:-1])):
        assert a[0] == pytest.approx(b[0], rel=1e-5, abs=1e-6), f"step {step} loss"
        for name in a[1]:
            assert_close(b[1][name], a[1][name], f"step {step} grad {name}", rtol=1e-4, atol=1e-6)
        assert a[2] == pytest.approx(b[2]) and a[3] == b[3], f"step {step} stats"
    assert_close(packed[-1], dense[-1], "eval logits after the steps", rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_model_trains_like_dense(checkpointing):
    """Three optimizer steps of a tiny Llama (random ReLU MLPs: ~50% zeros): same losses, gradients, sparsity
    stats and final logits as dense; capacity 24 of F = 48: some rows fit, the others spill."""
    dense, _ = train_steps(tiny_llama(), "dense", checkpointing=checkpointing)
    packed, state = train_steps(tiny_llama(), "twell", capacity=24, checkpointing=checkpointing)
    assert state.packed_layers == [0, 1]
    counts = state.layers[0].kernel.counts
    assert (counts <= 24).any() and (counts > 24).any(), counts
    assert_trains_alike(packed, dense)


def test_compiled_packed_model_fullgraph_matches_eager_dense():
    """model.compile-style whole-model tracing of the training MLPs (fullgraph: no graph break; the record and
    counts side effects replayed): loss, gradients and the recorded counts as eager dense."""
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    results = []
    compiled = lambda m: torch.compile(m, backend="aot_eager", fullgraph=True)  # noqa: E731
    for mode, wrap in (("dense", lambda m: m), ("twell", compiled)):
        model = tiny_llama()
        mlps, packed = packed_ffn(model, mode)
        counts = SparsityCounts()
        mlps.start()
        logits = wrap(model)(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss = loss + 0.1 * l1_of(mlps, counts, 16)
        loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters()}, counts.step_stats().nonzeros))
    assert [layer.kernel.counts.shape for layer in packed.layers] == [(16,), (16,)]
    (loss_a, grads_a, nz_a), (loss_b, grads_b, nz_b) = results
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=1e-5) and nz_a == pytest.approx(nz_b)
    for name in grads_a:
        assert_close(grads_b[name], grads_a[name], name, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_gpu_compiled_model_trains_on_the_packed_kernels():
    """finetune's GPU setting on a tiny Llama: bf16 autocast, the whole model compiled in place (inductor, fullgraph:
    no graph break). train.kernels=twell runs the packed Triton op in every layer (its per-row counts recorded on the
    GPU); loss and gradients match the dense training MLPs' within bf16 rounding."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (4, 65), generator=gen).cuda()
    results, packed = [], None
    for mode in ("dense", "twell"):
        # a fresh dynamo cache: every transformers model's forward shares one wrapper code object, and a suite's
        # earlier compiles in this process count towards its recompile limit (8: fullgraph fails past it)
        torch._dynamo.reset()
        model = tiny_llama(hidden=64, f=256).cuda()
        mlps, packed = packed_ffn(model, mode)
        model.compile(fullgraph=True)
        mlps.start()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ids[:, :-1]).logits
        l1 = l1_of(mlps, SparsityCounts(), ids[:, :-1].numel())
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()) + 0.05 * l1
        loss.backward()
        results.append((loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}))
    assert packed.packed_layers == [0, 1]
    assert all(layer.kernel.counts is not None and layer.kernel.counts.is_cuda for layer in packed.layers)
    (loss_d, grads_d), (loss_p, grads_p) = results
    assert loss_p == pytest.approx(loss_d, rel=1e-2)
    for name, g in grads_d.items():
        err = (grads_p[name] - g).abs().max().item()
        assert err <= 3e-2 * g.abs().max().item() + 1e-6, f"{name}: max |packed - dense| {err:.3g}"


def test_auto_mode_hysteresis_capacity_and_refusals():
    model = tiny_llama(layers=3, f=400)
    mlps, packed = packed_ffn(model, "auto")
    assert packed.packed_layers == []
    assert packed.update([AUTO_ON, AUTO_ON - 0.01, 0.99], [10.0, 20.0, 1.0]) == [0, 2]
    assert packed.update([AUTO_OFF + 0.01, 0.5, 0.99]) == [0, 2]  # between the thresholds: no flip
    assert packed.update([AUTO_OFF - 0.01, 0.5, 0.99]) == [2]
    assert any("layer 0: dense FFN" in c for c in packed.changes)
    # from the mean: 1.5 x 10 + 32 = 47 -> 48 (<= half of the default 112: shrunk); 62 -> 64 (kept 112)
    assert [layer.kernel.capacity for layer in packed.layers] == [48, None, 48]
    assert packed.capacities == [48, 112, 48]
    layer = packed.layers[2]  # measured per-row counts take over (1.25 x p99)
    for count, want in ((10, 16), (18, 32), (14, 32), (100, 128), (52, 128), (40, 64)):
        layer.kernel.counts = torch.full((100,), count, dtype=torch.int32)
        packed.update([0.5, 0.5, 0.99])
        assert layer.kernel.capacity == want, \
            f"count {count}: capacity {layer.kernel.capacity} != {want} (grow now, shrink at half)"
    grid = [capacity_grid(n, 10**6) for n in (1, 16, 17, 33, 50, 100, 200, 1121, 5221)]
    assert grid == [16, 16, 32, 48, 64, 112, 224, 1280, 6144] and capacity_grid(5221, 5000) == 5000
    assert PackedFFN(mlps.layers, "dense").layers == []
    with pytest.raises(SparsifyError, match="not one of"):
        PackedFFN(mlps.layers, "sparse")
    silu = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, hidden_act="silu"))
    with pytest.raises(SparsifyError, match="convert the model to ReLU"):
        packed_ffn(silu, "twell")


class ThetaAct(torch.nn.Module):
    """A stand-in of the training side's threshold activation: act_fn with a float32 buffer `theta` [F]."""

    def __init__(self, theta):
        super().__init__()
        self.register_buffer("theta", theta)

    def forward(self, g):
        return torch.where(g > self.theta, g, 0.0)


def thresholded(model, seed=0):
    """Each MLP's act_fn replaced by ThetaAct with a theta cutting ~70% of the ReLU's actives."""
    gen = torch.Generator().manual_seed(seed)
    for mlp in mlp_modules(model):
        f = mlp.down_proj.weight.shape[1]
        theta = torch.rand(f, generator=gen) * 0.3
        theta[::5] = 0.0
        mlp.act_fn = ThetaAct(theta)
    return model


def test_packed_model_with_thresholds_trains_like_dense():
    """The MLPs' act_fn.theta (read at every forward, moved in place between steps as a controller does)
    reaches the packed FFN: losses, gradients, sparsity stats and logits as the dense model's own forward."""
    def steps(mode):
        model = thresholded(tiny_llama())
        out, packed = train_steps(model, mode, capacity=16)
        return out, packed, model

    dense, _, _ = steps("dense")
    packed, state, model = steps("twell")
    assert state.packed_layers == [0, 1]
    plain, _ = train_steps(tiny_llama(), "dense")
    assert sum(dense[0][2]) < 0.8 * sum(plain[0][2]), "the thresholds cut nothing"
    assert_trains_alike(packed, dense)
    mlp = mlp_modules(model)[0]
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(3))
    with torch.enable_grad():
        before = mlp(x)
        mlp.act_fn.theta.add_(1e4)  # in place, as a controller moves it: the next forward reads the new value
        after = mlp(x)
    assert before.abs().max() > 0 and after.abs().max() == 0


def test_lora_is_refused_with_the_settings_named():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(layers=1), peft.LoraConfig(r=2, target_modules=["gate_proj", "up_proj"]))
    with pytest.raises(SparsifyError, match=r"train.kernels='twell'.*LoRA.*lora.r"):
        packed_ffn(model, "twell")


def test_fused_gate_up_family_matches_dense():
    """Phi-3's fused gate_up_proj: the packed path slices gate (first F rows) and up; same grads as dense."""
    from transformers import Phi3Config, Phi3ForCausalLM

    def model():
        torch.manual_seed(0)
        return Phi3ForCausalLM(Phi3Config(vocab_size=64, hidden_size=16, intermediate_size=48, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, hidden_act="relu",
                                          pad_token_id=0))

    dense, _ = train_steps(model(), "dense", steps=2)
    packed, state = train_steps(model(), "twell", steps=2, capacity=8)
    assert state.packed_layers == [0] and state.layers[0].fused
    for a, b in zip(dense[:-1], packed[:-1]):
        assert a[0] == pytest.approx(b[0], rel=1e-5)
        for name in a[1]:
            assert_close(b[1][name], a[1][name], name, rtol=1e-4, atol=1e-6)


DIST_SCRIPT = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from tests.train.helpers import distributed_worker
distributed_worker({mode!r}, {out!r})
"""


def train_full_batch(model, batches, mode):
    """Two AdamW steps on full batches (the single-process reference of the distributed test)."""
    mlps, _ = packed_ffn(model, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    adamw_steps(model, mlps, opt, batches)
    return model


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_packed_ffn_under_ddp_and_fsdp2(mode, tmp_path):
    """Two gloo ranks, each half the batch, packed FFN under DDP / FSDP2: the weights after two AdamW steps
    equal one process's dense training on the full batches."""
    out, script = tmp_path / "state.pt", tmp_path / "worker.py"
    script.write_text(DIST_SCRIPT.format(root=str(ROOT), mode=mode, out=str(out)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    batches = [torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    want = dict(train_full_batch(tiny_llama(), batches, "dense").named_parameters())
    got = torch.load(out, weights_only=True)
    for name, p in want.items():
        assert_close(got[name], p, f"{mode} {name}", rtol=1e-4, atol=1e-6)


def test_bench_smoke(tmp_path):
    """eval/bench/bench_train_ffn.py --smoke: every code path of the benchmark on tiny CPU shapes."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "eval" / "bench" / "bench_train_ffn.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "TABLE" in proc.stdout and out.is_file()
