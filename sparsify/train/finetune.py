"""finetune: continued pretraining of a ReLU model until every layer holds its zeros target: an L1 penalty on h
(sparsity.method=l1), or an L1 warm-up and then a thresholded gate held at the target (threshold, the default
recipe's); the run ends at its step / token budget, or where sparsity plateaus.

    sparsify finetune recipes/smollm2-135m.yaml train.max_tokens=20_000_000 sparsity.l1=2e-2
    torchrun --nproc_per_node 8 -m sparsify finetune recipes/mistral-7b-fsdp.yaml

One loop, top to bottom (`finetune`): check the recipe (preflight), prepare the model (a SiLU source is
converted first) and the data, optionally load the original dense model as distillation teacher, then per
optimizer step (train/step.py train_step, where the loss is composed): grad_accum micro-batches of
ce * cross-entropy + l1(step) * L1(h) + kd * KL(teacher || student) + mlp * MLP distance, the MLP terms from the
training MLPs (train/mlp.py); clip, AdamW, cosine schedule, dead-neuron re-init; log, evaluate, checkpoint; stop at
the step/token budget or when sparsity plateaus; export the final model folder (convert format, recipe.yaml +
sparsity.json inside).
SIGTERM (a scheduler's or `timeout`'s stop) or a first Ctrl-C ends the run at the next step with a checkpoint
of that step, so `--resume` loses nothing; a second Ctrl-C interrupts at once.

Output folder:
    converted/        the ReLU model the run started from (when the source had to be converted)
    data/             tokenised text (reusable as data.train of another run)
    checkpoints/step-N/ state.pt (model, optimizer, RNG: tensors only, loaded with weights_only=True) and
                      meta.json (step, data position, scheduler, plateau, recipe), written atomically; removed
                      when the run is done unless output.keep_checkpoints_when_done
    metrics.jsonl     one line per logged step ("step", "tokens", "loss", "l1", "sparsity", per layer ...)
                      and per evaluation ("val_loss", "val_ppl", ...)
    tensorboard/, loss.png, sparsity.png, recipe.yaml, model/ (the result)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from sparsify.errors import SparsifyError
from sparsify.families import activation_of
from sparsify.folder.convert import convert
from sparsify.folder.gguf import no_transformers_bars
from sparsify.sources import local_config
from sparsify.train.checkpoint import check_output, load_checkpoint, remove_checkpoints, save_checkpoint
from sparsify.train.config import Recipe, dump_recipe, format_help, parse_recipe
from sparsify.train.data import TokenData, prepare_data
from sparsify.train.distributed import Dist, RunStopped, StopRequest, init_distributed
from sparsify.train.export import export
from sparsify.train.metrics import MetricsLog, flops_per_token, plot, read_history, step_record
from sparsify.train.mlp import TrainMLPs
from sparsify.train.model import (DecayToStart, build_optimizer, load_student, load_teacher, source_activation,
                                  total_steps_of, wrap_model)
from sparsify.train.objective import L1Control, Plateau, SparsityCounts, ThresholdControl, reinit_dead
from sparsify.train.packed_ffn import PackedFFN
from sparsify.train.preflight import load_recipe, raise_problems, recipe_notes, recipe_problems
from sparsify.train.profiling import StepProfiler
from sparsify.train.step import Run, evaluate_all, losses, train_step


def finetune(recipe: Recipe, *, resume: bool = False, progress: bool = True, verbose: bool = True,
             data_only: bool = False, notes: list[str] | None = None) -> Path:
    """Run a recipe; returns OUT/model, the fine-tuned model folder (with `data_only`: OUT/data, the token folder,
    made without training: the model is converted for its tokenizer).

    Args:
        recipe: a validated Recipe (see `sparsify.train.preflight.load_recipe`).
        resume: continue from the newest checkpoint in output.dir (same recipe); exact, even after SIGKILL.
        progress: show progress bars (rank 0 only).
        verbose: print validation results, and a line per logged step when there are no progress bars, to
            stderr (rank 0 only); metrics.jsonl gets everything either way.
        notes: what to say before work starts about settings the run will not use (default:
            preflight.recipe_notes(recipe)); the CLI passes those of the recipe as typed (recipe_notes with
            as_written), which leave a threshold recipe's own warm-up keys out when an override only set the method.

    Raises:
        RunStopped: a signal stopped the run (after a checkpoint, or after the export when it came at the end).
    """
    from transformers import AutoTokenizer

    raise_problems("the recipe", recipe_problems(recipe))  # load_recipe checked it; a Recipe built in Python too
    dist = init_distributed()
    for note in (recipe_notes(recipe) if notes is None else notes) if dist.main and verbose else []:
        print(f"note: {note}", file=sys.stderr)
    out = Path(recipe.output.dir)
    if data_only:  # tokenising touches no run in OUT and needs none of the run's settings to be supported
        checkpoint = None
        out.mkdir(parents=True, exist_ok=True)
    else:
        _refuse_unsupported(recipe, dist)
        checkpoint = check_output(out, recipe, resume, dist)
    if dist.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_flush_denormal(True)  # L1 drives h towards 0: denormal arithmetic made CPU steps 5x slower
    with contextlib.ExitStack() as quiet:
        if not progress:  # transformers' own bars too (converting, loading and writing weights)
            quiet.enter_context(no_transformers_bars())
        model_dir = prepare_model(recipe, out, dist, progress)
        if not data_only and dist.device.type == "cpu":
            check_cpu_memory(recipe, model_dir)  # before tokenising: a GPU-sized recipe on a CPU was OOM-killed
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        data = _data(recipe, tokenizer, out, dist, progress, verbose)
        if data_only:
            return data.folder
        run = _setup(recipe, dist, model_dir, data)
        run.verbose = verbose
        if checkpoint is not None:
            load_checkpoint(run, checkpoint)
            if dist.main and verbose:
                print(f"resuming from step {run.state.step} ({run.state.tokens:,} tokens) of {checkpoint}",
                      file=sys.stderr)
        if dist.main:
            (out / "recipe.yaml").write_text(dump_recipe(recipe))
        log = MetricsLog(out, recipe, dist, run.state.step)
        history = read_history(out) if dist.main else []
        try:
            with StopRequest() as stop:
                _loop(run, log, history, progress, stop)
        finally:
            log.close()
        if dist.main and recipe.output.plots:
            plot(out, history)
        folder = export(run, model_dir, out, tokenizer, history)
        if not recipe.output.keep_checkpoints_when_done:
            remove_checkpoints(out, dist)
        if stop.signum:  # caught during the last step or the final evaluation: the run is done, but the caller stops
            raise RunStopped(f"the run had reached its end (step {run.state.step}): the fine-tuned model was "
                             f"exported to {folder}.", stop.signum)
        return folder


def prepare_model(recipe: Recipe, out: Path, dist: Dist, progress: bool = True) -> Path:
    """A ReLU model folder to train: the source itself when already ReLU, else its conversion in OUT/converted."""
    source = recipe.model.source  # convert resolves the alias; its provenance keeps the name, not a local path
    config = local_config(source)
    if config is not None and activation_of(config) == "relu":
        return Path(source).expanduser()
    target = out / "converted"
    done = target / "config.json"
    if dist.main and not (done.is_file() and json.loads(done.read_text()).get("sparsify", {}).get("source") == source):
        convert(source, target, revision=recipe.model.revision, overwrite=True, progress=progress, flag="output.dir")
    dist.barrier()
    return target


def check_cpu_memory(recipe: Recipe, model_dir: Path, available: int | None = None) -> None:
    """Refuses a run on the CPU whose training state and logits alone exceed the memory available now, for all the
    processes on this machine (LOCAL_WORLD_SIZE). A lower bound: 4 bytes per parameter (float32 weights), 12 more
    per trained one (gradient, AdamW's two moments; none for train.freeze matches, and with LoRA the adapters
    only, left out here) and 4 for its start copy (weight_decay_to=start); 4 per parameter for the teacher; the
    micro-batch's logits and their gradient in float32, twice that with KD. The default recipe, sized for a GPU
    (16 x 2048 tokens, a 49k vocabulary, a teacher), needs ~27 GiB this way and was killed by the kernel with no
    message on a 24 GB machine."""
    import fnmatch

    from transformers import AutoConfig, AutoModelForCausalLM

    from sparsify import sources

    free = sources.available_memory() if available is None else available
    if free is None:
        return
    try:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            named = [(n, p.numel()) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()]
    except Exception:  # a config stock transformers cannot build: no estimate (the run's own load says more)
        return
    t = recipe.train
    params = sum(n for _, n in named)
    trained = 0 if recipe.lora.r > 0 else sum(
        n for name, n in named if not any(fnmatch.fnmatchcase(name, p) for p in t.freeze))
    teacher = recipe.distill.kd > 0 or recipe.distill.mlp > 0
    vocab = getattr(config.get_text_config(), "vocab_size", 0)
    logits = t.batch_size * t.seq_len * vocab * 4 * (2 + 2 * (recipe.distill.kd > 0))
    state = 4 * params + (12 + 4 * (t.weight_decay_to == "start")) * trained + 4 * params * teacher
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    need = procs * (state + logits)
    if need <= free:
        return
    each = f" for each of {procs} processes" if procs > 1 else ""
    if procs * state > free:
        fix = ("the model itself does not fit here: a smaller model, lora.r (adapters only), train.freeze, "
               "distill.kd=0 distill.mlp=0 (no teacher), or a GPU")
    else:
        fix = (f"the recipe is sized for a GPU; for a CPU smoke run use train.seq_len=128 train.batch_size=4 "
               "distill.kd=0 (the README's CPU example), or run it on a GPU")
    raise SparsifyError(
        f"this run needs at least ~{need / 2**30:.1f} GiB of memory on the CPU and {free / 2**30:.1f} GiB are "
        f"available now ({params / 1e6:.0f}M parameters, {trained / 1e6:.0f}M of them trained"
        f"{', and the teacher' if teacher else ''}: {state / 2**30:.1f} GiB; train.batch_size {t.batch_size} x "
        f"train.seq_len {t.seq_len} tokens of {vocab:,}-way logits: {logits / 2**30:.1f} GiB{each}): {fix}.")


def _refuse_unsupported(recipe: Recipe, dist: Dist) -> None:
    """The problems that depend on the number of processes, known only once torchrun has started them."""
    steps = total_steps_of(recipe, dist)
    if recipe.sparsity.blend_steps >= steps:
        raise SparsifyError(f"sparsity.blend_steps={recipe.sparsity.blend_steps} is not below the run's {steps} "
                            "steps: the model would end between its source activation and ReLU. Lower blend_steps "
                            "or raise train.max_tokens / max_steps.")
    warmup = recipe.sparsity.warmup_tokens
    tokens_per_step = recipe.train.batch_size * recipe.train.grad_accum * dist.world * recipe.train.seq_len
    if recipe.sparsity.method == "threshold" and warmup >= steps * tokens_per_step:
        raise SparsifyError(f"sparsity.warmup_tokens={warmup:,} is not below the run's {steps} steps x "
                            f"{tokens_per_step:,} tokens: theta would never be calibrated. Shorten the warm-up or "
                            "raise train.max_tokens / max_steps.")
    if recipe.lora.r > 0 and dist.world > 1 and recipe.train.distributed == "fsdp":
        raise SparsifyError("lora.r > 0 with train.distributed=fsdp is not supported; use distributed=ddp for "
                            "LoRA (adapters are small) or lora.r=0 for a sharded full fine-tune.")


def _data(recipe: Recipe, tokenizer: Any, out: Path, dist: Dist, progress: bool, verbose: bool) -> TokenData:
    if dist.main:  # one tokenisation; other ranks wait and then read the same files
        folder = prepare_data(recipe.data, tokenizer, out / "data", progress=progress)
    dist.barrier()
    if not dist.main:
        folder = prepare_data(recipe.data, tokenizer, out / "data", progress=False)  # reuses rank 0's files
    data = TokenData(folder, recipe.train.seq_len, recipe.data.seed, recipe.data.weights or None)
    notes = [data.validation_note(recipe.train.batch_size, recipe.train.eval_batches, dist.world)]  # raises if none
    notes += [data.heldout_note(name, recipe.train.batch_size, recipe.train.eval_batches, dist.world)
              for name in data.domains]
    for note in notes:
        if note and dist.main and verbose:
            print(f"note: {note}", file=sys.stderr)
    return data


def _setup(recipe: Recipe, dist: Dist, model_dir: Path, data: TokenData) -> Run:
    """The run's objects, in the order they depend on each other: the training MLPs go into the student before
    compile / DDP wrap it, the optimizer's start weights are taken before a checkpoint is loaded."""
    sp, d = recipe.sparsity, recipe.distill
    source = source_activation(model_dir)
    if sp.blend_steps > 0 and source in (None, "relu"):
        raise SparsifyError(f"sparsity.blend_steps={sp.blend_steps}: {model_dir} records no non-ReLU source "
                            "activation to blend from (config.json sparsify.source_activation); give the SiLU source "
                            "as model.source, or set sparsity.blend_steps=0.")
    student = load_student(model_dir, recipe, dist)
    teacher = load_teacher(model_dir, dist, recipe.train.seq_len) if d.kd > 0 or d.mlp > 0 else None
    if teacher is not None and recipe.train.compile and d.kd > 0:
        teacher.compile()  # (distill.mlp alone runs only the teacher's MLPs, from the student's)
    mlps = TrainMLPs(student, sp, source=source, teacher=teacher if d.mlp > 0 else None)
    thresholds = ThresholdControl(mlps, sp, dist.device)
    kernels = PackedFFN(mlps.layers, recipe.train.kernels)
    wrapped = wrap_model(student, recipe, dist)
    optimizer, schedule = build_optimizer(student, recipe, total_steps_of(recipe, dist), dist)
    # method threshold: the L1 warm-up's control (its own target, or fixed mode), stopped at the calibration
    l1 = dataclasses.replace(sp, target=sp.warmup_target) if thresholds.enabled else sp
    return Run(recipe=recipe, dist=dist, data=data, model_dir=model_dir,
               student=student, wrapped=wrapped, teacher=teacher, mlps=mlps,
               logit_losses=torch.compile(losses) if recipe.train.compile else losses,
               l1_weights=L1Control(l1, len(mlps.layers), dist.device), thresholds=thresholds,
               counts=SparsityCounts(), kernels=kernels,
               optimizer=optimizer, schedule=schedule, decay_to_start=DecayToStart.of(student, recipe),
               plateau=Plateau(sp.plateau_tolerance, sp.plateau_window,
                               after=max(sp.ramp_steps if sp.schedule == "ramp" else 0, sp.blend_steps)))


def _loop(run: Run, log: MetricsLog, history: list[dict], progress: bool, stop: StopRequest | None = None) -> None:
    """Steps until the budget or the plateau; logs, evaluates and checkpoints on the way. On a stop request
    (SIGTERM, Ctrl-C) it checkpoints the step just done and raises RunStopped."""
    from tqdm.auto import tqdm

    t, out = run.recipe.train, Path(run.recipe.output.dir)
    total = total_steps_of(run.recipe, run.dist)
    fpt = flops_per_token(run.student, t.seq_len)
    if run.state.step == 0:
        evaluate_all(run, log, history, first=True)
    bar = tqdm(total=total, initial=run.state.step, unit="step", disable=not (progress and run.dist.main),
               dynamic_ncols=True, desc="finetune")
    window, tic, steps = None, time.perf_counter(), 0
    profiler = StepProfiler(t.profile_steps, out, enabled=run.dist.main)
    while run.state.step < total and not run.state.stopped:
        sums = train_step(run)
        profiler.after_step(run.state.step)
        window = sums if window is None else {k: window[k] + v for k, v in sums.items()}
        steps += 1
        bar.update(1)
        logging_now = run.state.step % t.log_every == 0 or run.state.step == total
        stats = _after_step(run, logging_now)
        if logging_now:
            _log_step(run, log, history, bar, step_record(run, window, stats, time.perf_counter() - tic, steps, fpt))
            window, tic, steps = None, time.perf_counter(), 0
        if t.eval_every and run.state.step % t.eval_every == 0 and run.state.step < total:
            evaluate_all(run, log, history)
        saved = None
        if t.save_every and run.state.step % t.save_every == 0 and run.state.step < total and not run.state.stopped:
            saved = save_checkpoint(run, out)
        signum = stop.due(run.dist, run.state.step, t.log_every) if stop is not None else 0
        if signum and run.state.step < total and not run.state.stopped:
            bar.close()
            folder = saved or save_checkpoint(run, out)
            raise RunStopped(f"the run stopped after step {run.state.step} ({run.state.tokens:,} tokens) and saved "
                             f"checkpoint {folder}; continue with the same command and --resume.", signum)
    bar.close()
    run.state.stopped = run.state.stopped or f"budget: {run.state.step} steps, {run.state.tokens} tokens"
    evaluate_all(run, log, history)
    if run.recipe.output.keep_checkpoints_when_done:  # else a SIGKILL from here on resumes the last periodic one
        save_checkpoint(run, out)


def _after_step(run: Run, logging_now: bool):
    """The step's sparsity statistics, when something needs them: dead-neuron re-init, the per-layer L1
    control, the packed-FFN decisions or the log. Returns them (None when nothing did)."""
    if not (run.recipe.sparsity.reinit_dead or run.l1_weights.adaptive or run.thresholds.calibrated or logging_now):
        run.counts.reset()
        return None
    stats = run.counts.step_stats(run.dist.reduce)
    if run.recipe.sparsity.reinit_dead:
        reinit_dead(run.student, stats.inactive, run.state.step, run.recipe.train.seed)
    if not run.mlps.blended(run.state.step - 1):  # the blend's zeros say nothing about the targets
        run.l1_weights.update(stats, run.state.tokens)
    run.thresholds.update(stats, run.state.tokens)
    if logging_now:
        run.kernels.update(stats.zeros, stats.nonzeros)  # train.kernels: which layers pack, and their capacity
        if run.kernels.changes and run.dist.main and run.verbose:
            print(f"step {run.state.step}: train.kernels " + "; ".join(run.kernels.changes), file=sys.stderr)
    return stats


def _log_step(run: Run, log: MetricsLog, history: list[dict], bar: Any, record: dict) -> None:
    """Writes a logged step's record, shows it (bar or stderr line) and asks the plateau rule whether to stop."""
    log.write(record)
    history.append(record)
    line = (f"tok/s={record['tokens_per_s']:.3g} loss={record['loss']:.3f} l1={record['l1']:.3g} "
            f"zeros={record['sparsity']:.1%} nnz={record['nonzeros']:.0f}")
    if run.l1_weights.adaptive:  # the layer furthest below its target, and the coefficient range
        zeros, coef = record["per_layer"]["zeros"], record["per_layer"]["l1_coef"]
        line += f" min_zeros={min(zeros):.1%} coef={min(coef):.2g}..{max(coef):.2g}"
    elif run.thresholds.calibrated:  # method threshold: the layer furthest below its target, and theta's range
        zeros, theta = record["per_layer"]["zeros"], record["per_layer"]["theta"]
        line += f" min_zeros={min(zeros):.1%} theta={min(theta):.2g}..{max(theta):.2g}"
    bar.set_postfix_str(line)
    if bar.disable and run.dist.main and run.verbose:  # no bar (logs, batch jobs): a line per logged step
        mfu = f" mfu={record['mfu']:.1%}" if "mfu" in record else ""
        print(f"step {run.state.step}/{bar.total} tokens={run.state.tokens:,} {line}{mfu}", file=sys.stderr)
    sp = run.recipe.sparsity
    if run.plateau.update(run.state.step, record["sparsity"]):
        run.state.stopped = f"plateau: sparsity {record['sparsity']:.4f} changed < {sp.plateau_tolerance} over " \
                            f"{sp.plateau_window} steps"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = format_help()
    p.add_argument("recipe", help="recipe YAML file (see recipes/); every key is listed below")
    p.add_argument("overrides", nargs="*", default=[], metavar="SECTION.KEY=VALUE",
                   help="recipe overrides, e.g. train.lr=3e-4 sparsity.l1=2e-2 output.dir=runs/x")
    p.add_argument("--resume", action="store_true", help="continue the run in output.dir from its newest checkpoint (after a crash, "
                   "or after SIGTERM / Ctrl-C, which checkpoint the step they stop at)")
    p.add_argument("--print-recipe", action="store_true", help="print the resolved recipe as YAML and exit")
    p.add_argument("--prepare-data", action="store_true",
                   help="tokenise the recipe's data into OUTPUT/data and stop (the model is converted for its "
                        "tokenizer): a folder to carry to a machine without the text, given there as "
                        "data.train=[FOLDER] (its held-out domains come with it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (logs still go to metrics.jsonl)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress bars and no validation or step lines: only errors and the final folder "
                        "(metrics.jsonl still gets everything)")


def main(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe, args.overrides, check_paths=not args.print_recipe)
    if args.print_recipe:
        print(dump_recipe(recipe), end="")
        return 0
    notes = recipe_notes(recipe, parse_recipe(args.recipe).as_written)
    folder = finetune(recipe, resume=args.resume, progress=not (args.no_progress or args.quiet),
                      verbose=not args.quiet, data_only=args.prepare_data, notes=notes)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"token folder: {folder} (train from it with data.train=[{folder}])" if args.prepare_data else
              f"fine-tuned model: {folder}; {_checkpoints_note(recipe)}")
    if torch.distributed.is_initialized():
        gc.collect()  # the run's DDP reducer (kept alive by reference cycles) goes before its process group
        torch.distributed.destroy_process_group()
    return 0


def _checkpoints_note(recipe: Recipe) -> str:
    """What became of the checkpoints, and how a run is extended: the last words of a finished run."""
    if recipe.output.keep_checkpoints_when_done:
        return (f"checkpoints kept in {Path(recipe.output.dir) / 'checkpoints'}: extend the run with the same command, "
                "a larger train.max_tokens (or max_steps) and --resume")
    return ("checkpoints removed (a finished run is not resumed; to extend a run later, start it with "
            "output.keep_checkpoints_when_done=true)")
