"""`sparsify eval`: accuracy, perplexity, sparsity profile and speed for one or more models, side by side.

    evaluate(["orig=smollm2.gguf", "relu=out/relu", "ft=out/ft"], tasks=["eval/tasks"],
             texts=["notes.txt"], limit=20, out="report/")

Sections (each optional):
- accuracy: lm-eval in-process (HFLM around the already-loaded model), tasks by name (Hub data) or local
  task YAML files/folders (offline; see eval/tasks/).
- perplexity and bits per byte on text files: sliding windows, each token scored once.
- sparsity profile on the same tokens: forward pre-hooks on every layer's mlp.down_proj capture
  h = act(gate) * up (its input in every supported family); per layer non-zeros per token, dead neurons,
  the largest (row, tile) count against the TwELL slots (the kernels' prefill tile and slots) and the union reuse R(BT) the kernels exploit.
- speed (CUDA only): prefill and decode tokens/s, the TwELL path against the same model dense, same run.

Writes report.json (with provenance), report.md and PNG plots into the output folder (see sparsify.report).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .convert import is_hub_id, load_gguf
from .errors import SparsifyError

# The paper's accuracy suite (mean of these seven); needs the Hub.
PAPER_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "openbookqa", "commonsense_qa")
# The (row, tile) layout is the kernels' prefill one (sparsify.kernels.twell_reference TILE, SLOTS),
# imported lazily so that `sparsify eval --help` does not import torch.
# Weights dtype names, as `sparsify convert --dtype` accepts them -> torch dtype attribute.
DTYPES = {"auto": None, "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}
REUSE_BLOCKS = (16, 32, 64, 128)  # token-block sizes BT for the union reuse R(BT)
LOCAL_TASKS_HINT = "eval/tasks/ (in the sparsify repository)"
OFFLINE_HINT = (
    "Offline, evaluate local tasks instead: `--tasks eval/tasks/` runs the multiple-choice and perplexity "
    "tasks shipped in the sparsify repository (or point --tasks at your own task YAML with "
    "`dataset_path: json` and a jsonl file), or `--tasks none` to skip accuracy."
)


# ----------------------------------------------------------------------------------------------- inputs
@dataclass
class ModelSpec:
    """One model to evaluate: a display name and where it comes from."""

    name: str
    source: str  # local model folder, Hub id, or .gguf file
    gguf_file: str | None = None  # file name inside `source` when loading a .gguf


@dataclass
class TaskSpec:
    """Resolved lm-eval tasks: names to run plus folders of local YAML (resolved copies) to index."""

    names: list[str] = field(default_factory=list)
    include_paths: list[str] = field(default_factory=list)
    registered: bool = False  # some names are lm-eval's own tasks (index its ~10k YAML files: ~5 s)

    def manager(self) -> Any:
        from lm_eval.tasks import TaskManager

        return TaskManager(include_path=self.include_paths or None, include_defaults=self.registered)


@dataclass
class SpeedGrid:
    """Shapes timed by --speed (CUDA only)."""

    batches: tuple[int, ...] = (1, 8, 32)
    seqs: tuple[int, ...] = (512, 2048)
    decode_batches: tuple[int, ...] = (1, 16)
    decode_prompt: int = 128
    decode_tokens: int = 64
    repeats: int = 5


def parse_models(models: list[str | Path]) -> list[ModelSpec]:
    """Turn `[NAME=]PATH` strings into ModelSpecs with unique names; checks local paths exist."""
    specs: list[ModelSpec] = []
    for raw in models:
        raw = str(raw)
        name, _, source = raw.partition("=") if _has_label(raw) else ("", "", raw)
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
                "folder, a .gguf file or a Hub id, optionally labelled as NAME=PATH."
            )
        default = path.stem if gguf else (path.name or source)
        specs.append(ModelSpec(name=name or default, source=source, gguf_file=gguf))
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


def check_texts(texts: list[str | Path]) -> list[Path]:
    """Text files must exist and hold some text; collects every problem into one error."""
    paths, problems = [], []
    for t in texts:
        p = Path(t).expanduser()
        if not p.is_file():
            problems.append(f"{t}: no such file")
        elif not p.read_text(encoding="utf-8", errors="replace").strip():
            problems.append(f"{t}: empty")
        paths.append(p)
    if problems:
        raise SparsifyError("--text: " + "; ".join(problems) + ". Pass UTF-8 text files (plain prose or docs).")
    return paths


# ------------------------------------------------------------------------------------------------ tasks
def resolve_tasks(tasks: list[str] | None, tmp: Path) -> TaskSpec:
    """Task names and local YAML paths -> names + include folders (resolved copies live in `tmp`).

    lm-eval needs absolute `data_files` paths, so every local YAML folder is copied into `tmp` with
    relative data_files rewritten against the YAML's own folder; `!function` helpers are copied beside it.
    """
    if tasks is None:
        return TaskSpec(names=list(PAPER_TASKS), registered=True)
    spec = TaskSpec()
    for i, item in enumerate(t for t in tasks if t and t.lower() != "none"):
        path = Path(item).expanduser()
        if path.suffix in (".yaml", ".yml") or path.exists():
            if not path.exists():
                raise SparsifyError(f"--tasks: {item} does not exist. Local tasks live in {LOCAL_TASKS_HINT}.")
            root = path if path.is_dir() else path.parent
            copy = tmp / f"tasks{i}"
            names = _copy_resolved(root, copy, only=None if path.is_dir() else path)
            if not names:
                raise SparsifyError(f"--tasks: {item} holds no task YAML (a `task:` or `group:` key).")
            spec.names += names
            spec.include_paths.append(str(copy))
        else:
            spec.names.append(item)
            spec.registered = True
    return spec


def _copy_resolved(root: Path, dest: Path, only: Path | None) -> list[str]:
    """Copy YAML (+ .py helpers) under `root` to `dest`, making data_files absolute; return task names."""
    import yaml

    names = []
    for src in sorted(root.rglob("*")):
        rel = src.relative_to(root)
        if src.suffix == ".py" and "__pycache__" not in rel.parts:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
        if src.suffix not in (".yaml", ".yml"):
            continue
        doc = yaml.load(src.read_text(encoding="utf-8"), Loader=_TaggedLoader)
        if not isinstance(doc, dict):
            continue
        kwargs = doc.get("dataset_kwargs") or {}
        if "data_files" in kwargs:
            kwargs["data_files"] = _absolute(kwargs["data_files"], src.parent)
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(yaml.dump(doc, Dumper=_TaggedDumper, sort_keys=False), encoding="utf-8")
        if only is None or src.resolve() == only.resolve():
            names += [doc[k] for k in ("task", "group") if isinstance(doc.get(k), str)][:1]
    return names


def _absolute(files: Any, base: Path) -> Any:
    if isinstance(files, str):
        return files if "://" in files else str((base / files).resolve())
    if isinstance(files, list):
        return [_absolute(f, base) for f in files]
    if isinstance(files, dict):
        return {k: _absolute(v, base) for k, v in files.items()}
    return files


class _Function(str):
    """A `!function module.name` scalar kept verbatim through our YAML round trip."""


def _yaml_classes():
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    class Dumper(yaml.SafeDumper):
        pass

    Loader.add_constructor("!function", lambda loader, node: _Function(loader.construct_scalar(node)))
    Dumper.add_representer(_Function, lambda dumper, v: dumper.represent_scalar("!function", str(v)))
    return Loader, Dumper


_TaggedLoader, _TaggedDumper = _yaml_classes()


def check_tasks(spec: TaskSpec) -> None:
    """Build every task once before any model loads, so missing data fails fast with a clear message."""
    if not spec.names:
        return
    manager = spec.manager()
    for name in spec.names:
        try:
            manager.load([name])
        except KeyError:
            raise SparsifyError(
                f"--tasks: {name!r} is neither an lm-eval task, group or tag nor a task YAML path. Use a "
                f"registered name (e.g. {', '.join(PAPER_TASKS[:3])}) or a YAML file/folder such as "
                f"{LOCAL_TASKS_HINT}."
            ) from None
        except Exception as e:  # datasets/hub raise many kinds (ConnectionError, OfflineModeIsEnabled, ...)
            raise SparsifyError(f"task {name!r}: its data could not be loaded ({type(e).__name__}: {e}). "
                                f"{OFFLINE_HINT}") from None


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


def is_sparsify_folder(spec: ModelSpec) -> bool:
    """A local folder written by sparsify: config.json with a `sparsify` section and auto_map pointing
    at our flat modeling_sparsify.py. Only such folders run their modeling code without --trust-remote-code."""
    config = Path(spec.source) / "config.json"
    if spec.gguf_file or not config.is_file():
        return False
    try:
        cfg = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(cfg, dict):
        return False
    auto_map = cfg.get("auto_map")
    return (isinstance(cfg.get("sparsify"), dict) and isinstance(auto_map, dict) and bool(auto_map)
            and all(str(v).split("--")[-1].startswith("modeling_sparsify.") for v in auto_map.values()))


def load_model(spec: ModelSpec, device: str, dtype: str, trust_remote_code: bool = False) -> tuple[Any, Any]:
    """Load model + tokenizer. Modeling code shipped with the model runs only for sparsify folders (our own
    modeling_sparsify.py) or when the user asked for it (`trust_remote_code`); others load stock."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dt = torch_dtype(dtype, device)
    trust = trust_remote_code or is_sparsify_folder(spec)
    where = str(Path(spec.source) / spec.gguf_file) if spec.gguf_file else spec.source
    try:
        if spec.gguf_file:  # dequantised like `sparsify convert` does it, same errors
            model, tok = load_gguf(Path(spec.source) / spec.gguf_file, str(dt).removeprefix("torch."))
        else:
            tok = AutoTokenizer.from_pretrained(spec.source, trust_remote_code=trust)
            model = AutoModelForCausalLM.from_pretrained(spec.source, trust_remote_code=trust, dtype=dt)
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


def down_projs(model: Any) -> list[Any]:
    """Each layer's down_proj, in layer order: its input is h = act(gate) * up in every supported family."""
    from .architectures import mlp_modules

    return [m.down_proj for m in mlp_modules(model)]


# --------------------------------------------------------------------------------------------- accuracy
def accuracy(model: Any, tok: Any, spec: TaskSpec, limit: int | None, batch_size: int) -> dict[str, dict]:
    """lm-eval in-process on the loaded model; returns {task: {metric: value, "samples": n}}."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=batch_size)
    out = simple_evaluate(model=lm, tasks=list(spec.names), task_manager=spec.manager(), limit=limit,
                          bootstrap_iters=0, log_samples=False)
    results: dict[str, dict] = {}
    for task, metrics in out["results"].items():
        row = {k.split(",")[0]: float(v) for k, v in metrics.items()
               if "," in k and "stderr" not in k and isinstance(v, (int, float))}
        samples = out.get("n-samples", {}).get(task, {})
        row["samples"] = int(samples.get("effective", samples.get("original", 0)))
        results[task] = row
    return results


# ---------------------------------------------------------------------------------------------- sparsity
class SparsityRecorder:
    """Forward pre-hooks on each down_proj accumulating TwELL-relevant statistics of h (exact zeros).

    Only positions in `self.keep` (the newly scored tokens of a sliding window) are counted, so every
    token of the text contributes once, in order; the union reuse uses consecutive tokens across windows.
    """

    def __init__(self, modules: list[Any]):
        self.keep = slice(None)
        self.layers = [_LayerStats() for _ in modules]
        self.handles = [m.register_forward_pre_hook(self._hook(i)) for i, m in enumerate(modules)]

    def _hook(self, i: int):
        def hook(module, inputs):
            h = inputs[0][:, self.keep]  # [B, t, F]
            self.layers[i].add((h != 0).reshape(-1, h.shape[-1]))  # [B*t, F] bool
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def summary(self) -> dict:
        layers = [s.result() for s in self.layers]
        tile, slots = kernel_layout()
        return {"tokens": layers[0]["tokens"] if layers else 0, "tile": tile, "slots": slots,
                "layers": layers, "summary": _summarise(layers)}


def kernel_layout() -> tuple[int, int]:
    """(tile width T, slots S) of the TwELL prefill layout the shipped kernels use."""
    from .kernels.twell_reference import SLOTS, TILE

    return TILE, SLOTS


class _LayerStats:
    def __init__(self):
        self.tile, self.slots = kernel_layout()
        self.nnz: list[Any] = []  # per-token counts, [t] int32 chunks
        self.neuron_hits = None  # [F] int64: tokens in which each neuron fired
        self.tile_max = 0
        self.tiles = self.overflow_tiles = self.overflow_rows = 0
        self.carry: dict[int, Any] = {}  # BT -> leftover rows [r < BT, F] bool
        self.pairs = dict.fromkeys(REUSE_BLOCKS, 0)  # active pairs inside full blocks
        self.unions = dict.fromkeys(REUSE_BLOCKS, 0)

    def add(self, active: Any) -> None:
        import torch

        rows, width = active.shape
        self.width = width
        counts = active.sum(dim=1)  # [t]
        self.nnz.append(counts.to("cpu", torch.int32))
        hits = active.sum(dim=0, dtype=torch.int64).cpu()  # [F]
        self.neuron_hits = hits if self.neuron_hits is None else self.neuron_hits + hits
        pad = (-width) % self.tile
        tiled = torch.nn.functional.pad(active, (0, pad)).view(rows, -1, self.tile).sum(dim=2)  # [t, F/T]
        self.tile_max = max(self.tile_max, int(tiled.max()) if rows else 0)
        self.tiles += tiled.numel()
        self.overflow_tiles += int((tiled > self.slots).sum())
        self.overflow_rows += int((tiled > self.slots).any(dim=1).sum())
        for bt in REUSE_BLOCKS:
            self._reuse(bt, active)

    def _reuse(self, bt: int, active: Any) -> None:
        import torch

        rows = torch.cat([self.carry[bt], active]) if bt in self.carry else active  # [r, F]
        full = rows.shape[0] // bt * bt
        if full:
            blocks = rows[:full].view(-1, bt, rows.shape[1])  # [n, BT, F]
            self.pairs[bt] += int(blocks.sum())
            self.unions[bt] += int(blocks.any(dim=1).sum())
        self.carry[bt] = rows[full:]

    def result(self) -> dict:
        import torch

        if not self.nnz:
            return {"tokens": 0}
        nnz = torch.cat(self.nnz).double()  # [N]
        dead = int((self.neuron_hits == 0).sum())
        return {
            "tokens": nnz.numel(), "width": self.width,
            "nnz_mean": float(nnz.mean()), "nnz_p99": float(torch.quantile(nnz, 0.99)), "nnz_max": int(nnz.max()),
            "density": float(nnz.mean()) / self.width,
            "dead": dead, "dead_frac": dead / self.width,
            "tile_max": self.tile_max, "overflow_rate": self.overflow_tiles / max(self.tiles, 1),
            "overflow_row_rate": self.overflow_rows / nnz.numel(),
            "reuse": {str(bt): (self.pairs[bt] / self.unions[bt] if self.unions[bt] else None) for bt in REUSE_BLOCKS},
        }


def _summarise(layers: list[dict]) -> dict:
    """Across layers: mean non-zeros per token, zeros %, dead %, worst tile, overflow, pooled reuse."""
    layers = [l for l in layers if l.get("tokens")]
    if not layers:
        return {}
    n = len(layers)
    width = sum(l["width"] for l in layers)
    return {
        "nnz_mean": sum(l["nnz_mean"] for l in layers) / n,
        "nnz_p99_max": max(l["nnz_p99"] for l in layers),
        "nnz_max": max(l["nnz_max"] for l in layers),
        "zeros": 1 - sum(l["nnz_mean"] for l in layers) / width,
        "dead_frac": sum(l["dead"] for l in layers) / width,
        "tile_max": max(l["tile_max"] for l in layers),
        "overflow_rate": sum(l["overflow_rate"] for l in layers) / n,
        "reuse": {bt: _mean_or_none([l["reuse"][bt] for l in layers]) for bt in map(str, REUSE_BLOCKS)},
    }


def _mean_or_none(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


# -------------------------------------------------------------------------------------------- perplexity
def text_pass(model: Any, tok: Any, text: str, window: int, max_tokens: int | None,
              recorder: SparsityRecorder | None) -> dict:
    """Sliding-window negative log-likelihood of `text`; each token scored once, with >= window/2 context.

    Bits per byte = total NLL / ln 2 / UTF-8 bytes of the scored text (tokenizer-independent).
    """
    import torch

    if max_tokens:  # tokenising a 50 MB file to keep 8k tokens wastes minutes; ~4 chars per token
        text = text[: max_tokens * 16]
    ids, n_bytes = _tokenize(tok, text, max_tokens)
    if len(ids) < 2:
        raise SparsifyError("--text: a text file holds fewer than 2 tokens; perplexity needs more text.")
    ids = torch.tensor(ids, device=model.device)  # [N]
    stride, nll, scored, prev_end = max(window // 2, 1), 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        new = end - prev_end if begin else end - 1  # the first token of the text has no prediction
        if recorder is not None:  # count each position's h once: those not seen in an earlier window
            recorder.keep = slice(prev_end - begin if begin else 0, None)
        with torch.inference_mode():
            logits = model(ids[None, begin:end], use_cache=False).logits[0, -new - 1:-1].float()  # [new, V]
        nll += float(torch.nn.functional.cross_entropy(logits, ids[end - new:end], reduction="sum"))
        scored, prev_end = scored + new, end
        if end == len(ids):
            break
    return {"tokens": scored, "bytes": n_bytes, "nll": nll / max(scored, 1),
            "perplexity": math.exp(nll / max(scored, 1)), "bits_per_byte": nll / math.log(2) / max(n_bytes, 1)}


def _tokenize(tok: Any, text: str, max_tokens: int | None) -> tuple[list[int], int]:
    """Token ids (at most max_tokens) and the UTF-8 byte count of the text they cover."""
    try:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ids = enc["input_ids"][: max_tokens or None]
        covered = text[: enc["offset_mapping"][len(ids) - 1][1]] if ids else ""
    except (NotImplementedError, TypeError, KeyError):  # slow tokenizers have no offsets
        ids = tok(text, add_special_tokens=False)["input_ids"][: max_tokens or None]
        covered = tok.decode(ids)
    return ids, len(covered.encode("utf-8"))


def texts_section(model: Any, tok: Any, texts: list[Path], window: int, max_tokens: int | None) -> tuple[dict, dict]:
    """Perplexity per text file and one sparsity profile over all of them (same forward passes).

    Remote-code models run their dense torch FFN here: the TwELL kernels never call down_proj, so its hook
    would see nothing (the kernels compute the same function; speed is measured separately).
    """
    recorder = SparsityRecorder(down_projs(model))
    previous = set_ffn_backend(model, "dense")
    try:
        ppl = {p.name: text_pass(model, tok, p.read_text(encoding="utf-8", errors="replace"),
                                 window, max_tokens, recorder) for p in texts}
    finally:
        recorder.remove()
        set_ffn_backend(model, previous)
    profile = recorder.summary()
    missed = [i for i, layer in enumerate(profile["layers"]) if layer["tokens"] != profile["tokens"]]
    if missed:
        raise SparsifyError(f"sparsity profile: layers {missed} saw a different number of tokens than layer 0; "
                            "their down_proj was not called on every forward (an unknown fused MLP?).")
    return ppl, profile


def model_window(model: Any, window: int) -> int:
    limit = getattr(model.config, "max_position_embeddings", None) or window
    return max(2, min(window, int(limit)))


# ------------------------------------------------------------------------------------------------- speed
def mlps(model: Any) -> list[Any]:
    """Per-layer gated MLP modules in order."""
    from .architectures import mlp_modules

    return list(mlp_modules(model))


def set_ffn_backend(model: Any, backend: str | dict) -> dict:
    """Set `ffn_backend` on every module that has it (sparsify remote-code MLPs): one backend for all, or a
    dict module -> backend (what an earlier call returned, to restore). Returns the previous settings."""
    previous = {m: m.ffn_backend for m in model.modules() if hasattr(m, "ffn_backend")}
    for module in previous:
        module.ffn_backend = backend[module] if isinstance(backend, dict) else backend
    return previous


def speed_section(model: Any, tokens: Any, grid: SpeedGrid) -> dict:
    """Prefill and decode tokens/s, TwELL vs dense on the same weights in this run; CUDA only.

    Inputs are real text tokens (random ids would give unrealistic sparsity), tiled to fill each shape.
    """
    import torch

    if model.device.type != "cuda":
        return {"available": False, "reason": "speed needs a CUDA GPU: CPU timings say nothing about the "
                "TwELL kernels. Run `sparsify eval --speed` on a machine with an NVIDIA GPU."}
    # dense: torch FFN; twell: the sparse kernels forced; auto: the dispatcher's choice (what users get)
    previous = set_ffn_backend(model, "auto")
    try:
        backends = ["dense", "twell", "auto"] if previous else ["stock"]
        seqs = sorted({min(s, int(getattr(model.config, "max_position_embeddings", 0) or s)) for s in grid.seqs})
        prefill, decode, share = _speed_rows(model, tokens, grid, backends, seqs)
    finally:  # an error (or Ctrl-C) mid-run must not leave the model on a forced backend
        set_ffn_backend(model, previous)
    return {"available": True, "backends": backends, "device": torch.cuda.get_device_name(model.device),
            "dtype": str(model.dtype).removeprefix("torch."), "prefill": prefill, "decode": decode,
            "ffn_share": share, "speedup": _speedups(prefill, decode)}


def _speed_rows(model: Any, tokens: Any, grid: SpeedGrid, backends: list[str],
                seqs: list[int]) -> tuple[list[dict], list[dict], dict]:
    """Prefill rows, decode rows and FFN time share, each shape under every backend."""
    dev = model.device
    prefill, decode = [], []
    for b in grid.batches:
        for s in seqs:
            prefill += [{"batch": b, "seq": s, **r} for r in
                        _each_backend(model, backends, _prefill_row, _text_batch(tokens, b, s, dev), grid.repeats)]
    for b in grid.decode_batches:
        prompt = _text_batch(tokens, b, grid.decode_prompt, dev)
        decode += [{"batch": b, "prompt": grid.decode_prompt, "new_tokens": grid.decode_tokens, **r}
                   for r in _each_backend(model, backends, _decode_row, prompt, grid)]
    mid = _text_batch(tokens, grid.batches[len(grid.batches) // 2], seqs[-1], dev)
    share = {r.pop("backend"): r for r in _each_backend(model, backends, _ffn_share, mid) if not r.get("repeat")}
    return prefill, decode, share


def _each_backend(model: Any, backends: list[str], fn, *args) -> list[dict]:
    """One shape under every backend back to back (same clocks, same cache state), then dense once more:
    the two dense numbers' spread is the run's noise, reported next to the ratios."""
    order = backends + (["dense"] if "dense" in backends else [])
    rows = []
    for i, backend in enumerate(order):
        if backend != "stock":
            set_ffn_backend(model, backend)
        rows.append({"backend": backend, **({"repeat": True} if i == len(backends) else {}),
                     **_guard_oom(fn, model, *args)})
    return rows


def _text_batch(tokens: Any, batch: int, seq: int, device: Any = "cpu") -> Any:
    """[B, S] consecutive text tokens (the text repeated when too short): each row a different passage."""
    import torch

    need = batch * seq
    reps = -(-need // tokens.numel())
    return torch.cat([tokens] * reps)[:need].view(batch, seq).to(device)  # [B, S]


def _guard_oom(fn, *args) -> dict:
    """Run one measurement; out-of-memory or a kernel refusing a shape becomes a row note, not a crash."""
    import torch

    try:
        return {**fn(*args), "path": _ran_path(args[0])}
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"error": "out of memory"}
    except (RuntimeError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def _ran_path(model: Any) -> str | None:
    """Which FFN path the last forward took, from SparseMLP.last_path ("twell_ffn:twell", "twell_ffn:dense"
    as the kernels' dispatcher ran it, or "torch"); None for stock models."""
    paths = sorted({m.last_path for m in model.modules() if getattr(m, "last_path", "")})
    return ",".join(paths) or None


def _forward(model: Any, ids: Any, **kw) -> Any:
    try:  # logits for the last position only, as a real prefill would (the lm_head over all is not FFN work)
        return model(ids, logits_to_keep=1, **kw)
    except TypeError:
        return model(ids, **kw)


def _cuda_ms(fn, repeats: int) -> float:
    """Median milliseconds of fn() over `repeats` timed calls after two warm-ups (autotune, allocator)."""
    import torch

    fn(), fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _prefill_row(model: Any, ids: Any, repeats: int) -> dict:
    import torch

    def run():
        with torch.inference_mode():
            _forward(model, ids, use_cache=False)

    ms = _cuda_ms(run, repeats)
    torch.cuda.reset_peak_memory_stats(model.device)
    run()
    peak = torch.cuda.max_memory_allocated(model.device)
    return {"ms": ms, "tokens_per_s": ids.numel() / ms * 1e3, "peak_mem_gb": peak / 2**30}


def _decode_row(model: Any, prompt: Any, grid: SpeedGrid) -> dict:
    """Greedy decode of grid.decode_tokens tokens after a prefilled prompt; only the decode steps timed."""
    import torch

    # transformers >= 5.2x names the KV cache `cache` (`past_key_values` is deprecated); 5.17 only knows the latter
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def run() -> float:
        with torch.inference_mode():
            out = _forward(model, prompt, use_cache=True)
            past, nxt = getattr(out, name), out.logits[:, -1:].argmax(-1)  # [B, 1]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(grid.decode_tokens):
                out = model(nxt, use_cache=True, **{name: past})
                past, nxt = getattr(out, name), out.logits[:, -1:].argmax(-1)
            end.record()
            end.synchronize()
        return start.elapsed_time(end)

    run()  # warm-up
    torch.cuda.reset_peak_memory_stats(model.device)
    times = sorted(run() for _ in range(max(grid.repeats // 2, 1)))
    ms = times[len(times) // 2]
    return {"ms": ms, "tokens_per_s": prompt.shape[0] * grid.decode_tokens / ms * 1e3,
            "peak_mem_gb": torch.cuda.max_memory_allocated(model.device) / 2**30}


def _ffn_share(model: Any, ids: Any) -> dict:
    """Fraction of one prefill's GPU time spent inside the MLP modules (CUDA events around each call)."""
    import torch

    events: list[tuple[Any, Any]] = []

    def pre(module, inputs):
        events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        events[-1][0].record()

    def post(module, inputs, output):
        events[-1][1].record()

    handles = [h for m in mlps(model) for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        with torch.inference_mode():
            _forward(model, ids, use_cache=False)  # warm-up
            events.clear()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _forward(model, ids, use_cache=False)
            end.record()
            end.synchronize()
    finally:
        for h in handles:
            h.remove()
    total, ffn = start.elapsed_time(end), sum(a.elapsed_time(b) for a, b in events)
    return {"batch": ids.shape[0], "seq": ids.shape[1], "total_ms": total, "ffn_ms": ffn, "ffn_share": ffn / total}


def _speedups(prefill: list[dict], decode: list[dict]) -> dict:
    """twell and auto tokens/s over dense tokens/s for each shape measured with all (same run, same weights)."""
    def ratios(rows: list[dict], key: tuple[str, ...]) -> list[dict]:
        by = {(r["backend"], bool(r.get("repeat")), *(r[k] for k in key)): r.get("tokens_per_s") for r in rows}
        out = []
        for r in rows:
            if r["backend"] != "dense" or r.get("repeat") or not r.get("tokens_per_s"):
                continue
            shape = tuple(r[k] for k in key)
            twell, auto, again = (by.get((b, rep, *shape)) for b, rep in (("twell", False), ("auto", False), ("dense", True)))
            if twell or auto:
                dense = r["tokens_per_s"]
                out.append({**dict(zip(key, shape)), "twell_over_dense": twell / dense if twell else None,
                            "auto_over_dense": auto / dense if auto else None,
                            "dense_noise": abs(again / dense - 1) if again else None})
        return out

    return {"prefill": ratios(prefill, ("batch", "seq")), "decode": ratios(decode, ("batch",))}


def speed_tokens(tok: Any, texts: list[Path]) -> Any:
    """Real text for speed runs: the first --text file, else the sample text shipped with sparsify."""
    import torch

    data = Path(__file__).parent / "corpus"
    shipped = [data / "python-howto-heldout.txt", *sorted(data.glob("*.txt"))]
    source = texts[0] if texts else next((p for p in shipped if p.is_file()), None)
    if source is None:
        raise SparsifyError("--speed needs real text (sparsity depends on it): pass --text FILE.")
    text = source.read_text(encoding="utf-8", errors="replace")[:400_000]
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"])  # [N]


# -------------------------------------------------------------------------------------------- provenance
def provenance(device: str) -> dict:
    """Versions, machine, git commit: every report explains where its numbers came from."""
    import importlib.metadata as md
    import platform
    import subprocess
    import sys

    import torch

    from . import __version__

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    repo = Path(__file__).resolve().parents[1]
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
        "name": spec.name, "source": spec.source + (f"/{spec.gguf_file}" if spec.gguf_file else ""),
        "path": str(Path(spec.source).resolve()) if Path(spec.source).exists() else None,
        "class": type(model).__name__, "model_type": getattr(cfg, "model_type", None),
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
    trust_remote_code: bool = False  # run modeling code of models other than sparsify folders
    grid: SpeedGrid = field(default_factory=SpeedGrid)


def evaluate(models: list[str | Path], *, tasks: list[str] | None = None, texts: list[str | Path] = (),
             limit: int | None = None, speed: bool = False, out: str | Path | None = None,
             **options: Any) -> dict:
    """Evaluate one or more models side by side and (if `out`) write report.json, report.md and plots.

    Args:
        models: model folders, .gguf files or Hub ids, each optionally labelled `NAME=PATH`.
        tasks: lm-eval task names and/or local task YAML files/folders; None = the paper's seven
            (needs the Hub); [] or ["none"] = no accuracy section.
        texts: text files for perplexity, bits per byte and the sparsity profile.
        limit: at most this many examples per task.
        speed: time prefill/decode, TwELL vs dense (CUDA only; on CPU the section says so).
        out: output folder; files are replaced atomically.
        **options: EvalSettings fields (batch_size, window, text_tokens, device, dtype, trust_remote_code,
            grid). dtype: auto, bf16/bfloat16, fp16/float16 or fp32/float32. trust_remote_code: run the
            modeling code of Hub ids and folders other than sparsify's own (sparsify folders always run theirs).
    Returns:
        The report dict (what report.json holds).
    """
    settings = EvalSettings(tasks=tasks, texts=[str(t) for t in texts], limit=limit, speed=speed, **options)
    torch_dtype(settings.dtype, "cpu")  # an unknown --dtype fails before any model is loaded
    specs = parse_models(list(models))
    text_paths = check_texts(settings.texts)
    device = pick_device(settings.device)
    with tempfile.TemporaryDirectory(prefix="sparsify-tasks-") as tmp:
        task_spec = resolve_tasks(tasks, Path(tmp))
        check_tasks(task_spec)
        rows = _run_all(specs, task_spec, text_paths, settings, device)
    report = {"sparsify_report": 1, "provenance": provenance(device),
              "settings": {**asdict(settings), "device": device, "task_names": task_spec.names},
              "models": rows}
    if out is not None:
        from .report import write_report

        write_report(report, Path(out))
    return report


def _run_all(specs: list[ModelSpec], task_spec: TaskSpec, texts: list[Path], settings: EvalSettings,
             device: str) -> list[dict]:
    from tqdm.auto import tqdm

    stages = ["load"] + ["accuracy"] * bool(task_spec.names) + ["text"] * bool(texts) + ["speed"] * settings.speed
    rows = []
    with tqdm(total=len(specs) * len(stages), desc="sparsify eval", unit="stage") as bar:
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
    parser.epilog = ("Offline example: sparsify eval orig=model.gguf relu=out/relu ft=out/ft "
                     "--tasks eval/tasks/ --text notes.txt --limit 20 --out report/")
    parser.add_argument("models", nargs="+", metavar="MODEL",
                        help="model folder, .gguf file or Hub id; label it as NAME=PATH for the tables")
    parser.add_argument("--tasks", default=None,
                        help="comma-separated lm-eval task names and/or local task YAML files or folders "
                             f"(offline: eval/tasks/); 'none' skips accuracy. Default: {','.join(PAPER_TASKS)} "
                             "(the paper's suite; needs the Hub)")
    parser.add_argument("--text", nargs="+", action="extend", default=[], metavar="FILE",
                        help="text files for perplexity, bits per byte and the sparsity profile")
    parser.add_argument("--limit", type=int, default=None, help="at most N examples per task (quick runs)")
    parser.add_argument("--speed", action="store_true", help="time prefill/decode, TwELL vs dense (CUDA only)")
    parser.add_argument("--out", default="eval-report", help="output folder (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="lm-eval batch size (default: %(default)s)")
    parser.add_argument("--window", type=int, default=1024,
                        help="perplexity window in tokens; each token is scored with >= window/2 context")
    parser.add_argument("--text-tokens", type=int, default=16384,
                        help="at most N tokens per text file (default: %(default)s; 0 = all)")
    parser.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if available)")
    parser.add_argument("--dtype", default="auto", choices=list(DTYPES),
                        help="weights dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the modeling code that a Hub model or a non-sparsify folder ships (only for "
                             "models you trust); folders written by sparsify always run their own "
                             "modeling_sparsify.py, other models load as stock transformers classes")
    parser.add_argument("--speed-batches", type=_ints, default=SpeedGrid.batches, help="prefill batch sizes, e.g. 1,8,32")
    parser.add_argument("--speed-seqs", type=_ints, default=SpeedGrid.seqs, help="prefill sequence lengths, e.g. 512,2048")
    parser.add_argument("--decode-batches", type=_ints, default=SpeedGrid.decode_batches, help="decode batch sizes")


def main(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise SparsifyError(f"--limit {args.limit}: must be a positive number of examples.")
    tasks = None if args.tasks is None else [t.strip() for t in args.tasks.split(",") if t.strip()]
    grid = SpeedGrid(batches=args.speed_batches, seqs=args.speed_seqs, decode_batches=args.decode_batches)
    report = evaluate(args.models, tasks=tasks, texts=args.text, limit=args.limit, speed=args.speed,
                      out=args.out, batch_size=args.batch_size, window=args.window,
                      text_tokens=args.text_tokens or None, device=args.device, dtype=args.dtype,
                      trust_remote_code=args.trust_remote_code, grid=grid)
    from .report import render_markdown

    print(render_markdown(report))
    print(f"wrote {Path(args.out) / 'report.json'}, report.md and plots")
    return 0
