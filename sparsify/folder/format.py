"""The model-folder format every stage reads and writes (atomic folder output: sparsify.folder.atomic, re-exported).

A sparsify model folder is a Hugging Face folder that loads two ways:
- stock transformers: `AutoModelForCausalLM.from_pretrained(folder)` gives the family's own class with a
  ReLU MLP activation (config.json keeps the family's `model_type`), i.e. a correct dense ReLU model;
- `trust_remote_code=True`: `auto_map` selects `modeling_sparsify.Sparse<Base>`, our flat modeling code
  copied into the folder together with the TwELL kernel files it imports.
config.json also carries a `sparsify` section with the provenance (source, revision, activation, version).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

from sparsify.version import __version__
from sparsify.families import THRESHOLD_ACT, Family, family_for, thresholded
from sparsify.folder.atomic import atomic_dir, check_output  # noqa: F401 (every stage's output helpers, from here)
from sparsify.folder.card import folder_card

MODELING_FILE = "modeling_sparsify.py"
# --dtype names a model folder is written or loaded in -> torch dtype attribute (None: as stored)
DTYPES = {"auto": None, "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}
ACT_FIELDS = ("hidden_act", "hidden_activation")


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
    """config.json for a sparsify folder: same family and fields, ReLU activation, auto_map, provenance. A
    thresholded folder (`sparsify.threshold` in the config or the provenance) gets THRESHOLD_ACT instead, which
    stock transformers refuses: its thresholds load only with the sparsify modeling code."""
    config = dict(config)
    config["sparsify"] = {**config.get("sparsify", {}), **provenance, "version": __version__}
    act = THRESHOLD_ACT if thresholded(config) else "relu"
    for field in {family.act_field, *(f for f in ACT_FIELDS if f in config)}:
        config[field] = act
    config["architectures"] = [family.causal_lm]
    config["auto_map"] = {"AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.Sparse{family.causal_lm}"}
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
                      overwrite: bool = False, extra_files: dict[str, bytes | str] | None = None,
                      flag: str = "-o/--output") -> Path:
    """Write a loaded model (stock or remote-code class) and its tokenizer as a sparsify model folder,
    atomically. `extra_files` (name -> content) are written beside the weights (recipe, stats, ...). An existing
    `out` is replaced only with `overwrite`, and only when empty or a model folder sparsify wrote (atomic.py);
    `flag` names the option that gave `out`, for that message."""
    out = Path(out)
    family_for(model.config)  # refuse early, before writing gigabytes
    with atomic_dir(out, overwrite, flag, kind="model") as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, content in (extra_files or {}).items():
            mode = "wb" if isinstance(content, bytes) else "w"
            with open(tmp / name, mode) as f:
                f.write(content)
        finalize_folder(tmp, provenance, name=out.name)
    return out
