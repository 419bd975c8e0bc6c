"""`sparsify eval`: accuracy, perplexity, sparsity profile and speed for one or more models, side by side.

    evaluate(["orig=smollm2-135m-gguf", "relu=sparsify-demo/relu", "ft=sparsify-demo/ft/model"],
             tasks=["eval/tasks"], texts=["notes.txt"], limit=20, out="report/")

This module is the command: settings, the per-model loop and report.json's provenance; which models and how
they load is sparsify.evaluation.loading. Each section lives in its own module (each optional):
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
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sparsify.errors import SparsifyError
from sparsify.evaluation.accuracy import PAPER_TASKS, TaskSpec, accuracy, check_tasks, resolve_tasks
from sparsify.evaluation.loading import ModelSpec, ffn_backend_of, load_model, parse_models, pick_device, torch_dtype
from sparsify.evaluation.perplexity import HELDOUT_TEXT, check_texts, model_window, texts_section
from sparsify.evaluation.speed import GPU_ONLY, SpeedGrid, int_list, speed_section, speed_tokens
from sparsify.folder.format import DTYPES
from sparsify.sources import sparsify_section


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
        "twell_capable": ffn_backend_of(model) is not None,
        "sparsify": getattr(cfg, "sparsify", None),
    }


@dataclass
class EvalSettings:
    """Everything `evaluate` needs besides the models; recorded in report.json."""

    tasks: list[str] | None = None
    texts: list[str] = field(default_factory=list)
    ood_texts: list[str] = field(default_factory=list)  # text no model trained on: the OOD ratio's texts
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
             ood_texts: list[str | Path] = (), limit: int | None = None, speed: bool = False,
             out: str | Path | None = None, overwrite: bool = False, **options: Any) -> dict:
    """Evaluate one or more models side by side and (if `out`) write report.json, report.md and plots.

    Args:
        models: model folders, .gguf files or Hub ids, each optionally labelled `NAME=PATH`.
        tasks: lm-eval task names and/or local task YAML files/folders; None = the paper's seven
            (needs the Hub); [] or ["none"] = no accuracy section.
        texts: text files for perplexity, bits per byte and the sparsity profile; None = the held-out
            text bundled with sparsify (perplexity.HELDOUT_TEXT; a note on stderr says so), or none when
            ood_texts are given; [] = no text section.
        ood_texts: text files from sources none of the models trained on, scored like `texts`; each model's OOD
            ratio (the headline: report.ood_ratios) is the geometric mean over them of its perplexity / the first
            model's.
        limit: at most this many examples per task.
        speed: time prefill/decode, TwELL vs dense (CUDA only: refused on another device, before any work).
        out: output folder for report.json, report.md and the plots, written at once at the end; it must not
            exist (checked before any model loads) unless `overwrite`.
        overwrite: replace an existing `out` that holds a report (whole, atomically; a folder holding anything
            else is refused).
        **options: EvalSettings fields (batch_size, window, text_tokens, device, dtype, trust_remote_code,
            grid, progress). dtype: auto, bf16/bfloat16, fp16/float16 or fp32/float32. trust_remote_code: run the
            modeling code a Hub model or folder ships; without it such code never runs (sparsify folders
            load with sparsify's installed modeling code either way, never the folder's copy).
    Returns:
        The report dict (what report.json holds).
    """
    bundled = texts is None and not ood_texts
    texts = [HELDOUT_TEXT] if bundled else list(texts or [])
    settings = EvalSettings(tasks=tasks, texts=[str(t) for t in texts], ood_texts=[str(t) for t in ood_texts],
                            limit=limit, speed=speed, **options)
    problems = settings_problems(settings)
    if problems:
        raise SparsifyError(" ".join(problems))
    if out is not None:
        from sparsify.evaluation.report import check_report_output

        check_report_output(out, overwrite)  # before hours of work, not after
    torch_dtype(settings.dtype, "cpu")  # an unknown --dtype fails before any model is loaded
    device = pick_device(settings.device)
    if settings.speed and not device.startswith("cuda"):
        raise SparsifyError(GPU_ONLY.format(device=device))
    specs = parse_models(list(models))
    text_paths = check_texts(settings.texts, settings.ood_texts)
    with tempfile.TemporaryDirectory(prefix="sparsify-tasks-") as tmp, quiet_bars(not settings.progress):
        task_spec = resolve_tasks(tasks, Path(tmp))
        if task_spec.names:
            _refuse_synthetic(specs)
        check_tasks(task_spec)  # builds each task's dataset: the datasets library's bars, hidden by -q too
        if bundled:  # said once every input is known good: an error is never preceded by it
            print(f"sparsify eval: no --text given, so perplexity and the sparsity profile are measured on the "
                  f"held-out text bundled with sparsify ({HELDOUT_TEXT.name}: Python HOWTO documents); pass --text "
                  "FILE for your own, or --text none to skip them.", file=sys.stderr)
        rows = _run_all(specs, task_spec, text_paths, settings, device)
    report = {"sparsify_report": 1, "provenance": provenance(device),
              "settings": {**asdict(settings), "device": device, "task_names": task_spec.names,
                           "texts_bundled": bundled},
              "models": rows}
    if out is not None:
        from sparsify.evaluation.report import write_report

        write_report(report, Path(out), overwrite)
    return report


def settings_problems(settings: EvalSettings) -> list[str]:
    """Numbers out of range, named as the command line spells them (before any model is loaded)."""
    checks = [("--limit", settings.limit, 1, "a positive number of examples per task"),
              ("--batch-size", settings.batch_size, 1, "a positive number of sequences per lm-eval batch"),
              ("--window", settings.window, 2, "at least 2 tokens (one of context, one scored)"),
              ("--text-tokens", settings.text_tokens, 1,
               "a positive number of tokens per text file (all: 0 on the command line, None in Python)")]
    problems = [f"{flag} {value}: must be {what}." for flag, value, least, what in checks
                if value is not None and value < least]
    names = [Path(t).name for t in settings.texts + settings.ood_texts]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # the report keys each text by its file name
        problems.append(f"--text / --ood-text: {', '.join(twice)} given twice (the report names a text by its file "
                        "name); give each file once, or rename one copy.")
    return problems


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


def _refuse_synthetic(specs: list[ModelSpec]) -> None:
    """Accuracy of a `sparsify synth` folder: random weights and a placeholder tokenizer without BOS / EOS, which
    lm-eval needs (it failed deep inside lm-eval): refused before any model loads."""
    synthetic = [f"{s.name} ({s.source})" for s in specs if (sparsify_section(s.source) or {}).get("synthetic")]
    if synthetic:
        raise SparsifyError(f"{', '.join(synthetic)}: a `sparsify synth` folder (random weights, a placeholder "
                            "tokenizer) has no accuracy to measure, and lm-eval cannot run on it; pass --tasks none "
                            "(perplexity and the sparsity profile still run), or leave it out of this eval.")


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
            row["speed"] = speed_section(model, speed_tokens(tok, texts[0] if texts else HELDOUT_TEXT), settings.grid)
        bar.update()
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Evaluate models side by side: accuracy (lm-eval), perplexity and bits per byte on text files, the "
        "activation-sparsity profile that decides TwELL kernel speed, and (with --speed, on CUDA) prefill/"
        "decode throughput of the TwELL path against the same model dense. Writes report.json, report.md "
        "and PNG plots into --out."
    )
    parser.epilog = ("Offline example, after `sparsify demo`: sparsify eval orig=smollm2-135m-gguf "
                     "relu=sparsify-demo/relu ft=sparsify-demo/ft/model --tasks eval/tasks/ --limit 20 "
                     "--text-tokens 2048 --out report/ (the demo's 2048 held-out tokens, so the perplexities match "
                     "the demo's; perplexity depends on the tokens scored and the window).")
    parser.add_argument("models", nargs="+", metavar="MODEL",
                        help="model folder, .gguf file or Hub id; label it as NAME=PATH for the tables")
    parser.add_argument("--tasks", default=None,
                        help="comma-separated lm-eval task names and/or local task YAML files or folders "
                             f"(offline: eval/tasks/); 'none' skips accuracy. Default: {','.join(PAPER_TASKS)} "
                             "(the paper's suite; needs the Hub)")
    parser.add_argument("--text", nargs="+", action="extend", default=[], metavar="FILE",
                        help="text files for perplexity, bits per byte and the sparsity profile (default: the "
                             f"held-out text bundled with sparsify, {HELDOUT_TEXT.name}; 'none' skips them)")
    parser.add_argument("--ood-text", nargs="+", action="extend", default=[], metavar="FILE",
                        help="text files from sources the models never trained on (say, a novel, news, another "
                             "project's docs): scored like --text, and the geometric mean of each model's "
                             "perplexity / the first model's over them is the report's headline OOD ratio. With "
                             "--ood-text and no --text, the bundled text is not scored")
    parser.add_argument("--limit", type=int, default=None,
                        help="at most N examples per task, for quick runs (default: all)")
    parser.add_argument("--speed", action="store_true",
                        help="time prefill/decode, TwELL vs dense (CUDA GPU only: refused elsewhere, like bench)")
    parser.add_argument("-o", "--out", "--output", dest="out", default="eval-report",
                        help="output folder for report.json, report.md and the plots; it must not exist, unless "
                             "--overwrite (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out report (the whole folder, at the end of the run; a folder "
                             "holding anything but a report is refused)")
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
    parser.add_argument("--speed-batches", type=int_list, default=SpeedGrid.batches, help="prefill batch sizes, e.g. 1,8,32 (default: "
                        f"{','.join(map(str, SpeedGrid.batches))})")
    parser.add_argument("--speed-seqs", type=int_list, default=SpeedGrid.seqs, help="prefill sequence lengths, e.g. 512,2048 "
                        f"(default: {','.join(map(str, SpeedGrid.seqs))})")
    parser.add_argument("--decode-batches", type=int_list, default=SpeedGrid.decode_batches, help="decode batch sizes (default: "
                        f"{','.join(map(str, SpeedGrid.decode_batches))})")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars (errors and warnings still show)")


def main(args: argparse.Namespace) -> int:
    tasks = None if args.tasks is None else [t.strip() for t in args.tasks.split(",") if t.strip()]
    grid = SpeedGrid(batches=args.speed_batches, seqs=args.speed_seqs, decode_batches=args.decode_batches)
    texts = None if not args.text else [] if [t.lower() for t in args.text] == ["none"] else args.text
    report = evaluate(args.models, tasks=tasks, texts=texts, ood_texts=args.ood_text, limit=args.limit, speed=args.speed,
                      out=args.out, overwrite=args.overwrite, batch_size=args.batch_size, window=args.window,
                      text_tokens=None if args.text_tokens == 0 else args.text_tokens, device=args.device, dtype=args.dtype,
                      trust_remote_code=args.trust_remote_code, grid=grid, progress=not args.quiet)
    from sparsify.evaluation.report import summary

    print(summary(report, Path(args.out)))
    return 0
