"""The model-folder format every stage reads and writes, and atomic folder output.

A sparsify model folder is a Hugging Face folder that loads two ways:
- stock transformers: `AutoModelForCausalLM.from_pretrained(folder)` gives the family's own class with a
  ReLU MLP activation (config.json keeps the family's `model_type`), i.e. a correct dense ReLU model;
- `trust_remote_code=True`: `auto_map` selects `modeling_sparsify.Sparse<Base>`, our flat modeling code
  copied into the folder together with the TwELL kernel files it imports.
config.json also carries a `sparsify` section with the provenance (source, revision, activation, version).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sparsify.version import __version__
from sparsify.families import Family, family_for
from sparsify.folder.card import folder_card
from sparsify.errors import SparsifyError

MODELING_FILE = "modeling_sparsify.py"
# --dtype names a model folder is written or loaded in -> torch dtype attribute (None: as stored)
DTYPES = {"auto": None, "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}
ACT_FIELDS = ("hidden_act", "hidden_activation")


def check_output(out: str | os.PathLike, overwrite: bool = False, flag: str = "-o/--output") -> None:
    """Refuses an output path that exists (unless `overwrite`) or is not a folder: call it before long work.
    `flag` is the option that named it, for the message."""
    out = Path(out).absolute()
    if out.exists() and not overwrite:
        raise SparsifyError(f"output folder {out} already exists; pass --overwrite to replace it, "
                            f"or choose another {flag}.")
    if out.exists() and not out.is_dir():
        raise SparsifyError(f"output path {out} exists and is not a folder; choose another {flag}.")


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False, flag: str = "-o/--output") -> Iterator[Path]:
    """Yield a fresh temporary folder beside `out`; on success it replaces `out`, on any failure
    (exception, Ctrl-C) it is removed and `out` is left as it was.

    Leftovers of a run killed with SIGKILL (`.NAME.tmp-*`, `.NAME.old-*` beside `out`) are removed on entry.
    """
    out = Path(out).absolute()
    check_output(out, overwrite, flag)
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in [*out.parent.glob(f".{out.name}.tmp-*"), *out.parent.glob(f".{out.name}.old-*")]:
        if _is_dead_leftover(stale):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        yield tmp
        _normal_permissions(tmp)
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _is_dead_leftover(path: Path) -> bool:
    """True for a `.NAME.tmp-PID-*` / `.NAME.old-PID` folder whose process no longer runs (a killed run's)."""
    tag = path.name.split(".tmp-", 1)[1] if ".tmp-" in path.name else path.name.split(".old-", 1)[1]
    try:
        pid = int(tag.split("-", 1)[0])
    except ValueError:
        return False  # not one of ours: leave it alone
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename tmp to out; an existing out is moved aside first and moved back if the second rename fails."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _normal_permissions(folder: Path) -> None:
    """mkdtemp (and transformers' temp-file writes) leave 0700/0600; give what a plain copy would get."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


def shipped_code_files() -> list[Path]:
    """The bundle copied into every model folder: the flat .py files of sparsify.kernels (the modeling
    classes, the decode engine, the op, its dispatcher, the inference kernels and their reference).
    Sub-packages (the training kernels) are never shipped."""
    spec = importlib.util.find_spec("sparsify.kernels")  # no import: kernels may pull in triton
    kernel_dir = Path(next(iter(spec.submodule_search_locations)))
    return sorted(p for p in kernel_dir.glob("*.py") if p.name != "__init__.py")


def install_code(folder: Path) -> None:
    """Copy the flat modeling + kernel files into `folder`, replacing older copies."""
    for stale in folder.glob("*.py"):
        stale.unlink()
    for f in shipped_code_files():
        shutil.copyfile(f, folder / f.name)


def relu_config(config: dict[str, Any], family: Family, provenance: dict[str, Any]) -> dict[str, Any]:
    """config.json for a sparsify folder: same family and fields, ReLU activation, auto_map, provenance."""
    config = dict(config)
    for field in {family.act_field, *(f for f in ACT_FIELDS if f in config)}:
        config[field] = "relu"
    config["architectures"] = [family.causal_lm]
    config["auto_map"] = {"AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.Sparse{family.causal_lm}"}
    config["sparsify"] = {**config.get("sparsify", {}), **provenance, "version": __version__}
    return config


def finalize_folder(folder: Path, provenance: dict[str, Any], name: str) -> dict[str, Any]:
    """Turn a saved Hugging Face folder into a sparsify folder: rewrite config.json, install the code,
    write the model card (titled `name`, the folder's final name). Returns the new config."""
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config = relu_config(config, family_for(config), provenance)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    install_code(folder)
    (folder / "README.md").write_text(folder_card(name, config))
    return config


def save_model_folder(model: Any, tokenizer: Any, out: str | os.PathLike, *, provenance: dict[str, Any],
                      overwrite: bool = False, extra_files: dict[str, bytes | str] | None = None) -> Path:
    """Write a loaded model (stock or remote-code class) and its tokenizer as a sparsify model folder,
    atomically. `extra_files` (name -> content) are written beside the weights (recipe, stats, ...)."""
    out = Path(out)
    family_for(model.config)  # refuse early, before writing gigabytes
    with atomic_dir(out, overwrite) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, content in (extra_files or {}).items():
            mode = "wb" if isinstance(content, bytes) else "w"
            with open(tmp / name, mode) as f:
                f.write(content)
        finalize_folder(tmp, provenance, name=out.name)
    return out
