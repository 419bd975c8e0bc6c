"""Shared parts of the training tests: the texts, the test recipe, running the CLI (one process or torchrun on 2
gloo processes) and comparing two runs' metrics; the packed-FFN tests' tiny ReLU Llama, its training MLPs and the
rank of their distributed test (run by torchrun from a script). The tiny SiLU model and its tokens are fixtures
(conftest.py)."""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TRAIN_TEXT = REPO / "sparsify" / "corpus" / "python-tutorial.txt"
VALID_TEXT = REPO / "sparsify" / "corpus" / "python-howto-heldout.txt"
STEPS = 40


def recipe_dict(source: Path, out: Path, keep: bool = False, tokens: Path | None = None, outputs: bool = False,
                **train) -> dict:
    """The test recipe: `tokens` (a prepared folder) in place of the text when given; `outputs`: plots and
    TensorBoard too (off where a test does not look at them: they cost seconds per run)."""
    data = {"train": [str(tokens)]} if tokens else {"train": [str(TRAIN_TEXT)], "validation": [str(VALID_TEXT)]}
    return {
        "model": {"source": str(source)},
        "data": {**data, "num_proc": 1},
        "sparsity": {"l1": 0.05, "normalization": "sum_hidden", "reinit_dead": True},
        "distill": {"kd": 1.0},
        "train": {"max_steps": STEPS, "seq_len": 32, "batch_size": 2, "lr": 3e-3, "warmup_steps": 4,
                  "save_every": 10, "log_every": 5, "eval_batches": 2, **train},
        "output": {"dir": str(out), "plots": outputs, "tensorboard": outputs, "keep_checkpoints_when_done": keep},
    }


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def cli(args: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "sparsify", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def torchrun(path: Path, *extra: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "sparsify", "finetune", "--no-progress", *extra, str(path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def assert_same_run(ref: list[dict], got: list[dict], rel: float) -> None:
    assert [m["step"] for m in got] == [m["step"] for m in ref]
    for a, b in zip(ref, got):
        key = "loss" if "loss" in a else "val_loss"
        assert b[key] == pytest.approx(a[key], rel=rel, abs=0), (a["step"], key, a[key], b[key])


# ------------------------------------------------------------------- the packed FFN's tiny models
def tiny_llama(layers=2, hidden=16, f=48, seed=0):
    """A random ReLU Llama (vocab 64) of `layers` layers, hidden `hidden`, F = `f`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=f, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, hidden_act="relu")
    return LlamaForCausalLM(cfg)


def packed_ffn(model, mode, normalization="sum_hidden"):
    """The model's training MLPs, and train.kernels=`mode` over them (as finetune sets them up)."""
    from sparsify.train.config import SparsitySection
    from sparsify.train.mlp import TrainMLPs
    from sparsify.train.packed_ffn import PackedFFN

    mlps = TrainMLPs(model, SparsitySection(normalization=normalization))
    return mlps, PackedFFN(mlps.layers, mode)


def l1_of(mlps, counts, tokens):
    """Ends a recorded forward: its L1 terms summed over layers; its counts added to the step's."""
    terms = mlps.take()
    counts.add_forward(terms.nonzeros, terms.fired, tokens)
    return terms.l1.sum()


def adamw_steps(train, mlps, opt, batches) -> None:
    """One AdamW step per batch of `train` (the model, or its DDP / FSDP wrapper): CE + 0.05 x the MLPs' L1."""
    from sparsify.train.objective import SparsityCounts

    for ids in batches:
        mlps.start()
        logits = train(input_ids=ids[:, :-1]).logits
        l1 = l1_of(mlps, SparsityCounts(), ids[:, :-1].numel())
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()) + 0.05 * l1
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def distributed_worker(mode, out):
    """One rank of test_packed_ffn_under_ddp_and_fsdp2: half of every batch, packed FFN, DDP or FSDP2."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = tiny_llama()
    batches = [torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    halves = [b[2 * rank: 2 * rank + 2] for b in batches]
    mlps, _ = packed_ffn(model, "twell")
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        train = model
    else:
        train = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    adamw_steps(train, mlps, opt, halves)
    state = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
             for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(state, out)
    # DDP's reducer must go before its process group: destroyed after it, gloo's teardown hung now and then
    # (3 of ~40 runs here; faulthandler showed the main thread past this function's return, in C++ teardown)
    del train, model, opt
    gc.collect()
    dist.destroy_process_group()
