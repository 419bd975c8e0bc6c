"""The sparsity objective's bookkeeping: the step's sparsity statistics, the L1 coefficients (fixed or driven to
a target), the thresholds and their controller, the plateau rule, dead-neuron re-init.

The terms themselves come from the training-time MLPs (sparsify/train/mlp.py): each training forward returns,
per layer, the L1 term of h, its count of non-zeros and the neurons that fired; the loop (train/step.py) weighs
the L1 terms with L1Control's coefficients and adds the counts up here, in SparsityCounts, over the micro-batches of
one optimizer step. A neuron that fired in no micro-batch of the step is "dead" for that step, counted in the stats
and re-initialised when the recipe says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from sparsify.families import gate_weight, mlp_modules
from sparsify.train.config import SparsitySection
from sparsify.train.mlp import TrainMLPs


class SparsityCounts:
    """The non-zeros of h and the neurons that fired, summed over the micro-batches of one optimizer step."""

    def __init__(self) -> None:
        self.nonzeros: torch.Tensor | None = None  # [L] float64
        self.active: torch.Tensor | None = None  # [L, F] bool, OR over the micro-batches
        self.tokens = 0

    def add_forward(self, nonzeros: torch.Tensor, fired: torch.Tensor, tokens: int) -> None:
        """One micro-batch: nonzeros [L] (float64), fired [L, F] bool, over `tokens` tokens."""
        self.nonzeros = nonzeros if self.nonzeros is None else self.nonzeros + nonzeros
        self.active = fired if self.active is None else self.active | fired
        self.tokens += tokens

    def step_stats(self, reduce=None) -> "StepStats":
        """Stats of the micro-batches since the last call (one optimizer step), on the device; resets them.

        `reduce(tensor, op)` all-reduces across processes ("sum" or "max") so every rank sees the same stats.
        No host sync here: reading a StepStats property does that, at logged steps only.
        """
        nnz, active = self.nonzeros, self.active.to(torch.uint8)  # [L], [L, F]
        tokens = torch.full_like(nnz, float(self.tokens))
        if reduce is not None:
            nnz, tokens, active = reduce(nnz, "sum"), reduce(tokens, "sum"), reduce(active, "max")
        self.reset()
        return StepStats(per_token=nnz / tokens, inactive=active == 0)

    def reset(self) -> None:
        """Ends the step: drops its counts without reading them (no device sync)."""
        self.nonzeros, self.active, self.tokens = None, None, 0


@dataclass
class StepStats:
    """Per-layer sparsity of one optimizer step (device tensors; the properties copy to the host)."""

    per_token: torch.Tensor  # [L] mean non-zeros of h per token
    inactive: torch.Tensor  # [L, F] bool: neurons that never fired during the step

    @property
    def width(self) -> int:
        return self.inactive.shape[1]

    @property
    def nonzeros(self) -> list[float]:
        return self.per_token.cpu().tolist()

    @property
    def zeros(self) -> list[float]:
        """Fraction of h exactly 0, per layer."""
        return (1 - self.per_token / self.width).cpu().tolist()

    @property
    def dead(self) -> list[int]:
        return self.inactive.sum(1).cpu().tolist()

    @property
    def sparsity(self) -> float:
        """Fraction of zeros, mean over layers."""
        return float(1 - self.per_token.mean() / self.width)

    @property
    def mean_nonzeros(self) -> float:
        return float(self.per_token.mean())


def l1_coefficient(cfg: SparsitySection, step: int) -> float:
    """The fixed-mode L1 weight at optimizer step `step` (0-based): constant, or a linear ramp from 0 over
    ramp_steps. In target mode it is only the starting coefficient of every layer (see L1Control)."""
    if cfg.schedule == "ramp" and step < cfg.ramp_steps:
        return cfg.l1 * (step + 1) / cfg.ramp_steps
    return cfg.l1


def layer_targets(cfg: SparsitySection, layers: int) -> list[float] | None:
    """The fraction of zeros each layer is driven to (None in fixed mode): one number for every layer, or the
    per-layer list as given."""
    if cfg.target is None:
        return None
    targets = cfg.target if isinstance(cfg.target, list) else [cfg.target]
    return [float(targets[0])] * layers if len(targets) == 1 else [float(v) for v in targets]


class L1Control:
    """The per-layer L1 coefficients: fixed (sparsity.l1 and its schedule, the same for every layer) or driven
    to sparsity.target (each layer its own coefficient, dual ascent in log space).

    Target mode. The constraint is zeros_l >= target_l, where zeros_l is layer l's measured fraction of zeros in
    h over the last optimizer step (all processes). Its multiplier is the layer's L1 coefficient c_l, updated
    after every step, on the device (no host sync):
        log c_l += target_gain * clamp(target_l - zeros_l, -0.05, 0.05),   c_l clamped to [l1_min, l1_max]
    so a layer below its target gets a stronger penalty and a layer above it a weaker one (sparser than asked
    costs quality for nothing). The update is multiplicative because the useful coefficients span orders of
    magnitude across layers and models (SmolLM2-135M: layer 0 stayed at 69% zeros under the coefficient that
    took the others to 91%); the clamp on the error keeps the far-off start (the bare swap's ~60% zeros) from
    winding the coefficient up faster than the weights can follow. Every step moves log c by at most
    0.05 * target_gain: 0.005 with the default gain of 0.1, an e-fold in 200 steps at the most.

    With sparsity.target_ramp, target_l rises linearly from layer l's zeros at the first update (the bare swap's)
    to its final value over that many training tokens.
    """

    def __init__(self, cfg: SparsitySection, layers: int, device: torch.device):
        self.cfg, self.layers = cfg, layers
        targets = layer_targets(cfg, layers)
        if targets is not None and len(targets) != layers:
            raise ValueError(f"sparsity.target lists {len(targets)} values for a model of {layers} layers")
        self.target = None if targets is None else torch.tensor(targets, device=device, dtype=torch.float32)
        self.log_coef = torch.full((layers,), math.log(max(cfg.l1, cfg.l1_min)), device=device, dtype=torch.float32)
        self.start: torch.Tensor | None = None  # [L] zeros at the first update: where a target ramp begins
        self.stopped = False  # stop(): no penalty from then on

    @property
    def adaptive(self) -> bool:
        return self.target is not None and not self.stopped

    def stop(self) -> None:
        """The penalty is off for the rest of the run (sparsity.method=threshold, once theta is calibrated)."""
        self.stopped = True

    def coefficients(self, step: int) -> torch.Tensor:
        """[L] float32 on the device: the weights of the per-layer L1 terms at optimizer step `step`."""
        if self.stopped:
            return torch.zeros_like(self.log_coef)
        if self.adaptive:
            return self.log_coef.exp()
        return torch.full_like(self.log_coef, l1_coefficient(self.cfg, step))

    @torch.no_grad()
    def update(self, stats: StepStats, tokens: int = 0) -> None:
        """After an optimizer step (`tokens` trained so far): one dual-ascent step on every layer's coefficient
        (target mode only)."""
        if not self.adaptive:
            return
        zeros = (1 - stats.per_token / stats.width).float()  # [L]
        if self.start is None:
            self.start = torch.minimum(zeros, self.target)  # a layer already past its target ramps from there
        error = (self.targets_at(tokens) - zeros).clamp(-0.05, 0.05)
        lo, hi = math.log(self.cfg.l1_min), math.log(self.cfg.l1_max)
        self.log_coef.add_(self.cfg.target_gain * error).clamp_(lo, hi)

    def targets_at(self, tokens: int) -> torch.Tensor:
        """[L] the targets in force after `tokens` training tokens (the final ones without a ramp)."""
        ramp = self.cfg.target_ramp
        if ramp <= 0 or self.start is None:
            return self.target
        return self.start + (self.target - self.start) * min(1.0, tokens / ramp)

    def state_dict(self) -> dict:
        return {"log_coef": self.log_coef.tolist(), "start": None if self.start is None else self.start.tolist(),
                "stopped": self.stopped}

    def load_state_dict(self, state: dict) -> None:
        self.log_coef.copy_(torch.tensor(state["log_coef"], dtype=torch.float32))
        self.stopped = bool(state.get("stopped", False))
        if state.get("start") is not None:
            self.start = torch.tensor(state["start"], dtype=torch.float32, device=self.log_coef.device)


def allocate_zeros(cost: list[float], mean: float, low: float, high: float) -> list[float]:
    """Per-layer fractions of zeros with the given mean, each in [low, high], from each layer's measured cost c_l.

    A layer's loss is modelled as c_l / d_l at density d_l = 1 - zeros_l (it grows without bound as the layer
    empties); minimising sum_l c_l / d_l at a fixed sum of densities gives d_l proportional to sqrt(c_l). Layers
    the bounds clip are fixed there and the rest share what is left (water-filling), so the mean holds exactly."""
    n = len(cost)
    weight = [math.sqrt(max(c, 1e-12)) for c in cost]
    total = n * (1 - mean)  # the densities' sum
    lo_d, hi_d = 1 - high, 1 - low
    density: list[float | None] = [None] * n
    while True:
        free = [i for i in range(n) if density[i] is None]
        if not free:
            break
        left = total - sum(d for d in density if d is not None)
        scale = left / sum(weight[i] for i in free)
        trial = {i: weight[i] * scale for i in free}
        over = [i for i in free if trial[i] > hi_d]
        under = [i for i in free if trial[i] < lo_d]
        if not over and not under:
            for i in free:
                density[i] = trial[i]
            break
        for i in over if over else under:  # the worse side first: fixing one side never pushes the other across
            density[i] = hi_d if i in over else lo_d
    return [1 - d for d in density]


class ThresholdControl:
    """sparsity.method=threshold: the controller of every training MLP's ThresholdReLU (mlp.py).

    Calibration (once, at the first step after sparsity.warmup_tokens): one eager, no-grad forward of a training
    batch records g / s_j per layer; theta_l is the quantile of those values at the layer's target, so every layer
    starts at its target (one the warm-up left sparser keeps its zeros: see _cut; all processes average
    log theta_l). Then after every step, on the device:
        log theta_l += threshold_gain * clamp(target_l - zeros_l, -0.05, 0.05)
    With sparsity.threshold_ramp, target_l is a ramp: from min(warmup_target_l, target_l) at the calibration
    (the quantile taken there) to target_l threshold_ramp tokens later, linear in tokens.
    The L1 penalty is off from the calibration on (L1Control.stop). A disabled control (method l1) does nothing.
    """

    LOG_MIN, LOG_MAX = math.log(1e-6), math.log(1e3)

    def __init__(self, mlps: TrainMLPs, cfg: SparsitySection, device: torch.device):
        self.cfg, self.enabled = cfg, cfg.method == "threshold"
        self.mlps = mlps.layers if self.enabled else []
        self.acts = [m.act for m in self.mlps]  # TrainMLPs made them ThresholdReLUs (sparsity.method=threshold)
        targets = layer_targets(cfg, len(self.mlps)) if self.enabled else None
        self.target = None if targets is None else torch.tensor(targets, device=device, dtype=torch.float32)
        self.start = self.target  # [L] the target at the calibration (the ramp's start; no ramp: the target)
        if self.enabled and cfg.threshold_ramp > 0 and cfg.warmup_target is not None:
            warm = layer_targets(replace(cfg, target=cfg.warmup_target), len(self.mlps))
            self.start = torch.minimum(torch.tensor(warm, device=device, dtype=torch.float32), self.target)
        self.log_theta = torch.full((len(self.mlps),), self.LOG_MIN, device=device)  # [L]
        self.calibrated = False
        self.calibrated_at = 0  # training tokens at the calibration (where the ramp starts)
        self.cost: list[float] = []  # allocate=sensitivity: each layer's measured cost of zeros (allocate_zeros)

    def due(self, tokens: int) -> bool:
        """Whether the calibration happens before the step that starts after `tokens` training tokens."""
        return self.enabled and not self.calibrated and tokens >= self.cfg.warmup_tokens

    def target_at(self, tokens: int) -> torch.Tensor:
        """[L] the zeros target theta holds after `tokens` training tokens (the ramp, or the target itself)."""
        if self.start is self.target:  # (no ramp)
            return self.target
        frac = min(1.0, max(0.0, (tokens - self.calibrated_at) / self.cfg.threshold_ramp))
        return self.start + (self.target - self.start) * frac

    @torch.no_grad()
    def calibrate(self, forward, reduce=None, tokens: int = 0, loss=None) -> None:
        """`forward()` runs the model once, eagerly, on a training batch; `reduce(tensor, op)` all-reduces;
        `tokens`: training tokens so far (the ramp starts there); `loss()`: the same batch's next-token loss (a
        0-d tensor), needed by sparsity.allocate=sensitivity."""
        self.calibrated_at = tokens
        if self.cfg.threshold == "neuron":
            for mlp, act in zip(self.mlps, self.acts):
                act.shape.copy_(neuron_shape(mlp))
        for act in self.acts:
            act.theta.zero_()
            act.sample = act.theta.new_empty(0)
        try:
            forward()
            samples = [a.sample for a in self.acts]
        finally:
            for act in self.acts:
                act.sample = None
        if self.cfg.allocate == "sensitivity":
            self._allocate(samples, reduce, loss)
        self.log_theta.copy_(self._log_quantiles(samples, self.target_at(tokens), reduce))
        self.calibrated = True
        self._write()

    def _log_quantiles(self, samples: list[torch.Tensor], zeros: torch.Tensor, reduce=None) -> torch.Tensor:
        """[L] log theta_l that cuts the fraction `zeros[l]` of layer l's sampled gate values (all processes
        averaged)."""
        quantiles = torch.stack([self._cut(v, q) for v, q in zip(samples, zeros.tolist())])  # [L]
        log_theta = quantiles.clamp_min(0).log().clamp(self.LOG_MIN, self.LOG_MAX)
        if reduce is not None:
            world = reduce(torch.ones((), device=log_theta.device), "sum")
            log_theta = reduce(log_theta, "sum") / world
        return log_theta

    @staticmethod
    def _cut(values: torch.Tensor, zeros: float) -> torch.Tensor:
        """The threshold that cuts the fraction `zeros` of `values` (a layer's sampled g / s_j). A layer the L1
        warm-up already left sparser than that (the quantile is <= 0) gets its smallest positive value: the
        largest theta that keeps it as it is. Not 0: theta moves in log space, by at most exp(0.05 gain) a step,
        so a theta at the floor (1e-6) took thousands of steps to reach the gates' scale once the penalty stopped,
        and the layer's zeros fell far below its target meanwhile (distill.ce=0.1 at 20M tokens, 82% zeros)."""
        if not values.numel():
            return values.new_zeros(())
        cut = torch.quantile(values, zeros)
        if cut > 0:
            return cut
        positive = values[values > 0]
        return positive.min() if positive.numel() else cut

    def _allocate(self, samples: list[torch.Tensor], reduce, loss) -> None:
        """sparsity.allocate=sensitivity: each layer's target from the loss its extra zeros cost (see
        allocate_zeros), measured on the calibration batch: every layer at the mean target, then one layer at a
        time `allocate_probe` deeper. The targets replace `target` (and the ramp's end)."""
        if loss is None:
            raise ValueError("sparsity.allocate=sensitivity needs the calibration batch's loss")
        cfg, layers = self.cfg, len(self.acts)
        mean = float(self.target.mean())
        base = torch.full((layers,), mean, device=self.target.device)
        deeper = (base + cfg.allocate_probe).clamp(max=0.999)
        at_base, at_deeper = self._log_quantiles(samples, base, reduce), self._log_quantiles(samples, deeper, reduce)

        def measure() -> float:
            value = loss().detach().float()
            if reduce is not None:
                value = reduce(value, "sum") / reduce(torch.ones((), device=value.device), "sum")
            return float(value)

        self.log_theta.copy_(at_base)
        self._write()
        reference = measure()
        rise = []
        for layer in range(layers):
            self.log_theta.copy_(at_base)
            self.log_theta[layer] = at_deeper[layer]
            self._write()
            rise.append(measure() - reference)
        # the loss of layer l modelled as c / d: the probe's rise is c (1 / d_deeper - 1 / d_base)
        step = [1 / (1 - z) - 1 / (1 - mean) for z in deeper.tolist()]
        self.cost = [max(r, 0.0) / s for r, s in zip(rise, step)]
        low, high = cfg.allocate_range
        self.target = torch.tensor(allocate_zeros(self.cost, mean, low, high), device=self.target.device)
        if self.start is not None and cfg.threshold_ramp > 0 and cfg.warmup_target is not None:
            warm = layer_targets(replace(cfg, target=cfg.warmup_target), layers)
            self.start = torch.minimum(torch.tensor(warm, device=self.target.device), self.target)
        else:
            self.start = self.target

    @torch.no_grad()
    def update(self, stats: StepStats, tokens: int = 0) -> None:
        """After an optimizer step (`tokens` training tokens so far): one controller step on every layer's theta
        (calibrated runs only)."""
        if not self.calibrated:
            return
        zeros = (1 - stats.per_token / stats.width).float()  # [L]
        error = (self.target_at(tokens) - zeros).clamp(-0.05, 0.05)
        self.log_theta.add_(self.cfg.threshold_gain * error).clamp_(self.LOG_MIN, self.LOG_MAX)
        self._write()

    def _write(self) -> None:
        theta = self.log_theta.exp()
        for layer, act in enumerate(self.acts):
            act.theta.copy_(theta[layer] * act.shape)

    def theta(self) -> list[float]:
        """theta_l per layer (the layer's scale; per-neuron thresholds are it times s_j): host copy, for logs."""
        return self.log_theta.exp().tolist() if self.calibrated else [0.0] * len(self.acts)

    def thresholds(self) -> list[torch.Tensor]:
        """The [F] float32 threshold of every layer, as the exported folder carries them."""
        return [act.theta for act in self.acts]

    def state_dict(self) -> dict:
        state = {"log_theta": self.log_theta.tolist(), "calibrated": self.calibrated,
                 "calibrated_at": self.calibrated_at}
        if self.cfg.allocate == "sensitivity" and self.calibrated:  # the measured targets, for --resume
            state |= {"target": self.target.tolist(), "start": self.start.tolist(), "cost": self.cost}
        return state

    def load_state_dict(self, state: dict) -> None:
        if "target" in state:
            device = self.log_theta.device
            self.target = torch.tensor(state["target"], device=device, dtype=torch.float32)
            self.start = self.target if state["start"] == state["target"] else \
                torch.tensor(state["start"], device=device, dtype=torch.float32)
            self.cost = list(state["cost"])
        self.log_theta.copy_(torch.tensor(state["log_theta"], dtype=torch.float32))
        self.calibrated = bool(state["calibrated"])  # (theta and shape themselves are model buffers)
        self.calibrated_at = int(state.get("calibrated_at", 0))  # (checkpoints before threshold_ramp: no ramp)


@torch.no_grad()
def neuron_shape(mlp: nn.Module) -> torch.Tensor:
    """s_j = 1 / (|W_up[j]| |W_down[:, j]|), scaled to geometric mean 1: [F] float32."""
    if hasattr(mlp, "gate_up_proj"):
        w = _full(mlp.gate_up_proj.weight)
        up = w[w.shape[0] // 2:]
    else:
        up = _full(mlp.up_proj.weight)  # [F, d]
    down = _full(mlp.down_proj.weight)  # [d, F]
    log_s = -(up.float().norm(dim=1).clamp_min(1e-12).log() + down.float().norm(dim=0).clamp_min(1e-12).log())
    return (log_s - log_s.mean()).exp()


def _full(w: torch.Tensor) -> torch.Tensor:
    return w.full_tensor() if _is_dtensor(w) else w


class Plateau:
    """Stop rule: the fraction of zeros changed by less than `tolerance` (relative) over the last `window` steps."""

    def __init__(self, tolerance: float, window: int, after: int = 0):
        self.tolerance, self.window, self.after = tolerance, window, after
        self.history: list[tuple[int, float]] = []  # (step, sparsity) at logged steps

    def update(self, step: int, sparsity: float) -> bool:
        """Records the sparsity after `step`; True when it has stabilised."""
        self.history.append((step, sparsity))
        return self.reached()

    def reached(self) -> bool:
        """Whether the recorded history meets the rule now (a resumed run re-asks: its rule may have changed)."""
        if not self.history:
            return False
        step, sparsity = self.history[-1]
        self.history = [(s, v) for s, v in self.history if s >= step - self.window]
        if self.tolerance <= 0 or step < self.after + self.window:
            return False
        first_step, first = self.history[0]
        if step - first_step < self.window * 0.9:  # not enough history in the window (e.g. just resumed)
            return False
        return abs(sparsity - first) <= self.tolerance * max(abs(first), 1e-12)

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history = [tuple(x) for x in state["history"]]


@torch.no_grad()
def reinit_dead(model: nn.Module, inactive: torch.Tensor, step: int, seed: int) -> None:
    """The paper's mitigation: gate rows j of neurons inactive the whole step get 0.9 W[j] + 0.1 N(0, 0.02^2).

    Runs on the weights' device without a host sync (it happens every step). The noise of layer l at step s
    comes from a generator seeded by (seed, s, l), drawn for all F rows, so every process (DDP replicas, FSDP
    shards) and a resumed run draw the same numbers.
    """
    for layer, mlp in enumerate(mlp_modules(model)):
        w = _gate_weight(mlp)
        local = w.to_local() if _is_dtensor(w) else w  # FSDP2: this rank's rows of the full weight
        gen = torch.Generator(device=local.device).manual_seed((seed * 1_000_003 + step) * 1009 + layer)
        full_rows = inactive.shape[1]
        noise = torch.randn(full_rows, local.shape[-1], generator=gen, device=local.device) * 0.02  # [F, d]
        dead = inactive[layer].to(local.device)  # [F]
        if _is_dtensor(w):  # torch.chunk sharding on dim 0, as fully_shard does
            offset = w.device_mesh.get_local_rank() * math.ceil(w.shape[0] / w.device_mesh.size())
            rows = torch.arange(offset, offset + local.shape[0], device=local.device)  # global row ids
            keep = rows < full_rows  # a fused gate_up keeps its up rows after F: never touched
            dead = torch.where(keep, dead[rows.clamp(max=full_rows - 1)], False)  # [local rows]
            noise = noise[rows.clamp(max=full_rows - 1)]
        blended = 0.9 * local.float() + 0.1 * noise  # [rows, d]
        local.copy_(torch.where(dead[:, None], blended, local.float()).to(local.dtype))


def _gate_weight(mlp: nn.Module) -> torch.Tensor:
    """families.gate_weight, except a fused gate_up_proj sharded by FSDP2 (a DTensor): that one comes whole, its
    rows past F (the up rows) left out by the caller, since a slice of a sharded DTensor's rows is not a view."""
    if hasattr(mlp, "gate_up_proj") and _is_dtensor(mlp.gate_up_proj.weight):
        return mlp.gate_up_proj.weight
    return gate_weight(mlp)


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"
