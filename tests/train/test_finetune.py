"""finetune end to end on CPU: a tiny random Llama with the SmolLM2 tokenizer, ~40 steps on real text.

One uninterrupted reference run (module fixture) is compared with a run killed by SIGKILL and resumed,
and with the same run under torchrun on 2 gloo processes (DDP).
"""

import json
import math
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.train.helpers import (REPO, STEPS, TRAIN_TEXT, VALID_TEXT, assert_same_run, cli, metrics, recipe_dict,
                                 torchrun)


@pytest.fixture(scope="module")
def reference(tiny_silu, tmp_path_factory) -> Path:
    """The uninterrupted 40-step run, in a subprocess like the runs it is compared with (same threads)."""
    out = tmp_path_factory.mktemp("reference")
    path = out / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(tiny_silu, out / "run", outputs=True)))
    proc = cli(["finetune", str(path), "--no-progress"])
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log
    (out / "cli.log").write_text(log)
    for bar in ("it/s]", "s/it]", "Loading weights", "Writing model shards"):  # --no-progress: no bar of anyone's
        assert bar not in log, (bar, log[-3000:])
    return out / "run"


def test_sparsity_rises_loss_finite_outputs_written(reference):
    from transformers import AutoModelForCausalLM

    lines = metrics(reference)
    train = [m for m in lines if "sparsity" in m]
    evals = [m for m in lines if "val_ppl" in m]
    assert [m["step"] for m in train] == list(range(5, STEPS + 1, 5))
    for m in train:
        assert {"step", "tokens", "loss", "l1", "sparsity", "per_layer", "tokens_per_s"} <= m.keys()
        assert all(math.isfinite(m[k]) for k in ("loss", "ce", "l1", "kd"))
        assert len(m["per_layer"]["zeros"]) == 2
    assert train[-1]["tokens"] == STEPS * 2 * 32
    # a random ReLU MLP starts near half zeros; the L1 term must push it well above (past 0.9 at some logged
    # step: a dead-neuron reinit, a discrete event whose step can move with the BLAS, dips it afterwards)
    zeros = [m["sparsity"] for m in train]
    assert zeros[0] < 0.8 and max(zeros) > 0.9 and zeros[-1] > zeros[0] + 0.2, zeros
    assert evals[0]["step"] == 0 and "teacher_val_ppl" in evals[0] and evals[-1]["step"] == STEPS
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]  # it learned something from the text
    for name in ("loss.png", "sparsity.png", "recipe.yaml", "tensorboard"):
        assert (reference / name).exists(), name
    assert not (reference / "checkpoints").exists()  # a finished run keeps no optimizer state unless asked
    last = (reference.parent / "cli.log").read_text().strip().splitlines()[-1]
    assert last.startswith(f"fine-tuned model: {reference / 'model'}; checkpoints removed") and \
        "output.keep_checkpoints_when_done=true" in last, last
    model_dir = reference / "model"
    stats = json.loads((model_dir / "sparsity.json").read_text())
    assert stats["sparsity"] == train[-1]["sparsity"]
    assert yaml.safe_load((model_dir / "recipe.yaml").read_text())["sparsity"]["l1"] == 0.05
    config = json.loads((model_dir / "config.json").read_text())
    assert config["hidden_act"] == "relu" and config["sparsify"]["finetuned"] is True
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # stock load: the dense ReLU model
    assert type(model).__name__ == "LlamaForCausalLM"
    ours = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True)  # remote code: the sparse class
    assert type(ours).__name__ == "LlamaForCausalLM" and type(ours) is not type(model)  # the name pipelines accept
    assert type(ours).__qualname__ == "SparseLlamaForCausalLM"
    ids = torch.tensor([[1, 200, 3000, 40000, 7]])
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_sigkill_then_resume_matches_uninterrupted(reference, tiny_silu, tmp_path):
    out = tmp_path / "run"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(tiny_silu, out)))
    proc = cli(["finetune", str(path), "--no-progress"], start_new_session=True)
    target = out / "checkpoints" / "step-00000020" / "state.pt"
    deadline = time.time() + 400
    while not target.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # mid-run, possibly mid-write of the next checkpoint
    proc.communicate()
    assert not (out / "model").exists(), "the run finished before it could be killed"
    resumed = cli(["finetune", str(path), "--resume", "--no-progress"])
    log, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, log
    assert "[step 0]" not in log  # it continued from a checkpoint instead of starting over
    ref, got = metrics(reference), metrics(out)
    assert [m["step"] for m in got] == [m["step"] for m in ref]
    # bitwise: same data order, exact fp32 state, noise seeded by step, one thread in both processes
    for a, b in zip(ref, got):
        key = "loss" if "loss" in a else "val_loss"
        assert b[key] == a[key], (a["step"], key, a[key], b[key])
        assert b.get("sparsity") == a.get("sparsity"), a["step"]


def test_sigterm_checkpoints_the_step_it_stops_at_and_resume_matches_uninterrupted(reference, tiny_silu, tmp_path):
    out = tmp_path / "run"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(tiny_silu, out)))
    proc = cli(["finetune", str(path), "--no-progress"])
    first = out / "checkpoints" / "step-00000010" / "state.pt"
    deadline = time.time() + 400
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, log[-3000:]
    said = "sparsify finetune: terminated (SIGTERM); the run stopped after step "
    assert said in log and "continue with the same command and --resume." in log and "error" not in log, log[-3000:]
    stopped_at = int(log.split(said)[1].split()[0])
    assert 10 <= stopped_at < STEPS
    assert (out / "checkpoints" / f"step-{stopped_at:08d}" / "state.pt").is_file()  # the step it stopped at
    assert not (out / "model").exists()
    assert max(m["step"] for m in metrics(out)) <= stopped_at
    resumed = cli(["finetune", str(path), "--resume", "--no-progress"])
    log, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, log
    assert f"resuming from step {stopped_at} (" in log, log[-3000:]  # says where it continues
    ref, got = metrics(reference), metrics(out)
    assert [m["step"] for m in got] == [m["step"] for m in ref]
    split = next(m["step"] for m in ref if "loss" in m and m["step"] > stopped_at)
    for a, b in zip(ref, got):  # bitwise, as after SIGKILL: nothing of the stopped step is lost or repeated
        key = "loss" if "loss" in a else "val_loss"
        if key == "loss" and a["step"] == split and stopped_at % 5:
            continue  # the logged window that the stop cut in two: its resumed half alone is averaged
        assert b[key] == a[key], (a["step"], key, a[key], b[key])
    assert got[-1]["step"] == STEPS and got[-1]["val_loss"] == ref[-1]["val_loss"]


def test_ctrl_c_in_training_is_worded_as_in_convert_and_exits_130(tiny_silu, tmp_path):
    """Ctrl-C during training printed "error: stopped by SIGINT", during convert "interrupted" (issue 40): one
    wording, `sparsify COMMAND: interrupted; what was kept`, and exit 130 in both."""
    out = tmp_path / "run"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(tiny_silu, out, save_every=0)))
    proc = cli(["finetune", str(path), "--no-progress"])
    deadline = time.time() + 400
    while not (out / "metrics.jsonl").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)  # (metrics.jsonl: the model is loaded and the first evaluation written)
    proc.send_signal(signal.SIGINT)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, log[-3000:]
    line = log.strip().splitlines()[-1]
    assert line.startswith("sparsify finetune: interrupted; the run stopped after step ") and \
        line.endswith("; continue with the same command and --resume."), log[-3000:]
    step = int(line.split("after step ")[1].split()[0])
    assert (out / "checkpoints" / f"step-{step:08d}" / "state.pt").is_file()


def test_a_stop_during_the_last_step_exports_and_still_stops_the_caller(tiny_silu, tokens, tmp_path, monkeypatch):
    """A signal caught in the last step finishes the run (export included) and then raises RunStopped, so a
    caller such as `sparsify demo` stops too instead of swallowing the user's Ctrl-C / SIGTERM."""
    from sparsify.train import finetune as ft
    from sparsify.train.preflight import load_recipe

    real = ft.train_step

    def step(run):
        sums = real(run)
        if run.state.step == 2:
            signal.raise_signal(signal.SIGTERM)  # the StopRequest handler catches it (main thread)
        return sums

    monkeypatch.setattr(ft, "train_step", step)
    before = signal.getsignal(signal.SIGTERM)
    recipe = load_recipe(recipe_dict(tiny_silu, tmp_path / "run", tokens=tokens, max_steps=2, save_every=1))
    with pytest.raises(ft.RunStopped, match="the run had reached its end") as stopped:
        ft.finetune(recipe, progress=False, verbose=False)
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert (tmp_path / "run" / "model" / "config.json").is_file()
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is put back


def test_resume_without_checkpoint_and_fresh_run_over_old_one_are_refused(tiny_silu, tokens, tmp_path):
    from sparsify.errors import SparsifyError
    from sparsify.train.finetune import finetune
    from sparsify.train.preflight import load_recipe

    recipe = load_recipe(recipe_dict(tiny_silu, tmp_path / "run", tokens=tokens, max_steps=2, save_every=1))
    with pytest.raises(SparsifyError, match="no checkpoint"):
        finetune(recipe, resume=True, progress=False)
    finetune(recipe, progress=False)
    with pytest.raises(SparsifyError, match=r"holds a finished run \(model/\); set output.overwrite=true"):
        finetune(recipe, progress=False)
    with pytest.raises(SparsifyError, match="no checkpoint .* only with output.keep_checkpoints_when_done=true"):
        finetune(recipe, resume=True, progress=False)


def test_resume_refuses_a_changed_recipe_but_allows_budget_and_stop_rule(tiny_silu, tokens, tmp_path):
    from sparsify.errors import SparsifyError
    from sparsify.train.finetune import finetune
    from sparsify.train.preflight import load_recipe

    out = tmp_path / "run"
    kept = load_recipe(recipe_dict(tiny_silu, out, tokens=tokens, keep=True, max_steps=2, save_every=1))
    finetune(kept, progress=False)
    with pytest.raises(SparsifyError, match="holds checkpoints of an earlier run .* pass --resume to continue it"):
        finetune(kept, progress=False)  # kept checkpoints: a fresh run over them is refused too
    changed = load_recipe(recipe_dict(tiny_silu, out, tokens=tokens, keep=True, max_steps=2, save_every=1, lr=1e-3,
                                      seq_len=16))
    with pytest.raises(SparsifyError) as e:
        finetune(changed, resume=True, progress=False)
    listed = str(e.value).split("Resuming would")[0]
    assert "train.lr: 0.003 in the checkpoint, now 0.001" in listed
    assert "train.seq_len: 32 in the checkpoint, now 16" in listed
    assert "max_steps" not in listed and "output." not in listed
    # what the H200 run did: same token budget, plateau stop switched off; plus a longer budget and fewer plots
    allowed = load_recipe(recipe_dict(tiny_silu, out, tokens=tokens, max_steps=3, save_every=1, log_every=1),
                          ["sparsity.plateau_tolerance=0", "output.plots=false",
                           "output.keep_checkpoints_when_done=false"])  # output.*: free to change on resume
    model_dir = finetune(allowed, resume=True, progress=False)
    assert json.loads((model_dir / "config.json").read_text())["sparsify"]["steps"] == 3
    assert [m["step"] for m in metrics(out) if "sparsity" in m] == [2, 3]  # the first leg logged its last step
    assert not list(out.glob("*.tmp"))  # the trimmed metrics.jsonl replaced the old one, no leftovers
    assert not (out / "checkpoints").exists()  # this leg did not ask to keep them


def test_resume_checks_the_global_batch_not_its_split():
    from sparsify.errors import SparsifyError
    from sparsify.train.checkpoint import check_resume_recipe
    from sparsify.train.config import dump_recipe
    from sparsify.train.preflight import load_recipe

    saved = dump_recipe(load_recipe({"data": {"train": ["x.txt"]}, "train": {"max_steps": 5, "batch_size": 4}},
                                    check_paths=False))
    same = load_recipe({"data": {"train": ["x.txt"]}, "train": {"max_steps": 5, "batch_size": 1, "grad_accum": 2}},
                       check_paths=False)
    check_resume_recipe(saved, 1, same, 2, Path("out/checkpoints/step-1"))  # 4 x 1 x 1 == 1 x 2 x 2
    with pytest.raises(SparsifyError, match=r"global batch .*: 4 in the checkpoint .* now 8"):
        check_resume_recipe(saved, 1, same, 4, Path("out/checkpoints/step-1"))


# fsdp: 75 s on 2 busy CPU cores (two processes, then a resume); ddp: 38 s
@pytest.mark.parametrize("mode", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_two_gloo_processes_match_single_process(reference, tiny_silu, tmp_path, mode):
    """batch 1 on each of 2 ranks reads the same sequences as batch 2 on one: the losses must agree.

    FSDP2 also resumes: its sharded state is gathered into the checkpoint and scattered back.
    """
    path = tmp_path / "recipe.yaml"
    out = tmp_path / "run"
    path.write_text(yaml.safe_dump(recipe_dict(tiny_silu, out, keep=True, batch_size=1, distributed=mode)))
    torchrun(path)
    # same sequences per step; only the order of float sums differs (measured: 1e-7 relative)
    assert_same_run(metrics(reference), metrics(out), rel=1e-5)
    assert (out / "model" / "model.safetensors").exists()
    if mode == "fsdp":
        first = metrics(out)
        for name in ("model", "checkpoints/step-00000040"):
            shutil.rmtree(out / name)
        torchrun(path, "--resume")  # from step 30
        assert_same_run(first, metrics(out), rel=1e-6)


def test_lora_with_checkpointing_merges_at_export_and_plateau_stops(tiny_silu, tokens, tmp_path):
    """LoRA adapters (peft) train through the same loop and are merged into plain weights at export; a loose
    plateau tolerance ends the run early and says why."""
    from safetensors.torch import load_file

    from sparsify.train.finetune import finetune
    from sparsify.train.preflight import load_recipe

    recipe = load_recipe(recipe_dict(tiny_silu, tmp_path / "run", tokens=tokens, max_steps=30, save_every=0, log_every=2,
                                     gradient_checkpointing=True),
                         ["lora.r=4", "distill.kd=0", "sparsity.plateau_tolerance=0.5", "sparsity.plateau_window=6"])
    model_dir = finetune(recipe, progress=False)
    lines = [m for m in metrics(tmp_path / "run") if "sparsity" in m]
    # logged at 2, 4, 6, 8: step 8 is the first with 6 steps of history (since step 2); nothing moves 50% in 6
    assert lines[-1]["step"] == 8
    stats = json.loads((model_dir / "sparsity.json").read_text())
    assert stats["step"] == 8
    assert json.loads((model_dir / "config.json").read_text())["sparsify"]["stopped"].startswith("plateau")
    merged = load_file(model_dir / "model.safetensors")
    original = load_file(tiny_silu / "model.safetensors")
    assert not any("lora" in k for k in merged)
    key = "model.layers.0.mlp.up_proj.weight"
    assert merged[key].shape == original[key].shape and not torch.equal(merged[key], original[key])


@pytest.mark.slow
def test_compiled_matches_eager(tiny_silu, tokens, tmp_path):
    """torch.compile (inductor on the CPU here) captures the down_proj hooks: same losses as eager."""
    from sparsify.train.finetune import finetune
    from sparsify.train.preflight import load_recipe

    runs = []
    for compiled in (False, True):
        out = tmp_path / f"run-{compiled}"
        recipe = recipe_dict(tiny_silu, out, tokens=tokens, max_steps=4, log_every=2, save_every=0, compile=compiled)
        finetune(load_recipe(recipe, ["distill.kd=0"]), progress=False)  # no teacher: one model to compile
        runs.append(metrics(out))
    assert_same_run(runs[0], runs[1], rel=1e-4)
    assert runs[1][-2]["sparsity"] == pytest.approx(runs[0][-2]["sparsity"], abs=1e-3)


class Payload:
    """Unpickling it calls open(path, "w"): what any code a pickled checkpoint may carry would run."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_checkpoints_are_plain_tensors_and_a_pickled_object_is_refused(tiny_silu, tokens, tmp_path):
    from sparsify.errors import SparsifyError
    from sparsify.train.finetune import finetune
    from sparsify.train.preflight import load_recipe

    out = tmp_path / "run"
    finetune(load_recipe(recipe_dict(tiny_silu, out, tokens=tokens, keep=True, max_steps=2, save_every=1), ["distill.kd=0"]),
             progress=False)
    newest = out / "checkpoints" / "step-00000002"
    blob = torch.load(newest / "state.pt", weights_only=True)  # tensors in plain containers only
    assert set(blob) == {"model", "optimizer", "rng"} and isinstance(blob["rng"]["numpy"], torch.Tensor)
    meta = json.loads((newest / "meta.json").read_text())
    assert meta["state"]["step"] == 2 and meta["world"] == 1 and "lr_lambdas" in meta["scheduler"]
    longer = load_recipe(recipe_dict(tiny_silu, out, tokens=tokens, keep=True, max_steps=3, save_every=1), ["distill.kd=0"])

    ran = tmp_path / "payload-ran"
    blob["rng"]["extra"] = Payload(ran)
    torch.save(blob, newest / "state.pt")
    with pytest.raises(SparsifyError, match=r"refusing to load .*state.pt: it holds pickled Python objects"):
        finetune(longer, resume=True, progress=False)
    assert not ran.exists()  # refused before anything in it ran
    torch.load(newest / "state.pt", weights_only=False)  # what the old loader did: runs the payload
    assert ran.exists()

    (newest / "meta.json").unlink()  # the old one-pickle format has no meta.json
    with pytest.raises(SparsifyError, match="is not a checkpoint this sparsify can resume"):
        finetune(longer, resume=True, progress=False)


def test_a_run_that_cannot_fit_the_cpus_memory_is_refused_before_tokenising(tiny_silu, tmp_path, monkeypatch):
    """The default recipe's GPU sizing on a CPU (16 x 2048 tokens, 49k-way logits, a teacher) was killed by the
    kernel with no message: the run is refused after the conversion, before tokenising, naming the sizes and the
    CPU smoke settings; the README's CPU smoke run of SmolLM2-135M fits 4 GiB; frozen and LoRA-wrapped weights
    carry no optimizer state; a model too large by itself says so, not 'use a smaller batch'."""
    from sparsify.errors import SparsifyError
    from sparsify.train import finetune as ft
    from sparsify.train.preflight import load_recipe

    recipe = load_recipe(recipe_dict(tiny_silu, tmp_path / "run"), ["train.batch_size=16", "train.seq_len=2048",
                                                                    "distill.kd=1"])
    monkeypatch.setattr(ft, "_data", lambda *a, **k: pytest.fail("tokenised before refusing"))
    monkeypatch.setattr("sparsify.sources.available_memory", lambda: 2**30)
    with pytest.raises(SparsifyError, match=r"needs at least ~\d+\.\d GiB .* 1\.0 GiB are available now .*, and the "
                       r"teacher: .*train.batch_size 16 x train.seq_len 2048 tokens of 49,152-way logits: 24\.0 GiB\): "
                       r"the recipe is sized for a GPU; .* train.seq_len=128"):
        ft.finetune(recipe, progress=False, verbose=False)
    converted = tmp_path / "run" / "converted"
    logits = 16 * 2048 * 49152 * 4 * 4  # micro-batch logits and their gradient, the teacher's twice more
    with pytest.raises(SparsifyError):
        ft.check_cpu_memory(recipe, converted, available=logits)  # the logits alone fill it
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two processes on this machine: twice the need
    fits_one = load_recipe(recipe_dict(tiny_silu, tmp_path / "r1"), ["train.batch_size=4", "train.seq_len=128"])
    one = 4 * 128 * 49152 * 4 * 4
    with pytest.raises(SparsifyError, match="for each of 2 processes"):
        ft.check_cpu_memory(fits_one, converted, available=int(1.5 * one) + 2**22)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    ft.check_cpu_memory(fits_one, converted, available=int(1.5 * one) + 2**22)

    smol = tmp_path / "smol"  # the README's CPU smoke run (its overrides) on SmolLM2-135M's config: fits 4 GiB
    smol.mkdir()
    shutil.copy(REPO / "eval" / "configs" / "smollm2-135m.json", smol / "config.json")
    smoke = load_recipe(REPO / "recipes" / "smollm2-135m.yaml", [
        f"data.train=[{TRAIN_TEXT}]", f"data.validation=[{VALID_TEXT}]", "data.weights=[]", "data.heldout={}",
        "data.ood=[]", "distill.kd=0", "sparsity.method=l1", "sparsity.target=none", "train.max_steps=20",
        "train.max_tokens=none", "train.seq_len=128", "train.batch_size=4"])
    ft.check_cpu_memory(smoke, smol, available=4 * 2**30)
    with pytest.raises(SparsifyError, match=r"135M parameters, 135M of them trained: 2\.5 GiB.* the model itself "
                                            r"does not fit here"):
        ft.check_cpu_memory(smoke, smol, available=2 * 2**30)
    frozen = load_recipe(REPO / "recipes" / "smollm2-135m.yaml", [*smoke_overrides(smoke), "train.freeze=['*']"])
    ft.check_cpu_memory(frozen, smol, available=int(1.0 * 2**30))  # 4 bytes a weight + start copy of none
    lora = load_recipe(REPO / "recipes" / "smollm2-135m.yaml", [*smoke_overrides(smoke), "lora.r=8"])
    ft.check_cpu_memory(lora, smol, available=int(1.0 * 2**30))


def smoke_overrides(recipe) -> list[str]:
    """A recipe's data and size overrides, to build variants of it."""
    return [f"data.train=[{TRAIN_TEXT}]", f"data.validation=[{VALID_TEXT}]", "data.weights=[]", "data.heldout={}",
            "data.ood=[]", "distill.kd=0", "sparsity.method=l1", "sparsity.target=none", "train.max_steps=20",
            "train.max_tokens=none", f"train.seq_len={recipe.train.seq_len}", f"train.batch_size={recipe.train.batch_size}"]


def test_recipe_problems_stop_finetune_before_anything_is_written(tiny_silu, tmp_path):
    """A Recipe built in Python (not through load_recipe) is checked too: a missing data file is reported before
    the SiLU source is converted or the output folder made."""
    from sparsify.errors import SparsifyError
    from sparsify.train.finetune import finetune
    from sparsify.train.preflight import load_recipe

    recipe = load_recipe(recipe_dict(tiny_silu, tmp_path / "run"), [f"data.train=[{tmp_path / 'gone.txt'}]"],
                         check_paths=False)
    with pytest.raises(SparsifyError, match=r"has 1 problem\(s\):\n  - data.train: '.*gone.txt' matches no file"):
        finetune(recipe, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_profile_steps_writes_a_report_and_attention_order_keeps_fallbacks(tiny_silu, tokens, tmp_path):
    """train.profile_steps profiles the steps after the warm-up and writes OUTPUT/profile.txt (on the CPU: the
    profiler's op table); the attention choice puts one SDPA backend first and keeps the others as fallbacks."""
    from torch.nn.attention import SDPBackend

    from sparsify.train.finetune import finetune
    from sparsify.train.step import attention_order
    from sparsify.train.profiling import WARMUP_STEPS, classify
    from sparsify.train.preflight import load_recipe

    recipe = load_recipe(recipe_dict(tiny_silu, tmp_path / "run", tokens=tokens, max_steps=WARMUP_STEPS + 2, save_every=0,
                                     log_every=WARMUP_STEPS + 2, profile_steps=2), ["distill.kd=0"])
    finetune(recipe, progress=False)
    text = (tmp_path / "run" / "profile.txt").read_text()
    assert "aten::mm" in text or "aten::addmm" in text, text[:2000]

    order = attention_order("flash", torch.device("cpu"))
    assert order[0] == SDPBackend.FLASH_ATTENTION and len(set(order)) == 4
    assert attention_order("cudnn", torch.device("cpu"))[0] == SDPBackend.CUDNN_ATTENTION
    assert attention_order("auto", torch.device("cpu")) is None  # torch's own order off Hopper
    assert classify("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>") \
        == "attention"
    assert classify("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64") == "attention"
    assert classify("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert classify("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT") == "matmul"
    assert classify("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "compiled (inductor)"
    assert classify("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>") \
        == "optimizer"
    assert classify("something_new") == "other"


def test_compiled_training_attention_is_causal_sdpa_without_a_mask(monkeypatch):
    """The training models use CAUSAL_SDPA: under a whole-model torch.compile SDPA still gets is_causal=True and
    no mask, where stock "sdpa" under compile (torch < 2.14) materialises a [B, 1, T, T] mask and computes every
    score (measured: attention 45% of an H200 step); logits equal stock eager sdpa."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparsify.train.model import register_causal_sdpa

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, hidden_act="relu")
    torch.manual_seed(0)
    stock = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    ours = LlamaForCausalLM._from_config(config, attn_implementation=register_causal_sdpa())
    ours.load_state_dict(stock.state_dict())
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    ids = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        want = stock(input_ids=ids, use_cache=False).logits
        ours.compile(backend="aot_eager")  # dynamo decides the mask while tracing; no need to generate code
        seen.clear()
        got = ours(input_ids=ids, use_cache=False).logits
    assert seen and all(s == (True, True) for s in seen), seen
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_training_attention_keeps_the_mask_for_sliding_windows_shorter_than_the_sequence():
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    from sparsify.train.model import CAUSAL_SDPA, training_attention

    assert training_attention(LlamaConfig(), 2048) == CAUSAL_SDPA
    assert training_attention(Qwen2Config(sliding_window=512), 2048) == CAUSAL_SDPA  # use_sliding_window False
    assert training_attention(MistralConfig(sliding_window=4096), 2048) == CAUSAL_SDPA  # window covers it
    assert training_attention(MistralConfig(sliding_window=1024), 2048) == "sdpa"
    assert training_attention(Gemma3TextConfig(sliding_window=512), 2048) == "sdpa"  # local layers: 512
    assert training_attention(Gemma3TextConfig(sliding_window=512), 256) == CAUSAL_SDPA


def test_target_mode_adapts_each_layer_and_resumes_exactly(tiny_silu, tokens, tmp_path):
    """sparsity.target: a layer below its target gets a stronger L1 coefficient, one above it a weaker one; the
    coefficients are logged per layer and restored on --resume (a run resumed from its step-6 checkpoint
    reproduces the uninterrupted one bitwise)."""
    from sparsify.train.finetune import finetune
    from sparsify.train.preflight import load_recipe

    out = tmp_path / "run"
    overrides = ["sparsity.target=[0.99, 0.05]", "sparsity.target_gain=2", "train.log_every=2",
                 "train.save_every=6", "train.keep_checkpoints=5", "output.plots=true",
                 "output.keep_checkpoints_when_done=true"]
    recipe = load_recipe(recipe_dict(tiny_silu, out, tokens=tokens, max_steps=12), overrides)
    finetune(recipe, progress=False)
    ref = metrics(out)
    coefs = [m["per_layer"]["l1_coef"] for m in ref if "sparsity" in m]
    assert len(coefs) == 6
    assert coefs[-1][0] > coefs[0][0] > 0.05 > coefs[0][1] > coefs[-1][1]  # l1 = 0.05 is where both started
    assert (out / "sparsity.png").is_file()

    again = tmp_path / "again"
    shutil.copytree(out, again)
    shutil.rmtree(again / "checkpoints" / "step-00000012")
    shutil.rmtree(again / "model")
    finetune(load_recipe(recipe_dict(tiny_silu, again, tokens=tokens, max_steps=12), overrides), resume=True, progress=False)
    got = metrics(again)
    assert [m["step"] for m in got] == [m["step"] for m in ref]
    for a, b in zip(ref, got):
        assert b.get("loss") == a.get("loss") and b.get("val_loss") == a.get("val_loss"), a["step"]
        assert b.get("per_layer", {}).get("l1_coef") == a.get("per_layer", {}).get("l1_coef"), a["step"]


@pytest.mark.parametrize("kd", [1.0, 0.0])
def test_heldout_domains_are_reported_as_ratios_to_the_original(tiny_silu, tmp_path, kd):
    """data.heldout: every evaluation reports each domain's perplexity and its ratio to the original dense
    model, which is evaluated once on the same text (the teacher, or with kd = 0 a copy rebuilt for it); a
    resumed run takes the original's numbers back from metrics.jsonl."""
    from sparsify.train.finetune import finetune
    from sparsify.train.preflight import load_recipe

    general = tmp_path / "general.txt"
    general.write_text(TRAIN_TEXT.read_text()[-6000:])  # not the same file: a held-out file may not be trained on
    out = tmp_path / "run"
    overrides = [f"data.heldout={{general: [{general}], docs: [{VALID_TEXT}]}}", f"distill.kd={kd}",
                 "train.save_every=2", "train.eval_every=2", "output.keep_checkpoints_when_done=true",
                 "data.validation=[]"]  # the held-out docs file is a domain here; validation is held out of train
    recipe = load_recipe(recipe_dict(tiny_silu, out, max_steps=4), overrides)
    finetune(recipe, progress=False)
    evals = [m for m in metrics(out) if "val_loss" in m]
    first = evals[0]
    assert set(first["teacher_heldout"]) == {"general", "docs"}
    for m in evals:
        assert set(m["heldout"]) == {"general", "docs"}
        for name, d in m["heldout"].items():
            assert d["ppl"] == pytest.approx(math.exp(d["loss"]))
            assert d["ratio"] == pytest.approx(d["ppl"] / first["teacher_heldout"][name]["ppl"])
        assert m["val_ppl_ratio"] == pytest.approx(m["val_ppl"] / first["teacher_val_ppl"])
    # the original SiLU model is far better than the bare ReLU swap at step 0
    assert first["heldout"]["docs"]["ratio"] > 1

    shutil.rmtree(out / "checkpoints" / "step-00000004")
    shutil.rmtree(out / "model")
    finetune(recipe, resume=True, progress=False)
    again = [m for m in metrics(out) if "val_loss" in m]
    assert again[-1]["heldout"] == evals[-1]["heldout"] and "teacher_heldout" not in again[-1]


def test_packed_ffn_kernels_train_like_dense_and_resume(tiny_silu, tokens, tmp_path):
    """train.kernels=twell: the packed FFN path gives the dense path's losses and sparsity (fp32, CPU: the
    torch implementation of the same packed format), logs which layers pack with what capacity, and a run
    resumed from a checkpoint continues with the same per-layer decisions."""
    from sparsify.train.finetune import finetune
    from sparsify.train.preflight import load_recipe

    runs = {}
    for mode in ("dense", "twell"):
        out = tmp_path / mode
        finetune(load_recipe(recipe_dict(tiny_silu, out, tokens=tokens, max_steps=8),
                             [f"train.kernels={mode}", "train.log_every=2", "train.save_every=4",
                              "train.keep_checkpoints=3", "output.keep_checkpoints_when_done=true"]), progress=False)
        runs[mode] = metrics(out)
    dense, twell = runs["dense"], runs["twell"]
    assert [m["step"] for m in dense] == [m["step"] for m in twell]
    for a, b in zip(dense, twell):
        key = "loss" if "loss" in a else "val_loss"
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), (a["step"], key)
        if "sparsity" in a:
            assert b["sparsity"] == pytest.approx(a["sparsity"], abs=0.02)
            assert "packed" not in a["per_layer"] and b["per_layer"]["packed"] == [True, True]
            assert all(16 <= c <= 64 for c in b["per_layer"]["capacity"])  # F = 64: grid values, at most F

    again = tmp_path / "again"
    shutil.copytree(tmp_path / "twell", again)
    shutil.rmtree(again / "checkpoints" / "step-00000008")
    shutil.rmtree(again / "model")
    finetune(load_recipe(recipe_dict(tiny_silu, again, tokens=tokens, max_steps=8),
                         ["train.kernels=twell", "train.log_every=2", "train.save_every=4", "train.keep_checkpoints=3",
                          "output.keep_checkpoints_when_done=true"]),
             resume=True, progress=False)
    assert metrics(again)[-1]["val_loss"] == twell[-1]["val_loss"]


def test_packed_ffn_kernels_refuse_lora_before_loading(tiny_silu, tmp_path):
    from sparsify.errors import SparsifyError
    from sparsify.train.preflight import load_recipe

    with pytest.raises(SparsifyError, match=r"train.kernels: `auto` with lora.r = 4; the packed FFN kernels"):
        load_recipe(recipe_dict(tiny_silu, tmp_path / "run", max_steps=2), ["train.kernels=auto", "lora.r=4"])


def test_blend_then_target_and_frozen_attention(tiny_silu, tokens, tmp_path):
    """sparsity.blend_steps: the first evaluation sees the source (SiLU) model, so the step-0 perplexity is the
    original's; target-mode coefficients stay put while blending and move after. train.freeze keeps attention
    weights as they were; a pattern matching nothing is refused."""
    from safetensors.torch import load_file

    from sparsify.errors import SparsifyError
    from sparsify.train.finetune import finetune
    from sparsify.train.preflight import load_recipe

    out = tmp_path / "run"
    overrides = ["sparsity.blend_steps=4", "sparsity.target=0.99", "sparsity.target_gain=2", "train.log_every=2",
                 "train.freeze=[*.self_attn.*]"]
    finetune(load_recipe(recipe_dict(tiny_silu, out, tokens=tokens, max_steps=8), overrides), progress=False)
    m = metrics(out)
    first = m[0]
    assert first["val_loss"] == pytest.approx(first["teacher_val_loss"], rel=1e-5)  # blend at 0 = the original
    coefs = {r["step"]: r["per_layer"]["l1_coef"] for r in m if "sparsity" in r}
    assert coefs[2] == coefs[4] == pytest.approx([0.05, 0.05])  # no update while blending (steps 1-4)
    assert all(c > 0.05 for c in coefs[8])  # then below target: stronger
    before = load_file(str(next((out / "converted").glob("*.safetensors"))))
    after = load_file(str(next((out / "model").glob("*.safetensors"))))
    attn = [k for k in before if ".self_attn." in k]
    assert attn and all(torch.equal(before[k], after[k]) for k in attn)
    assert not torch.equal(before["model.layers.0.mlp.gate_proj.weight"], after["model.layers.0.mlp.gate_proj.weight"])
    assert json.loads((out / "model" / "config.json").read_text())["hidden_act"] == "relu"

    with pytest.raises(SparsifyError, match=r"train.freeze: \['\*attn_typo\*'\] match no parameter"):
        finetune(load_recipe(recipe_dict(tiny_silu, tmp_path / "bad", tokens=tokens, max_steps=2), ["train.freeze=[*attn_typo*]"]),
                 progress=False)
    with pytest.raises(SparsifyError, match="sparsity.blend_steps=8 is not below the run's 2 steps"):
        finetune(load_recipe(recipe_dict(tiny_silu, tmp_path / "bad2", tokens=tokens, max_steps=2), ["sparsity.blend_steps=8"]),
                 progress=False)


def test_prepare_data_tokenises_and_stops_and_the_folder_trains(tiny_silu, tmp_path, capsys):
    """finetune --prepare-data: OUT/data (the token folder, to carry to a machine without the text) and no
    training; a later run trains from that folder as it is."""
    from sparsify import cli as sparsify_cli

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(tiny_silu, tmp_path / "prep", max_steps=4)))
    assert sparsify_cli.main(["finetune", str(path), "--prepare-data", "-q"]) == 0
    folder = tmp_path / "prep" / "data"
    assert f"token folder: {folder}" in capsys.readouterr().out
    assert (folder / "train.bin").stat().st_size > 0 and not (tmp_path / "prep" / "metrics.jsonl").exists()
    assert not (tmp_path / "prep" / "model").exists()
    path.write_text(yaml.safe_dump(recipe_dict(tiny_silu, tmp_path / "run", tokens=folder, max_steps=4)))
    assert sparsify_cli.main(["finetune", str(path), "-q"]) == 0
    assert (tmp_path / "run" / "model" / "config.json").is_file()
    assert not (tmp_path / "run" / "data").exists()  # the carried folder is read as it is, not tokenised again


def test_a_foreign_output_model_folder_is_refused_at_the_start_not_at_the_export(tiny_silu, tmp_path, monkeypatch):
    """The export replaces OUTPUT/model whole; one holding other files is refused before the conversion (it was
    found only at the export, after the whole run)."""
    from sparsify.errors import SparsifyError
    from sparsify.train import finetune as ft
    from sparsify.train.preflight import load_recipe

    (tmp_path / "run" / "model").mkdir(parents=True)
    (tmp_path / "run" / "model" / "notes.txt").write_text("keep")
    recipe = load_recipe(recipe_dict(tiny_silu, tmp_path / "run"), ["output.overwrite=true"])
    monkeypatch.setattr(ft, "prepare_model", lambda *a, **k: pytest.fail("converted before refusing"))
    with pytest.raises(SparsifyError, match=r"output.dir .*model holds notes.txt, and is not a model folder"):
        ft.finetune(recipe, progress=False, verbose=False)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["model"]
