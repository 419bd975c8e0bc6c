"""sparsity.method=threshold: h = g * [g > theta] * up, theta driven to the target by a controller on the zeros.

The activation's values and gradients (straight-through and exact), the calibration and the controller on a tiny
model, then the whole run on CPU: the L1 warm-up, the switch, the targets held, --resume exact across the switch,
and the exported folder (theta in float32 in the weights, an activation stock transformers refuses).
"""

import json
import math
import shutil

import pytest
import torch
from safetensors import safe_open

from sparsify.train.config import SparsitySection
from sparsify.train.mlp import ThresholdReLU, TrainMLPs
from sparsify.train.objective import StepStats, ThresholdControl, neuron_shape

from tests.train.helpers import metrics, recipe_dict

THRESHOLD = ["sparsity.method=threshold", "sparsity.target=[0.9, 0.8]", "sparsity.warmup_target=0.7",
             "sparsity.warmup_tokens=384", "train.log_every=2", "train.save_every=4", "train.keep_checkpoints=10",
             "output.keep_checkpoints_when_done=true",
             "train.lr=3e-4"]  # (at the suite's 3e-3, Adam moves this random model's 0.02-scale weights ~15% a step)


@pytest.mark.parametrize("ste", [True, False])
def test_threshold_relu_values_and_gradients(ste):
    g = torch.tensor([-1.0, 0.0, 0.2, 0.5, 0.50001, 2.0], requires_grad=True)
    act = ThresholdReLU(6, ste, torch.device("cpu"))
    act.theta.copy_(torch.tensor([0.5] * 6))
    y = act(g)
    assert y.tolist() == [0.0, 0.0, 0.0, 0.0, pytest.approx(0.50001), 2.0]  # strictly greater than theta
    y.sum().backward()
    # straight-through: the gradient of every positive gate passes, as under ReLU; exact: only above theta
    assert g.grad.tolist() == ([0, 0, 1, 1, 1, 1] if ste else [0, 0, 0, 0, 1, 1])


def test_theta_zero_is_relu_bitwise_in_bf16():
    g = torch.randn(4, 64, dtype=torch.bfloat16)
    assert torch.equal(ThresholdReLU(64, True, torch.device("cpu"))(g), torch.relu(g))


def _tiny_model(layers=2, d=16, f=64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=d, intermediate_size=f, num_hidden_layers=layers,
                                        num_attention_heads=2, num_key_value_heads=1, hidden_act="relu"))


def _control(model, cfg: SparsitySection) -> ThresholdControl:
    """The thresholds of `model`'s training MLPs (ThresholdReLU activations) and their controller."""
    return ThresholdControl(TrainMLPs(model, cfg), cfg, torch.device("cpu"))


def _zeros(model, ids):
    from sparsify.families import mlp_modules

    seen = []
    hooks = [m.down_proj.register_forward_pre_hook(lambda mod, a: seen.append(float((a[0] == 0).float().mean())))
             for m in mlp_modules(model)]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("mode", ["layer", "neuron"])
def test_calibration_puts_every_layer_at_its_target_and_the_controller_follows(mode):
    model = _tiny_model()
    cfg = SparsitySection(method="threshold", threshold=mode, target=[0.9, 0.75], threshold_gain=1.0)
    control = _control(model, cfg)
    ids = torch.randint(0, 128, (4, 64))
    relu_zeros = _zeros(model, ids)  # theta = 0 until calibrated: the ReLU model
    assert all(z < 0.7 for z in relu_zeros) and control.theta() == [0.0, 0.0]
    control.calibrate(lambda: model(input_ids=ids))
    zeros = _zeros(model, ids)
    assert zeros == pytest.approx([0.9, 0.75], abs=0.01), zeros
    if mode == "neuron":  # theta_j = theta_l * s_j with s_j = 1 / (|W_up[j]| |W_down[:, j]|), geometric mean 1
        mlp = model.model.layers[1].mlp
        s = neuron_shape(mlp)
        assert s.log().mean().abs() < 1e-5 and s.std() > 0
        ratio = mlp.up_proj.weight.norm(dim=1) * mlp.down_proj.weight.norm(dim=0)
        assert torch.allclose(control.acts[1].theta, control.theta()[1] * s) and \
            torch.allclose(s * ratio, (s * ratio)[0].expand(64), rtol=1e-4)
    # a layer below its target gets a higher theta, one above a lower one; the largest move is exp(0.05 * gain)
    before = control.theta()
    width = 64
    control.update(StepStats(per_token=torch.tensor([(1 - 0.85) * width, (1 - 0.80) * width]),
                             inactive=torch.zeros(2, width, dtype=torch.bool)))
    after = control.theta()
    assert after[0] == pytest.approx(before[0] * math.exp(0.05)) and after[1] == pytest.approx(before[1] * math.exp(-0.05))


def test_a_layer_already_past_its_target_keeps_its_zeros_and_gets_a_theta_at_its_gates_scale():
    """A layer the L1 warm-up left sparser than its target: the quantile at the target is 0, and theta is the
    layer's smallest positive gate (its zeros unchanged, but for that one value), not the 1e-6 floor that the
    log-space controller needed thousands of steps to climb from once the penalty stopped."""
    model = _tiny_model()
    with torch.no_grad():
        model.model.layers[0].mlp.gate_proj.weight[:61].zero_()  # 61 of 64 gates read 0: 95.3% zeros
    control = _control(model, SparsitySection(method="threshold", target=[0.9, 0.75]))
    ids = torch.randint(0, 128, (4, 64))
    gates = []
    hook = model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda mod, a, out: gates.append(out))
    before = _zeros(model, ids)
    hook.remove()
    assert before[0] > 0.9
    control.calibrate(lambda: model(input_ids=ids))
    after = _zeros(model, ids)
    smallest = float(gates[0][gates[0] > 0].min())
    assert control.theta()[0] == pytest.approx(smallest, rel=1e-5) and smallest > 1e-4
    # unchanged, but for the smallest gate itself where exp(log theta) rounds to it or above (not > theta)
    assert 0 <= after[0] - before[0] <= 1 / gates[0].numel() + 1e-9
    assert after[1] == pytest.approx(0.75, abs=0.01)  # the other layer: its quantile, as before


def test_threshold_ramp_calibrates_at_the_warmup_zeros_then_raises_the_target_linearly():
    """sparsity.threshold_ramp: theta is calibrated to each layer's warm-up target (capped at its target), and the
    target the controller holds rises linearly to the final one over the ramp's tokens, from the calibration on."""
    model = _tiny_model()
    cfg = SparsitySection(method="threshold", target=[0.9, 0.6], warmup_target=0.7, warmup_tokens=100,
                          threshold_ramp=1000)
    control = _control(model, cfg)
    ids = torch.randint(0, 128, (4, 64))
    control.calibrate(lambda: model(input_ids=ids), tokens=200)
    assert _zeros(model, ids) == pytest.approx([0.7, 0.6], abs=0.01)  # layer 1's warm-up 0.7 capped at its 0.6
    assert control.target_at(200).tolist() == pytest.approx([0.7, 0.6])
    assert control.target_at(700).tolist() == pytest.approx([0.8, 0.6])
    assert control.target_at(1200).tolist() == pytest.approx([0.9, 0.6]) == control.target_at(5000).tolist()
    # the controller chases the ramped target: at 700 tokens, 0.78 zeros is below layer 0's 0.8 -> theta up
    before = control.theta()
    control.update(StepStats(per_token=torch.tensor([(1 - 0.78) * 64, (1 - 0.6) * 64]),
                             inactive=torch.zeros(2, 64, dtype=torch.bool)), tokens=700)
    after = control.theta()
    assert after[0] == pytest.approx(before[0] * math.exp(0.02), rel=1e-4) and after[1] == pytest.approx(before[1])
    state = control.state_dict()  # --resume: the ramp restarts where it was (its start is in the checkpoint)
    again = _control(_tiny_model(), cfg)
    again.load_state_dict(state)
    assert again.calibrated_at == 200 and again.target_at(700).tolist() == pytest.approx([0.8, 0.6])
    no_ramp = _control(_tiny_model(), SparsitySection(method="threshold", target=[0.9, 0.6], warmup_target=0.7,
                                                      warmup_tokens=100))
    assert no_ramp.target_at(0).tolist() == pytest.approx([0.9, 0.6])


def test_threshold_run_with_a_ramp_starts_at_the_warmup_zeros_and_climbs(tiny_silu, tokens, tmp_path):
    """The ramp wired through a run: calibrated at the warm-up's zeros (0.7 for both layers), then, with the
    target rising over 192 tokens (3 steps), the controller raises theta step after step: layer 0's zeros climb
    towards its 0.9, where a run without the ramp sits at 0.9 from the switch on."""
    from sparsify.train.finetune import finetune
    from sparsify.train.preflight import load_recipe

    out = tmp_path / "run"
    finetune(load_recipe(recipe_dict(tiny_silu, out, tokens=tokens, max_steps=12),
                         [*THRESHOLD, "sparsity.threshold_ramp=192"]), progress=False)
    layer0 = [m["per_layer"]["zeros"][0] for m in metrics(out) if "sparsity" in m and m["l1_coef"] == 0]
    assert len(layer0) == 3 and layer0[0] < 0.8, layer0
    assert layer0[2] > layer0[0] + 0.02, layer0


def test_threshold_run_warms_up_switches_holds_targets_exports_and_resumes_exactly(tiny_silu, tokens, tmp_path):
    """12 steps of 64 tokens: 6 of L1 warm-up (384 tokens), the calibration, 6 with theta held at the targets."""
    from transformers import AutoModelForCausalLM

    from sparsify.families import THRESHOLD_ACT
    from sparsify.train.finetune import finetune
    from sparsify.train.preflight import load_recipe

    out = tmp_path / "run"
    finetune(load_recipe(recipe_dict(tiny_silu, out, tokens=tokens, max_steps=12), THRESHOLD), progress=False)
    ref = metrics(out)
    train = [m for m in ref if "sparsity" in m]
    assert [m["step"] for m in train] == [2, 4, 6, 8, 10, 12]
    for m in train[:3]:  # the warm-up: L1 on, theta 0
        assert m["l1_coef"] > 0 and m["per_layer"]["theta"] == [0.0, 0.0]
    for m in train[3:]:  # after the switch: L1 off, theta > 0, every layer near its target
        assert m["l1_coef"] == 0 and all(t > 0 for t in m["per_layer"]["theta"])
        assert m["per_layer"]["zeros"] == pytest.approx([0.9, 0.8], abs=0.04), m["per_layer"]["zeros"]

    folder = out / "model"
    config = json.loads((folder / "config.json").read_text())
    assert config["hidden_act"] == THRESHOLD_ACT and config["sparsify"]["threshold"]["mode"] == "layer"
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        theta = [f.get_tensor(f"model.layers.{i}.mlp.threshold") for i in range(2)]
    assert not any(".act_fn." in k for k in keys)
    assert all(t.dtype == torch.float32 and t.shape == (64,) for t in theta)
    assert [float(t[0]) for t in theta] == pytest.approx(train[-1]["per_layer"]["theta"], rel=1e-6)
    with pytest.raises(KeyError, match="trust_remote_code"):  # stock transformers: refused, never a dense ReLU model
        AutoModelForCausalLM.from_pretrained(folder)

    for resume_from in ("step-00000004", "step-00000008"):  # before and after the switch
        again = tmp_path / f"again-{resume_from}"
        shutil.copytree(out, again)
        for ckpt in (again / "checkpoints").iterdir():
            if ckpt.name > resume_from:
                shutil.rmtree(ckpt)
        shutil.rmtree(again / "model")
        finetune(load_recipe(recipe_dict(tiny_silu, again, tokens=tokens, max_steps=12), THRESHOLD), resume=True,
                 progress=False)
        got = metrics(again)
        assert [m["step"] for m in got] == [m["step"] for m in ref]
        for a, b in zip(ref, got):
            assert b.get("loss") == a.get("loss") and b.get("val_loss") == a.get("val_loss"), (resume_from, a["step"])
            assert b.get("per_layer", {}).get("theta") == a.get("per_layer", {}).get("theta"), (resume_from, a["step"])


@pytest.mark.parametrize("overrides, message", [
    (["sparsity.method=threshold", "sparsity.target=none"], "needs sparsity.target"),
    (["sparsity.method=threshold", "sparsity.target=0.9", "sparsity.warmup_target=0.8"], "no warm-up to drive"),
    (["sparsity.method=threshold", "sparsity.target=0.9", "sparsity.warmup_tokens=10_000"], "never be calibrated"),
    (["sparsity.method=threshold", "sparsity.target=0.9", "sparsity.threshold_grad=ste", "train.kernels=twell"],
     "threshold_grad=exact"),
    (["sparsity.method=threshold", "sparsity.target=0.9", "sparsity.blend_steps=2"], "both replace the MLP activation"),
    (["sparsity.method=threshold", "sparsity.target=[0.9, 0.9, 0.9]"], "3 values, but"),
    (["sparsity.method=threshold", "sparsity.target=0.9", "sparsity.threshold_ramp=1000"], "where the ramp starts"),
    (["sparsity.method=threshold", "sparsity.target=0.9", "sparsity.threshold_ramp=-1"], "must be >= 0"),
])
def test_threshold_recipe_problems_are_refused_before_work(tiny_silu, tmp_path, overrides, message):
    from sparsify.errors import SparsifyError
    from sparsify.train.preflight import load_recipe

    with pytest.raises(SparsifyError, match=message):
        load_recipe(recipe_dict(tiny_silu, tmp_path / "run", max_tokens=5_000), overrides)


def test_warmup_keys_under_l1_are_noted_not_refused(tiny_silu, tmp_path):
    """recipe_notes of a Recipe alone (a recipe built in Python: nothing says which values the recipe file had): warm-up
    keys set under L1 are noted, not refused; a recipe without them gets no note."""
    from sparsify.train.preflight import load_recipe, recipe_notes

    recipe = recipe_dict(tiny_silu, tmp_path / "run", max_tokens=5_000)
    r = load_recipe(recipe, ["sparsity.warmup_target=0.8", "sparsity.warmup_tokens=100"])
    assert r.sparsity.method == "l1"
    (note,) = recipe_notes(r)
    assert "sparsity.warmup_target, sparsity.warmup_tokens: set" in note and "not used" in note
    assert recipe_notes(load_recipe(recipe, [])) == []
    threshold = load_recipe(recipe, ["sparsity.method=threshold", "sparsity.target=0.9", "sparsity.warmup_target=0.8",
                                     "sparsity.warmup_tokens=100"])
    assert recipe_notes(threshold) == []


def test_a_threshold_recipe_run_as_l1_by_one_override_gets_no_note_on_its_own_keys(tiny_silu, tokens, tmp_path,
                                                                                   capsys):
    """The README's CPU example runs the threshold recipe with sparsity.method=l1 and got a note that the recipe's
    own sparsity.warmup_target / warmup_tokens are unused (issue 40). From the command as typed: the recipe file's
    own warm-up keys are not noted, a value set on the command line is, and so are an L1 recipe file's own."""
    import yaml

    from sparsify import cli as sparsify_cli

    recipe = recipe_dict(tiny_silu, tmp_path / "run", tokens=tokens, max_steps=4)
    recipe["sparsity"].update(method="threshold", target=0.9, warmup_target=0.8, warmup_tokens=100)
    threshold = tmp_path / "threshold.yaml"
    threshold.write_text(yaml.safe_dump(recipe))
    recipe["sparsity"].update(method="l1", target=None)
    l1 = tmp_path / "l1.yaml"
    l1.write_text(yaml.safe_dump(recipe))

    def notes(path, *overrides):  # --prepare-data: the notes come before any work, and no training follows
        assert sparsify_cli.main(["finetune", str(path), *overrides, "--prepare-data", "--no-progress"]) == 0
        return [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: sparsity.")]

    assert notes(threshold, "sparsity.method=l1", "sparsity.target=none") == []
    (note,) = notes(threshold, "sparsity.method=l1", "sparsity.target=none", "sparsity.warmup_tokens=200")
    assert note.startswith("note: sparsity.warmup_tokens: set, but sparsity.method is `l1`"), note
    (note,) = notes(l1)
    assert note.startswith("note: sparsity.warmup_target, sparsity.warmup_tokens: set, but sparsity.method is `l1`")


def test_compiled_threshold_run_matches_eager_and_compiles_once(tiny_silu, tokens, tmp_path):
    """Under torch.compile (inductor on the CPU here) the calibration forward runs eagerly and theta, moved in place
    every step, is an input of the compiled graph, not a constant: same losses as eager, no recompile per step."""
    import torch._dynamo

    from sparsify.train.finetune import finetune
    from sparsify.train.preflight import load_recipe

    from tests.train.helpers import assert_same_run

    runs, frames = [], []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()  # the counters are global: earlier tests in this process add to them
        out = tmp_path / f"run-{compiled}"
        recipe = recipe_dict(tiny_silu, out, tokens=tokens, max_steps=8, log_every=2, save_every=0, compile=compiled)
        finetune(load_recipe(recipe, ["distill.kd=0", "sparsity.method=threshold", "sparsity.target=0.9",
                                      "sparsity.warmup_tokens=128", "train.lr=3e-4"]), progress=False)
        runs.append(metrics(out))
        frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert_same_run(runs[0], runs[1], rel=1e-4)
    thetas = [[t for m in run if "sparsity" in m for t in m["per_layer"]["theta"]] for run in runs]
    assert thetas[1] == pytest.approx(thetas[0], rel=1e-4) and thetas[0][-1] > 0
    assert frames[0] == 0 and frames[1] <= 4, frames  # the model's forward (and the loss) once each; not one per theta update


def test_allocate_zeros_keeps_the_mean_within_the_range_and_gives_cheap_layers_more():
    from sparsify.train.objective import allocate_zeros

    zeros = allocate_zeros([1.0, 4.0, 0.25, 1.0], mean=0.95, low=0.90, high=0.99)
    assert sum(zeros) / 4 == pytest.approx(0.95)
    density = [1 - z for z in zeros]  # no bound binds: density in proportion to sqrt(cost)
    assert density[1] / density[0] == pytest.approx(2.0) and density[0] / density[2] == pytest.approx(2.0)
    assert zeros[2] > zeros[0] > zeros[1] and zeros[0] == pytest.approx(zeros[3])
    clipped = allocate_zeros([100.0, 1.0, 1.0, 1.0], mean=0.95, low=0.90, high=0.99)  # layer 0 would want 84.6%
    assert clipped[0] == pytest.approx(0.90) and sum(clipped) / 4 == pytest.approx(0.95)
    assert clipped[1:] == pytest.approx([0.95 + 0.05 / 3] * 3)
    # free layers share what the clipped one leaves: the mean holds before any layer reaches `high`
    assert allocate_zeros([0.0, 0.0, 5.0], mean=0.95, low=0.90, high=0.99) == pytest.approx([0.975, 0.975, 0.90])
    assert allocate_zeros([2.0] * 3, mean=0.93, low=0.90, high=0.99) == pytest.approx([0.93] * 3)


SENSITIVITY = [o for o in THRESHOLD if not o.startswith("sparsity.target=")] + [
    "sparsity.target=0.85", "sparsity.allocate=sensitivity", "sparsity.allocate_range=[0.75, 0.95]"]


def test_sensitivity_allocation_measures_each_layer_keeps_the_mean_and_resumes_exactly(tiny_silu, tokens, tmp_path,
                                                                                        capfd):
    """allocate=sensitivity: at the calibration each layer's cost is measured on the batch and the targets are
    chosen within the range with the mean of `target`; the log names them, the layers are held there, the exported
    folder records them, and --resume after the switch restores them (the same numbers)."""
    from sparsify.train.finetune import finetune
    from sparsify.train.preflight import load_recipe

    out = tmp_path / "run"
    finetune(load_recipe(recipe_dict(tiny_silu, out, tokens=tokens, max_steps=12), SENSITIVITY), progress=False)
    assert "zeros allocated by sensitivity (mean 0.8500)" in capfd.readouterr().err
    chosen = json.loads((out / "model" / "config.json").read_text())["sparsify"]["threshold"]
    assert chosen["allocate"] == "sensitivity" and len(chosen["costs"]) == 2 and min(chosen["costs"]) >= 0
    targets = chosen["targets"]
    assert sum(targets) / 2 == pytest.approx(0.85, abs=1e-4) and all(0.75 <= t <= 0.95 for t in targets)
    assert targets[0] != pytest.approx(targets[1], abs=1e-3)  # two layers of a random model do not cost the same
    ref = metrics(out)
    last = [m for m in ref if "sparsity" in m][-1]
    assert last["per_layer"]["zeros"] == pytest.approx(targets, abs=0.05), last["per_layer"]["zeros"]

    again = tmp_path / "again"
    shutil.copytree(out, again)
    for ckpt in (again / "checkpoints").iterdir():
        if ckpt.name > "step-00000008":
            shutil.rmtree(ckpt)
    shutil.rmtree(again / "model")
    finetune(load_recipe(recipe_dict(tiny_silu, again, tokens=tokens, max_steps=12), SENSITIVITY), resume=True,
             progress=False)
    for a, b in zip(ref, metrics(again)):
        assert b.get("loss") == a.get("loss") and b.get("per_layer", {}).get("theta") == a.get("per_layer", {}).get("theta")
    assert json.loads((again / "model" / "config.json").read_text())["sparsify"]["threshold"]["targets"] == targets


@pytest.mark.parametrize("overrides, message", [
    (["sparsity.allocate_range=[0.96, 0.99]"], "does not hold the mean target"),
    (["sparsity.allocate_range=[0.9]"], "give \\[low, high\\]"),
    (["sparsity.allocate_probe=0.5"], "allocate_probe: got 0.5"),
    (["sparsity.allocate=evenly"], "evenly"),
])
def test_sensitivity_allocation_problems_are_refused_before_work(tiny_silu, tmp_path, overrides, message):
    from sparsify.errors import SparsifyError
    from sparsify.train.preflight import load_recipe

    base = ["sparsity.method=threshold", "sparsity.target=0.95", "sparsity.allocate=sensitivity"]
    with pytest.raises(SparsifyError, match=message):
        load_recipe(recipe_dict(tiny_silu, tmp_path / "run", max_tokens=5_000), base + overrides)
