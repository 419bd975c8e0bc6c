"""One optimizer step and one evaluation pass: the run's objects (Run), the loss, the compute context."""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from sparsify.train.config import Recipe
from sparsify.train.distributed import Dist
from sparsify.train.mlp import TrainMLPs
from sparsify.train.model import DecayToStart, load_teacher
from sparsify.train.objective import L1Control, Plateau, SparsityCounts, ThresholdControl
from sparsify.train.packed_ffn import PackedFFN


@dataclass
class TrainState:
    """Everything about progress that is not a tensor; saved in every checkpoint."""

    step: int = 0  # optimizer steps done
    samples: int = 0  # training sequences consumed, all processes together: the data position
    tokens: int = 0  # training tokens consumed (samples * seq_len)
    stopped: str = ""  # why the run ended (budget / plateau)


@dataclass(kw_only=True)
class Run:
    """The objects of one run, by their role in it (finetune._setup builds it)."""

    recipe: Recipe
    dist: Dist
    data: Any  # sparsify.train.data.TokenData
    model_dir: Path | None = None  # the ReLU folder trained (the original dense model is rebuilt from it)
    # the models
    student: nn.Module  # the model trained, unwrapped (a peft model with LoRA); its MLPs are mlps.layers
    wrapped: nn.Module  # what training forwards and backwards go through: the student under DDP / FSDP / compile
    teacher: nn.Module | None = None  # the original dense model (distill.kd > 0 or distill.mlp > 0)
    mlps: TrainMLPs  # the student's training-time MLPs: the activation, and what each forward gives the loss
    # the objective
    logit_losses: Callable  # (logits, targets, teacher logits, temperature) -> (ce, kd); `losses`, maybe compiled
    l1_weights: L1Control  # the per-layer L1 coefficients (fixed, or driven to sparsity.target)
    thresholds: ThresholdControl  # sparsity.method=threshold: theta per layer and its controller (else disabled)
    counts: SparsityCounts  # the step's non-zeros and fired neurons, summed over its micro-batches
    kernels: PackedFFN  # train.kernels: which MLPs train on the packed FFN kernels, and their capacity
    # the optimizer
    optimizer: torch.optim.Optimizer
    schedule: Any  # the learning-rate schedule (LambdaLR)
    decay_to_start: DecayToStart | None = None  # train.weight_decay_to=start
    # progress
    state: TrainState = field(default_factory=TrainState)
    plateau: Plateau  # the stop rule on the zeros
    reference: dict[str, float] = field(default_factory=dict)  # the original model's loss per evaluated text
    verbose: bool = True  # a line per logged step (when no progress bar) and per validation, on stderr


def losses(logits: torch.Tensor, targets: torch.Tensor, teacher_logits: torch.Tensor | None,
           temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy and KL(teacher || student), both fp32, averaged over tokens. logits: [B, T, V]."""
    flat = logits.flatten(0, 1).float()  # [B*T, V]
    ce = F.cross_entropy(flat, targets.flatten())
    if teacher_logits is None:
        return ce, torch.zeros((), device=ce.device)
    s = F.log_softmax(flat / temperature, -1)  # [B*T, V]
    t = F.log_softmax(teacher_logits.flatten(0, 1).float() / temperature, -1)  # [B*T, V]
    kd = F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2
    return ce, kd


def compute_context(run: Run) -> contextlib.ExitStack:
    """bf16 autocast and the attention kernel order of the recipe, around every forward (and its backward)."""
    stack = contextlib.ExitStack()
    if run.dist.device.type == "cuda":
        if run.recipe.train.bf16:
            stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
        order = attention_order(run.recipe.train.attention, run.dist.device)
        if order is not None:
            from torch.nn.attention import sdpa_kernel

            stack.enter_context(sdpa_kernel(order, set_priority=True))
    return stack


def attention_order(choice: str, device: torch.device) -> list | None:
    """SDPA backends, preferred first (all kept: one that cannot serve a shape falls through); None = torch's."""
    from torch.nn.attention import SDPBackend

    if choice == "auto":
        # cuDNN's fused attention beats the FlashAttention-2 backend on training shapes on Hopper only
        # (transformers PR #48163)
        hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
        choice = "cudnn" if hopper else None
    if choice is None:
        return None
    first = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[choice]
    rest = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return [first] + [b for b in rest if b != first]


def train_step(run: Run) -> dict[str, torch.Tensor]:
    """One optimizer step over grad_accum micro-batches; returns the step's mean loss terms (device tensors)."""
    t, d, dist = run.recipe.train, run.recipe.distill, run.dist
    run.mlps.set_step(run.state.step)  # sparsity.blend_steps: the blend's alpha for this step
    if run.thresholds.due(run.state.tokens):
        calibrate_thresholds(run)
    coef = run.l1_weights.coefficients(run.state.step)  # [L]
    keys = ("loss", "ce", "l1", "kd") + (("mlp",) if d.mlp > 0 else ())
    sums = {k: torch.zeros((), device=dist.device) for k in keys}
    kd_on = run.teacher is not None and d.kd > 0
    for micro in range(t.grad_accum):
        first = run.state.samples + (micro * dist.world + dist.rank) * t.batch_size
        batch = run.data.train_batch(first, t.batch_size)  # [B, T+1]
        if dist.device.type == "cuda":  # pinned: the copy overlaps the previous micro-batch's kernels
            batch = batch.pin_memory().to(dist.device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]  # [B, T]
        last = micro == t.grad_accum - 1
        sync = contextlib.nullcontext() if last or not hasattr(run.wrapped, "no_sync") else run.wrapped.no_sync()
        with sync, compute_context(run):
            teacher_logits = None
            if kd_on:
                with torch.no_grad():
                    teacher_logits = run.teacher(input_ids=inputs).logits  # [B, T, V]
            run.mlps.start()
            logits = run.wrapped(input_ids=inputs).logits  # [B, T, V]
            ffn = run.mlps.take()  # per layer: l1 [L], nonzeros [L], fired [L, F], distance [L] (distill.mlp)
            run.counts.add_forward(ffn.nonzeros, ffn.fired, tokens=inputs.numel())
            ce, kd = run.logit_losses(logits, targets, teacher_logits, d.temperature)
            loss = d.ce * ce + (coef * ffn.l1).mean() + d.kd * kd
            terms = {"ce": ce, "l1": ffn.l1.mean(), "kd": kd}  # l1 logged before weighting, mean over layers
            if d.mlp > 0:
                terms["mlp"] = ffn.distance.mean()
                loss = loss + d.mlp * terms["mlp"]
            (loss / t.grad_accum).backward()
        for k, v in {"loss": loss, **terms}.items():
            sums[k] += v.detach() / t.grad_accum
    if t.clip > 0:
        sums["grad_norm"] = _clip(run, t.clip)
    run.optimizer.step()
    if run.decay_to_start is not None:
        run.decay_to_start.step(run.optimizer.param_groups[0]["lr"])  # the matrices' group
    run.schedule.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.state.step += 1
    run.state.samples += t.batch_size * t.grad_accum * dist.world
    run.state.tokens += t.batch_size * t.grad_accum * dist.world * t.seq_len
    return sums


def calibrate_thresholds(run: Run) -> None:
    """sparsity.method=threshold, at the end of the L1 warm-up: theta of every layer from one eager, no-grad forward
    of this step's first micro-batch (every process its own, averaged), then the L1 penalty is off."""
    t, dist = run.recipe.train, run.dist
    full = run.data.train_batch(run.state.samples + dist.rank * t.batch_size, t.batch_size).to(dist.device)
    batch, targets = full[:, :-1], full[:, 1:]  # [B, T]

    def forward() -> torch.Tensor:
        was_training = run.student.training
        run.student.eval()  # (no dropout in what is measured)
        try:
            with compute_context(run), torch.compiler.set_stance("force_eager"):  # a compiled model runs as is
                return run.student(input_ids=batch).logits  # [B, T, V]
        finally:
            run.student.train(was_training)

    def loss() -> torch.Tensor:  # (sparsity.allocate=sensitivity: the batch's loss under trial thresholds)
        return F.cross_entropy(forward().flatten(0, 1).float(), targets.flatten())

    run.thresholds.calibrate(forward, dist.reduce if dist.world > 1 else None, run.state.tokens, loss=loss)
    run.l1_weights.stop()
    if dist.main and run.verbose:
        if run.recipe.sparsity.allocate == "sensitivity":
            chosen = " ".join(f"{z:.3f}" for z in run.thresholds.target.tolist())
            print(f"step {run.state.step}: zeros allocated by sensitivity (mean {float(run.thresholds.target.mean()):.4f}"
                  f"), layer 0 first: {chosen}", file=sys.stderr)
        theta = run.thresholds.theta()
        ramp = run.recipe.sparsity.threshold_ramp
        aim = "the targets" if run.thresholds.start is run.thresholds.target else \
            f"the warm-up's zeros, rising to the targets over {ramp:,} tokens"
        print(f"step {run.state.step}: thresholds calibrated to {aim} (theta {min(theta):.3g}..{max(theta):.3g}, "
              f"{run.recipe.sparsity.threshold} mode); the L1 penalty is off from here", file=sys.stderr)


def _clip(run: Run, clip: float) -> torch.Tensor:
    norm = torch.nn.utils.clip_grad_norm_([p for p in run.student.parameters() if p.requires_grad], clip)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor


@torch.no_grad()
def evaluate(run: Run, model: nn.Module, domain: str | None = None) -> float:
    """Mean next-token cross-entropy over eval_batches micro-batches per rank (a fixed set, split over ranks), on
    the validation text, or on held-out domain `domain` (data.heldout).

    The windows are the training ones: non-overlapping, seq_len tokens, so a token has seq_len/2 tokens of
    context on average. `sparsify eval` scores the same text with sliding windows (>= window/2 context), so
    its perplexity reads lower. Both are right for what they measure; compare runs with the same one."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, device=run.dist.device, dtype=torch.float64)  # [loss sum, token count]
    t, dist = run.recipe.train, run.dist
    batches = run.data.validation_batches(t.batch_size, t.eval_batches, dist.rank, dist.world) if domain is None \
        else run.data.heldout_batches(domain, t.batch_size, t.eval_batches, dist.rank, dist.world)
    for batch in batches:
        batch = batch.to(run.dist.device)  # [B, T+1]
        with compute_context(run):
            logits = model(input_ids=batch[:, :-1]).logits  # [B, T, V]
        total[0] += F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum").double()
        total[1] += batch[:, 1:].numel()
    total = dist.reduce(total, "sum")
    model.train(was_training)
    return float(total[0] / total[1])


def evaluate_all(run: Run, log: Any, history: list[dict], first: bool = False) -> None:
    """Validation loss of the model being trained, and its loss on every held-out domain (data.heldout), each
    also as a perplexity ratio to the original dense model, which is evaluated on the same text once, on the
    first call (a resumed run reads those numbers back from metrics.jsonl). `log` is the run's MetricsLog."""
    loss = evaluate(run, run.student)
    record = {"step": run.state.step, "tokens": run.state.tokens, "val_loss": loss, "val_ppl": math.exp(loss)}
    if first:
        record.update(_reference_record(run))
    elif not run.reference:
        run.reference = _reference_from(history)
    if "validation" in run.reference:
        record["val_ppl_ratio"] = math.exp(loss - run.reference["validation"])
    if run.data.domains:
        record["heldout"] = {}
        for name in run.data.domains:
            dl = evaluate(run, run.student, name)
            record["heldout"][name] = {"loss": dl, "ppl": math.exp(dl)}
            if name in run.reference:
                record["heldout"][name]["ratio"] = math.exp(dl - run.reference[name])
        record.update(headline_ratios(record["heldout"], run.recipe.data.ood))
    log.write(record)
    history.append(record)
    if run.dist.main and run.verbose:
        print(_evaluation_line(record), file=sys.stderr)


def headline_ratios(heldout: dict, ood: list[str]) -> dict:
    """`ood_ratio` (the headline) and `id_ratio`: geometric means of the perplexity ratios to the original model
    over the out-of-distribution domains (data.ood) and over the other, in-distribution held-out domains."""
    out = {}
    for key, names in (("ood_ratio", [n for n in heldout if n in ood]), ("id_ratio", [n for n in heldout if n not in ood])):
        ratios = [heldout[n]["ratio"] for n in names if "ratio" in heldout[n]]
        if ratios and len(ratios) == len(names):
            out[key] = statistics.geometric_mean(ratios)
    return out


def _evaluation_line(record: dict) -> str:
    ratio = f" ({record['val_ppl_ratio']:.3f}x the original)" if "val_ppl_ratio" in record else ""
    extra = f", original dense model {record['teacher_val_ppl']:.2f}" if "teacher_val_ppl" in record else ""
    domains = "".join(f"; {name} {d['ppl']:.2f}" + (f" ({d['ratio']:.3f}x)" if "ratio" in d else "")
                      for name, d in record.get("heldout", {}).items())
    headline = "".join(f"; {label} {record[key]:.3f}x" for key, label in (("ood_ratio", "OOD ratio"),
                                                                          ("id_ratio", "in-distribution ratio"))
                       if key in record)
    return f"[step {record['step']}] validation perplexity {record['val_ppl']:.2f}{ratio}{extra}{headline}{domains}"


def _reference_record(run: Run) -> dict:
    """The original dense model's validation and held-out losses, as first-evaluation fields; sets run.reference.

    The teacher when distilling; otherwise, when there are held-out domains to compare, the original is rebuilt
    from the trained folder for this one evaluation (without domains, a kd = 0 run skips it)."""
    teacher = run.teacher
    if teacher is None and run.data.domains and run.model_dir is not None:
        teacher = load_teacher(run.model_dir, run.dist, run.recipe.train.seq_len)
    if teacher is None:
        return {}
    run.reference = {"validation": evaluate(run, teacher)}
    run.reference.update({name: evaluate(run, teacher, name) for name in run.data.domains})
    if teacher is not run.teacher:
        del teacher
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    fields = {"teacher_val_loss": run.reference["validation"], "teacher_val_ppl": math.exp(run.reference["validation"])}
    if run.data.domains:
        fields["teacher_heldout"] = {name: {"loss": run.reference[name], "ppl": math.exp(run.reference[name])}
                                     for name in run.data.domains}
    return fields


def _reference_from(history: list[dict]) -> dict[str, float]:
    """run.reference as the first evaluation of this run recorded it (for a resumed run)."""
    first = next((h for h in history if "teacher_val_loss" in h), None)
    if first is None:
        return {}
    return {"validation": first["teacher_val_loss"],
            **{name: d["loss"] for name, d in first.get("teacher_heldout", {}).items()}}
