"""The models of a run: the ReLU student, the dense teacher (its source activation put back), how they are
wrapped for DDP / FSDP2 / torch.compile, and the optimizer with its schedule."""

from __future__ import annotations

import fnmatch
import json
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparsify.errors import SparsifyError
from sparsify.families import family_for, mlp_modules
from sparsify.train.config import Recipe
from sparsify.train.distributed import Dist


# Training batches are packed windows without padding, so attention is plain causal. Under torch.compile
# (torch < 2.14) transformers' "sdpa" materialises a [B, 1, T, T] mask and SDPA then computes every score; this
# implementation is the same SDPA call with no mask, so SDPA runs is_causal=True (eval/bench/bench_train.py
# measures the difference). Training only, and not for sliding-window layers (training_attention): exports keep "sdpa".
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
        checkpoint_activations(model)
    if recipe.lora.r > 0:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=recipe.lora.r, lora_alpha=recipe.lora.alpha, lora_dropout=recipe.lora.dropout,
                          target_modules=list(recipe.lora.target_modules), task_type="CAUSAL_LM")
        with warnings.catch_warnings():  # peft reads transformers' deprecated name; nothing a user can act on
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            model = get_peft_model(model, lora)
    freeze(model, recipe.train.freeze)
    return model.to(dist.device)


def checkpoint_activations(model: nn.Module) -> None:
    """Recompute each layer's activations in backward, non-reentrant: the L1 term reads h inside checkpointed
    layers, which needs a grad-enabled forward."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.24 (the old one warns)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def freeze(model: nn.Module, patterns: list[str]) -> None:
    """train.freeze: parameters whose names match a glob pattern are not trained (a pattern matching nothing
    is an error: it is a typo, or names another family's modules)."""
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


def source_activation(model_dir: Path) -> str | None:
    """The activation the folder was converted from (config.json sparsify.source_activation), None if unrecorded."""
    return json.loads((model_dir / "config.json").read_text()).get("sparsify", {}).get("source_activation")


def load_teacher(model_dir: Path, dist: Dist, seq_len: int) -> nn.Module:
    """The original dense model: the same weights with the source activation put back (no second download)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    original = source_activation(model_dir)
    if not original or original == "relu":
        raise SparsifyError(f"distillation (distill.kd or distill.mlp > 0) and the held-out ratios need the original "
                            f"dense model, but {model_dir} does not record a non-ReLU source activation (config.json "
                            "sparsify.source_activation). Give the SiLU source as model.source (it is converted "
                            "first), or set distill.kd=0 distill.mlp=0.")
    field_name = family_for(json.loads((model_dir / "config.json").read_text())).act_field
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

        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
    if recipe.train.compile:
        model.compile()
    if dist.world == 1 or fsdp:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules holding an MLP (FSDP2's sharding unit): the parents of what families.mlp_modules finds."""
    mlps = set(map(id, mlp_modules(model)))
    return [m for m in model.modules() if any(id(c) in mlps for c in m.children())]


def build_optimizer(model: nn.Module, recipe: Recipe, total_steps: int, dist: Dist):
    """AdamW (fused on CUDA) with decay on matrices only, towards zero (AdamW's own) or, with
    train.weight_decay_to=start, none here: DecayToStart pulls them towards the run's start. Linear warm-up then
    cosine to lr * min_lr_ratio."""
    t = recipe.train
    params = [p for p in model.parameters() if p.requires_grad]
    to_start = t.weight_decay_to == "start" and t.weight_decay > 0
    groups = [{"params": _matrices(model), "weight_decay": 0.0 if to_start else t.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    fused = {"fused": True} if dist.device.type == "cuda" else {}
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), **fused)

    def lr_factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / (t.warmup_steps + 1)
        progress = min(1.0, (step - t.warmup_steps) / max(1, total_steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)


def _matrices(model: nn.Module) -> list[nn.Parameter]:
    """The trained parameters that weight decay applies to: matrices, not biases or norms."""
    return [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]


class DecayToStart:
    """train.weight_decay_to=start: after each optimizer step, w <- w - lr * weight_decay * (w - w_start) on every
    matrix (decoupled, like AdamW's own decay towards zero; lr is the step's). w_start: the weights as they are when
    this is built, the run's start (build it before a checkpoint is loaded: a resumed run rebuilds the same start)."""

    def __init__(self, model: nn.Module, weight_decay: float):
        self.matrices, self.weight_decay = _matrices(model), weight_decay
        with torch.no_grad():
            self.start = [p.detach().clone() for p in self.matrices]

    @classmethod
    def of(cls, model: nn.Module, recipe: Recipe) -> DecayToStart | None:
        """The recipe's, or None (weight_decay_to=zero, or no decay)."""
        t = recipe.train
        return cls(model, t.weight_decay) if t.weight_decay_to == "start" and t.weight_decay > 0 else None

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for p, p0 in zip(self.matrices, self.start):
            p.lerp_(p0, lr * self.weight_decay)


def total_steps_of(recipe: Recipe, dist: Dist) -> int:
    """Optimizer steps of the run: max_steps, or max_tokens in global batches, whichever comes first."""
    t = recipe.train
    per_step = t.batch_size * t.grad_accum * dist.world * t.seq_len
    budget = [t.max_steps] if t.max_steps is not None else []
    if t.max_tokens is not None:
        budget.append(math.ceil(t.max_tokens / per_step))
    return min(budget)
