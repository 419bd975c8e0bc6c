"""Checkpoints of a run: OUT/checkpoints/step-N/{state.pt, meta.json}, written atomically, loaded without
unpickling code, and the checks that keep one output folder to one run (resume with the same recipe)."""

from __future__ import annotations

import fnmatch
import json
import pickle
import random
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from sparsify.version import __version__
from sparsify.errors import SparsifyError
from sparsify.train.config import Recipe, dump_recipe
from sparsify.train.distributed import Dist
from sparsify.train.step import Run, TrainState

CHECKPOINT_FORMAT = "sparsify-checkpoint/2"

# Recipe keys that may differ between a checkpoint and the run resuming it: where the run stops and how it is
# logged, saved and executed, none of which changes what one step computes (up to float summation order).
# Everything else (lr, seq_len, data, l1, kd, ...) must match, or the resumed run is a mix of two runs.
RESUMABLE_KEYS = (
    "output.*",  # where and what is written
    "data.fetch",  # how the text was fetched, not what it is
    "train.max_steps", "train.max_tokens",  # the budget: extend or cut a run (the cosine schedule follows it)
    "sparsity.plateau_tolerance", "sparsity.plateau_window",  # the stop rule, e.g. 0 to run the full budget
    "train.eval_every", "train.log_every", "train.save_every", "train.keep_checkpoints",
    "train.compile", "train.gradient_checkpointing", "train.distributed", "data.num_proc",  # speed / memory
    "train.attention", "train.profile_steps", "train.kernels",  # packed FFN: the same gradients to rounding
    "train.batch_size", "train.grad_accum",  # free as long as the global batch (checked below) is unchanged
)


def full_state(run: Run) -> tuple[dict, dict]:
    """Full (unsharded) model and optimizer state dicts on the CPU; collective under FSDP."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(run.student, run.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_checkpoint(run: Run, out: Path) -> Path:
    """OUT/checkpoints/step-N/{state.pt, meta.json}, written atomically by rank 0; keeps the newest keep_checkpoints.

    state.pt holds only tensors in plain containers (model, optimizer, RNG states as tensors), so it loads with
    torch.load(weights_only=True) and resuming never unpickles code; meta.json holds the rest (step, data
    position, scheduler, plateau history, recipe).
    """
    from sparsify.folder.format import atomic_dir

    model_sd, optim_sd = full_state(run)
    folder = out / "checkpoints" / f"step-{run.state.step:08d}"
    if run.dist.main:
        rng_tensors, rng_meta = _rng_state()
        meta = {"format": CHECKPOINT_FORMAT, "state": asdict(run.state), "scheduler": run.schedule.state_dict(),
                "plateau": run.plateau.state_dict(), "l1_control": run.l1_weights.state_dict(),
                "threshold_control": run.thresholds.state_dict(),
                "train_kernels": run.kernels.state_dict(), "recipe": dump_recipe(run.recipe), "world": run.dist.world,
                "version": __version__, "rng": rng_meta}
        with atomic_dir(folder, overwrite=True, kind=None) as tmp:
            torch.save({"model": model_sd, "optimizer": optim_sd, "rng": rng_tensors}, tmp / "state.pt")
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        for old in checkpoints(out)[: -run.recipe.train.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    run.dist.barrier()
    return folder


def _rng_state() -> tuple[dict, dict]:
    """Every RNG's state split into tensors (state.pt) and plain values (meta.json)."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    tensors = {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(np_keys.astype(np.int64)),
               "python": torch.tensor(py_state, dtype=torch.int64),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    return tensors, {"numpy": [np_name, np_pos, np_has_gauss, np_gauss], "python": [py_version, py_gauss]}


def _set_rng_state(tensors: dict, meta: dict) -> None:
    np_name, np_pos, np_has_gauss, np_gauss = meta["numpy"]
    torch.set_rng_state(tensors["torch"])
    np.random.set_state((np_name, tensors["numpy"].numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    py_version, py_gauss = meta["python"]
    random.setstate((py_version, tuple(tensors["python"].tolist()), py_gauss))
    if tensors["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(tensors["cuda"])


def checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints of output folder `out`, oldest first."""
    return sorted(p for p in (out / "checkpoints").glob("step-*") if (p / "state.pt").is_file())


def resumable_recipe(out: Path) -> str | None:
    """The recipe (YAML) of the newest checkpoint in output folder `out`; None when none can be resumed."""
    found = checkpoints(out)
    try:
        return read_checkpoint_meta(found[-1])["recipe"] if found else None
    except SparsifyError:
        return None


def read_checkpoint_meta(folder: Path) -> dict:
    """meta.json of a checkpoint; refuses a folder that has none of this format."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        meta = {}
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise SparsifyError(
            f"{folder} is not a checkpoint this sparsify can resume (no meta.json of format {CHECKPOINT_FORMAT}). "
            "Start the run over with output.overwrite=true, or set another output.dir.")
    return meta


def read_checkpoint_tensors(folder: Path) -> dict:
    """state.pt of a checkpoint, loaded with weights_only=True: tensors and plain containers only.

    Every rank maps the same file (mmap: one copy in the page cache, not one per rank).
    """
    path = folder / "state.pt"
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        detail = str(err).split("WeightsUnpickler error:")[-1].strip().splitlines()[0]
        raise SparsifyError(
            f"refusing to load {path}: it holds pickled Python objects, not only tensors and plain containers "
            f"({detail}). sparsify checkpoints never do, and unpickling such a file can run arbitrary code. "
            "Resume only from checkpoints written by sparsify; otherwise start over with output.overwrite=true or "
            "another output.dir.") from None


def load_checkpoint(run: Run, folder: Path) -> None:
    """Restores everything save_checkpoint wrote."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    meta, blob = read_checkpoint_meta(folder), read_checkpoint_tensors(folder)
    # under FSDP each rank keeps its own shard of the full tensors
    opts = StateDictOptions(full_state_dict=True)
    set_state_dict(run.student, run.optimizer, model_state_dict=blob["model"], optim_state_dict=blob["optimizer"], options=opts)
    run.schedule.load_state_dict(meta["scheduler"])
    run.state = TrainState(**meta["state"])
    run.plateau.load_state_dict(meta["plateau"])
    run.l1_weights.load_state_dict(meta["l1_control"])
    if "threshold_control" in meta:  # (absent from checkpoints of earlier versions: method l1)
        run.thresholds.load_state_dict(meta["threshold_control"])
    run.kernels.load_state_dict(meta["train_kernels"])  # the same layers packed with the same capacities
    _set_rng_state(blob["rng"], meta["rng"])
    # The final checkpoint records why the run ended; the resumed recipe may extend the budget or change the
    # plateau rule (RESUMABLE_KEYS), so decide again: the loop re-checks the budget, the plateau is asked here.
    if run.state.stopped.startswith("budget") or not run.plateau.reached():
        run.state.stopped = ""


def _flat(recipe: dict) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, keys in recipe.items() for key, value in (keys or {}).items()}


def check_resume_recipe(saved_yaml: str, saved_world: int, recipe: Recipe, world: int, checkpoint: Path) -> None:
    """Raises SparsifyError listing every setting of `recipe` that differs from the checkpoint's own recipe."""
    old, new = _flat(yaml.safe_load(saved_yaml)), _flat(yaml.safe_load(dump_recipe(recipe)))
    diffs = [f"{k}: {old.get(k, '(absent)')!r} in the checkpoint, now {new.get(k, '(absent)')!r}"
             for k in sorted(old.keys() | new.keys())
             if old.get(k) != new.get(k) and not any(fnmatch.fnmatchcase(k, pat) for pat in RESUMABLE_KEYS)]
    # sequences per optimizer step decide the data position and what a step means: they must stay the same
    was = old["train.batch_size"] * old["train.grad_accum"] * saved_world
    now = recipe.train.batch_size * recipe.train.grad_accum * world
    if was != now:
        diffs.append(f"global batch (train.batch_size x train.grad_accum x processes): {was} in the checkpoint "
                     f"({old['train.batch_size']} x {old['train.grad_accum']} x {saved_world}), now {now} "
                     f"({recipe.train.batch_size} x {recipe.train.grad_accum} x {world})")
    if diffs:
        listing = "\n".join(f"  - {d}" for d in diffs)
        raise SparsifyError(
            f"--resume: the recipe differs from the one {checkpoint} was trained with:\n{listing}\n"
            f"Resuming would mix two runs. Restore these values (the run's recipe is {checkpoint.parents[1] / 'recipe.yaml'}),"
            " or start a fresh run with another output.dir (or output.overwrite=true). Only these keys may change on "
            f"resume: {', '.join(RESUMABLE_KEYS)}.")


def check_output(out: Path, recipe: Recipe, resume: bool, dist: Dist) -> Path | None:
    """The checkpoint to resume from (None for a fresh run); refuses to mix runs in one folder, and an OUT/model
    that is not a model folder sparsify wrote (the export replaces it whole at the end: refused now, not then)."""
    from sparsify.folder.atomic import check_output as check_replaceable

    if (out / "model").exists():
        check_replaceable(out / "model", overwrite=True, flag="output.dir", kind="model")
    found = checkpoints(out)
    finished = (out / "model" / "config.json").is_file()
    if resume:
        if not found:
            kept = " (a finished run keeps its checkpoints only with output.keep_checkpoints_when_done=true)" \
                if finished else ""
            raise SparsifyError(f"--resume: no checkpoint in {out / 'checkpoints'}{kept}; run without --resume to "
                                "start, or set output.dir to the folder of the run to continue.")
        meta = read_checkpoint_meta(found[-1])
        check_resume_recipe(meta["recipe"], meta["world"], recipe, dist.world, found[-1])
        return found[-1]
    if (found or finished) and not recipe.output.overwrite:
        what = f"checkpoints of an earlier run (newest: {found[-1].name}); pass --resume to continue it," if found \
            else "a finished run (model/); set"
        raise SparsifyError(f"{out} holds {what} output.overwrite=true to start over, or choose another output.dir.")
    if dist.main:
        for stale in [out / "checkpoints", out / "metrics.jsonl", out / "tensorboard"]:
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    return None


def remove_checkpoints(out: Path, dist: Dist) -> None:
    """Deletes OUT/checkpoints (model and optimizer state: 12 bytes per parameter) once a run is done."""
    if dist.main:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    dist.barrier()
