"""The training-time MLP (sparsify/train/mlp.py): the model's own parameters and function, the activation of each
method, and the terms one forward returns."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

from sparsify.families import mlp_modules
from sparsify.train.config import SparsitySection
from sparsify.train.mlp import ThresholdReLU, TrainMLP, TrainMLPs

CFG = dict(vocab_size=64, hidden_size=16, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, max_position_embeddings=32)


def llama(act="relu", seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**CFG, hidden_act=act))


def phi3():
    torch.manual_seed(0)
    return Phi3ForCausalLM(Phi3Config(**CFG, hidden_act="relu", pad_token_id=0))


@pytest.mark.parametrize("make", [llama, phi3])
def test_the_model_keeps_its_names_and_function_and_gets_its_own_mlps_back(make):
    model, ids = make(), torch.randint(0, 64, (2, 9))
    names = [n for n, _ in model.named_parameters()]
    own = mlp_modules(model)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    mlps = TrainMLPs(model, SparsitySection())
    assert all(isinstance(m, TrainMLP) for m in mlp_modules(model)) and len(mlps.layers) == 2
    assert [n for n, _ in model.named_parameters()] == names  # optimizer state and checkpoints unchanged
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)
    mlps.start()
    assert torch.equal(model(input_ids=ids).logits, want)  # a training forward: the same function
    assert mlps.take().l1.shape == (2,)
    with pytest.raises(ValueError, match="TrainMLPs already"):
        TrainMLPs(model, SparsitySection())
    mlps.restore()
    assert mlp_modules(model) == own


def test_distance_to_the_original_mlp_on_the_students_own_input():
    """distill.mlp: per layer ||y - y_orig||^2 / ||y_orig||^2, y_orig the teacher's MLP on the student's MLP input."""
    student, teacher, ids = llama(), llama("silu"), torch.randint(0, 64, (2, 9))
    seen = []  # (x, y) of every MLP
    hooks = [m.register_forward_hook(lambda m, a, y: seen.append((a[0], y)) and None) for m in mlp_modules(student)]
    with torch.no_grad():
        student(input_ids=ids)
    for h in hooks:
        h.remove()
    teachers = mlp_modules(teacher)
    want = [((y - t(x)).pow(2).sum() / t(x).pow(2).sum()).item() for (x, y), t in zip(seen, teachers)]
    mlps = TrainMLPs(student, SparsitySection(), teacher=teacher)
    mlps.start()
    student(input_ids=ids)
    distance = mlps.take().distance
    assert distance.tolist() == pytest.approx(want, rel=1e-5) and distance.requires_grad
    distance.mean().backward()
    assert student.model.layers[0].mlp.gate_proj.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in teacher.parameters())


def test_blend_moves_from_silu_to_relu_over_its_steps():
    silu, relu, ids = llama("silu").eval(), llama("relu").eval(), torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        want_silu, want_relu = silu(input_ids=ids).logits, relu(input_ids=ids).logits
        mlps = TrainMLPs(relu, SparsitySection(blend_steps=4), source="silu")
        mlps.set_step(0)
        torch.testing.assert_close(relu(input_ids=ids).logits, want_silu)  # step 0: the source model
        mlps.set_step(2)  # half way: (silu + relu) / 2 in every MLP
        x = torch.randn(3, 16)
        torch.testing.assert_close(mlps.layers[0].activation(x), 0.5 * torch.nn.functional.silu(x) + 0.5 * torch.relu(x))
        assert mlps.blended(3) and not mlps.blended(4)
        mlps.set_step(4)  # the model's own ReLU from here on
        torch.testing.assert_close(relu(input_ids=ids).logits, want_relu)


def test_threshold_method_puts_a_threshold_relu_under_the_models_name():
    model = llama()
    mlps = TrainMLPs(model, SparsitySection(method="threshold", threshold_grad="exact"))
    act = mlps.layers[1].act
    assert isinstance(act, ThresholdReLU) and not act.ste and act.theta.shape == (40,)
    assert "model.layers.1.mlp.act_fn.theta" in model.state_dict()  # the checkpoint name of earlier versions
