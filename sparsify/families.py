"""Supported model families: one table row each, no per-family functions.

Every family here has a gated MLP at `model.layers[i].mlp` computing
    down_proj( act(gate_proj(x)) * up_proj(x) )      (or a fused gate_up_proj, Phi-3 style)
and reads its activation from one config field at construction time. Converting a family means setting
that field to "relu"; the weights do not change. The input of `down_proj` is exactly h = act(gate) * up
in every row, which is where the L1 penalty and the sparsity statistics hook in.

To add a family: add a row (tests/test_families.py tests each on tests/tiny.py's FAMILY_CONFIG; the extras a
family needs go in FAMILY_EXTRA there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparsify.errors import SparsifyError


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json "model_type", kept unchanged by convert
    name: str  # what users call it
    causal_lm: str  # transformers class the sparse model subclasses
    act_field: str  # config field holding the MLP activation
    fused_gate_up: bool = False  # one gate_up_proj [2F, d] instead of gate_proj + up_proj
    example: str = ""  # a Hub id, for the README table


FAMILIES: tuple[Family, ...] = (
    Family("llama", "Llama 2/3, SmolLM/SmolLM2, TinyLlama", "LlamaForCausalLM", "hidden_act",
           example="meta-llama/Llama-3.2-1B"),
    Family("mistral", "Mistral", "MistralForCausalLM", "hidden_act", example="mistralai/Mistral-7B-v0.3"),
    Family("qwen2", "Qwen2 / Qwen2.5", "Qwen2ForCausalLM", "hidden_act", example="Qwen/Qwen2.5-0.5B"),
    Family("qwen3", "Qwen3 (dense)", "Qwen3ForCausalLM", "hidden_act", example="Qwen/Qwen3-0.6B"),
    Family("gemma", "Gemma", "GemmaForCausalLM", "hidden_act", example="google/gemma-2b"),
    Family("gemma2", "Gemma 2", "Gemma2ForCausalLM", "hidden_activation", example="google/gemma-2-2b"),
    Family("gemma3_text", "Gemma 3 (text)", "Gemma3ForCausalLM", "hidden_activation",
           example="google/gemma-3-1b-pt"),
    Family("phi3", "Phi-3 / Phi-3.5 / Phi-4-mini", "Phi3ForCausalLM", "hidden_act", fused_gate_up=True,
           example="microsoft/Phi-3-mini-4k-instruct"),
    Family("olmo2", "OLMo 2", "Olmo2ForCausalLM", "hidden_act", example="allenai/OLMo-2-0425-1B"),
    Family("granite", "Granite 3", "GraniteForCausalLM", "hidden_act", example="ibm-granite/granite-3.1-2b-base"),
    Family("smollm3", "SmolLM3", "SmolLM3ForCausalLM", "hidden_act", example="HuggingFaceTB/SmolLM3-3B"),
)

BY_MODEL_TYPE: dict[str, Family] = {f.model_type: f for f in FAMILIES}

# The activation field of a thresholded folder (h = g [g > theta] * up, theta per neuron): a name stock transformers
# does not know, so it refuses the folder instead of dropping the thresholds. The shipped modeling code defines the
# same string (kernels/modeling_sparsify.py THRESHOLD_ACT; tests/test_families.py checks they agree).
THRESHOLD_ACT = "relu_threshold (load with trust_remote_code=True)"
# Gate activations we know how to swap. ReLU is already the target (a second convert is a no-op swap); a thresholded
# folder keeps its thresholds (its `sparsify.threshold` section stays, and with it THRESHOLD_ACT: format.relu_config).
GATED_ACTIVATIONS = {"silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate", "relu",
                     THRESHOLD_ACT}

# Families users bring that we refuse, each with the reason (better than "unknown").
REFUSED = {
    "gemma3": "this is the multimodal Gemma 3 wrapper; convert a text-only Gemma 3 checkpoint (model_type gemma3_text)",
    "mixtral": "mixture-of-experts MLPs are not supported yet",
    "qwen2_moe": "mixture-of-experts MLPs are not supported yet",
    "qwen3_moe": "mixture-of-experts MLPs are not supported yet",
    "gpt2": "its MLP is not gated (no gate_proj): there is no gate activation to make sparse",
    "gpt_neox": "its MLP is not gated (no gate_proj): there is no gate activation to make sparse",
    "opt": "its MLP is not gated (no gate_proj): there is no gate activation to make sparse",
    "bert": "it is an encoder with an ungated MLP; sparsify converts decoder LLMs with gated MLPs",
}


def supported_list() -> str:
    return ", ".join(f"{f.name} ({f.model_type})" for f in FAMILIES)


def _get(config: Any, key: str, default: Any = None) -> Any:
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def family_for(config: Any) -> Family:
    """The table row for a config (a config.json dict or a transformers config object).

    Raises SparsifyError naming the supported families when the model is unknown or not gated.
    """
    model_type = _get(config, "model_type")
    if model_type in REFUSED:
        raise SparsifyError(f"model_type {model_type!r} cannot be converted: {REFUSED[model_type]}. "
                            f"Supported families: {supported_list()}.")
    family = BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise SparsifyError(
            f"model_type {model_type!r} is not a supported gated-MLP family. Supported families: "
            f"{supported_list()}. If your model is a Llama-style gated model under another name, "
            "open an issue with its config.json.")
    act = _get(config, family.act_field)
    if act is not None and act not in GATED_ACTIVATIONS:
        raise SparsifyError(
            f"{family.name} config has {family.act_field}={act!r}, which is not a gate activation sparsify "
            f"can swap (expected one of {sorted(GATED_ACTIVATIONS)}).")
    return family


def thresholded(config: Any) -> bool:
    """Whether a config (a config.json dict or a config object) is a thresholded folder's: a `sparsify` section
    with a `threshold` entry ({"mode": "layer" | "neuron"})."""
    info = _get(config, "sparsify") or {}
    return isinstance(info, dict) and isinstance(info.get("threshold"), dict)


def activation_of(config: Any) -> str | None:
    """The MLP activation a config declares (None when the field is absent)."""
    return _get(config, family_for(config).act_field)


def mlp_modules(model: Any) -> list[Any]:
    """The per-layer gated MLP modules of a loaded model, in layer order (stock or remote-code class).

    Found by shape, not by family: a module with `down_proj` and either `gate_proj` + `up_proj` or a
    fused `gate_up_proj`. Its `down_proj` input is h = act(gate) * up.
    """
    mlps = [m for _, m in model.named_modules()
            if hasattr(m, "down_proj") and (hasattr(m, "gate_up_proj") or
                                            (hasattr(m, "gate_proj") and hasattr(m, "up_proj")))]
    if not mlps:
        raise SparsifyError(f"{type(model).__name__} has no gated MLP (gate_proj/up_proj/down_proj) modules.")
    return mlps


def gate_weight(mlp: Any) -> Any:
    """The gate rows [F, d] of a gated MLP's weights (a view into a fused gate_up_proj, whose first F rows they are)."""
    if hasattr(mlp, "gate_up_proj"):
        w = mlp.gate_up_proj.weight
        return w[: w.shape[0] // 2]
    return mlp.gate_proj.weight
