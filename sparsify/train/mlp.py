"""The training-time MLP. While a model trains, each of its gated MLPs is a TrainMLP: it computes
h = act(gate(x)) * up(x) with the method's activation and returns, beside its output, what the losses need.

    mlps = TrainMLPs(model, recipe.sparsity, source="silu", teacher=None)   # in place of the model's MLPs
    mlps.start()
    logits = model(input_ids=ids).logits
    terms = mlps.take()                    # ForwardTerms of that forward, one entry per layer
    loss = ce + (coef * terms.l1).mean()   # the training loop composes the loss (train/step.py)

The activation, one per run:
    relu       the model's own act_fn
    threshold  (sparsity.method=threshold) ThresholdReLU, g [g > theta], theta [F] moved by objective.ThresholdControl
    blend      (sparsity.blend_steps) (1 - alpha) source(g) + alpha relu(g), alpha = step / blend_steps, then relu

What one training forward of a layer gives (MLPTerms), from h:
    l1        |h| normalised as sparsity.normalization: sum_hidden = sum over F, mean over tokens (the paper's
              code; F times stronger at equal coefficient), mean = mean over tokens and F (the paper's text)
    nonzeros  the count of h != 0 (no grad)
    fired     [F] bool: the neurons active on at least one token (a neuron silent all step is "dead")
    distance  distill.mlp: ||y - y_orig||^2 / ||y_orig||^2, y_orig the original dense MLP of the same layer on
              the student's own input x (each sparse MLP is taught the original function on the inputs it really
              receives, so one layer's error is not charged to the next; only the teacher's MLP weights run)
A layer on the packed FFN kernels (train.kernels; packed_ffn.PackedFFN picks the layers and their capacity)
computes the same four from its bitmask: autograd keeps the packed activation instead of three dense [M, F] tensors.

The MLP's children are taken over as they are (gate_proj, up_proj, down_proj or Phi-3's gate_up_proj, act_fn),
so parameter and buffer names, their order, checkpoints and optimizer state are the model's own; LoRA-wrapped
projections run as wrapped. `restore()` gives the model its own MLP modules back (the export).
Only forwards under autograd compute the terms (evaluation and calibration run the plain expression), and they are
kept only between start() and take(): gradient checkpointing re-runs a layer's forward in backward, which must
redo the same ops (non-reentrant checkpointing checks the saved tensors) and keeps nothing. Under torch.compile
the record is a list append, which dynamo replays as a side effect.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sparsify.families import mlp_modules
from sparsify.kernels.train.twell_train import sparse_ffn_train
from sparsify.train.config import SparsitySection

ACT_NAMES = ("act_fn", "activation_fn")  # the activation's attribute: Llama-style MLPs; Phi-3


@dataclass
class MLPTerms:
    """One layer's training forward: what the losses and the sparsity statistics read (module docstring)."""

    l1: torch.Tensor  # scalar, with grad
    nonzeros: torch.Tensor  # scalar count, no grad
    fired: torch.Tensor  # [F] bool
    distance: torch.Tensor | None  # scalar, with grad (distill.mlp), else None


@dataclass
class ForwardTerms:
    """Every layer's MLPTerms of one forward, stacked in layer order."""

    l1: torch.Tensor  # [L], with grad: the loss weighs each layer with its own coefficient
    nonzeros: torch.Tensor  # [L] float64
    fired: torch.Tensor  # [L, F] bool
    distance: torch.Tensor | None  # [L], with grad (distill.mlp), else None


@dataclass
class PackedChoice:
    """train.kernels for one layer, set by packed_ffn.PackedFFN: whether its training forward runs the packed FFN
    kernels, with how many packed values per row (None: the kernel's default), and the per-row active counts
    of its last training forward there (what the next capacity is sized from)."""

    packed: bool = False
    capacity: int | None = None
    counts: torch.Tensor | None = None  # [M] int32


class ThresholdReLU(nn.Module):
    """The activation of sparsity.method=threshold: g * [g > theta] (ReLU while theta is 0).

    theta [F] float32 = exp(log theta_l) * shape, both buffers (in checkpoints, so --resume is exact), moved in place
    by ThresholdControl (torch.compile sees inputs that change, not constants). g is compared in the dtype it comes
    in (bf16 under autocast) against theta in float32, as the shipped kernels compare it. `ste`: the gradient of
    g under theta passes as ReLU's does (value r - stop_grad(r * cut) is r * [g > theta], its derivative [g > 0]).
    """

    def __init__(self, width: int, ste: bool, device: torch.device):
        super().__init__()
        self.ste = ste
        self.register_buffer("theta", torch.zeros(width, device=device, dtype=torch.float32))
        self.register_buffer("shape", torch.ones(width, device=device, dtype=torch.float32))
        self.sample: torch.Tensor | None = None  # calibration: set to an empty tensor to collect g / shape

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        if self.sample is not None:  # (calibration only: an eager, no-grad forward)
            self.sample = torch.cat([self.sample, _subsample(g.detach().float() / self.shape, 1 << 20)])
        r = torch.relu(g)
        cut = g <= self.theta  # [..., F] (promoted: compared in float32, g exactly as it came)
        return r - (r * cut).detach() if self.ste else r.masked_fill(cut, 0)


def _subsample(v: torch.Tensor, n: int) -> torch.Tensor:
    """At most n values of v, drawn uniformly at random (a fixed seed: the same batch gives the same sample). Not a
    stride: one that divides F would sample the same few neurons of every token."""
    flat = v.flatten()
    if flat.numel() <= n:
        return flat
    gen = torch.Generator(device=flat.device).manual_seed(flat.numel())
    return flat[torch.randint(0, flat.numel(), (n,), generator=gen, device=flat.device)]


class TrainMLP(nn.Module):
    """One gated MLP as it trains: y = down(h), h = act(gate(x)) * up(x); a forward under autograd also hands its
    MLPTerms to the TrainMLPs that own it (module docstring)."""

    def __init__(self, mlp: nn.Module, index: int, owner: TrainMLPs):
        super().__init__()
        for name, child in mlp.named_children():  # the model's own modules: names and order kept
            self.add_module(name, child)
        self.index, self.owner = index, owner  # owner: a plain object, not a submodule
        self.fused = hasattr(mlp, "gate_up_proj")  # Phi-3: one [2F, d] projection, the gate rows first
        self.act_name = next((n for n in ACT_NAMES if isinstance(getattr(mlp, n, None), nn.Module)), None)
        if self.act_name is None:
            raise ValueError(f"{type(mlp).__name__} has no act_fn / activation_fn module")
        self.width = self.down_proj.weight.shape[1]  # F
        self.kernel = PackedChoice()

    @property
    def act(self) -> nn.Module:
        """The activation module: the model's ReLU, or ThresholdReLU (sparsity.method=threshold)."""
        return getattr(self, self.act_name)

    def activation(self, g: torch.Tensor) -> torch.Tensor:
        if self.owner.blending:  # sparsity.blend_steps: the source activation -> ReLU
            a = self.owner.alpha.to(g.dtype)
            return (1 - a) * self.owner.source(g) + a * torch.relu(g)
        return self.act(g)

    def h(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate(x)) * up(x) [B, T, F], the family's own expression."""
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [B, T, F] each
            return up * self.activation(gate)
        return self.activation(self.gate_proj(x)) * self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation, calibration: the plain expression
            return self.down_proj(self.h(x))
        y, terms = self.terms(x)
        self.owner.record(terms)
        return y

    def terms(self, x: torch.Tensor) -> tuple[torch.Tensor, MLPTerms]:
        """y [B, T, d] and this forward's MLPTerms, on the packed FFN kernels or the dense expression."""
        normalization = self.owner.normalization
        if self.kernel.packed:
            w_gate, w_up = self.gate_up_weights()
            y, l1, nonzeros, fired, counts = sparse_ffn_train(
                x, w_gate, w_up, self.down_proj.weight, normalization=normalization, capacity=self.kernel.capacity,
                row_counts=True, threshold=getattr(self.act, "theta", None))
            self.kernel.counts = counts.detach()
        else:
            h = self.h(x)  # [B, T, F]
            a = h.abs()
            l1 = a.float().sum(-1).mean() if normalization == "sum_hidden" else a.float().mean()
            nz = h != 0  # [B, T, F]
            nonzeros, fired = nz.sum(), nz.flatten(0, -2).any(0)
            y = self.down_proj(h)
        return y, MLPTerms(l1, nonzeros.detach(), fired, self.distance(x, y))

    def distance(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """distill.mlp: ||y - y_orig||^2 / ||y_orig||^2 against the original dense MLP of this layer on x."""
        if self.owner.teachers is None:
            return None
        with torch.no_grad():
            ref = self.owner.teachers[self.index](x).float()  # [B, T, d]
        return (y.float() - ref).pow(2).sum() / ref.pow(2).sum().clamp_min(1e-12)

    def gate_up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """w_gate, w_up [F, d] (views into a fused gate_up_proj)."""
        if self.fused:
            w = self.gate_up_proj.weight  # [2F, d]
            return w[: self.width], w[self.width:]
        return self.gate_proj.weight, self.up_proj.weight


class TrainMLPs:
    """Every gated MLP of a model as a TrainMLP (swapped in place), the activation's blend, and the record of one
    training forward. `teacher`: the original dense model, whose MLPs distill.mlp measures against; `source`: the
    activation the model was converted from (the blend's start)."""

    def __init__(self, model: nn.Module, sparsity: SparsitySection, *, source: str | None = None,
                 teacher: nn.Module | None = None):
        own = mlp_modules(model)
        if any(isinstance(m, TrainMLP) for m in own):
            raise ValueError("the model's MLPs are TrainMLPs already")
        self.normalization = sparsity.normalization
        self.teachers = mlp_modules(teacher) if teacher is not None else None
        if self.teachers is not None and len(self.teachers) != len(own):
            raise ValueError(f"teacher has {len(self.teachers)} MLPs, student {len(own)}")
        self.blend_steps = sparsity.blend_steps
        self.blending = self.blend_steps > 0
        self.source: nn.Module | None = None  # the blend's start
        if self.blending:
            from transformers.activations import ACT2FN

            self.source = ACT2FN[source]
        device = own[0].down_proj.weight.device
        # one scalar every layer reads, moved in place: torch.compile sees an input that changes, not a constant
        self.alpha = torch.zeros((), device=device)
        self.recording = False
        self.recorded: list[MLPTerms] = []
        names = {id(m): name for name, m in model.named_modules()}
        self.own: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, attribute, the model's own MLP)
        self.layers: list[TrainMLP] = []
        for index, mlp in enumerate(own):
            parent_name, _, attribute = names[id(mlp)].rpartition(".")
            parent = model.get_submodule(parent_name)
            layer = TrainMLP(mlp, index, self)
            if sparsity.method == "threshold":
                setattr(layer, layer.act_name, ThresholdReLU(layer.width, sparsity.threshold_grad == "ste", device))
            setattr(parent, attribute, layer)
            self.own.append((parent, attribute, mlp))
            self.layers.append(layer)

    def start(self) -> None:
        """Before a training forward: keep every layer's MLPTerms until take()."""
        self.recorded, self.recording = [], True

    def record(self, terms: MLPTerms) -> None:
        if self.recording:
            self.recorded.append(terms)

    def take(self) -> ForwardTerms:
        """Stops recording; the forward's terms, one entry per layer."""
        self.recording = False
        if len(self.recorded) != len(self.layers):
            raise RuntimeError(f"recorded the terms of {len(self.recorded)} of {len(self.layers)} MLPs; did the "
                               "forward run under autograd?")
        r = self.recorded
        distance = torch.stack([t.distance for t in r]) if self.teachers is not None else None
        return ForwardTerms(l1=torch.stack([t.l1 for t in r]), nonzeros=torch.stack([t.nonzeros for t in r]).double(),
                            fired=torch.stack([t.fired for t in r]), distance=distance)

    def set_step(self, step: int) -> None:
        """Before optimizer step `step` (0-based): the blend's alpha = step / blend_steps; ReLU from blend_steps on."""
        if not self.blending:
            return
        if step >= self.blend_steps:
            self.blending = False  # (one recompile under torch.compile)
            return
        self.alpha.fill_(step / self.blend_steps)

    def blended(self, step: int) -> bool:
        """Whether optimizer step `step` trained the blended activation."""
        return step < self.blend_steps

    def restore(self) -> None:
        """The model's own MLP modules back in place (their ReLU activations, the same projections)."""
        for parent, attribute, mlp in self.own:
            setattr(parent, attribute, mlp)
        self.own = []
