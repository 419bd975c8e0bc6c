"""The L1 objective and sparsity statistics against hand-computed h = relu(gate(x)) * up(x)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sparsify.recipe import SparsitySection
from sparsify.sparsity import Plateau, SparsityProbe, l1_coefficient, reinit_dead


def tiny_relu(layers=3, hidden=16, F=40):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=F, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, hidden_act="relu")
    return LlamaForCausalLM(cfg)


def hand_h(model, ids):
    """h of every layer, captured independently of the probe: relu(gate(x)) * up(x) on the MLP input."""
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
    probe = SparsityProbe(model, normalization)
    probe.start()
    model(input_ids=ids)
    l1 = probe.take(tokens=ids.numel())
    per_layer = [h.abs().sum(-1).mean() if normalization == "sum_hidden" else h.abs().mean() for h in hs]
    torch.testing.assert_close(l1, torch.stack(per_layer).mean())
    if normalization == "sum_hidden":  # the paper's code: F times the paper's text at the same coefficient
        torch.testing.assert_close(l1 / 40, torch.stack([h.abs().mean() for h in hs]).mean())
    l1.backward()  # the penalty reaches the gate and up weights
    assert model.model.layers[0].mlp.gate_proj.weight.grad.abs().sum() > 0
    stats = probe.step_stats()
    for i, h in enumerate(hs):
        nz = (h != 0).float()
        assert stats.nonzeros[i] == pytest.approx(nz.sum().item() / 14)
        assert stats.zeros[i] == pytest.approx(1 - nz.mean().item())
        assert stats.dead[i] == int((nz.flatten(0, 1).sum(0) == 0).sum())
    assert stats.sparsity == pytest.approx(sum(stats.zeros) / 3)
    assert 0.2 < stats.sparsity < 0.8  # a random ReLU MLP: about half zeros


def test_dead_means_silent_in_every_micro_batch_of_the_step():
    model = tiny_relu(layers=1)
    probe = SparsityProbe(model, "sum_hidden")
    fired = torch.zeros(40, dtype=torch.bool)
    for _ in range(3):
        ids = torch.randint(0, 64, (1, 3))
        fired |= (hand_h(model, ids)[0] != 0).flatten(0, 1).any(0)
        probe.start()
        model(input_ids=ids)
        probe.take(tokens=3)
    stats = probe.step_stats()
    assert torch.equal(stats.inactive[0], ~fired) and stats.dead == [int((~fired).sum())]


def test_probe_ignores_forwards_outside_training_steps():
    model = tiny_relu()
    probe = SparsityProbe(model, "mean")
    model(input_ids=torch.randint(0, 64, (1, 4)))  # e.g. evaluation
    probe.start()
    model(input_ids=torch.randint(0, 64, (1, 4)))
    probe.take(tokens=4)
    assert probe.token_sum == 4 and len(probe.l1) == 3


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
