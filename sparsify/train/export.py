"""The end of a run: OUT/model, the trained weights (LoRA merged) as a model folder in the convert format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from sparsify.train.checkpoint import full_state
from sparsify.train.config import dump_recipe
from sparsify.train.step import Run


def export(run: Run, model_dir: Path, out: Path, tokenizer: Any, history: list[dict]) -> Path:
    """OUT/model: the trained weights (LoRA merged) in the convert format, recipe.yaml and sparsity.json inside."""
    from sparsify.folder.format import save_model_folder

    fsdp = run.dist.world > 1 and run.recipe.train.distributed == "fsdp"
    model_sd, _ = full_state(run) if fsdp else (None, None)  # collective: every rank takes part
    target = out / "model"
    if run.dist.main:
        model = _plain_model(run, model_dir, model_sd)
        config = json.loads((model_dir / "config.json").read_text())
        dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float32")
        thresholds = _take_thresholds(run, model)  # method threshold: theta out of the training activations
        model = model.to("cpu", dtype)
        for mlp, theta in thresholds:  # float32 whatever the weights' dtype: `<mlp>.threshold` in the weights
            mlp.register_buffer("threshold", theta)
        train_lines = [h for h in history if "sparsity" in h]
        last = train_lines[-1] if train_lines else {}
        provenance = {"finetuned": True, "finetuned_from": str(model_dir), "steps": run.state.step,
                      "tokens": run.state.tokens, "sparsity": last.get("sparsity"), "stopped": run.state.stopped,
                      "l1": run.recipe.sparsity.l1, "normalization": run.recipe.sparsity.normalization,
                      "target": run.recipe.sparsity.target}
        if thresholds:  # the folder's activation becomes THRESHOLD_ACT (sparsify.folder.format.relu_config)
            sp = run.recipe.sparsity
            provenance["threshold"] = {"mode": sp.threshold, "grad": sp.threshold_grad,
                                       "warmup_tokens": sp.warmup_tokens, "warmup_target": sp.warmup_target,
                                       "allocate": sp.allocate}
            if sp.allocate == "sensitivity":  # the per-layer targets the calibration chose, and their costs
                provenance["threshold"] |= {"targets": [round(v, 5) for v in run.thresholds.target.tolist()],
                                            "costs": run.thresholds.cost}
        sparsity = {"step": run.state.step, "tokens": run.state.tokens, "per_layer": last.get("per_layer"),
                    "sparsity": last.get("sparsity"), "nonzeros": last.get("nonzeros"),
                    "evaluations": [h for h in history if "val_loss" in h]}
        extra = {"recipe.yaml": dump_recipe(run.recipe), "sparsity.json": json.dumps(sparsity, indent=2) + "\n"}
        save_model_folder(model, tokenizer, target, provenance=provenance, overwrite=True, flag="output.dir",
                          extra_files=extra)
    run.dist.barrier()
    return target


def _take_thresholds(run: Run, model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """(mlp, theta [F] float32 on the CPU) of every layer of a method-threshold run, for the model's own MLP modules
    (their plain ReLU: the folder's modeling code applies theta); [] for method l1."""
    from sparsify.families import mlp_modules

    if not run.thresholds.enabled:
        return []
    if not run.thresholds.calibrated:
        raise RuntimeError("sparsity.method=threshold: the run ended before its thresholds were calibrated (the "
                           "budget ends inside sparsity.warmup_tokens)")
    return [(mlp, theta.detach().float().cpu().clone())
            for mlp, theta in zip(mlp_modules(model), run.thresholds.thresholds())]


def _plain_model(run: Run, model_dir: Path, model_sd: dict | None) -> torch.nn.Module:
    """One whole model on rank 0 with its own MLP modules: DDP replicas already are (their training MLPs are put
    back); FSDP shards are rebuilt from the gathered state (FSDP excludes LoRA); LoRA adapters are merged into the
    weights."""
    from transformers import AutoModelForCausalLM

    run.mlps.restore()
    model = run.student
    if model_sd is not None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        training_only = (".act_fn.theta", ".act_fn.shape", ".activation_fn.theta", ".activation_fn.shape")
        model.load_state_dict({k: v for k, v in model_sd.items() if not k.endswith(training_only)})
    if run.recipe.lora.r > 0:
        model = model.merge_and_unload()
    return model
