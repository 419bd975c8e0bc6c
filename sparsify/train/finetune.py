"""finetune: continued pretraining of a ReLU model with an L1 penalty on h until its sparsity stabilises.

    sparsify finetune recipes/smollm2-135m.yaml train.max_tokens=20_000_000 sparsity.l1=2e-2
    torchrun --nproc_per_node 8 -m sparsify finetune recipes/mistral-7b-fsdp.yaml

One loop, top to bottom (`finetune`): prepare the model (a SiLU source is converted first) and the data,
optionally load the original dense model as distillation teacher, then per optimizer step: grad_accum
micro-batches of cross-entropy + l1(step) * L1(h) + kd * KL(teacher || student), clip, AdamW, cosine
schedule, dead-neuron re-init; log, evaluate, checkpoint; stop at the step/token budget or when sparsity
plateaus; export the final model folder (convert format, recipe.yaml + sparsity.json inside). SIGTERM (a
scheduler's or `timeout`'s stop) or a first Ctrl-C ends the run at the next step with a checkpoint of that step,
so `--resume` loses nothing; a second Ctrl-C interrupts at once.

Output folder:
    converted/        the ReLU model the run started from (when the source had to be converted)
    data/             tokenised text (reusable as data.train of another run)
    checkpoints/step-N/ state.pt (model, optimizer, RNG: tensors only, loaded with weights_only=True) and
                      meta.json (step, data position, scheduler, plateau, recipe), written atomically
    metrics.jsonl     one line per logged step ("step", "tokens", "loss", "l1", "sparsity", per layer ...)
                      and per evaluation ("val_loss", "val_ppl", ...)
    tensorboard/, loss.png, sparsity.png, recipe.yaml, model/ (the result)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import pickle
import random
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sparsify import __version__
from sparsify.errors import SparsifyError
from sparsify.train.profiling import StepProfiler
from sparsify.train.config import Recipe, dump_recipe, format_help, load_recipe, raise_problems, recipe_problems
from sparsify.sources import local_config
from sparsify.train.objective import ActivationBlend, L1Control, Plateau, SparsityProbe, StepStats, reinit_dead

# Dense bf16 peak FLOP/s for MFU (NVIDIA datasheets, SXM parts, no sparsity). SPARSIFY_PEAK_TFLOPS overrides.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "4090": 165.0}


# ------------------------------------------------------------------------------------------ run context


@dataclass
class Dist:
    """Where this process sits: rank/world under torchrun, else 0/1."""

    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """All-reduce (sum or max) of a copy of `t`; identity on one process."""
        if self.world == 1:
            return t
        t = t.clone()
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM if op == "sum" else torch.distributed.ReduceOp.MAX)
        return t


@dataclass
class TrainState:
    """Everything about progress that is not a tensor; saved in every checkpoint."""

    step: int = 0  # optimizer steps done
    samples: int = 0  # training sequences consumed, all processes together: the data position
    tokens: int = 0  # training tokens consumed (samples * seq_len)
    stopped: str = ""  # why the run ended (budget / plateau)


class RunStopped(SparsifyError):
    """The run stopped on a signal after writing a checkpoint; the CLI exits 128 + the signal's number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class StopRequest:
    """SIGTERM or a first SIGINT, caught: the training loop stops at its next step boundary and checkpoints.

    Under torchrun the agent forwards the signal to every rank (the workers run in their own sessions), not
    necessarily before the same step, so ranks agree at logged steps (a max-reduce of the flag, where the
    logging already synchronises); one process checks after every step. The agent kills its workers 30 s after
    forwarding (its shutdown timeout), so train.log_every steps plus a checkpoint must fit in that.
    A second SIGINT raises KeyboardInterrupt as usual. Handlers can only be set from the main thread.
    """

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._previous[s] = signal.signal(s, self._catch)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _catch(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.signum:
            raise KeyboardInterrupt
        self.signum = self.signum or signum

    def due(self, dist: Dist, step: int, log_every: int) -> int:
        """The signal to stop on now (0: none), the same on every rank."""
        if dist.world == 1:
            return self.signum
        if step % log_every:
            return 0
        return int(dist.reduce(torch.tensor([self.signum], device=dist.device), "max").item())


def _init_distributed() -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world == 1:
        return Dist(device=torch.device("cuda" if cuda else "cpu"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend="nccl" if cuda else "gloo")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    return Dist(rank=torch.distributed.get_rank(), world=world, device=device)


# ------------------------------------------------------------------------------------------ model


def prepare_model(recipe: Recipe, out: Path, dist: Dist, progress: bool = True) -> Path:
    """A ReLU model folder to train: the source itself when already ReLU, else its conversion in OUT/converted."""
    from sparsify.families import activation_of
    from sparsify.folder.convert import convert

    source = recipe.model.source  # convert resolves the alias; its provenance keeps the name, not a local path
    config = local_config(source)
    if config is not None and activation_of(config) == "relu":
        return Path(source).expanduser()
    target = out / "converted"
    done = target / "config.json"
    if dist.main and not (done.is_file() and json.loads(done.read_text()).get("sparsify", {}).get("source") == source):
        convert(source, target, revision=recipe.model.revision, overwrite=True, progress=progress)
    dist.barrier()
    return target


# Training and validation batches are packed windows of text with no padding, so attention is plain causal.
# Under torch.compile (torch < 2.14) transformers' "sdpa" cannot prove its mask away and materialises a
# [B, 1, T, T] mask: SDPA then computes every score (no is_causal, no FlashAttention); on the H200 attention
# took 45% of a SmolLM2-135M step (eval/results/finetune-h200/trainbench-r1). This implementation is the
# same SDPA call with no mask at all, so SDPA runs is_causal=True. Only for the models trained here (and not
# for sliding-window layers, see training_attention): exported folders keep "sdpa".
CAUSAL_SDPA = "sparsify_causal_sdpa"


def register_causal_sdpa() -> str:
    """Registers CAUSAL_SDPA with transformers (idempotent) and returns its name for attn_implementation."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(CAUSAL_SDPA, _no_mask)
    return CAUSAL_SDPA


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None  # SDPA with attn_mask=None and more than one query: is_causal=True


def training_attention(config: Any, seq_len: int) -> str:
    """CAUSAL_SDPA when every layer attends causally over the whole training window; stock "sdpa" (its mask,
    slower under compile but exact) when some layer has a sliding window shorter than seq_len (Gemma 2/3,
    Mistral v0.1, ...): dropping the mask there would train another model than the one exported."""
    layer_types = getattr(config, "layer_types", None) or []
    if layer_types and all(t == "full_attention" for t in layer_types):
        return register_causal_sdpa()
    window = getattr(config, "sliding_window", None)
    if window is None or window >= seq_len or getattr(config, "use_sliding_window", True) is False:
        return register_causal_sdpa()
    return "sdpa"


def load_student(model_dir: Path, recipe: Recipe, dist: Dist) -> nn.Module:
    """The stock transformers class of the ReLU folder in fp32 (master weights), LoRA and checkpointing applied."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(recipe.train.seed)  # LoRA adapter init
    attention = training_attention(AutoConfig.from_pretrained(model_dir), recipe.train.seq_len)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention)
    model.config.use_cache = False
    if recipe.train.gradient_checkpointing:
        # non-reentrant: the L1 term reads h inside checkpointed layers, which needs grad-enabled forward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if recipe.lora.r > 0:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=recipe.lora.r, lora_alpha=recipe.lora.alpha, lora_dropout=recipe.lora.dropout,
                          target_modules=list(recipe.lora.target_modules), task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    freeze(model, recipe.train.freeze)
    return model.to(dist.device)


def freeze(model: nn.Module, patterns: list[str]) -> None:
    """train.freeze: parameters whose names match a glob pattern are not trained (a pattern matching nothing
    is an error: it is a typo, or names another family's modules)."""
    import fnmatch

    if not patterns:
        return
    names = [name for name, _ in model.named_parameters()]
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched:
        raise SparsifyError(f"train.freeze: {unmatched} match no parameter of the model; names look like "
                            f"{names[len(names) // 2]!r} (e.g. '*.self_attn.*' for attention).")
    for name, param in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            param.requires_grad_(False)


def load_teacher(model_dir: Path, dist: Dist, seq_len: int) -> nn.Module:
    """The original dense model: the same weights with the source activation put back (no second download)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sparsify.families import family_for

    config = json.loads((model_dir / "config.json").read_text())
    original = config.get("sparsify", {}).get("source_activation")
    if not original or original == "relu":
        raise SparsifyError(f"distill.kd > 0 needs the original dense model, but {model_dir} does not record a "
                            "non-ReLU source activation (config.json sparsify.source_activation). Give the SiLU "
                            "source as model.source (it is converted first), or set distill.kd=0.")
    field_name = family_for(config).act_field
    cfg = AutoConfig.from_pretrained(model_dir, **{field_name: original})
    dtype = torch.bfloat16 if dist.device.type == "cuda" else torch.float32
    teacher = AutoModelForCausalLM.from_pretrained(model_dir, config=cfg, dtype=dtype,
                                                   attn_implementation=training_attention(cfg, seq_len))
    teacher.config.use_cache = False
    return teacher.to(dist.device).eval().requires_grad_(False)


def wrap_model(model: nn.Module, recipe: Recipe, dist: Dist) -> nn.Module:
    """DDP or FSDP2 under torchrun; torch.compile when asked. Returns the module to call for training.

    Compilation is in place (parameter names, hence checkpoints and optimizer state, stay unprefixed); FSDP2
    shards first and compiles the sharded model, DDP wraps the compiled one (both are the documented orders).
    """
    fsdp = dist.world > 1 and recipe.train.distributed == "fsdp"
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in _decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
    if recipe.train.compile:
        model.compile()
    if dist.world == 1 or fsdp:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    from sparsify.families import mlp_modules

    mlps = set(map(id, mlp_modules(model)))
    return [m for m in model.modules() if any(id(c) in mlps for c in m.children())]


def build_optimizer(model: nn.Module, recipe: Recipe, total_steps: int, dist: Dist):
    """AdamW (fused on CUDA) with decay on matrices only; linear warm-up then cosine to lr * min_lr_ratio."""
    t = recipe.train
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    fused = {"fused": True} if dist.device.type == "cuda" else {}
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), **fused)

    def lr_factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / (t.warmup_steps + 1)
        progress = min(1.0, (step - t.warmup_steps) / max(1, total_steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)


def total_steps_of(recipe: Recipe, dist: Dist) -> int:
    t = recipe.train
    per_step = t.batch_size * t.grad_accum * dist.world * t.seq_len
    budget = [t.max_steps] if t.max_steps is not None else []
    if t.max_tokens is not None:
        budget.append(math.ceil(t.max_tokens / per_step))
    return min(budget)


# ------------------------------------------------------------------------------------------ one step


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


@dataclass
class Run:
    """The objects of one run, passed around instead of a dozen arguments."""

    recipe: Recipe
    dist: Dist
    model: nn.Module  # unwrapped (peft model when LoRA)
    train_model: nn.Module  # what forward/backward go through (DDP / FSDP / compiled)
    teacher: nn.Module | None
    probe: SparsityProbe
    data: Any  # sparsify.train.data.TokenData
    opt: torch.optim.Optimizer
    sched: Any
    state: TrainState
    plateau: Plateau
    loss_fn: Any
    l1: L1Control  # the per-layer L1 coefficients (fixed, or driven to sparsity.target)
    ffn: Any = None  # sparsify.train.packed_ffn.PackedFFN: which layers train on the packed FFN kernels
    blend: ActivationBlend | None = None  # sparsity.blend_steps: source activation -> ReLU over the first steps
    model_dir: Path | None = None  # the ReLU folder trained (the original dense model is rebuilt from it)
    reference: dict[str, float] = field(default_factory=dict)  # the original model's loss per evaluated text
    verbose: bool = True  # a line per logged step (when no progress bar) and per validation, on stderr


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
        # cuDNN's fused attention is reported 1.7-2.3x faster than the FlashAttention-2 backend for training
        # shapes on Hopper and slower elsewhere (transformers PR #48163); our H200 runs use it (trainbench-r3:
        # 25.6 ms of a 100 ms step), a same-run comparison with flash is not recorded yet.
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
    t, dist = run.recipe.train, run.dist
    run.blend.set_step(run.state.step)
    coef = run.l1.coefficients(run.state.step)  # [L]
    sums = {k: torch.zeros((), device=dist.device) for k in ("loss", "ce", "l1", "kd")}
    for micro in range(t.grad_accum):
        first = run.state.samples + (micro * dist.world + dist.rank) * t.batch_size
        batch = run.data.train_batch(first, t.batch_size)  # [B, T+1]
        if dist.device.type == "cuda":  # pinned: the copy overlaps the previous micro-batch's kernels
            batch = batch.pin_memory().to(dist.device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]  # [B, T]
        last = micro == t.grad_accum - 1
        sync = contextlib.nullcontext() if last or not hasattr(run.train_model, "no_sync") else run.train_model.no_sync()
        with sync, compute_context(run):
            teacher_logits = None
            if run.teacher is not None:
                with torch.no_grad():
                    teacher_logits = run.teacher(input_ids=inputs).logits  # [B, T, V]
            run.probe.start()
            logits = run.train_model(input_ids=inputs).logits  # [B, T, V]
            l1 = run.probe.take(tokens=inputs.numel())  # [L]
            ce, kd = run.loss_fn(logits, targets, teacher_logits, run.recipe.distill.temperature)
            loss = ce + (coef * l1).mean() + run.recipe.distill.kd * kd
            l1 = l1.mean()  # logged: the penalty before weighting, mean over layers
            (loss / t.grad_accum).backward()
        for k, v in (("loss", loss), ("ce", ce), ("l1", l1), ("kd", kd)):
            sums[k] += v.detach() / t.grad_accum
    if t.clip > 0:
        sums["grad_norm"] = _clip(run, t.clip)
    run.opt.step()
    run.sched.step()
    run.opt.zero_grad(set_to_none=True)
    run.state.step += 1
    run.state.samples += t.batch_size * t.grad_accum * dist.world
    run.state.tokens += t.batch_size * t.grad_accum * dist.world * t.seq_len
    return sums


def _clip(run: Run, clip: float) -> torch.Tensor:
    norm = torch.nn.utils.clip_grad_norm_([p for p in run.model.parameters() if p.requires_grad], clip)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor


@torch.no_grad()
def evaluate(run: Run, model: nn.Module, domain: str | None = None) -> float:
    """Mean next-token cross-entropy over eval_batches micro-batches per rank (a fixed set, split over ranks), on
    the validation text, or on held-out domain `domain` (data.heldout).

    The windows are the training ones: non-overlapping, seq_len tokens, so a token has seq_len/2 tokens of
    context on average. `sparsify eval` scores the same text with sliding windows (>= window/2 context), so
    its perplexity reads lower (SmolLM2-135M on the demo's held-out text, first 2048 tokens: 28.6 here with
    seq_len 128, 14.0 in eval). Both are right for what they measure; compare runs with the same one."""
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


# ------------------------------------------------------------------------------------------ checkpoints


def _full_state(run: Run) -> tuple[dict, dict]:
    """Full (unsharded) model and optimizer state dicts on the CPU; collective under FSDP."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(run.model, run.opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


CHECKPOINT_FORMAT = "sparsify-checkpoint/2"


def save_checkpoint(run: Run, out: Path) -> Path:
    """OUT/checkpoints/step-N/{state.pt, meta.json}, written atomically by rank 0; keeps the newest keep_checkpoints.

    state.pt holds only tensors in plain containers (model, optimizer, RNG states as tensors), so it loads with
    torch.load(weights_only=True) and resuming never unpickles code; meta.json holds the rest (step, data
    position, scheduler, plateau history, recipe).
    """
    from sparsify.folder.format import atomic_dir

    model_sd, optim_sd = _full_state(run)
    folder = out / "checkpoints" / f"step-{run.state.step:08d}"
    if run.dist.main:
        np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
        py_version, py_state, py_gauss = random.getstate()
        rng = {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(np_keys.astype(np.int64)),
               "python": torch.tensor(py_state, dtype=torch.int64),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
        meta = {"format": CHECKPOINT_FORMAT, "state": asdict(run.state), "scheduler": run.sched.state_dict(),
                "plateau": run.plateau.state_dict(), "l1_control": run.l1.state_dict(),
                "train_kernels": run.ffn.state_dict(),
                "recipe": dump_recipe(run.recipe), "world": run.dist.world,
                "version": __version__, "rng": {"numpy": [np_name, np_pos, np_has_gauss, np_gauss],
                                                "python": [py_version, py_gauss]}}
        with atomic_dir(folder, overwrite=True) as tmp:
            torch.save({"model": model_sd, "optimizer": optim_sd, "rng": rng}, tmp / "state.pt")
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        for old in _checkpoints(out)[: -run.recipe.train.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    run.dist.barrier()
    return folder


def _checkpoints(out: Path) -> list[Path]:
    return sorted(p for p in (out / "checkpoints").glob("step-*") if (p / "state.pt").is_file())


def resumable_recipe(out: Path) -> str | None:
    """The recipe (YAML) of the newest checkpoint in output folder `out`; None when none can be resumed."""
    found = _checkpoints(out)
    try:
        return read_checkpoint_meta(found[-1])["recipe"] if found else None
    except SparsifyError:
        return None


def read_checkpoint_meta(folder: Path) -> dict:
    """meta.json of a checkpoint; refuses checkpoints of another format (older ones were one pickle)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        meta = {}
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise SparsifyError(
            f"{folder} is not a checkpoint this sparsify can resume (no meta.json of format {CHECKPOINT_FORMAT}; "
            "older checkpoints were one pickled file, which can run code when loaded). Start the run over with "
            "output.overwrite=true, or set another output.dir.")
    return meta


def read_checkpoint_tensors(folder: Path) -> dict:
    """state.pt of a checkpoint, loaded with weights_only=True: tensors and plain containers only.

    Every rank maps the same file (mmap: one copy in the page cache, not one per rank).
    """
    path = folder / "state.pt"
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        detail = str(err).split("WeightsUnpickler error:")[-1].strip().splitlines()[0]
        raise SparsifyError(
            f"refusing to load {path}: it holds pickled Python objects, not only tensors and plain containers "
            f"({detail}). sparsify checkpoints never do, and unpickling such a file can run arbitrary code. "
            "Resume only from checkpoints written by sparsify; otherwise start over with output.overwrite=true or "
            "another output.dir.") from None


def load_checkpoint(run: Run, folder: Path) -> None:
    """Restores everything save_checkpoint wrote."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    meta, blob = read_checkpoint_meta(folder), read_checkpoint_tensors(folder)
    # under FSDP each rank keeps its own shard of the full tensors
    opts = StateDictOptions(full_state_dict=True)
    set_state_dict(run.model, run.opt, model_state_dict=blob["model"], optim_state_dict=blob["optimizer"], options=opts)
    run.sched.load_state_dict(meta["scheduler"])
    run.state = TrainState(**meta["state"])
    run.plateau.load_state_dict(meta["plateau"])
    if "l1_control" in meta:  # checkpoints written before target mode hold none (fixed mode needs none)
        run.l1.load_state_dict(meta["l1_control"])
    if "train_kernels" in meta:  # the same layers on the packed path with the same capacities (another mode: ignored)
        run.ffn.load_state_dict(meta["train_kernels"])
    rng, np_name, np_pos, np_has_gauss, np_gauss = blob["rng"], *meta["rng"]["numpy"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state((np_name, rng["numpy"].numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    py_version, py_gauss = meta["rng"]["python"]
    random.setstate((py_version, tuple(rng["python"].tolist()), py_gauss))
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    # The final checkpoint records why the run ended; the resumed recipe may extend the budget or change the
    # plateau rule (RESUMABLE_KEYS), so decide again: the loop re-checks the budget, the plateau is asked here.
    if run.state.stopped.startswith("budget") or not run.plateau.reached():
        run.state.stopped = ""


# Recipe keys that may differ between a checkpoint and the run resuming it: where the run stops and how it is
# logged, saved and executed, none of which changes what one step computes (up to float summation order).
# Everything else (lr, seq_len, data, l1, kd, ...) must match, or the resumed run is a mix of two runs.
RESUMABLE_KEYS = (
    "output.*",  # where and what is written
    "data.fetch",  # how the text was fetched, not what it is
    "train.max_steps", "train.max_tokens",  # the budget: extend or cut a run (the cosine schedule follows it)
    "sparsity.plateau_tolerance", "sparsity.plateau_window",  # the stop rule, e.g. 0 to run the full budget
    "train.eval_every", "train.log_every", "train.save_every", "train.keep_checkpoints",
    "train.compile", "train.gradient_checkpointing", "train.distributed", "data.num_proc",  # speed / memory
    "train.attention", "train.profile_steps", "train.kernels",  # packed FFN: the same gradients to rounding
    "train.batch_size", "train.grad_accum",  # free as long as the global batch (checked below) is unchanged
)


def _flat(recipe: dict) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, keys in recipe.items() for key, value in (keys or {}).items()}


def check_resume_recipe(saved_yaml: str, saved_world: int, recipe: Recipe, world: int, checkpoint: Path) -> None:
    """Raises SparsifyError listing every setting of `recipe` that differs from the checkpoint's own recipe."""
    import fnmatch

    import yaml

    old, new = _flat(yaml.safe_load(saved_yaml)), _flat(yaml.safe_load(dump_recipe(recipe)))
    diffs = [f"{k}: {old.get(k, '(absent)')!r} in the checkpoint, now {new.get(k, '(absent)')!r}"
             for k in sorted(old.keys() | new.keys())
             if old.get(k) != new.get(k) and not any(fnmatch.fnmatchcase(k, pat) for pat in RESUMABLE_KEYS)]
    # sequences per optimizer step decide the data position and what a step means: they must stay the same
    was = old["train.batch_size"] * old["train.grad_accum"] * saved_world
    now = recipe.train.batch_size * recipe.train.grad_accum * world
    if was != now:
        diffs.append(f"global batch (train.batch_size x train.grad_accum x processes): {was} in the checkpoint "
                     f"({old['train.batch_size']} x {old['train.grad_accum']} x {saved_world}), now {now} "
                     f"({recipe.train.batch_size} x {recipe.train.grad_accum} x {world})")
    if diffs:
        listing = "\n".join(f"  - {d}" for d in diffs)
        raise SparsifyError(
            f"--resume: the recipe differs from the one {checkpoint} was trained with:\n{listing}\n"
            f"Resuming would mix two runs. Restore these values (the run's recipe is {checkpoint.parents[1] / 'recipe.yaml'}),"
            " or start a fresh run with another output.dir (or output.overwrite=true). Only these keys may change on "
            f"resume: {', '.join(RESUMABLE_KEYS)}.")


# ------------------------------------------------------------------------------------------ logging


class MetricsLog:
    """metrics.jsonl (+ TensorBoard when installed) on rank 0; lines past a resumed step are dropped first."""

    def __init__(self, out: Path, recipe: Recipe, dist: Dist, from_step: int):
        self.path, self.main, self.tb = out / "metrics.jsonl", dist.main, None
        if not self.main:
            return
        if self.path.exists():  # resume: forget what happened after the checkpoint, it is about to be redone
            kept = [json.dumps(r) for r in _parse_lines(self.path) if r["step"] <= from_step]
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
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(key, value, record["step"])
            for i, z in enumerate(record.get("per_layer", {}).get("zeros", [])):
                self.tb.add_scalar(f"zeros/layer_{i:02d}", z, record["step"])
            for i, c in enumerate(record.get("per_layer", {}).get("l1_coef", [])):
                self.tb.add_scalar(f"l1_coef/layer_{i:02d}", c, record["step"])
            for name, d in record.get("heldout", {}).items():
                for key, value in d.items():
                    self.tb.add_scalar(f"heldout/{name}_{key}", value, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


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
    coefs = run.l1.coefficients(run.state.step - 1)  # the weights the last step used (target mode: the next's)
    tokens_per_s = steps * t.batch_size * t.grad_accum * dist.world * t.seq_len / max(seconds, 1e-9)
    peak = peak_flops(dist.device)
    record = {"step": run.state.step, "tokens": run.state.tokens, **vals,
              "l1_coef": coefs.mean().item(), "lr": run.sched.get_last_lr()[0],
              "sparsity": stats.sparsity, "nonzeros": stats.mean_nonzeros, "dead": sum(stats.dead),
              "tokens_per_s": tokens_per_s}
    if peak:
        record["mfu"] = tokens_per_s * fpt / (peak * dist.world)
    record["per_layer"] = {"zeros": stats.zeros, "nonzeros": stats.nonzeros, "dead": stats.dead,
                           "l1_coef": coefs.tolist()}
    if run.ffn.layers:  # train.kernels twell / auto: the path each layer takes from the next step on
        record["per_layer"]["packed"] = [layer.packed for layer in run.ffn.layers]
        record["per_layer"]["capacity"] = run.ffn.capacities
    return record


# ------------------------------------------------------------------------------------------ the end


def export(run: Run, model_dir: Path, out: Path, tokenizer: Any, history: list[dict]) -> Path:
    """OUT/model: the trained weights (LoRA merged) in the convert format, recipe.yaml and sparsity.json inside."""
    from transformers import AutoModelForCausalLM

    from sparsify.folder.format import save_model_folder

    fsdp = run.dist.world > 1 and run.recipe.train.distributed == "fsdp"
    model_sd, _ = _full_state(run) if fsdp else (None, None)  # collective: every rank takes part
    target = out / "model"
    if run.dist.main:
        model = run.model  # DDP replicas are whole models already
        if fsdp:  # sharded: rebuild one plain CPU copy from the gathered state (FSDP excludes LoRA)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            model.load_state_dict(model_sd)
        if run.recipe.lora.r > 0:
            model = model.merge_and_unload()
        config = json.loads((model_dir / "config.json").read_text())
        dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float32")
        model = model.to("cpu", dtype)
        train_lines = [h for h in history if "sparsity" in h]
        last = train_lines[-1] if train_lines else {}
        provenance = {"finetuned": True, "finetuned_from": str(model_dir), "steps": run.state.step,
                      "tokens": run.state.tokens, "sparsity": last.get("sparsity"), "stopped": run.state.stopped,
                      "l1": run.recipe.sparsity.l1, "normalization": run.recipe.sparsity.normalization,
                      "target": run.recipe.sparsity.target}
        sparsity = {"step": run.state.step, "tokens": run.state.tokens, "per_layer": last.get("per_layer"),
                    "sparsity": last.get("sparsity"), "nonzeros": last.get("nonzeros"),
                    "evaluations": [h for h in history if "val_loss" in h]}
        save_model_folder(model, tokenizer, target, provenance=provenance, overwrite=True, extra_files={
            "recipe.yaml": dump_recipe(run.recipe), "sparsity.json": json.dumps(sparsity, indent=2) + "\n"})
    run.dist.barrier()
    return target


def plot(out: Path, history: list[dict]) -> None:
    """loss.png (loss terms vs tokens, validation perplexity) and sparsity.png (zeros per layer vs tokens)."""
    if importlib.util.find_spec("matplotlib") is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [h for h in history if "sparsity" in h]
    evals = [h for h in history if "val_ppl" in h]
    if not train:
        return
    tokens = [h["tokens"] / 1e6 for h in train]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key in ("loss", "ce", "kd"):
        a.plot(tokens, [h[key] for h in train], label=key)
    a.set(xlabel="tokens (M)", ylabel="loss", title="training loss")
    a.legend()
    b.plot([h["tokens"] / 1e6 for h in evals], [h["val_ppl"] for h in evals], "o-")
    b.set(xlabel="tokens (M)", ylabel="perplexity", yscale="log", title="validation perplexity")
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    coefs = [h for h in train if "l1_coef" in h["per_layer"]]  # older runs did not log per-layer coefficients
    fig, axes = plt.subplots(1, 2 if coefs else 1, figsize=(13 if coefs else 7, 4.5), squeeze=False)
    ax = axes[0, 0]
    layers = len(train[-1]["per_layer"]["zeros"])
    color = [plt.cm.viridis(i / max(1, layers - 1)) for i in range(layers)]
    for i in range(layers):
        ax.plot(tokens, [h["per_layer"]["zeros"][i] for h in train], color=color[i], lw=0.8)
    ax.plot(tokens, [h["sparsity"] for h in train], "k--", lw=2, label="mean over layers")
    ax.set(xlabel="tokens (M)", ylabel="fraction of zeros in h", title=f"per-layer sparsity ({layers} layers, "
           "dark = first)")
    ax.legend()
    if coefs:
        ax = axes[0, 1]
        for i in range(layers):
            ax.plot([h["tokens"] / 1e6 for h in coefs], [h["per_layer"]["l1_coef"][i] for h in coefs], color=color[i],
                    lw=0.8)
        ax.set(xlabel="tokens (M)", ylabel="L1 coefficient", yscale="log", title="per-layer L1 coefficient")
    fig.tight_layout()
    fig.savefig(out / "sparsity.png", dpi=110)
    plt.close("all")


# ------------------------------------------------------------------------------------------ the loop


def finetune(recipe: Recipe, *, resume: bool = False, progress: bool = True, verbose: bool = True) -> Path:
    """Run a recipe; returns OUT/model, the fine-tuned model folder.

    Args:
        recipe: a validated Recipe (see `load_recipe`).
        resume: continue from the newest checkpoint in output.dir (same recipe); exact, even after SIGKILL.
        progress: show progress bars (rank 0 only).
        verbose: print validation results, and a line per logged step when there are no progress bars, to
            stderr (rank 0 only); metrics.jsonl gets everything either way.
    """
    from transformers import AutoTokenizer

    raise_problems("the recipe", recipe_problems(recipe))  # load_recipe checked it; a Recipe built in Python too
    dist = _init_distributed()
    if recipe.sparsity.blend_steps >= total_steps_of(recipe, dist):
        raise SparsifyError(f"sparsity.blend_steps={recipe.sparsity.blend_steps} is not below the run's "
                            f"{total_steps_of(recipe, dist)} steps: the model would end between its source activation "
                            "and ReLU. Lower blend_steps or raise train.max_tokens / max_steps.")
    if recipe.lora.r > 0 and dist.world > 1 and recipe.train.distributed == "fsdp":
        raise SparsifyError("lora.r > 0 with train.distributed=fsdp is not supported; use distributed=ddp for "
                            "LoRA (adapters are small) or lora.r=0 for a sharded full fine-tune.")
    out = Path(recipe.output.dir)
    checkpoint = _check_output(out, recipe, resume, dist)
    if dist.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_flush_denormal(True)  # L1 drives h towards 0: denormal arithmetic made CPU steps 5x slower
    with contextlib.ExitStack() as quiet:
        if not progress:  # transformers' own bars too (converting, loading and writing weights)
            from sparsify.folder.convert import no_transformers_bars

            quiet.enter_context(no_transformers_bars())
        model_dir = prepare_model(recipe, out, dist, progress)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        data = _data(recipe, tokenizer, out, dist, progress, verbose)
        run = _setup(recipe, dist, model_dir, data)
        run.verbose = verbose
        if checkpoint is not None:
            load_checkpoint(run, checkpoint)
        if dist.main:
            (out / "recipe.yaml").write_text(dump_recipe(recipe))
        log = MetricsLog(out, recipe, dist, run.state.step)
        history = _read_history(out) if dist.main else []
        try:
            with StopRequest() as stop:
                _loop(run, log, history, progress, stop)
        finally:
            log.close()
        if dist.main and recipe.output.plots:
            plot(out, history)
        folder = export(run, model_dir, out, tokenizer, history)
        if stop.signum:  # caught during the last step or the final evaluation: the run is done, but the caller stops
            raise RunStopped(f"stopped by {signal.Signals(stop.signum).name} at the end of training (step "
                             f"{run.state.step}); the fine-tuned model was exported to {folder}.", stop.signum)
        return folder


def _check_output(out: Path, recipe: Recipe, resume: bool, dist: Dist) -> Path | None:
    """The checkpoint to resume from (None for a fresh run); refuses to mix runs in one folder."""
    found = _checkpoints(out)
    if resume:
        if not found:
            raise SparsifyError(f"--resume: no checkpoint in {out / 'checkpoints'}; run without --resume to start, "
                                "or set output.dir to the folder of the run to continue.")
        meta = read_checkpoint_meta(found[-1])
        check_resume_recipe(meta["recipe"], meta["world"], recipe, dist.world, found[-1])
        return found[-1]
    if found and not recipe.output.overwrite:
        raise SparsifyError(f"{out} holds checkpoints of an earlier run (newest: {found[-1].name}); pass --resume to "
                            "continue it, output.overwrite=true to start over, or choose another output.dir.")
    if dist.main:
        for stale in [out / "checkpoints", out / "metrics.jsonl", out / "tensorboard"]:
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    return None


def _data(recipe: Recipe, tokenizer: Any, out: Path, dist: Dist, progress: bool, verbose: bool):
    from sparsify.train.data import TokenData, prepare_data

    if dist.main:  # one tokenisation; other ranks wait and then read the same files
        folder = prepare_data(recipe.data, tokenizer, out / "data", progress=progress)
    dist.barrier()
    if not dist.main:
        folder = prepare_data(recipe.data, tokenizer, out / "data", progress=False)  # reuses rank 0's files
    data = TokenData(folder, recipe.train.seq_len, recipe.data.seed, recipe.data.weights or None)
    notes = [data.validation_note(recipe.train.batch_size, recipe.train.eval_batches, dist.world)]  # raises if none
    notes += [data.heldout_note(name, recipe.train.batch_size, recipe.train.eval_batches, dist.world)
              for name in data.domains]
    for note in notes:
        if note and dist.main and verbose:
            print(f"note: {note}", file=sys.stderr)
    return data


def _setup(recipe: Recipe, dist: Dist, model_dir: Path, data: Any) -> Run:
    model = load_student(model_dir, recipe, dist)
    teacher = load_teacher(model_dir, dist, recipe.train.seq_len) if recipe.distill.kd > 0 else None
    if teacher is not None and recipe.train.compile:
        teacher.compile()
    probe = SparsityProbe(model, recipe.sparsity.normalization)
    from sparsify.train.packed_ffn import install_packed_ffn  # patches the MLPs before compile / DDP wrap them

    ffn = install_packed_ffn(model, probe, recipe.train.kernels)
    source = json.loads((model_dir / "config.json").read_text()).get("sparsify", {}).get("source_activation")
    if recipe.sparsity.blend_steps > 0 and source in (None, "relu"):
        raise SparsifyError(f"sparsity.blend_steps={recipe.sparsity.blend_steps}: {model_dir} records no non-ReLU source "
                            "activation to blend from (config.json sparsify.source_activation); give the SiLU source "
                            "as model.source, or set sparsity.blend_steps=0.")
    blend = ActivationBlend(model, source or "relu", recipe.sparsity.blend_steps, dist.device)
    train_model = wrap_model(model, recipe, dist)
    opt, sched = build_optimizer(model, recipe, total_steps_of(recipe, dist), dist)
    sp = recipe.sparsity
    plateau = Plateau(sp.plateau_tolerance, sp.plateau_window,
                      after=max(sp.ramp_steps if sp.schedule == "ramp" else 0, sp.blend_steps))
    loss_fn = torch.compile(losses) if recipe.train.compile else losses
    l1 = L1Control(sp, len(probe.mlps), dist.device)
    return Run(recipe, dist, model, train_model, teacher, probe, data, opt, sched, TrainState(), plateau, loss_fn, l1,
               ffn, blend, model_dir)


def _read_history(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return _parse_lines(path) if path.exists() else []


def _parse_lines(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a line cut short by a kill (the last one) is dropped."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def _loop(run: Run, log: MetricsLog, history: list[dict], progress: bool, stop: StopRequest | None = None) -> None:
    """Steps until the budget or the plateau; logs, evaluates and checkpoints on the way. On a stop request
    (SIGTERM, Ctrl-C) it checkpoints the step just done and raises RunStopped."""
    from tqdm.auto import tqdm

    t, out = run.recipe.train, Path(run.recipe.output.dir)
    total = total_steps_of(run.recipe, run.dist)
    fpt = flops_per_token(run.model, t.seq_len)
    if run.state.step == 0:
        _evaluate_all(run, log, history, first=True)
    bar = tqdm(total=total, initial=run.state.step, unit="step", disable=not (progress and run.dist.main),
               dynamic_ncols=True, desc="finetune")
    window, tic, steps = None, time.perf_counter(), 0
    profiler = StepProfiler(t.profile_steps, out, enabled=run.dist.main)
    while run.state.step < total and not run.state.stopped:
        sums = train_step(run)
        profiler.after_step(run.state.step)
        window = sums if window is None else {k: window[k] + v for k, v in sums.items()}
        steps += 1
        bar.update(1)
        logging_now = run.state.step % t.log_every == 0 or run.state.step == total
        if run.recipe.sparsity.reinit_dead or run.l1.adaptive or logging_now:
            stats = run.probe.step_stats(run.dist.reduce)
            if run.recipe.sparsity.reinit_dead:
                reinit_dead(run.model, stats.inactive, run.state.step, t.seed)
            if not run.blend.active(run.state.step - 1):  # the blend's zeros say nothing about the targets
                run.l1.update(stats)
        else:
            run.probe.reset()
        if logging_now:
            run.ffn.update(stats.zeros, stats.nonzeros)  # train.kernels: which layers pack, and their capacity
            if run.ffn.changes and run.dist.main and run.verbose:
                print(f"step {run.state.step}: train.kernels " + "; ".join(run.ffn.changes), file=sys.stderr)
            record = step_record(run, window, stats, time.perf_counter() - tic, steps, fpt)
            log.write(record)
            history.append(record)
            line = (f"tok/s={record['tokens_per_s']:.3g} loss={record['loss']:.3f} l1={record['l1']:.3g} "
                    f"zeros={record['sparsity']:.1%} nnz={record['nonzeros']:.0f}")
            if run.l1.adaptive:  # the layer furthest below its target, and the coefficient range
                zeros, coef = record["per_layer"]["zeros"], record["per_layer"]["l1_coef"]
                line += f" min_zeros={min(zeros):.1%} coef={min(coef):.2g}..{max(coef):.2g}"
            bar.set_postfix_str(line)
            if bar.disable and run.dist.main and run.verbose:  # no bar (logs, batch jobs): a line per logged step
                mfu = f" mfu={record['mfu']:.1%}" if "mfu" in record else ""
                print(f"step {run.state.step}/{total} tokens={run.state.tokens:,} {line}{mfu}", file=sys.stderr)
            if run.plateau.update(run.state.step, record["sparsity"]):
                run.state.stopped = f"plateau: sparsity {record['sparsity']:.4f} changed < " \
                                    f"{run.recipe.sparsity.plateau_tolerance} over {run.recipe.sparsity.plateau_window} steps"
            window, tic, steps = None, time.perf_counter(), 0
        if t.eval_every and run.state.step % t.eval_every == 0 and run.state.step < total:
            _evaluate_all(run, log, history)
        saved = None
        if t.save_every and run.state.step % t.save_every == 0 and run.state.step < total and not run.state.stopped:
            saved = save_checkpoint(run, out)
        signum = stop.due(run.dist, run.state.step, t.log_every) if stop is not None else 0
        if signum and run.state.step < total and not run.state.stopped:
            bar.close()
            folder = saved or save_checkpoint(run, out)
            raise RunStopped(f"stopped by {signal.Signals(signum).name} after step {run.state.step} "
                             f"({run.state.tokens:,} tokens); checkpoint {folder}. Continue with the same command "
                             "and --resume.", signum)
    bar.close()
    run.state.stopped = run.state.stopped or f"budget: {run.state.step} steps, {run.state.tokens} tokens"
    _evaluate_all(run, log, history)
    save_checkpoint(run, out)


def _evaluate_all(run: Run, log: MetricsLog, history: list[dict], first: bool = False) -> None:
    """Validation loss of the model being trained, and its loss on every held-out domain (data.heldout), each
    also as a perplexity ratio to the original dense model, which is evaluated on the same text once, on the
    first call (a resumed run reads those numbers back from metrics.jsonl)."""
    loss = evaluate(run, run.model)
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
            dl = evaluate(run, run.model, name)
            record["heldout"][name] = {"loss": dl, "ppl": math.exp(dl)}
            if name in run.reference:
                record["heldout"][name]["ratio"] = math.exp(dl - run.reference[name])
    log.write(record)
    history.append(record)
    if run.dist.main and run.verbose:
        ratio = f" ({record['val_ppl_ratio']:.3f}x the original)" if "val_ppl_ratio" in record else ""
        extra = f", original dense model {record['teacher_val_ppl']:.2f}" if "teacher_val_ppl" in record else ""
        domains = "".join(f"; {name} {d['ppl']:.2f}" + (f" ({d['ratio']:.3f}x)" if "ratio" in d else "")
                          for name, d in record.get("heldout", {}).items())
        print(f"[step {run.state.step}] validation perplexity {record['val_ppl']:.2f}{ratio}{extra}{domains}",
              file=sys.stderr)


def _reference_record(run: Run) -> dict:
    """The original dense model's validation and held-out losses, as first-evaluation fields; sets run.reference.

    The teacher when distilling; otherwise, when there are held-out domains to compare, the original is rebuilt
    from the trained folder for this one evaluation (without domains, a kd = 0 run skips it, as before)."""
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


# ------------------------------------------------------------------------------------------ CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = format_help()
    p.add_argument("recipe", help="recipe YAML file (see recipes/); every key is listed below")
    p.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE",
                   help="recipe overrides, e.g. train.lr=3e-4 sparsity.l1=2e-2 output.dir=runs/x")
    p.add_argument("--resume", action="store_true", help="continue the run in output.dir from its newest checkpoint (after a crash, "
                   "or after SIGTERM / Ctrl-C, which checkpoint the step they stop at)")
    p.add_argument("--print-recipe", action="store_true", help="print the resolved recipe as YAML and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (logs still go to metrics.jsonl)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress bars and no validation or step lines: only errors and the final folder "
                        "(metrics.jsonl still gets everything)")


def main(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe, args.overrides, check_paths=not args.print_recipe)
    if args.print_recipe:
        print(dump_recipe(recipe), end="")
        return 0
    folder = finetune(recipe, resume=args.resume, progress=not (args.no_progress or args.quiet),
                      verbose=not args.quiet)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"fine-tuned model: {folder}")
    if torch.distributed.is_initialized():
        gc.collect()  # the run's DDP reducer (kept alive by reference cycles) goes before its process group
        torch.distributed.destroy_process_group()
    return 0
