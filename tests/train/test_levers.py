"""The levers that protect what the original model knows (issue 21), on a tiny model on CPU: layer-wise FFN
distillation, the target ramp, teacher-generated data as a training source, and the out-of-distribution headline."""

import json
import math

import pytest
import torch

from sparsify.errors import SparsifyError
from sparsify.train.config import SparsitySection
from sparsify.train.objective import L1Control, StepStats
from sparsify.train.preflight import load_recipe
from tests.train.helpers import TRAIN_TEXT, VALID_TEXT, metrics, recipe_dict


def test_mlp_distillation_trains_with_a_finite_logged_term_and_the_ood_headline(tiny_silu, tmp_path):
    """distill.mlp alone (kd = 0): every logged step carries a finite, positive `mlp` term; every evaluation
    carries ood_ratio over the data.ood domains and id_ratio over the others, as geometric means of their ratios."""
    from sparsify.train.finetune import finetune

    general = tmp_path / "general.txt"
    general.write_text(TRAIN_TEXT.read_text()[-6000:])
    novel = tmp_path / "novel.txt"
    novel.write_text(VALID_TEXT.read_text()[:6000])
    overrides = [f"data.heldout={{general: [{general}], novel: [{novel}], docs: [{VALID_TEXT}]}}",
                 "data.ood=[novel, docs]", "data.validation=[]", "distill.kd=0", "distill.mlp=1.0",
                 "train.log_every=2", "train.eval_every=2"]
    finetune(load_recipe(recipe_dict(tiny_silu, tmp_path / "run", max_steps=4), overrides), progress=False)
    records = metrics(tmp_path / "run")
    steps = [m for m in records if "sparsity" in m]
    assert steps and all(math.isfinite(m["mlp"]) and m["mlp"] > 0 for m in steps)
    evals = [m for m in records if "val_loss" in m]
    for m in evals:
        ratios = {name: d["ratio"] for name, d in m["heldout"].items()}
        assert m["ood_ratio"] == pytest.approx(math.sqrt(ratios["novel"] * ratios["docs"]))
        assert m["id_ratio"] == pytest.approx(ratios["general"])


def test_lever_problems_are_listed_with_the_others_before_any_work(tmp_path):
    with pytest.raises(SparsifyError) as e:
        load_recipe({"data": {"train": ["x.txt"], "heldout": {"docs": ["y.txt"]}, "ood": ["novel"]},
                     "distill": {"mlp": -1}, "sparsity": {"target_ramp": 1000}, "train": {"lr": -1, "max_steps": 2}},
                    check_paths=False)
    msg = str(e.value)
    assert "distill.mlp: got -1" in msg and "train.lr: got -1" in msg
    assert "data.ood: ['novel'] not among the data.heldout domains" in msg
    assert "sparsity.target_ramp: 1000 without sparsity.target" in msg


def test_target_ramp_rises_from_the_first_steps_zeros_to_the_targets():
    cfg = SparsitySection(target=[0.9, 0.95], target_ramp=1000, l1=0.01)
    control = L1Control(cfg, layers=2, device=torch.device("cpu"))
    first = StepStats(per_token=torch.tensor([40.0, 10.0]), inactive=torch.zeros(2, 100, dtype=torch.bool))
    control.update(first, tokens=0)  # zeros 0.60 and 0.90: the ramp starts there
    assert control.targets_at(0).tolist() == pytest.approx([0.6, 0.9])
    assert control.targets_at(500).tolist() == pytest.approx([0.75, 0.925])
    assert control.targets_at(5000).tolist() == pytest.approx([0.9, 0.95])
    restored = L1Control(cfg, layers=2, device=torch.device("cpu"))
    restored.load_state_dict(json.loads(json.dumps(control.state_dict())))
    assert restored.targets_at(500).tolist() == pytest.approx([0.75, 0.925])
    no_ramp = L1Control(SparsitySection(target=0.9, l1=0.01), layers=2, device=torch.device("cpu"))
    no_ramp.update(first, tokens=0)
    assert no_ramp.targets_at(0).tolist() == pytest.approx([0.9, 0.9])


def test_a_gendata_folder_trains_beside_a_text_file_by_weight(tiny_silu, tmp_path):
    """`sparsify gendata` output is a data.train entry like any other, mixed with real text by data.weights."""
    from sparsify.train.data import TokenData
    from sparsify.train.finetune import finetune
    from sparsify.train.gendata import gendata

    gen = gendata(tiny_silu, tmp_path / "gen", tokens=300, seq_len=16, batch_size=4, device="cpu", progress=False)
    overrides = [f"data.train=[{gen}, {TRAIN_TEXT}]", "data.weights=[0.5, 0.5]", "distill.kd=0"]
    recipe = load_recipe(recipe_dict(tiny_silu, tmp_path / "run", max_steps=2), overrides)
    finetune(recipe, progress=False)
    meta = json.loads((tmp_path / "run" / "data" / "meta.json").read_text())
    assert len(meta["sources"]) == 2
    data = TokenData(tmp_path / "run" / "data", 32, 0, [0.5, 0.5])
    assert data.n_train > 0 and (tmp_path / "run" / "model" / "config.json").is_file()


@pytest.mark.parametrize("towards", ["zero", "start"])
def test_weight_decay_pulls_matrices_towards_zero_or_the_start_and_never_the_vectors(towards):
    """With zero gradients Adam moves nothing, so one step is the decay alone: w <- w - lr * wd * (w - target), the
    target zero (AdamW's own) or the weights when the optimizer was built (train.weight_decay_to=start); biases and
    norms never decay."""
    from sparsify.train.config import Recipe
    from sparsify.train.distributed import Dist
    from sparsify.train.model import DecayToStart, build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    recipe = Recipe()
    recipe.train.lr, recipe.train.weight_decay, recipe.train.weight_decay_to, recipe.train.warmup_steps = \
        0.1, 0.5, towards, 0
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt, _ = build_optimizer(model, recipe, total_steps=10, dist=Dist())
    decay = DecayToStart.of(model, recipe)  # (weight_decay_to=start: after the optimizer's step, as train_step calls it)
    assert (decay is None) == (towards == "zero")
    with torch.no_grad():  # moved away from the start after the optimizer exists, as training moves it
        for p in model.parameters():
            p.add_(1.0)
    moved = {k: v.clone() for k, v in model.state_dict().items()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    if decay is not None:
        decay.step(opt.param_groups[0]["lr"])
    after = model.state_dict()
    target = start["0.weight"] if towards == "start" else torch.zeros_like(start["0.weight"])
    torch.testing.assert_close(after["0.weight"], moved["0.weight"] - 0.1 * 0.5 * (moved["0.weight"] - target),
                               rtol=0, atol=1e-6)
    for name in ("0.bias", "1.weight", "1.bias"):
        torch.testing.assert_close(after[name], moved[name], rtol=0, atol=0)


def test_decay_to_start_trains_and_resumes_exactly(tiny_silu, tokens, tmp_path):
    """train.weight_decay_to=start end to end: the start is the model folder's weights, rebuilt on --resume (it is
    not in the checkpoint), so a run resumed from a middle checkpoint logs the same losses bitwise; and it is a
    different run from the default decay towards zero."""
    import shutil

    from sparsify.train.finetune import finetune

    def run(out, resume=False, to="start"):
        finetune(load_recipe(recipe_dict(tiny_silu, out, keep=True, tokens=tokens, max_steps=8, save_every=4, log_every=2,
                                         weight_decay=0.5), [f"train.weight_decay_to={to}"]),
                 resume=resume, progress=False)
        return [(m["step"], m.get("loss"), m.get("val_loss")) for m in metrics(out)]

    out = tmp_path / "run"
    ref = run(out)
    zero = run(tmp_path / "zero", to="zero")
    assert [s for s, *_ in zero] == [s for s, *_ in ref] and zero != ref
    again = tmp_path / "again"
    shutil.copytree(out, again)
    for ckpt in (again / "checkpoints").iterdir():
        if ckpt.name > "step-00000004":
            shutil.rmtree(ckpt)
    shutil.rmtree(again / "model")
    assert run(again, resume=True) == ref


@pytest.mark.slow
def test_decay_to_start_under_fsdp2_matches_one_process(tiny_silu, tmp_path):
    """FSDP2 shards the matrices (DTensors): the start copy is sharded with them and the pull is the same, so two
    gloo ranks with batch 1 each log the losses of one process with batch 2 (float sums in another order)."""
    import yaml

    from tests.train.helpers import assert_same_run, cli, torchrun

    runs = {}
    for mode in ("one", "fsdp"):
        out = tmp_path / mode
        train = {"max_steps": 12, "save_every": 0, "weight_decay": 0.5, "weight_decay_to": "start"}
        train |= {"batch_size": 1, "distributed": "fsdp"} if mode == "fsdp" else {}
        path = tmp_path / f"{mode}.yaml"
        path.write_text(yaml.safe_dump(recipe_dict(tiny_silu, out, **train)))
        if mode == "fsdp":
            torchrun(path)
        else:
            proc = cli(["finetune", str(path), "--no-progress"])
            log, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, log
        runs[mode] = metrics(out)
    assert_same_run(runs["one"], runs["fsdp"], rel=1e-5)


@pytest.mark.parametrize("ce", [0.0, 0.1, 1.0])
def test_the_objective_weighs_the_cross_entropy_by_distill_ce(tiny_silu, tmp_path, ce):
    """distill.ce weighs the next-token cross-entropy in the loss that trains (0: the logits of the original only);
    the log keeps both terms. No sparsity pressure here, so the loss is exactly ce * CE + kd * KL."""
    from sparsify.train.finetune import finetune

    overrides = [f"distill.ce={ce}", "distill.kd=1", "sparsity.method=l1", "sparsity.target=none", "sparsity.l1=0",
                 "train.log_every=1"]
    finetune(load_recipe(recipe_dict(tiny_silu, tmp_path / "run", max_steps=3), overrides), progress=False)
    steps = [m for m in metrics(tmp_path / "run") if "sparsity" in m]
    assert len(steps) == 3
    for m in steps:
        assert m["ce"] > 1 and m["kd"] > 0
        assert m["loss"] == pytest.approx(ce * m["ce"] + m["kd"], rel=1e-5)


def test_an_objective_with_nothing_on_the_logits_is_refused_before_any_work():
    with pytest.raises(SparsifyError) as e:
        load_recipe({"data": {"train": ["x.txt"]}, "distill": {"ce": 0, "kd": 0}, "train": {"max_steps": 2}},
                    check_paths=False)
    assert "distill.ce=0 with distill.kd=0" in str(e.value)
    with pytest.raises(SparsifyError, match=r"distill.ce: got -1(\.0)?; must be >= 0"):
        load_recipe({"data": {"train": ["x.txt"]}, "distill": {"ce": -1}, "train": {"max_steps": 2}}, check_paths=False)
