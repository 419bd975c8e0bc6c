"""The L1 objective and sparsity statistics against hand-computed h = relu(gate(x)) * up(x)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sparsify.train.config import SparsitySection
from sparsify.train.mlp import TrainMLPs
from sparsify.train.objective import L1Control, Plateau, SparsityCounts, StepStats, l1_coefficient, reinit_dead


def tiny_relu(layers=3, hidden=16, F=40):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=F, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, hidden_act="relu")
    return LlamaForCausalLM(cfg)


def hand_h(model, ids):
    """h of every layer, captured independently of the training MLPs: relu(gate(x)) * up(x) on the MLP input."""
    hs = []
    hooks = [layer.mlp.register_forward_pre_hook(
        lambda m, a: hs.append(torch.relu(m.gate_proj(a[0])) * m.up_proj(a[0]))) for layer in model.model.layers]
    model(input_ids=ids)
    for h in hooks:
        h.remove()
    return hs  # L x [B, T, F]


@pytest.mark.parametrize("normalization", ["sum_hidden", "mean"])
def test_l1_and_stats_match_hand_computation(normalization):
    model = tiny_relu()
    ids = torch.randint(0, 64, (2, 7))
    hs = hand_h(model, ids)
    mlps, counts = TrainMLPs(model, SparsitySection(normalization=normalization)), SparsityCounts()
    mlps.start()
    model(input_ids=ids)
    terms = mlps.take()
    counts.add_forward(terms.nonzeros, terms.fired, tokens=ids.numel())
    l1 = terms.l1  # [L]: the loss weighs each layer with its own coefficient
    per_layer = [h.abs().sum(-1).mean() if normalization == "sum_hidden" else h.abs().mean() for h in hs]
    torch.testing.assert_close(l1, torch.stack(per_layer))
    l1 = l1.mean()
    if normalization == "sum_hidden":  # the paper's code: F times the paper's text at the same coefficient
        torch.testing.assert_close(l1 / 40, torch.stack([h.abs().mean() for h in hs]).mean())
    l1.backward()  # the penalty reaches the gate and up weights
    assert model.model.layers[0].mlp.gate_proj.weight.grad.abs().sum() > 0
    stats = counts.step_stats()
    for i, h in enumerate(hs):
        nz = (h != 0).float()
        assert stats.nonzeros[i] == pytest.approx(nz.sum().item() / 14)
        assert stats.zeros[i] == pytest.approx(1 - nz.mean().item())
        assert stats.dead[i] == int((nz.flatten(0, 1).sum(0) == 0).sum())
    assert stats.sparsity == pytest.approx(sum(stats.zeros) / 3)
    assert 0.2 < stats.sparsity < 0.8  # a random ReLU MLP: about half zeros


def test_dead_means_silent_in_every_micro_batch_of_the_step():
    model = tiny_relu(layers=1)
    mlps, counts = TrainMLPs(model, SparsitySection()), SparsityCounts()
    fired = torch.zeros(40, dtype=torch.bool)
    for _ in range(3):
        ids = torch.randint(0, 64, (1, 3))
        fired |= (hand_h(model, ids)[0] != 0).flatten(0, 1).any(0)
        mlps.start()
        model(input_ids=ids)
        terms = mlps.take()
        counts.add_forward(terms.nonzeros, terms.fired, tokens=3)
    stats = counts.step_stats()
    assert torch.equal(stats.inactive[0], ~fired) and stats.dead == [int((~fired).sum())]


def test_terms_are_kept_between_start_and_take_only():
    model = tiny_relu()
    mlps = TrainMLPs(model, SparsitySection(normalization="mean"))
    model(input_ids=torch.randint(0, 64, (1, 4)))  # a forward outside a training step: nothing kept
    mlps.start()
    with torch.no_grad():  # evaluation inside one: no terms computed
        model(input_ids=torch.randint(0, 64, (1, 4)))
    with pytest.raises(RuntimeError, match="the terms of 0 of 3 MLPs"):
        mlps.take()
    mlps.start()
    model(input_ids=torch.randint(0, 64, (1, 4)))
    terms = mlps.take()
    assert terms.l1.shape == (3,) and terms.fired.shape == (3, 40) and terms.distance is None


def test_reinit_blends_only_dead_gate_rows_deterministically():
    model = tiny_relu(layers=2)
    before = [layer.mlp.gate_proj.weight.detach().clone() for layer in model.model.layers]
    inactive = torch.zeros(2, 40, dtype=torch.bool)
    inactive[0, [3, 17]] = True
    inactive[1, 39] = True
    reinit_dead(model, inactive, step=5, seed=1)
    after = [layer.mlp.gate_proj.weight.detach().clone() for layer in model.model.layers]
    for layer in range(2):
        changed = (after[layer] != before[layer]).any(1)
        assert torch.equal(changed, inactive[layer])
    noise = (after[0][3] - 0.9 * before[0][3]) / 0.1  # recovers the N(0, 0.02^2) draw
    assert 0.005 < noise.std().item() < 0.04
    again = tiny_relu(layers=2)  # same weights, same (seed, step): same result on every process / resume
    reinit_dead(again, inactive, step=5, seed=1)
    torch.testing.assert_close(again.model.layers[0].mlp.gate_proj.weight, after[0], rtol=0, atol=0)


def test_l1_schedule():
    const = SparsitySection(l1=0.02)
    assert [l1_coefficient(const, s) for s in (0, 100)] == [0.02, 0.02]
    ramp = SparsitySection(l1=0.02, schedule="ramp", ramp_steps=4)
    assert [l1_coefficient(ramp, s) for s in range(6)] == pytest.approx([0.005, 0.01, 0.015, 0.02, 0.02, 0.02])


def test_plateau_rule():
    p = Plateau(tolerance=0.01, window=20)
    assert not any(p.update(s, 0.5 + 0.01 * s) for s in range(0, 40, 5))  # still rising 10% per window
    assert not p.update(45, 0.90)
    assert not p.update(50, 0.90)
    stopped = [p.update(s, 0.90 + 0.0001 * (s - 55)) for s in range(55, 100, 5)]
    assert stopped[-1] and not stopped[0]
    restored = Plateau(0.01, 20)
    restored.load_state_dict(p.state_dict())
    assert restored.history == p.history
    assert restored.reached()  # a resumed run still sees the plateau under the same rule ...
    looser = Plateau(0.0, 20)
    looser.load_state_dict(p.state_dict())
    assert not looser.reached() and not Plateau(0.01, 20).reached()  # ... but not with the rule switched off
    assert not any(Plateau(0.0, 20).update(s, 0.9) for s in range(0, 100, 5))  # tolerance 0: never stops


def _stats(zeros: list[float], width: int = 100) -> StepStats:
    per_token = torch.tensor([(1 - z) * width for z in zeros], dtype=torch.float64)
    return StepStats(per_token=per_token, inactive=torch.zeros(len(zeros), width, dtype=torch.bool))


def test_fixed_mode_weighs_every_layer_with_the_schedule():
    from sparsify.train.config import SparsitySection

    ctl = L1Control(SparsitySection(l1=0.02, schedule="ramp", ramp_steps=4), 3, torch.device("cpu"))
    assert not ctl.adaptive
    torch.testing.assert_close(ctl.coefficients(1), torch.full((3,), 0.01))
    ctl.update(_stats([0.1, 0.2, 0.3]))  # no effect in fixed mode
    torch.testing.assert_close(ctl.coefficients(10), torch.full((3,), 0.02))


def test_target_mode_drives_each_layer_to_its_target_through_a_lagging_response():
    """A simulated model: each layer's zeros follow sigmoid(a_l + 1.5 log c_l) with a first-order lag of 50 steps
    (the weights take time to answer a new coefficient), a_l differing by layer as SmolLM2's layer 0 differs from
    the rest. The controller must bring every layer to its own target and hold it, with no layer left far below."""
    from sparsify.train.config import SparsitySection

    targets = [0.9, 0.95, 0.95, 0.97]
    cfg = SparsitySection(l1=0.06, target=targets, target_gain=0.5)
    ctl = L1Control(cfg, 4, torch.device("cpu"))
    offset = torch.tensor([0.0, 6.0, 7.0, 4.0])  # layer 0 hard, layers 1-2 easy, layer 3 in between
    zeros = torch.full((4,), 0.6)
    history = []
    for _ in range(3000):
        settled = torch.sigmoid(offset + 1.5 * ctl.coefficients(0).log())
        zeros = zeros + (settled - zeros) / 50
        ctl.update(_stats(zeros.tolist(), width=10_000))
        history.append(zeros.clone())
    last = torch.stack(history[-200:])  # [200, L]
    torch.testing.assert_close(last.mean(0), torch.tensor(targets), atol=3e-3, rtol=0)
    assert (last.max(0).values - last.min(0).values).max() < 0.01  # settled, not oscillating
    coef = ctl.coefficients(0)
    assert coef[0] > coef[3] > coef[1] > coef[2]  # the hard layer got the strongest penalty

    state = ctl.state_dict()  # a resumed run continues with the same coefficients
    again = L1Control(cfg, 4, torch.device("cpu"))
    again.load_state_dict(state)
    torch.testing.assert_close(again.coefficients(0), coef)


def test_target_mode_coefficients_stay_within_their_bounds():
    from sparsify.train.config import SparsitySection

    cfg = SparsitySection(l1=0.06, target=0.99, target_gain=10.0, l1_min=1e-3, l1_max=0.5)
    ctl = L1Control(cfg, 2, torch.device("cpu"))
    for _ in range(100):
        ctl.update(_stats([0.5, 0.999]))  # layer 0 never gets there, layer 1 is always above
    torch.testing.assert_close(ctl.coefficients(0), torch.tensor([0.5, 1e-3]))


def test_target_recipe_keys_parse_and_bad_values_are_listed_together(tmp_path):
    from sparsify.errors import SparsifyError
    from sparsify.train.preflight import load_recipe

    base = {"data": {"train": ["x.txt"]}, "train": {"max_steps": 5}}
    assert load_recipe(base, ["sparsity.target=0.95"], check_paths=False).sparsity.target == 0.95
    assert load_recipe(base, ["sparsity.target=[0.9, 0.95]"], check_paths=False).sparsity.target == [0.9, 0.95]
    assert load_recipe(base, ["sparsity.target=0.9,0.95"], check_paths=False).sparsity.target == [0.9, 0.95]
    assert load_recipe(base, check_paths=False).sparsity.target is None  # fixed mode stays the default
    with pytest.raises(SparsifyError) as e:
        load_recipe(base, ["sparsity.target=[0.9, 1.2]", "sparsity.schedule=ramp", "sparsity.ramp_steps=5",
                           "sparsity.l1_min=1", "sparsity.l1_max=0.1", "sparsity.target_gain=0"], check_paths=False)
    text = str(e.value)
    assert "has 4 problem(s)" in text
    assert "sparsity.target: 1.2 is outside (0, 1)" in text
    assert "sparsity.schedule: `ramp` with sparsity.target set" in text
    assert "need 0 < l1_min <= l1_max" in text and "sparsity.target_gain: got 0.0; must be > 0" in text

    # a per-layer list must match the model's layers, found from its config.json before any model loads
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "hidden_act": "relu", "num_hidden_layers": 3}')
    (tmp_path / "x.txt").write_text("some text")
    recipe = {**base, "model": {"source": str(model)}, "data": {"train": [str(tmp_path / "x.txt")]},
              "distill": {"kd": 0}}
    with pytest.raises(SparsifyError, match=r"sparsity.target: 2 values, but .*model has 3 layers"):
        load_recipe(recipe, ["sparsity.target=[0.9, 0.95]"])
    assert load_recipe(recipe, ["sparsity.target=[0.9, 0.95, 0.97]"]).sparsity.target == [0.9, 0.95, 0.97]


def test_blend_recipe_problems():
    from sparsify.errors import SparsifyError
    from sparsify.train.preflight import load_recipe

    base = {"data": {"train": ["x.txt"]}, "train": {"max_steps": 5}}
    with pytest.raises(SparsifyError) as e:
        load_recipe(base, ["sparsity.blend_steps=-1"], check_paths=False)
    assert "sparsity.blend_steps: got -1; must be >= 0" in str(e.value)
    with pytest.raises(SparsifyError, match="cannot train the blended activation"):
        load_recipe(base, ["sparsity.blend_steps=3", "train.kernels=twell"], check_paths=False)
    assert load_recipe(base, ["train.freeze=[*.self_attn.*, *.embed_tokens.*]"], check_paths=False).train.freeze == \
        ["*.self_attn.*", "*.embed_tokens.*"]
