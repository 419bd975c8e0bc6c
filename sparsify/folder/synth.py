"""synth: a random-weight sparsify model folder of any supported config, with a chosen activation sparsity.

It answers "what speed-up would my model get at Z% zeros?" before any GPU hours are spent on conversion,
and it is how the benchmarks measure shapes we have no trained weights for (Llama-3.1-8B, a 70B layer).
It measures SPEED, NOT QUALITY: the weights are random, the text it generates is noise.

How the sparsity is made honest (the kernels cannot see it coming): residual channel c = 0 is held
constant (embedding column c constant, every write into the residual stream's channel c zeroed: o_proj and
down_proj rows c, and the LM head's column c so the constant biases no token), so after each layer's norm
x[c] is a positive per-token scale. Each gate row j then gets a weight through channel c,
W_gate[j, c] = -quantile_t(g_j / x_c, 1 - p_j), calibrated layer by layer on random tokens, so that neuron j
fires on a fraction p_j of tokens. The p_j follow a skewed (log-normal) law whose mean is 1 - zeros: a few
neurons fire often, most rarely, as in trained ReLU models. Which neurons fire still depends on each
token's own activations, so the pattern changes from token to token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from sparsify.families import activation_of, family_for, gate_weight, mlp_modules
from sparsify.errors import SparsifyError
from sparsify.sources import available_memory

CHANNEL = 0
CONSTANT = 1.0
# Attention outputs are scaled down: with random weights attention averages its context, so the residual
# stream's spread (and with it each neuron's firing rate) would shrink with the token's position. At 0.1 the
# zeros stay within 1 point from 64 to 1024 tokens.
ATTN_SCALE = 0.1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt")
SAVED_DTYPES = ("bf16", "fp16", "fp32")  # a synth folder has a concrete dtype (no "auto")


def load_config(src: str | Path) -> tuple[dict[str, Any], Path | None, str]:
    """(config dict, model folder to copy a tokenizer from or None, portable name) for a config.json file,
    a model folder or a Hub id."""
    path = Path(src)
    if path.is_file():
        name = path.parent.name if path.name == "config.json" else path.stem
        return _read_json(path), None, name  # (a file's neighbours may belong to another model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SparsifyError(f"{src} is a folder without config.json; pass a config.json file or a model folder.")
        return _read_json(path / "config.json"), path, path.name
    if str(src).count("/") != 1 or str(src).startswith((".", "/")):
        raise SparsifyError(f"{src} is neither a config.json file, a model folder, nor a Hub id (owner/name).")
    try:
        from transformers import AutoConfig

        from sparsify.sources import hub_unreachable

        return AutoConfig.from_pretrained(str(src), local_files_only=hub_unreachable()).to_dict(), None, str(src)
    except OSError as e:
        raise SparsifyError(f"could not fetch the config of Hub model {src!r} ({e}). Offline, download its "
                            "config.json elsewhere and pass the file.") from e


def synthetic_tokenizer(vocab: int) -> Any:
    """A tokenizer for a random model: token i is the word `<i>` (whitespace-separated), so the folder loads
    like any other with AutoTokenizer; real text maps to <0> (unknown)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab)}, unk_token="<0>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<0>", pad_token="<0>")


def neuron_rates(f: int, zeros: float, skew: float, generator) -> Any:
    """Per-neuron firing probabilities p [F]: log-normal(0, skew) shape, clipped to [0, 1], mean 1 - zeros."""
    import torch

    r = torch.exp(skew * torch.randn(f, generator=generator, dtype=torch.float64))
    lo, hi = 0.0, 1.0 / float(r.min())  # scale a: mean(clip(a * r, 0, 1)) rises from 0 to 1 over [lo, hi]
    for _ in range(100):
        a = (lo + hi) / 2
        if float((a * r).clamp(max=1.0).mean()) < 1.0 - zeros:
            lo = a
        else:
            hi = a
    return (hi * r).clamp(max=1.0)


def _hold_channel_constant(model, c: int) -> None:
    """Embedding column c constant; every write into residual channel c (o_proj, down_proj rows c) zero;
    the LM head ignores channel c (for tied embeddings the constant column adds the same to every logit);
    attention outputs scaled by ATTN_SCALE (position-independent sparsity)."""
    import torch

    emb = model.get_input_embeddings().weight
    emb[:, c] = CONSTANT
    attention = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name.endswith(".o_proj")]
    mlps = mlp_modules(model)
    layers = model.config.get_text_config().num_hidden_layers
    if len(attention) != layers or len(mlps) != layers:
        raise SparsifyError(f"{type(model).__name__}: expected an o_proj and a gated MLP per layer ({layers}), "
                            f"found {len(attention)} and {len(mlps)}; synth does not support this layout.")
    for m in attention:
        m.weight.mul_(ATTN_SCALE)
    for m in [*attention, *(mlp.down_proj for mlp in mlps)]:
        m.weight[c, :] = 0
        if m.bias is not None:
            m.bias[c] = 0
    head = model.get_output_embeddings()
    if head is not None and head.weight is not emb:
        head.weight[:, c] = 0


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise SparsifyError(f"{path} is not a JSON model config ({e}); pass a model's config.json, the folder "
                            "holding one, or a Hub id.") from None
    if not isinstance(raw, dict):
        raise SparsifyError(f"{path} holds JSON but not a config object ({type(raw).__name__}); pass a model's "
                            "config.json.")
    return raw


def calibrate(model, zeros: float | list[float], *, skew: float, tokens: Any, check: Any, generator,
              stored: Any = None, progress: bool = False) -> list[float]:
    """Set each layer's gate column CHANNEL so neuron j fires on a fraction p_j of `tokens` ([B, L] ids), and
    return each layer's measured fraction of zeros in h on the fresh `check` ids ([B', L]).

    One forward of the decoder (no LM head) over both: at each MLP the thresholds come from the `tokens` rows,
    whose inputs went through the calibrated layers below; the `check` rows then run through the calibrated
    MLP like any later input (rows never mix), so they measure the finished model. Thresholds are rounded
    to `stored` (the dtype the folder is saved in; default the model's).
    """
    import torch
    from tqdm.auto import tqdm

    mlps = mlp_modules(model)
    targets = zeros if isinstance(zeros, list) else [zeros] * len(mlps)
    rows, found = tokens.shape[0], []
    bar = tqdm(total=len(mlps), desc="calibrating", unit="layer", disable=not progress)

    def set_thresholds(index):
        def pre(mlp, args):
            x = args[0][:rows].reshape(-1, args[0].shape[-1]).float()  # [N, d] the MLP's input (after the norm)
            w = gate_weight(mlp)
            _set_gate_channel(w, x, neuron_rates(w.shape[0], targets[index], skew, generator), stored or w.dtype)
            bar.update()
        return pre

    def count_zeros(mod, args):
        found.append(float((args[0][rows:] == 0).float().mean()))

    handles = [m.register_forward_pre_hook(set_thresholds(i)) for i, m in enumerate(mlps)]
    handles += [m.down_proj.register_forward_pre_hook(count_zeros) for m in mlps]
    try:
        with torch.no_grad():
            model.base_model(torch.cat([tokens, check]))
    finally:
        bar.close()
        for h in handles:
            h.remove()
    return found


def _set_gate_channel(w: Any, x: Any, p: Any, stored: Any) -> None:
    """w[:, CHANNEL] = minus the (1 - p_j) quantile of g_j / x_c over the rows of x [N, d], so that gate row j
    of w [F, d] is positive on a fraction p_j [F] of them; rounded to the `stored` dtype."""
    import torch

    xc = x[:, CHANNEL]
    if not bool((xc > 0).all()):
        raise SparsifyError("synth: the constant channel is not positive after a norm; this family's "
                            "norm layout is not supported.")
    w[:, CHANNEL] = 0
    t = (torch.nn.functional.linear(x, w.float()) / xc[:, None]).T.contiguous()  # [F, N]: fires iff t > -w[j, c]
    n = t.shape[1]
    k = ((1.0 - p.to(t.device)) * n).floor().long().clamp(0, n - 1)  # [F] rank of each neuron's threshold
    thr = _sorted_rows(t).gather(1, k[:, None])[:, 0]
    w[:, CHANNEL] = (-thr).to(stored).to(w.dtype)  # the value the saved folder will hold


def _sorted_rows(t: Any) -> Any:
    """t [F, N] with each row sorted; on CPU through numpy, whose vectorised sort is several times faster."""
    import numpy as np
    import torch

    if t.device.type != "cpu":
        return t.sort(dim=1).values
    return torch.from_numpy(np.sort(t.numpy(), axis=1))


def measure_zeros(model, tokens: Any) -> list[float]:
    """Fraction of zeros in h (the input of down_proj) per layer on `tokens` [B, L]."""
    import torch

    found: list[float] = []
    hooks = [m.down_proj.register_forward_pre_hook(lambda mod, args: found.append(float((args[0] == 0).float().mean())))
             for m in mlp_modules(model)]
    try:
        with torch.no_grad():
            model.base_model(tokens)  # h is all it needs: no LM head
    finally:
        for h in hooks:
            h.remove()
    return found


def synth(config: str | Path, out: str | Path, *, zeros: float = 0.9, layers: int | None = None,
          dtype: str = "bf16", device: str = "auto", seed: int = 0, skew: float = 1.0,
          calib_tokens: int = 1024, overwrite: bool = False, progress: bool = True) -> dict[str, Any]:
    """Write a random-weight sparsify model folder of `config` whose FFN activations have `zeros` zeros.

    Args:
        config: a config.json file, a model folder, or a Hub id (online).
        out: the folder to create (a normal sparsify model folder).
        zeros: target fraction of zeros in h per layer, in (0, 1).
        layers: keep only this many decoder layers (e.g. a 70B config at 2 layers).
        dtype: bf16, fp16 or fp32 for the saved weights (calibrated in that dtype, thresholds in fp32).
        device: where to build and calibrate ("auto": CUDA if available).
        seed: random seed for weights, rates and tokens.
        skew: spread of the log-normal per-neuron firing rates (0 = every neuron alike).
        calib_tokens: random tokens used for calibration (and again, fresh, for the check).

    Returns:
        The `sparsify.synthetic` record written to config.json (requested and measured zeros per layer).
    """
    import torch

    from sparsify.folder.format import DTYPES, check_output, save_model_folder

    dev = _check_arguments(zeros, dtype, layers, device)
    check_output(out, overwrite, kind="model")  # before building and calibrating
    if not progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    raw, folder, name = load_config(config)
    _check_size(raw, layers, dev)  # before building: a 70B config on a CPU would be killed, or fill the disk
    source_act = activation_of(raw)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = _random_model(raw, layers, dev, progress)
    vocab = model.get_input_embeddings().weight.shape[0]
    seq = min(512, calib_tokens)  # positions 0..511 in calibration; ATTN_SCALE keeps other lengths close
    calib = torch.randint(0, vocab, (max(1, calib_tokens // seq), seq), generator=gen).to(dev)
    check = torch.randint(0, vocab, (max(1, calib_tokens // seq), seq), generator=gen).to(dev)
    stored = getattr(torch, DTYPES[dtype])
    # Thresholds see the saved dtype's rounding (weights rounded to it); CPUs without bf16/fp16 matrix units
    # emulate those several times slower than float32, so there the same weights run in float32.
    compute = stored if dev.type == "cuda" else torch.float32
    model.to(stored).to(compute)
    if progress:
        print(f"synth: calibrating {len(mlp_modules(model))} layers to {zeros:.1%} zeros on {calib.numel():,} random "
              "tokens, measuring on as many fresh ones ...")
    measured = calibrate(model, zeros, skew=skew, tokens=calib, check=check, generator=gen, stored=stored,
                         progress=progress)
    model.to(stored)  # exact: every weight already holds a value of that dtype
    record = {"zeros_requested": zeros, "zeros_per_layer": [round(z, 4) for z in measured], "skew": skew,
              "seed": seed, "dtype": dtype, "measured_in": str(compute).removeprefix("torch."),
              "note": "random weights: for measuring speed, not quality"}
    extra, tokenizer = {}, None
    if folder is not None:
        extra = {f: (folder / f).read_bytes() for f in TOKENIZER_FILES if (folder / f).is_file()}
    if not extra:
        tokenizer = synthetic_tokenizer(vocab)
    model.config.sparsify = {"sparsity": sum(measured) / len(measured), "synthetic": record}
    provenance = {"source": f"synthetic ({name})", "activation": "relu", "source_activation": source_act,
                  "synthetic": record, "sparsity": sum(measured) / len(measured)}
    save_model_folder(model, tokenizer, out, provenance=provenance, overwrite=overwrite, extra_files=extra)
    if progress:
        per = ", ".join(f"{z:.3f}" for z in measured)
        print(f"synth: wrote {out}: zeros per layer {per} (requested {zeros}); random weights: speed, not quality.")
    return record


def _check_arguments(zeros: float, dtype: str, layers: int | None, device: str) -> Any:
    """The torch device to work on, after refusing bad arguments with the fix."""
    import torch

    if not 0.0 < zeros < 1.0:
        raise SparsifyError(f"--zeros {zeros} must be a fraction strictly between 0 and 1 (e.g. 0.9 for 90% zeros).")
    if dtype not in SAVED_DTYPES:
        raise SparsifyError(f"--dtype {dtype!r} is not one of {sorted(SAVED_DTYPES)}.")
    if layers is not None and layers < 1:
        raise SparsifyError(f"--layers {layers} must be at least 1.")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise SparsifyError(f"--device {device!r} is not a device; use auto, cpu or cuda (cuda:N).") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SparsifyError(f"--device {device}: this machine has no CUDA GPU that torch can use; use --device cpu "
                            "(a small config or --layers keeps it quick) or auto.")
    return dev


def _model_config(raw: dict[str, Any], layers: int | None) -> Any:
    """The transformers config of the ReLU model synth builds from config `raw`, cut to `layers`."""
    from transformers import AutoConfig

    family = family_for(raw)
    raw = {k: v for k, v in raw.items() if k not in ("auto_map", "sparsify", "quantization_config")}
    raw[family.act_field] = "relu"
    if layers is not None:
        raw["num_hidden_layers"] = layers
        if isinstance(raw.get("layer_types"), list):
            raw["layer_types"] = raw["layer_types"][:layers]
    raw["architectures"] = [family.causal_lm]
    return AutoConfig.for_model(**raw)


BUILD_BYTES = 5  # peak bytes per parameter of synth on the CPU


def _check_size(raw: dict[str, Any], layers: int | None, dev: Any) -> None:
    """Refuses --layers above the config's count, and on the CPU a model whose build does not fit the memory
    available now: BUILD_BYTES per parameter (float32 weights, the saved dtype's copy made from them; measured:
    the Llama-3.2-1B config, 1.24B parameters, peaked at 6.3 GB)."""
    import torch
    from transformers import AutoModelForCausalLM

    have = raw.get("num_hidden_layers") or (raw.get("text_config") or {}).get("num_hidden_layers")
    if layers is not None and have and layers > have:
        raise SparsifyError(f"--layers {layers}: the config has {have} decoder layers; pass at most {have} "
                            "(or leave --layers out for all of them).")
    if dev.type != "cpu":
        return

    def count(n: int | None) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in AutoModelForCausalLM.from_config(_model_config(raw, n)).parameters())

    params, free = count(layers), available_memory()
    if free is None or BUILD_BYTES * params <= free:
        return
    one = count(1)
    per_layer = count(2) - one  # a decoder layer's parameters; the rest (embeddings, head, norm) is one - per_layer
    fit = int((free / BUILD_BYTES - (one - per_layer)) // per_layer) if per_layer > 0 else 0
    fix = f"pass --layers {min(fit, have or fit)} or fewer (a few layers measure a layer's speed), or" if fit >= 1 \
        else f"not even one layer fits (the embeddings and one layer need ~{BUILD_BYTES * one / 2**30:.1f} GiB):"
    raise SparsifyError(f"a random model of this config ({params / 1e9:.2f}B parameters) needs "
                        f"~{BUILD_BYTES * params / 2**30:.1f} GiB of memory to build on the CPU, and "
                        f"{free / 2**30:.1f} GiB are available now: {fix} build it on a GPU (--device cuda).")


def _random_model(raw: dict[str, Any], layers: int | None, dev: Any, progress: bool) -> Any:
    """A float32 random-weight ReLU model of config `raw` (cut to `layers`), residual channel CHANNEL held
    constant."""
    import torch
    from transformers import AutoModelForCausalLM

    if progress:
        print(f"synth: building a random {family_for(raw).name} model on {dev} ...")
    with dev:
        model = AutoModelForCausalLM.from_config(_model_config(raw, layers), dtype=torch.float32).eval()
    with torch.no_grad():
        _hold_channel_constant(model, CHANNEL)
    return model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Make a random-weight sparsify model folder of any supported config with a chosen fraction of zeros "
        "in the FFN activations, to measure the speed-up TwELL kernels would give that model at that "
        "sparsity (`sparsify bench`). It measures speed, NOT quality: the weights are random.")
    parser.add_argument("config", help="a config.json file, a model folder, or a Hub id (online)")
    parser.add_argument("-o", "--output", required=True, help="the model folder to create")
    parser.add_argument("--zeros", type=float, default=0.9, help="fraction of zeros per layer (default 0.9)")
    parser.add_argument("--layers", type=int, default=None, help="keep only N decoder layers (big configs)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(SAVED_DTYPES), help="saved weight dtype (default bf16)")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda")
    parser.add_argument("--skew", type=float, default=1.0,
                        help="spread of per-neuron firing rates (log-normal sigma; 0 = uniform; default 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, rates and tokens (default 0)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder (only an empty one or a model "
                        "folder sparsify wrote)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress output")


def main(args: argparse.Namespace) -> int:
    synth(args.config, args.output, zeros=args.zeros, layers=args.layers, dtype=args.dtype, device=args.device,
          seed=args.seed, skew=args.skew, overwrite=args.overwrite, progress=not args.quiet)
    return 0
