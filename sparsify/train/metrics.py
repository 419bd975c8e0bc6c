"""What a run records: metrics.jsonl (+ TensorBoard), one record per logged step with tokens/s and MFU, and the
loss.png / sparsity.png plots drawn from it at the end."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from sparsify.train.config import Recipe
from sparsify.train.distributed import Dist
from sparsify.train.objective import StepStats

if TYPE_CHECKING:
    from sparsify.train.step import Run

# Dense bf16 peak FLOP/s for MFU (NVIDIA datasheets, SXM parts, no sparsity). SPARSIFY_PEAK_TFLOPS overrides.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "4090": 165.0}


class MetricsLog:
    """metrics.jsonl (+ TensorBoard when installed) on rank 0; lines past a resumed step are dropped first."""

    def __init__(self, out: Path, recipe: Recipe, dist: Dist, from_step: int):
        self.path, self.main, self.tb = out / "metrics.jsonl", dist.main, None
        if not self.main:
            return
        if self.path.exists():  # resume: forget what happened after the checkpoint, it is about to be redone
            kept = [json.dumps(r) for r in read_records(self.path) if r["step"] <= from_step]
            tmp = self.path.with_name(self.path.name + ".tmp")  # same folder: os.replace stays one rename
            tmp.write_text("".join(ln + "\n" for ln in kept))
            os.replace(tmp, self.path)  # a kill mid-write leaves the old, untrimmed file, trimmed again next time
        if recipe.output.tensorboard and importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"), purge_step=from_step + 1 if from_step else None)

    def write(self, record: dict) -> None:
        if not self.main:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            self._scalars(record)

    def _scalars(self, record: dict) -> None:
        step = record["step"]
        for key, value in record.items():
            if isinstance(value, (int, float)) and key != "step":
                self.tb.add_scalar(key, value, step)
        for i, z in enumerate(record.get("per_layer", {}).get("zeros", [])):
            self.tb.add_scalar(f"zeros/layer_{i:02d}", z, step)
        for key in ("l1_coef", "theta"):
            for i, c in enumerate(record.get("per_layer", {}).get(key, [])):
                self.tb.add_scalar(f"{key}/layer_{i:02d}", c, step)
        for name, d in record.get("heldout", {}).items():
            for key, value in d.items():
                self.tb.add_scalar(f"heldout/{name}_{key}", value, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_history(out: Path) -> list[dict]:
    """The records of OUT/metrics.jsonl so far ([] for a fresh run)."""
    path = out / "metrics.jsonl"
    return read_records(path) if path.exists() else []


def read_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a line cut short by a kill (the last one) is dropped."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def matmul_params(model: nn.Module) -> int:
    """Weights that take part in a matmul per token (all nn.Linear, lm_head included): 2 FLOPs each forward."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 N for the matmuls + 12 L d T for attention scores (PaLM appendix B)."""
    cfg = model.config
    return 6 * matmul_params(model) + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


def peak_flops(device: torch.device) -> float | None:
    if os.environ.get("SPARSIFY_PEAK_TFLOPS"):
        return float(os.environ["SPARSIFY_PEAK_TFLOPS"]) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf * 1e12 for key, tf in PEAK_TFLOPS.items() if key in name), None)


def step_record(run: Run, sums: dict, stats: StepStats, seconds: float, steps: int, fpt: float) -> dict:
    """One metrics.jsonl line: the last logged window's mean losses and the last step's sparsity."""
    t, dist = run.recipe.train, run.dist
    vals = {k: float(dist.reduce(v / steps, "sum")) / dist.world for k, v in sums.items()}
    coefs = run.l1_weights.coefficients(run.state.step - 1)  # the weights the last step used (target mode: the next's)
    tokens_per_s = steps * t.batch_size * t.grad_accum * dist.world * t.seq_len / max(seconds, 1e-9)
    peak = peak_flops(dist.device)
    record = {"step": run.state.step, "tokens": run.state.tokens, **vals,
              "l1_coef": coefs.mean().item(), "lr": run.schedule.get_last_lr()[0],
              "sparsity": stats.sparsity, "nonzeros": stats.mean_nonzeros, "dead": sum(stats.dead),
              "tokens_per_s": tokens_per_s}
    if peak:
        record["mfu"] = tokens_per_s * fpt / (peak * dist.world)
    record["per_layer"] = {"zeros": stats.zeros, "nonzeros": stats.nonzeros, "dead": stats.dead,
                           "l1_coef": coefs.tolist()}
    if run.thresholds.enabled:  # method threshold: each layer's theta_l (0 until calibrated)
        record["per_layer"]["theta"] = run.thresholds.theta()
    if run.kernels.layers:  # train.kernels twell / auto: the path each layer takes from the next step on
        record["per_layer"]["packed"] = run.kernels.packed
        record["per_layer"]["capacity"] = run.kernels.capacities
    return record


def plot(out: Path, history: list[dict]) -> None:
    """loss.png (loss terms vs tokens, validation perplexity), sparsity.png (zeros and L1 coefficient per layer vs
    tokens) and, with out-of-distribution domains, ood.png (the OOD ratio and zeros vs tokens); nothing without
    matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [h for h in history if "sparsity" in h]
    if train:
        _plot_loss(plt, train, [h for h in history if "val_ppl" in h], out / "loss.png")
        _plot_sparsity(plt, train, out / "sparsity.png")
    ood = [h for h in history if "ood_ratio" in h]
    if train and ood:
        _plot_ood(plt, train, ood, out / "ood.png")
    plt.close("all")


def _plot_ood(plt, train: list[dict], evals: list[dict], path: Path) -> None:
    """The headline against its price: the OOD ratio (and in-distribution ratio) and the zeros, vs tokens."""
    fig, a = plt.subplots(figsize=(7, 4))
    for key, label in (("ood_ratio", "out-of-distribution ratio"), ("id_ratio", "in-distribution ratio")):
        points = [(h["tokens"] / 1e6, h[key]) for h in evals if key in h]
        a.plot(*zip(*points), "o-", label=label)
    # log scale: the bare swap's first evaluation reads hundreds of times the original, the later ones ~1-2x
    a.set(xlabel="tokens (M)", ylabel="perplexity / original's (log)", yscale="log", title="quality kept vs zeros")
    a.axhline(1.0, color="gray", lw=0.8)
    a.legend(loc="upper right")
    b = a.twinx()
    b.plot([h["tokens"] / 1e6 for h in train], [h["sparsity"] for h in train], color="gray", alpha=0.6)
    b.set_ylabel("fraction of zeros (gray)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_loss(plt, train: list[dict], evals: list[dict], path: Path) -> None:
    tokens = [h["tokens"] / 1e6 for h in train]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key in ("loss", "ce", "kd", "mlp"):
        if key in train[-1]:
            a.plot(tokens, [h.get(key, float("nan")) for h in train], label=key)
    a.set(xlabel="tokens (M)", ylabel="loss", title="training loss")
    a.legend()
    b.plot([h["tokens"] / 1e6 for h in evals], [h["val_ppl"] for h in evals], "o-")
    b.set(xlabel="tokens (M)", ylabel="perplexity", yscale="log", title="validation perplexity")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_sparsity(plt, train: list[dict], path: Path) -> None:
    tokens = [h["tokens"] / 1e6 for h in train]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    layers = len(train[-1]["per_layer"]["zeros"])
    color = [plt.cm.viridis(i / max(1, layers - 1)) for i in range(layers)]
    for i in range(layers):
        a.plot(tokens, [h["per_layer"]["zeros"][i] for h in train], color=color[i], lw=0.8)
        b.plot(tokens, [h["per_layer"]["l1_coef"][i] for h in train], color=color[i], lw=0.8)
    a.plot(tokens, [h["sparsity"] for h in train], "k--", lw=2, label="mean over layers")
    a.set(xlabel="tokens (M)", ylabel="fraction of zeros in h", title=f"per-layer sparsity ({layers} layers, "
          "dark = first)")
    a.legend()
    positive = any(c > 0 for h in train for c in h["per_layer"]["l1_coef"])  # (l1 = 0: the no-L1 control)
    b.set(xlabel="tokens (M)", ylabel="L1 coefficient", yscale="log" if positive else "linear",
          title="per-layer L1 coefficient")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
