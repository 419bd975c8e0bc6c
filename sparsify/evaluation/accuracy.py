"""Accuracy for `sparsify eval`: lm-eval in-process on an already-loaded model.

Tasks are lm-eval names (Hub data) or local task YAML files/folders (offline; see eval/tasks/). Local YAML
is copied with its relative `data_files` made absolute (lm-eval needs that) and `!function` helpers beside
it; every task is built once before any model loads, so missing data fails fast.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shlex
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparsify.errors import SparsifyError
from sparsify.sources import hub_unreachable

# The paper's accuracy suite (mean of these seven); needs the Hub.
PAPER_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "openbookqa", "commonsense_qa")
_CHECKOUT_TASKS = Path(__file__).resolve().parents[2] / "eval" / "tasks"  # in a source checkout only
# the tasks shipped with the repository, by a path that works from any folder where this is a checkout
LOCAL_TASKS = shlex.quote(f"{_CHECKOUT_TASKS}/") if _CHECKOUT_TASKS.is_dir() else "eval/tasks/"
LOCAL_TASKS_HINT = LOCAL_TASKS if _CHECKOUT_TASKS.is_dir() else "eval/tasks/ (in the sparsify repository)"
OFFLINE_HINT = (
    f"Offline, evaluate local tasks instead: `--tasks {LOCAL_TASKS}` runs the multiple-choice and perplexity "
    "tasks shipped in the sparsify repository (or point --tasks at your own task YAML with "
    "`dataset_path: json` and a jsonl file), or `--tasks none` to skip accuracy."
)


@dataclass
class TaskSpec:
    """Resolved lm-eval tasks: names to run plus folders of local YAML (resolved copies) to index."""

    names: list[str] = field(default_factory=list)
    include_paths: list[str] = field(default_factory=list)
    by_name: list[str] = field(default_factory=list)  # the names given as lm-eval's own tasks: data from the Hub

    @property
    def registered(self) -> bool:
        """Some names are lm-eval's own tasks (index its ~10k YAML files: ~5 s)."""
        return bool(self.by_name)

    def manager(self) -> Any:
        from lm_eval.tasks import TaskManager

        return TaskManager(include_path=self.include_paths or None, include_defaults=self.registered)


def resolve_tasks(tasks: list[str] | None, tmp: Path) -> TaskSpec:
    """Task names and local YAML paths -> names + include folders (resolved copies live in `tmp`).

    lm-eval needs absolute `data_files` paths, so every local YAML folder is copied into `tmp` with
    relative data_files rewritten against the YAML's own folder; `!function` helpers are copied beside it.
    """
    if tasks is None:
        return TaskSpec(names=list(PAPER_TASKS), by_name=list(PAPER_TASKS))
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
            spec.by_name.append(item)
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
    """Build every task once before any model loads, so missing data fails fast with a clear message.

    lm-eval's own tasks download their data from the Hub, retrying each file for about half a minute when it
    cannot be reached: where the Hub's name does not resolve (sparsify.sources.hub_unreachable, checked once),
    that is said at once instead, unless HF_HUB_OFFLINE / HF_DATASETS_OFFLINE ask for the local cache."""
    if not spec.names:
        return
    manager = spec.manager()
    unknown = next((n for n in spec.names if n not in manager.all_tasks), None)
    if unknown is not None:  # a typo is a typo, online or not
        raise _unknown_task(unknown)
    if spec.by_name and not _cache_only() and hub_unreachable():
        default = " (the default without --tasks: the paper's suite)" if spec.by_name == list(PAPER_TASKS) else ""
        raise SparsifyError(
            f"tasks {', '.join(spec.by_name)}{default}: lm-eval downloads their data from the Hugging Face Hub, "
            "which cannot be reached from here (its host name does not resolve). Data already in the local cache: "
            f"run again with HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1. {OFFLINE_HINT}")
    for name in spec.names:
        try:
            manager.load([name])
        except KeyError:
            raise _unknown_task(name) from None
        except Exception as e:  # datasets/hub raise many kinds (ConnectionError, OfflineModeIsEnabled, ...)
            raise SparsifyError(f"task {name!r}: its data could not be loaded ({type(e).__name__}: {e}). "
                                f"{OFFLINE_HINT}") from None


def _unknown_task(name: str) -> SparsifyError:
    return SparsifyError(f"--tasks: {name!r} is neither an lm-eval task, group or tag nor a task YAML path. Use a "
                         f"registered name (e.g. {', '.join(PAPER_TASKS[:3])}) or a YAML file/folder such as "
                         f"{LOCAL_TASKS_HINT}.")


def _cache_only() -> bool:
    """HF_HUB_OFFLINE or HF_DATASETS_OFFLINE set: the datasets library reads its cache only, and says at once
    when a task's data is not there."""
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


# Metrics whose per-item score is 0 or 1, so the task value is a proportion p over n items and its standard
# error is sqrt(p (1 - p) / (n - 1)): what lm-eval's mean_stderr gives for them, computed here because
# sparsify runs lm-eval without bootstrapping (bootstrap_iters=0 skips every stderr, and bootstrapping other
# metrics starts a process pool per task).
PROPORTION_METRICS = ("acc", "acc_norm", "acc_mutual_info", "exact_match")
# lm-eval warns, once per HFLM, that it was handed a model object instead of a name. That is what sparsify
# does on purpose (one process; each model is loaded once and shared by every section), so exactly these two
# messages are dropped; every other lm-eval message still shows.
EXPECTED_LM_EVAL_WARNINGS = ("Passed an already-initialized model through `pretrained`",
                             "`pretrained` model kwarg is not of type `str`")


class _DropExpectedWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(EXPECTED_LM_EVAL_WARNINGS)


def silence_expected_warnings() -> None:
    """Drop EXPECTED_LM_EVAL_WARNINGS from lm-eval's HF model logger (once per process)."""
    log = logging.getLogger("lm_eval.models.huggingface")
    if not any(isinstance(f, _DropExpectedWarnings) for f in log.filters):
        log.addFilter(_DropExpectedWarnings())


@contextlib.contextmanager
def _without_lm_eval_env_info() -> Iterator[None]:
    """lm-eval appends environment details to each run's results: `git describe` in the current folder (which
    prints "fatal: not a git repository" outside a checkout, once per model) and torch's collect_env (pip,
    nvidia-smi: 2-3 s per model). sparsify reads only the scores and writes its own provenance, so both are
    skipped while simple_evaluate runs, then restored."""
    import lm_eval.evaluator as evaluator

    stand_ins = {"get_git_commit_hash": lambda: None, "add_env_info": lambda storage: None}
    saved = {name: getattr(evaluator, name) for name in stand_ins if hasattr(evaluator, name)}
    for name in saved:
        setattr(evaluator, name, stand_ins[name])
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(evaluator, name, fn)


def proportion_stderr(p: float, n: int) -> float | None:
    """Standard error of a proportion p measured on n items (None below 2 items)."""
    return math.sqrt(max(p * (1 - p), 0.0) / (n - 1)) if n >= 2 else None


def accuracy(model: Any, tok: Any, spec: TaskSpec, limit: int | None, batch_size: int) -> dict[str, dict]:
    """lm-eval in-process on the loaded model; returns {task: {metric: value, "<metric>_stderr": standard
    error (PROPORTION_METRICS only), "samples": n}}."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    silence_expected_warnings()
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=batch_size)
    with _without_lm_eval_env_info():
        out = simple_evaluate(model=lm, tasks=list(spec.names), task_manager=spec.manager(), limit=limit,
                              bootstrap_iters=0, log_samples=False)
    results: dict[str, dict] = {}
    for task, metrics in out["results"].items():
        row = {k.split(",")[0]: float(v) for k, v in metrics.items()
               if "," in k and "stderr" not in k and isinstance(v, (int, float))}
        samples = out.get("n-samples", {}).get(task, {})
        n = int(samples.get("effective", samples.get("original", 0)))
        for metric in [m for m in row if m in PROPORTION_METRICS]:
            row[f"{metric}_stderr"] = proportion_stderr(row[metric], n)
        row["samples"] = n
        results[task] = row
    return results
