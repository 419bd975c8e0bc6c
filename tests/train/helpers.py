"""Shared parts of the training tests: the texts, the test recipe, running the CLI (one process or torchrun on 2
gloo processes) and comparing two runs' metrics. The tiny model and its tokens are fixtures (conftest.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
