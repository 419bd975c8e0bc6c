"""Preflight: every problem of a recipe found before any work (no model loaded, no text read), each with its fix.

Values out of range, settings that contradict each other, a missing model source, data entries that match no
file (with the recipe's data.fetch command, once, when fetching is what fixes them), held-out files that are
also training files. `load_recipe` reads a recipe (sparsify.train.config) and raises one SparsifyError listing
every problem, so a user fixes a recipe in one round trip.

    recipe = load_recipe("recipes/smollm2-135m.yaml", overrides=["train.lr=3e-4", "sparsity.l1=2e-2"])
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from sparsify.errors import SparsifyError
from sparsify.families import THRESHOLD_ACT, activation_of
from sparsify.sources import hub_source_problem, local_config, source_problem
from sparsify.sources import resolve_source as resolve_model_source
from sparsify.train.config import DataSection, Recipe, parse_recipe
from sparsify.train.data import (HELDOUT_NAME, heldout_mismatch, match_files, missing_reason, overlap_problems,
                                 relative_note, resolve_source, single_prepared, source_names)

Problems = list[tuple[tuple[str, ...], str]]  # (recipe keys involved, message naming the fix)


def load_recipe(source: str | Path | dict | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                check_paths: bool = True) -> Recipe:
    """Reads a recipe (YAML path, mapping, or None for the defaults), applies `section.key=value` overrides and
    checks it.

    check_paths: also check that the model source and the local data files exist (off only to print or
    compare a recipe on a machine without them).

    Raises:
        SparsifyError: listing every unknown key, wrongly typed value, invalid setting and missing file at once.
    """
    parsed = parse_recipe(source, overrides)
    raise_problems(parsed.where, parsed.errors + recipe_problems(parsed.recipe, check_paths=check_paths,
                                                                 skip=parsed.bad))
    return parsed.recipe


def _check_values(r: Recipe) -> Problems:
    """Problems with values that have the right type but make no sense: (keys involved, message naming the fix)."""
    return _check_train(r) + _check_data(r.data) + _check_data_values(r.data) + _check_sparsity(r) + _check_combinations(r)


def _check_train(r: Recipe) -> Problems:
    e: Problems = []
    t = r.train
    positive = {"train.seq_len": t.seq_len, "train.batch_size": t.batch_size, "train.grad_accum": t.grad_accum,
                "train.lr": t.lr, "train.log_every": t.log_every, "train.eval_batches": t.eval_batches,
                "train.keep_checkpoints": t.keep_checkpoints, "sparsity.plateau_window": r.sparsity.plateau_window}
    e += [((k,), f"{k}: got {v}; must be > 0") for k, v in positive.items() if v <= 0]
    non_negative = {"train.warmup_steps": t.warmup_steps, "train.weight_decay": t.weight_decay,
                    "train.clip": t.clip, "train.save_every": t.save_every, "train.eval_every": t.eval_every,
                    "train.profile_steps": t.profile_steps,
                    "sparsity.l1": r.sparsity.l1, "sparsity.ramp_steps": r.sparsity.ramp_steps,
                    "sparsity.plateau_tolerance": r.sparsity.plateau_tolerance, "distill.kd": r.distill.kd,
                    "distill.ce": r.distill.ce, "distill.mlp": r.distill.mlp, "sparsity.target_ramp": r.sparsity.target_ramp,
                    "lora.r": r.lora.r, "data.num_proc": r.data.num_proc}
    e += [((k,), f"{k}: got {v}; must be >= 0") for k, v in non_negative.items() if v < 0]
    if t.max_steps is None and t.max_tokens is None:
        e.append((("train.max_steps", "train.max_tokens"),
                  "train: neither max_steps nor max_tokens is set; set one, e.g. train.max_tokens=50_000_000"))
    for k in ("max_steps", "max_tokens"):
        if getattr(t, k) is not None and getattr(t, k) < 0:
            e.append(((f"train.{k}",), f"train.{k}: got {getattr(t, k)}; must be >= 0"))
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        e.append((("train.betas",), f"train.betas: got {t.betas}; expected two numbers in [0, 1), e.g. [0.9, 0.95]"))
    if not 0 <= t.min_lr_ratio <= 1:
        e.append((("train.min_lr_ratio",), f"train.min_lr_ratio: got {t.min_lr_ratio}; must be in [0, 1]"))
    return e


def _check_data(d: DataSection) -> Problems:
    e: Problems = []
    if not 0 <= d.validation_fraction < 0.5:
        e.append((("data.validation_fraction",),
                  f"data.validation_fraction: got {d.validation_fraction}; must be in [0, 0.5)"))
    unknown = [name for name in d.ood if name not in d.heldout]
    if unknown:
        e.append((("data.ood", "data.heldout"),
                  f"data.ood: {unknown} not among the data.heldout domains ({sorted(d.heldout) or 'none'}); data.ood "
                  "names which held-out domains are out of distribution, so each needs its files in data.heldout "
                  "(to drop the held-out domains: data.heldout={} data.ood=[])"))
    heldout_entries = [x for files in d.heldout.values() for x in files]
    if d.max_tokens is None and any(x.startswith("hub:") for x in d.train + d.validation + heldout_entries):
        e.append((("data.max_tokens", "data.train", "data.validation", "data.heldout"),
                  "data.max_tokens: not set while data.train streams a Hub dataset; set how many tokens to read, "
                  "e.g. data.max_tokens=1_000_000_000"))
    if not d.train:
        e.append((("data.train",),
                  "data.train: empty; list text files, globs or hub:NAME datasets, e.g. data.train=docs/*.txt"))
    return e


def _check_sparsity(r: Recipe) -> Problems:
    e: Problems = []
    sp = r.sparsity
    if sp.schedule == "ramp" and sp.ramp_steps == 0:
        e.append((("sparsity.schedule", "sparsity.ramp_steps"),
                  "sparsity.ramp_steps: 0 with schedule `ramp`; set the ramp length, e.g. sparsity.ramp_steps=200"))
    if sp.target is not None:
        targets = sp.target if isinstance(sp.target, list) else [sp.target]
        bad_targets = [v for v in targets if not 0 < v < 1]
        if not targets:
            e.append((("sparsity.target",), "sparsity.target: an empty list; give one fraction of zeros (e.g. 0.95) "
                      "or one per layer"))
        elif bad_targets:
            e.append((("sparsity.target",), f"sparsity.target: {bad_targets[0]} is outside (0, 1); it is the fraction "
                      "of zeros each layer is driven to, e.g. sparsity.target=0.95"))
        if sp.schedule == "ramp":
            e.append((("sparsity.target", "sparsity.schedule"),
                      "sparsity.schedule: `ramp` with sparsity.target set; target mode adapts each layer's coefficient "
                      "itself, so set sparsity.schedule=constant (or drop sparsity.target for a ramped fixed l1)"))
        if not 0 < sp.l1_min <= sp.l1_max:
            e.append((("sparsity.l1_min", "sparsity.l1_max"),
                      f"sparsity.l1_min / l1_max: got {sp.l1_min} / {sp.l1_max}; need 0 < l1_min <= l1_max"))
        if sp.target_gain <= 0:
            e.append((("sparsity.target_gain",), f"sparsity.target_gain: got {sp.target_gain}; must be > 0"))
    elif sp.target_ramp > 0:
        e.append((("sparsity.target_ramp", "sparsity.target"),
                  f"sparsity.target_ramp: {sp.target_ramp} without sparsity.target; the ramp raises the targets of "
                  "target mode: set sparsity.target (e.g. 0.95), or sparsity.target_ramp=0"))
    return e + _check_threshold(r)


def _check_threshold(r: Recipe) -> Problems:
    """sparsity.method=threshold and the keys that only it reads."""
    e: Problems = []
    sp, t = r.sparsity, r.train
    if sp.method != "threshold":  # warm-up keys under l1: unused (recipe_notes says so), so that a recipe of the
        return e                  # threshold method runs as L1 with one override, sparsity.method=l1
    if sp.target is None:
        e.append((("sparsity.method", "sparsity.target"), "sparsity.method: `threshold` needs sparsity.target, the "
                  "fraction of zeros theta holds each layer at (one value or one per layer), e.g. sparsity.target=0.95"))
    if sp.warmup_target is not None:
        warm = sp.warmup_target if isinstance(sp.warmup_target, list) else [sp.warmup_target]
        if not warm or any(not 0 < v < 1 for v in warm):
            e.append((("sparsity.warmup_target",), f"sparsity.warmup_target: got {sp.warmup_target}; give the L1 "
                      "warm-up's fraction of zeros in (0, 1), one value or one per layer, e.g. 0.85"))
        elif sp.warmup_tokens == 0:
            e.append((("sparsity.warmup_target", "sparsity.warmup_tokens"), "sparsity.warmup_target: set with "
                      "sparsity.warmup_tokens = 0, so there is no warm-up to drive; set its length, e.g. "
                      "sparsity.warmup_tokens=8_000_000, or drop warmup_target"))
    if sp.warmup_tokens < 0:
        e.append((("sparsity.warmup_tokens",), f"sparsity.warmup_tokens: got {sp.warmup_tokens}; must be >= 0"))
    elif t.max_tokens is not None and sp.warmup_tokens >= t.max_tokens:
        e.append((("sparsity.warmup_tokens", "train.max_tokens"), f"sparsity.warmup_tokens: {sp.warmup_tokens:,} is "
                  f"not below train.max_tokens {t.max_tokens:,}: theta would never be calibrated; shorten the warm-up "
                  "or raise the budget"))
    if sp.threshold_ramp < 0:
        e.append((("sparsity.threshold_ramp",), f"sparsity.threshold_ramp: got {sp.threshold_ramp}; must be >= 0 "
                  "(tokens; 0: no ramp)"))
    elif sp.threshold_ramp > 0 and sp.warmup_target is None:
        e.append((("sparsity.threshold_ramp", "sparsity.warmup_target"), "sparsity.threshold_ramp: set without "
                  "sparsity.warmup_target, where the ramp starts; set it (e.g. sparsity.warmup_target=0.85), or drop "
                  "the ramp"))
    if sp.allocate == "sensitivity":
        lo_hi = sp.allocate_range
        targets = sp.target if isinstance(sp.target, list) else [sp.target] if sp.target is not None else []
        mean = sum(targets) / len(targets) if targets else None
        if len(lo_hi) != 2 or not 0 < lo_hi[0] <= lo_hi[1] < 1:
            e.append((("sparsity.allocate_range",), f"sparsity.allocate_range: got {lo_hi}; give [low, high] "
                      "fractions of zeros with 0 < low <= high < 1, e.g. [0.90, 0.99]"))
        elif mean is not None and not lo_hi[0] <= mean <= lo_hi[1]:
            e.append((("sparsity.allocate_range", "sparsity.target"), f"sparsity.allocate_range: {lo_hi} does not "
                      f"hold the mean target {mean:.4g}; widen the range or change sparsity.target"))
        if not 0 < sp.allocate_probe < 0.2:
            e.append((("sparsity.allocate_probe",), f"sparsity.allocate_probe: got {sp.allocate_probe}; give a "
                      "small step of zeros in (0, 0.2), e.g. 0.02"))
    if sp.threshold_gain <= 0:
        e.append((("sparsity.threshold_gain",), f"sparsity.threshold_gain: got {sp.threshold_gain}; must be > 0"))
    if sp.blend_steps > 0:
        e.append((("sparsity.blend_steps", "sparsity.method"), f"sparsity.blend_steps: {sp.blend_steps} with "
                  "sparsity.method=threshold; both replace the MLP activation. Set sparsity.blend_steps=0"))
    if t.kernels != "dense" and sp.threshold_grad == "ste":
        e.append((("train.kernels", "sparsity.threshold_grad"), f"train.kernels: `{t.kernels}` with "
                  "sparsity.threshold_grad=ste; the packed FFN keeps only the gate values above theta, so it gives "
                  "the exact gradient. Set sparsity.threshold_grad=exact, or train.kernels=dense"))
    return e


def _check_combinations(r: Recipe) -> Problems:
    e: Problems = []
    t, sp = r.train, r.sparsity
    if r.distill.temperature <= 0:
        e.append((("distill.temperature",), f"distill.temperature: got {r.distill.temperature}; must be > 0"))
    if r.distill.ce == 0 and r.distill.kd == 0:
        e.append((("distill.ce", "distill.kd"),
                  "distill.ce=0 with distill.kd=0 leaves no loss on the logits: the model would learn nothing but "
                  "the sparsity penalty. Set distill.kd=1 (the logits of the original; the usual choice with ce=0) or "
                  "distill.ce=1"))
    if sp.blend_steps < 0:
        e.append((("sparsity.blend_steps",), f"sparsity.blend_steps: got {sp.blend_steps}; must be >= 0"))
    if sp.blend_steps > 0 and t.kernels != "dense":
        e.append((("sparsity.blend_steps", "train.kernels"),
                  f"sparsity.blend_steps: {sp.blend_steps} with train.kernels={t.kernels}; the packed FFN kernels "
                  "compute relu(gate) * up and cannot train the blended activation. Set train.kernels=dense"))
    if t.kernels != "dense" and r.lora.r > 0:
        e.append((("train.kernels", "lora.r"),
                  f"train.kernels: `{t.kernels}` with lora.r = {r.lora.r}; the packed FFN kernels read the base weights "
                  "and would bypass the adapters. Set train.kernels=dense for LoRA, or lora.r=0 for a full fine-tune"))
    if not 0 <= r.lora.dropout < 1:
        e.append((("lora.dropout",), f"lora.dropout: got {r.lora.dropout}; must be in [0, 1)"))
    return e


def _check_data_values(d: DataSection) -> Problems:
    """data.weights and data.heldout problems seen without reading the disk (the number of sources a prepared
    folder records is checked with the paths)."""
    e: Problems = []
    w = d.weights
    example = f"e.g. data.weights=[{', '.join(['1'] * max(len(d.train), 2))}]"
    if w and len(d.train) > 1 and len(w) != len(d.train):
        entries = ", ".join(f"[{k}] {x!r}" for k, x in enumerate(d.train))
        e.append((("data.weights", "data.train"),
                  f"data.weights: {len(w)} weight(s) for {len(d.train)} data.train entries; give one weight per entry, "
                  f"in the order of data.train ({entries}), {example}"))
    bad = [(k, v) for k, v in enumerate(w) if not (math.isfinite(v) and v >= 0)]
    if bad:
        k, v = bad[0]
        e.append((("data.weights",), f"data.weights: got {w}; weights must be finite numbers >= 0 (entry {k} is "
                  f"{v}); give each source's share, {example}"))
    elif w and sum(w) <= 0:
        e.append((("data.weights",), f"data.weights: got {w}, which sum to 0: nothing would be trained on; give at "
                  f"least one positive weight, {example}, or leave data.weights empty to draw each source in "
                  "proportion to its size"))
    for name, files in d.heldout.items():
        if not HELDOUT_NAME.fullmatch(name):
            fix = re.sub(r"\W+", "_", name).strip("_") or "general"
            fix = fix if re.fullmatch(r"[A-Za-z_]\w*", fix, re.ASCII) else f"d_{fix}"
            e.append((("data.heldout",), f"data.heldout: name {name!r} is not a simple identifier (ASCII letters, "
                      f"digits and _, not starting with a digit); it names the stream heldout-NAME.bin and the "
                      f"metrics: rename it, e.g. {fix}"))
        if not files:
            e.append((("data.heldout",), f"data.heldout.{name}: an empty list; list the files of this held-out "
                      f"domain (e.g. {{{name}: [data/heldout/*.txt]}}) or remove it"))
    return e


def _check_paths(r: Recipe) -> Problems:
    """What is missing on disk (model source, data files), told without loading a model or reading the text."""
    e = data_path_problems(r.data)
    problem = source_problem(r.model.source) or hub_source_problem(r.model.source, r.model.revision)
    if problem:
        e.append((("model.source",), f"model.source: {problem}"))
    local = None if problem else Path(str(resolve_model_source(r.model.source))).expanduser()
    if r.model.revision is not None and local is not None and local.exists():
        e.append((("model.revision", "model.source"), f"model.revision {r.model.revision}: model.source "
                  f"{r.model.source} is local, and a revision names a Hub commit, branch or tag; set "
                  "model.revision=null (or give the Hub id as model.source)"))
    config = local_config(r.model.source)
    if config is None:
        return e
    try:
        activation = activation_of(config)
    except SparsifyError as err:  # a family convert and finetune do not handle
        return e + [(("model.source",), f"model.source: {err}")]
    if activation == THRESHOLD_ACT:
        return e + [(("model.source",), f"model.source: {r.model.source} is a thresholded folder (trained with "
                     "sparsity.method=threshold); fine-tuning one further is not supported. Start from the folder it "
                     "was fine-tuned from (config.json sparsify.finetuned_from) or from the original model")]
    layers = config.get("num_hidden_layers")
    for key in ("target", "warmup_target"):
        values = getattr(r.sparsity, key)
        if isinstance(values, list) and len(values) > 1 and layers and len(values) != layers:
            e.append(((f"sparsity.{key}", "model.source"),
                      f"sparsity.{key}: {len(values)} values, but {r.model.source} has {layers} layers; give "
                      f"one value per layer, or a single number for all of them"))
    recorded = config.get("sparsify", {}).get("source_activation")  # the teacher's activation, if converted
    teacher = {f"distill.{k}": getattr(r.distill, k) for k in ("kd", "mlp") if getattr(r.distill, k) > 0}
    if teacher and activation == "relu" and recorded in (None, "relu"):  # (either loads the original model)
        e.append((("model.source", *teacher),
                  f"{' and '.join(f'{k}={v:g}' for k, v in teacher.items())} need{'s' * (len(teacher) == 1)} the "
                  f"original dense model, but {r.model.source} is a ReLU folder that does not record its source "
                  "activation (config.json sparsify.source_activation); give the SiLU source as model.source (it is "
                  f"converted first), or set {' '.join(f'{k}=0' for k in teacher)}."))
    return e


def data_path_problems(cfg: DataSection) -> Problems:
    """Every data problem that needs the disk but not the text. Missing or mixed entries, held-out files shared
    with training or validation, and data.weights against the sources of a prepared folder."""
    keys = ("data.train", "data.validation", "data.heldout")
    e = [(keys, msg) for msg in source_problems(cfg) + overlap_problems(cfg)]
    folder = single_prepared(cfg)
    if folder is not None:
        mismatch = heldout_mismatch(cfg, folder)
        if mismatch:
            e.append((("data.heldout", "data.train"), mismatch))
    names = source_names(cfg) if folder is not None or len(cfg.train) == 1 else []
    if cfg.weights and names and len(cfg.weights) != len(names):
        listing = ", ".join(f"[{k}] {n!r}" for k, n in enumerate(names))
        what = (f"data.train is the prepared folder {folder}, which records {len(names)} training source(s) "
                f"({listing})" if folder is not None else f"data.train has 1 entry ({listing})")
        e.append((("data.weights", "data.train"),
                  f"data.weights: {len(cfg.weights)} weight(s), but {what}; give one weight per source, in that "
                  f"order, e.g. data.weights=[{', '.join(['1'] * len(names))}], or leave data.weights empty"))
    return e


def source_problems(cfg: DataSection) -> list[str]:
    """Every problem with the local entries of data.train / data.validation / data.heldout, found without reading
    any text: entries that match no file or only empty files, or mix file types. Missing entries that the
    recipe's data.fetch command gets are told once, with that command, where the first of them is."""
    if single_prepared(cfg) is not None:
        return []
    problems: list[str] = []
    fetched: list[tuple[str, str]] = []  # (key, entry) that data.fetch gets
    for key, entry in _local_entries(cfg):
        files = match_files(entry)
        if not files and _fetched_by(entry, cfg.fetch):
            if not fetched:
                problems.append("")  # the place of the one message about fetching, filled in below
            fetched.append((key, entry))
        elif not files:
            problems.append(f"{key}: {entry!r} {missing_reason(entry)}")
        elif all(os.path.getsize(f) == 0 for f in files):
            shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
            problems.append(f"{key}: {entry!r} matches only empty files (0 bytes): {shown}. Give files with "
                            "text in them, or remove the entry.")
        else:
            try:
                resolve_source(entry)
            except SparsifyError as err:
                problems.append(f"{key}: {err}")
    return [p or _fetch_message(fetched, cfg.fetch) for p in problems]


def _local_entries(cfg: DataSection) -> list[tuple[str, str]]:
    keyed = [("data.train", cfg.train), ("data.validation", cfg.validation),
             *((f"data.heldout.{name}", files) for name, files in cfg.heldout.items())]
    return [(key, entry) for key, entries in keyed for entry in entries if not entry.startswith("hub:")]


def _fetched_by(entry: str, fetch: str) -> bool:
    """Whether the data.fetch command names where `entry` lives: the entry itself, or one of its folders (at least
    two levels deep when it has that many, since a top folder such as `data` says little)."""
    if not fetch.strip() or Path(entry).expanduser().is_dir():
        return False
    folders: list[str] = []
    for part in Path(entry).parts[:-1]:
        if any(c in part for c in "*?["):
            break
        folders.append(part)
    names = [str(Path(*folders[:k])) for k in range(len(folders), min(2, len(folders)) - 1, -1) if k]
    if not any(c in entry for c in "*?["):
        names.append(entry)
    return any(re.search(rf"(?<![\w.-]){re.escape(n)}(?![\w.-])", fetch) for n in names)


def _fetch_message(fetched: list[tuple[str, str]], fetch: str) -> str:
    keys = sorted({key for key, _ in fetched}, key=[k for k, _ in fetched].index)
    listing = "; ".join(f"{key} " + ", ".join(repr(e) for k, e in fetched if k == key) for key in keys)
    verb = "matches" if len(fetched) == 1 else f"{len(fetched)} entries match"
    command = "\n".join("      " + line for line in fetch.strip().splitlines())
    return (f"{listing}: {verb} no file yet{relative_note(Path(fetched[0][1]))}. This recipe's data.fetch gets "
            f"{'it' if len(fetched) == 1 else 'all of them'}: {_fetch_where(fetch)}:\n{command}")


def _fetch_where(fetch: str) -> str:
    """Where to run data.fetch: here, unless it calls scripts by relative paths (bash eval/corpus/get-corpus.sh)
    that are not here; then from the source checkout that has them (this command too: the recipe's data paths are
    relative), or, installed from a wheel, from a clone of the repository (the scripts are not in the package)."""
    scripts = sorted(set(re.findall(r"(?<![\w./-])((?:[\w.-]+/)+[\w.-]+\.(?:sh|py))\b", fetch)))
    missing = [s for s in scripts if not Path(s).is_file()]
    if not missing:
        return f"run it once from {Path.cwd()}, then run this command again"
    from sparsify.sources import source_checkout

    checkout = source_checkout()
    if checkout is not None and all((checkout / s).is_file() for s in missing):
        return (f"it calls {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} in the sparsify "
                f"checkout, not here: run it once from "
                f"{checkout}, then run this command from there (the recipe's data paths are relative)")
    return (f"it calls {', '.join(missing)}, which come with the sparsify repository, not the installed package: "
            "run it once from the root of a clone of the repository, then run this command from there")


def recipe_notes(r: Recipe, as_written: Recipe | None = None) -> list[str]:
    """What a valid recipe sets but will not use, said before work starts (never an error).

    as_written: the recipe before its command-line overrides (ParsedRecipe.as_written). A threshold recipe run as
    L1 by one override, sparsity.method=l1 (the README's CPU example), keeps its own warm-up keys: those are not
    noted, only values set otherwise (by an override, or by a recipe that is L1 itself)."""
    sp = r.sparsity
    own = as_written.sparsity if as_written is not None and as_written.sparsity.method == "threshold" else None
    unset = {"warmup_target": None, "warmup_tokens": 0, "threshold_ramp": 0, "allocate": "uniform"}
    used = [f"sparsity.{k}" for k, v in unset.items()
            if getattr(sp, k) != v and (own is None or getattr(sp, k) != getattr(own, k))]
    if sp.method != "threshold" and used:
        return [f"{', '.join(used)}: set, but sparsity.method is `{sp.method}`; they describe the L1 warm-up and "
                "the thresholds of sparsity.method=threshold and are not used in this run"]
    return []


def recipe_problems(recipe: Recipe, *, check_paths: bool = True, skip: set[str] = frozenset()) -> list[str]:
    """Every problem of a well-typed recipe that can be found without loading a model: values out of range, and
    (check_paths) a missing model source or data file. Checks involving a key in `skip` ("section.key" or
    "section.*": keys whose value had the wrong type) are left out."""
    found = _check_values(recipe) + (_check_paths(recipe) if check_paths else [])
    return [msg for keys, msg in found if not any(k in skip or f"{k.split('.')[0]}.*" in skip for k in keys)]


def raise_problems(where: str, errors: list[str]) -> None:
    """One SparsifyError listing every problem (nothing to do when there is none)."""
    if errors:
        listing = "\n".join(f"  - {msg}" for msg in errors)
        raise SparsifyError(f"{where} has {len(errors)} problem(s):\n{listing}\n"
                            f"Fix them in the file or override on the command line (section.key=value); "
                            f"`sparsify finetune --help` lists every key.")


