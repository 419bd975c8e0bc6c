# Shipped verbatim inside every sparsify model folder (loaded with trust_remote_code=True).
# Flat and self-contained: imports only torch, transformers, the standard library and the sibling kernel
# files copied beside it (twell_ops.py and friends). Never import the sparsify package from here.
"""Sparse-FFN causal LMs: the family's own transformers class with its gated MLPs replaced by SparseMLP.

`config.json` keeps the family's `model_type` with a ReLU activation, so stock transformers loads the same
folder as a dense ReLU model; `auto_map` points AutoModelForCausalLM here, to `Sparse<Base>` (for example
`SparseLlamaForCausalLM`), built on first access from `transformers.<Base>`.

SparseMLP keeps the parameter names (gate_proj / up_proj / down_proj, or Phi-3's fused gate_up_proj), so
state dicts load unchanged, and it calls those modules whenever gradients may flow (training, LoRA). At
inference on CUDA with Triton it runs the TwELL kernels through `twell_ffn`; anywhere else the dense torch
expression, identical to the stock model's.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict

import torch
import torch.nn as nn
import transformers

try:  # twell_ops imports without triton (its kernels then report unavailable): only a missing file lands here
    from .twell_ops import dense_capture_active, dense_in_capture, last_backend, twell_ffn, twell_in_capture
    from .twell_triton import HAS_TRITON

    _KERNELS_MISSING = "" if HAS_TRITON else "triton is not installed"
except ImportError as e:  # an older folder without the kernel files: dense torch path, reason logged
    twell_ffn = twell_in_capture = dense_in_capture = dense_capture_active = None
    _KERNELS_MISSING = f"kernel files not importable: {e}"

logger = logging.getLogger("sparsify")
BACKENDS = ("auto", "twell", "dense")
TWIN = "the step check's all-dense twin of a decode step"
_announced: set[str] = set()


def _announce(path: str, reason: str) -> None:
    """Log which FFN path runs, once per process and path, so users can see it in their logs."""
    if path not in _announced:
        _announced.add(path)
        logger.info("sparsify: FFN path = %s (%s)", path, reason)


class SparseMLP(nn.Module):
    """relu(gate_proj(x)) * up_proj(x) -> down_proj, with a TwELL kernel path for CUDA inference.

    `ffn_backend` ("auto" | "twell" | "dense") is passed to twell_ffn; "dense" also skips the kernels.
    `last_path` records which path the last forward took: "twell_ffn:twell" / "twell_ffn:dense" (what the
    kernels' dispatcher actually ran) or "torch" (the nn.Linear modules).
    """

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.fused = hasattr(mlp, "gate_up_proj")
        if self.fused:  # Phi-3: one [2F, d] projection, gate first
            self.gate_up_proj = mlp.gate_up_proj
        else:
            self.gate_proj = mlp.gate_proj
            self.up_proj = mlp.up_proj
        self.down_proj = mlp.down_proj
        self.ffn_backend = "auto"
        self.last_path = ""
        self._views = None  # Phi-3: cached gate/up views of gate_up_proj.weight (the kernels' per-layer
        # dispatcher state lives on the W_gate tensor object, so it must be the same object every call)

    def _projections(self) -> list[nn.Module]:
        return [self.gate_up_proj, self.down_proj] if self.fused else [self.gate_proj, self.up_proj, self.down_proj]

    def _kernel_reason(self, x: torch.Tensor) -> str | None:
        """None when the TwELL path may run; otherwise why the dense torch path runs instead."""
        if _KERNELS_MISSING:
            return _KERNELS_MISSING
        if self.ffn_backend == "auto" and dense_capture_active():
            return TWIN  # the step check's all-dense twin (under torch.compile: fusable torch ops, not the op)
        if not x.is_cuda:
            return "input is not on a CUDA device"
        if self.ffn_backend == "dense":
            return "ffn_backend='dense'"
        if torch.is_grad_enabled() and (self.training or any(p.requires_grad for p in self.parameters())):
            return "gradients enabled (training path calls the nn.Linear modules)"
        if any(type(m) is not nn.Linear or m.bias is not None for m in self._projections()):
            return "projections carry biases or adapters"
        return None

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.fused:
            return self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight
        w = self.gate_up_proj.weight  # [2F, d], gate rows first
        key = (w.data_ptr(), w._version)
        if self._views is None or self._views[0] != key:
            f = w.shape[0] // 2
            self._views = (key, w[:f], w[f:])  # [F, d] each
        return self._views[1], self._views[2], self.down_proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reason = self._kernel_reason(x)
        if reason is None:
            w_gate, w_up, w_down = self._weights()  # [F, d], [F, d], [d, F]
            y = twell_ffn(x, w_gate, w_up, w_down, backend=self.ffn_backend)  # caches W_down^T on w_down
            if not torch.compiler.is_compiling():  # (traced: the op's path is only known when it runs)
                _announce(f"twell_ffn (backend={self.ffn_backend})", "CUDA inference with Triton")
                self.last_path = f"twell_ffn:{last_backend()}"
            return y
        if not torch.compiler.is_compiling():
            self.last_path = "torch"
            if reason != TWIN:  # (the twin is a check inside a capture, not the path the model runs)
                _announce("torch", reason)
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(up * torch.relu(gate))
        return self.down_proj(torch.relu(self.gate_proj(x)) * self.up_proj(x))


def sparsify_mlps(model: nn.Module) -> int:
    """Replace every gated MLP module in `model` by a SparseMLP sharing its projections; returns the count."""
    targets = [(name, m) for name, m in model.named_modules()
               if not isinstance(m, SparseMLP) and hasattr(m, "down_proj")
               and (hasattr(m, "gate_up_proj") or (hasattr(m, "gate_proj") and hasattr(m, "up_proj")))]
    for name, mlp in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, SparseMLP(mlp))
    return len(targets)


def set_ffn_backend(model: nn.Module, backend: str) -> None:
    """Set `ffn_backend` on every SparseMLP of `model` ("auto", "twell" or "dense")."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    for m in model.modules():
        if isinstance(m, SparseMLP):
            m.ffn_backend = backend


def default_backend(config) -> str:
    """The FFN backend a model starts with: `sparsify.ffn_backend` if the folder pins one, else "auto".

    "auto" (the kernels' dispatcher) decides per layer, per power-of-two token-count bucket and per regime
    (eager calls, calls captured in CUDA graphs) from that layer's measured density and paired timings,
    so a folder at moderate sparsity decodes on TwELL under graphs where that wins and prefills dense."""
    info = getattr(config, "sparsify", None) or {}
    if info.get("ffn_backend") in BACKENDS:
        return info["ffn_backend"]
    return "auto"


# ---------------------------------------------------------------------------------------------------------
# Fast decode: static KV cache + the decode step replayed from a CUDA graph.
#
# Eager decode is bound by the host: a 16-30 layer model launches hundreds of kernels per token, each a few
# microseconds of Python and driver time, which is longer than the GPU needs to read the weights. So on
# CUDA `generate()` defaults to transformers' static cache (fixed-shape key/value tensors) and the model's
# forward, when called for one new token per sequence on such a cache, is captured once into a CUDA graph
# and replayed for every later token. The generate loop itself (sampling, stopping criteria, masks) stays
# transformers' own, so every generation option keeps working. Prefill (many tokens) runs eagerly, through
# the FFN dispatcher. We capture the step ourselves rather than use transformers' automatic torch.compile
# of static-cache decoding ("reduce-overhead" CUDA graph trees): the FFN dispatcher times its graph-replay
# decision in an uncaptured warm-up step right before the capture, the greedy loop puts forward + argmax +
# bookkeeping into one graph, and the step check compares two captures of the same step. The forward we
# capture is compiled by default (FastDecode.compile: inductor's default mode, automatic dynamic shapes),
# which fuses the step's small non-FFN kernels. `enable_fast_decode(model, compile=True)` gives any
# transformers causal LM (the dense original too) the same regime, so comparisons are like for like.
# ---------------------------------------------------------------------------------------------------------


def _static_layers_only(cache) -> bool:
    """A cache whose every layer is a plain StaticLayer: fixed tensors and no rolling window, so a replayed
    step writes where the eager step would."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and getattr(cache, "is_compileable", False) and all(
        type(layer).__name__ == "StaticLayer" for layer in layers)


def _signature(value):
    """Hashable description of one forward argument: tensors by shape/dtype/device, plain values as they
    are, dicts item by item. Raises TypeError for anything a graph cannot take as a replaceable input."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if isinstance(value, dict):
        return ("dict", tuple((k, _signature(v)) for k, v in sorted(value.items())))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(type(value).__name__)


def _clone_inputs(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone_inputs(v) for k, v in value.items()}
    return value


def _copy_inputs(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, dict):
        for k, v in dst.items():
            _copy_inputs(v, src[k])


def _cache_counters(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, saved copy) of each cache layer's small bookkeeping tensors (e.g. cumulative_length), so
    the warm-up run before a capture can be undone: it must not count as a step."""
    saved = []
    for layer in cache.layers:
        for name, t in vars(layer).items():
            if isinstance(t, torch.Tensor) and name not in ("keys", "values"):
                saved.append((t, t.clone()))
    return saved


def _ffn_state(model) -> tuple:
    """What a captured graph baked in besides its inputs: each SparseMLP's backend (a graph captured on
    one backend must not be replayed after a switch to another)."""
    return tuple(m.ffn_backend for m in model.modules() if isinstance(m, SparseMLP))


class _Graph:
    __slots__ = ("cache", "graph", "inputs", "output", "failed")

    def __init__(self, cache):
        self.cache = cache  # held: its id keys the entry, so it must not be freed (and the id reused) first
        self.graph = self.inputs = self.output = None
        self.failed = False


def _restore(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each (tensor, saved copy) pair back: undoes a warm-up or timed run (cache counters, loop buffers)."""
    for t, copy in saved:
        t.copy_(copy)


class _EagerReplay:
    """cpu_emulation's stand-in for a CUDA graph: replay() calls the captured function again."""

    def __init__(self, fn):
        self.fn, self.output = fn, None

    def replay(self) -> None:
        self.output = self.fn()


def _capture_call(fn, restore, cuda: bool):
    """(graph, output) of fn() captured into a CUDA graph, after one run on a side stream (cuBLAS workspaces)
    that restore() undoes; with cpu_emulation (cuda False) an _EagerReplay of fn stands in for both."""
    if not cuda:
        replay = _EagerReplay(fn)
        return replay, replay
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # its own memory pool: graphs of dropped caches free theirs
        output = fn()
    return graph, output


class FastDecode:
    """Replays a model's decode step from CUDA graphs: one graph per (static cache, input shapes), made
    on the second decode step (the first runs eagerly and warms kernels, autotuners and the FFN
    dispatcher's graph-replay timing), replayed from the third on. At most MAX_GRAPHS are kept.

    `enabled` switches it off; `replays` / `captures` count what it did (tests and benchmarks read them).
    `compile` (on for sparsify folders unless their config says `"compile_decode": false`; off for other
    models unless enable_fast_decode(model, compile=True)) runs the decode steps, and so the captured
    graphs, through torch.compile of the forward: inductor fuses the many small non-FFN kernels of a step
    (norms, rotary, residual adds, cache writes), the FFN staying one opaque `sparsify::twell_ffn` op that
    dispatches when it runs. Measured on an H200: 1.6x (1B), 1.4x (8B) and 2.1x (SmolLM2-135M) the decode
    tokens/s of the uncompiled graphs, dense and sparse alike. Cost: a compile on the first generate() of
    a batch size (tens of seconds; shapes that change again get one dynamic-shape compile that serves the
    rest). Prefill stays eager. If compiling fails, a warning is logged and decoding goes on uncompiled.
    `cpu_emulation` (tests) runs the same flow on CPU tensors, a "replay" then being a forward call on the
    captured input buffers: the capture/replay bookkeeping is checked without a GPU.
    """

    MAX_GRAPHS = 4

    def __init__(self, forward, model=None):
        self.forward = forward  # the model's own forward, bound (it holds the model, as does self.model)
        self.model = model
        self.enabled = True
        self.cpu_emulation = False
        self.cache = None  # the static cache generate() reuses (see _reused_cache) and its (batch, length)
        self.cache_key = None
        self.loop = True  # greedy generate() runs the whole decode step (forward + argmax) in one graph
        self.check_step = True  # a captured step with TwELL layers is timed against the same step all dense
        self.step_checks: list[dict] = []  # what those checks measured and kept
        self.loops = 0  # generate() calls served by that loop
        self.timing = False  # (benchmarks) sync after prefill and at the end: `last` = {"ttft_s", "decode_s"}
        self.last: dict = {}
        self._loops: dict = {}  # (id(cache), batch, FFN backends, compile) -> _Loop
        self.replays = 0
        self.captures = 0
        self._graphs: OrderedDict = OrderedDict()
        self.compile = False
        self.compile_options: dict = {}  # extra torch.compile arguments (tests: {"backend": "eager"})
        self.compile_error: str | None = None
        self._compiled = None

    def decode_forward(self):
        """The forward decode steps run and graphs capture: the model's own, or (`compile`) that forward
        through torch.compile, made once (dynamo keeps one compiled graph per input shapes and FFN state)."""
        if not self.compile:
            return self.forward
        if self._compiled is None:
            import torch._dynamo

            compiled = torch.compile(self.forward, **self.compile_options)
            cfg = torch._dynamo.config  # FFN backends x batch sizes x cache lengths can pass dynamo's default 8
            name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"

            def run(*args, **kwargs):  # (called only uncaptured and while capturing: replays skip Python)
                with cfg.patch({name: max(getattr(cfg, name), 64)}):  # for these calls only, not the process
                    return compiled(*args, **kwargs)

            logger.warning("sparsify: compiling the decode step with torch.compile (the first generate() of a "
                           "batch size takes tens of seconds more; model.enable_fast_decode(compile=False) "
                           "skips it)")
            self._compiled = run
        return self._compiled

    def first_step(self, run, cache):
        """Run a decode step's first (eager, uncaptured) call `run(forward)` on decode_forward(); when
        compiling fails, undo what the step wrote to the cache's counters, log it, turn `compile` off and
        run the step on the plain forward."""
        if not self.compile:
            return run(self.forward)
        counters = _cache_counters(cache)
        try:
            return run(self.decode_forward())
        except torch.cuda.OutOfMemoryError:
            raise  # not a compiler failure: the caller's out-of-memory handling applies
        except Exception as e:  # noqa: BLE001 - dynamo/inductor failures come in many types
            _restore(counters)
            self.compile, self._compiled = False, None
            self.compile_error = f"{type(e).__name__}: {e}"
            logger.warning("sparsify: torch.compile of the decode step failed (%s); decoding uncompiled",
                           self.compile_error.splitlines()[0][:300])
            return run(self.forward)

    def drop_graphs(self) -> None:
        """Free every captured graph and the caches they hold (done when the reused cache is replaced)."""
        self._graphs.clear()
        self._loops.clear()

    def cache_of(self, args, kwargs):
        """The static cache this call decodes on, or None if the call is not a graphable decode step."""
        if not self.enabled or args or torch.is_grad_enabled():
            return None
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1:
            return None
        if not ids.is_cuda and not (self.cpu_emulation and ids.device.type == "cpu"):
            return None
        if kwargs.get("inputs_embeds") is not None or kwargs.get("labels") is not None:
            return None
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            return None
        if torch.compiler.is_compiling() or (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        return cache if cache is not None and _static_layers_only(cache) else None

    def __call__(self, cache, kwargs):
        try:
            key = (id(cache), _signature({k: v for k, v in kwargs.items() if v is not cache}),
                   _ffn_state(self.model) if self.model is not None else (), self.compile)
        except TypeError:
            return self.forward(**kwargs)
        entry = self._graphs.get(key)
        if entry is None:  # first decode step on this cache: eager warm-up
            self._graphs[key] = _Graph(cache)
            while len(self._graphs) > self.MAX_GRAPHS:
                self._graphs.popitem(last=False)
            out = self.first_step(lambda forward: forward(**kwargs), cache)
            if key[-1] != self.compile:  # compiling failed: the next step warms up and captures uncompiled
                self._graphs.pop(key, None)
            return out
        self._graphs.move_to_end(key)
        if entry.failed:
            return self.forward(**kwargs)
        if entry.graph is None:
            try:
                self._capture(entry, cache, kwargs)
            except Exception as e:  # noqa: BLE001 - anything a model does that a graph cannot hold
                entry.failed = True
                entry.graph = entry.inputs = entry.output = None
                logger.warning("sparsify: decode step not capturable in a CUDA graph (%s: %s); it runs eagerly",
                               type(e).__name__, e)
                return self.forward(**kwargs)
        else:
            _copy_inputs(entry.inputs, kwargs)
        entry.graph.replay()
        self.replays += 1
        out = entry.output.output if isinstance(entry.output, _EagerReplay) else entry.output
        result = type(out)(**{k: v for k, v in out.items()})
        result["logits"] = out.logits.clone()  # the graph overwrites its own buffer at the next replay
        return result

    def _capture(self, entry: _Graph, cache, kwargs) -> None:
        inputs = {k: (v if v is cache else _clone_inputs(v)) for k, v in kwargs.items()}
        counters = _cache_counters(cache)
        forward = self.decode_forward()
        ids = inputs["input_ids"]

        def capture():
            return _capture_call(lambda: forward(**inputs), lambda: _restore(counters), ids.is_cuda)

        entry.graph, entry.output = _step_check(self, capture, lambda: _restore(counters), ids.shape[0], cache,
                                                capture(), "transformers")
        entry.inputs = inputs
        self.captures += 1



# Greedy decoding, the common case, skips transformers' per-step host work too (mask building, logits
# processors, stopping checks with a host sync every token: ~2 ms a token measured on the H200 machine's
# host, more than a 1B model's whole GPU step): one graph holds forward + argmax + the bookkeeping of the
# next step, and the loop replays it with no host synchronisation, checking for end-of-sequence tokens
# every EOS_CHECK steps. Any option it does not implement (sampling, beams, logits processors, stopping
# criteria, streamers, padding, scores) keeps the transformers loop above.
EOS_CHECK = 64
_LOOP_KWARGS = {"input_ids", "inputs", "attention_mask", "max_new_tokens", "min_new_tokens", "do_sample",
                "pad_token_id", "eos_token_id", "use_cache", "generation_config"}
_NEUTRAL = {"num_beams": (None, 1), "num_beam_groups": (None, 1), "repetition_penalty": (None, 1.0),
            "no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "suppress_tokens": (None,),
            "begin_suppress_tokens": (None,), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
            "sequence_bias": (None,), "guidance_scale": (None, 1.0), "min_length": (None, 0),
            "encoder_repetition_penalty": (None, 1.0), "exponential_decay_length_penalty": (None,),
            "renormalize_logits": (None, False), "output_scores": (None, False), "output_logits": (None, False),
            "return_dict_in_generate": (None, False), "output_attentions": (None, False),
            "output_hidden_states": (None, False), "stop_strings": (None,), "max_time": (None,),
            "assistant_model": (None,), "prompt_lookup_num_tokens": (None,), "watermarking_config": (None,),
            "token_healing": (None, False), "dola_layers": (None,), "penalty_alpha": (None,)}


def _greedy_plan(model, args: tuple, kwargs: dict):
    """(ids, max_new, min_new, eos ids, pad id) when this generate() call is plain greedy decoding of an
    unpadded batch that the graph loop serves; else None (transformers' loop runs)."""
    if len(args) > 1 or set(kwargs) - _LOOP_KWARGS:
        return None
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long or ids.shape[1] == 0:
        return None
    config = kwargs.get("generation_config") or model.generation_config
    get = lambda k, default=None: kwargs[k] if k in kwargs else getattr(config, k, default)  # noqa: E731
    if get("do_sample", False) or get("use_cache", True) is False:
        return None
    if any(getattr(config, k, None) not in ok for k, ok in _NEUTRAL.items()):
        return None
    new = get("max_new_tokens")
    if new is None:
        length = getattr(config, "max_length", None)
        new = None if length is None else length - ids.shape[1]
    if new is None or new < 1:
        return None
    mask = kwargs.get("attention_mask")
    if mask is not None and (mask.shape != ids.shape or not bool(mask.all())):  # padding: transformers' loop
        return None
    eos = get("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else [int(e) for e in eos]
    pad = get("pad_token_id")
    if mask is None and pad is not None and bool((ids == pad).any()):
        return None  # transformers infers a padding mask from pad tokens in the prompt
    pad = pad if pad is not None else (eos[0] if eos else 0)
    return ids, int(new), int(get("min_new_tokens", 0) or 0), eos, int(pad)


class _Loop:
    """The captured greedy step for one (cache, batch): static next-token and output buffers."""

    def __init__(self, cache, batch: int, length: int, device):
        self.cache = cache
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)  # [B, 1] next input
        self.step = torch.zeros((), dtype=torch.long, device=device)  # index of the token being written
        self.out = torch.zeros(batch, length, dtype=torch.long, device=device)  # [B, L] generated tokens
        self.min_new = torch.zeros((), dtype=torch.long, device=device)
        self.graph = None
        self.eos = None  # [E] long tensor the graph masks before min_new_tokens (fixed at capture)
        self.eos_ids: tuple = ()  # its values, compared on the host

    def run_step(self, forward, cache_kw: str, cache) -> None:
        logits = forward(input_ids=self.token, use_cache=True, **{cache_kw: cache}).logits[:, -1, :]  # [B, V]
        if self.eos is not None:  # no end-of-sequence before min_new_tokens
            early = self.step < self.min_new
            logits = torch.where(early, logits.index_fill(1, self.eos, float("-inf")), logits)
        nxt = logits.argmax(-1)  # [B]
        self.out.scatter_(1, self.step.expand(nxt.shape[0], 1), nxt[:, None])
        self.token.copy_(nxt[:, None])
        self.step.add_(1)


def _greedy_generate(model, fast: "FastDecode", plan) -> torch.Tensor:
    """Greedy decoding on the reused static cache: eager prefill, then the captured step replayed."""
    ids, new, min_new, eos, pad = plan
    batch = ids.shape[0]
    cache = _reused_cache(model, fast, (ids,), {"max_new_tokens": new})
    cache_kw = _cache_kwarg(model)
    forward = fast.forward
    cuda = ids.is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if fast.timing:
        sync()
        t0 = time.perf_counter()
    key = (id(cache), batch, _ffn_state(model), fast.compile)
    loop = fast._loops.get(key)
    if loop is None:
        loop = fast._loops[key] = _Loop(cache, batch, cache.layers[0].max_cache_len, ids.device)
    with torch.no_grad():
        logits = forward(input_ids=ids, use_cache=True, **{cache_kw: cache}).logits[:, -1, :]  # prefill
        if eos and min_new > 0:
            logits[:, eos] = float("-inf")
        first = logits.argmax(-1)
        loop.out[:, 0] = first
        loop.token.copy_(first[:, None])
        loop.step.fill_(1)
        loop.min_new.fill_(min_new)
        if fast.timing:
            sync()
            fast.last = {"ttft_s": time.perf_counter() - t0}
            t1 = time.perf_counter()
        if loop.graph is None or loop.eos_ids != tuple(eos):  # the graph holds its eos tensor: (re)capture
            loop.graph = None
            loop.eos_ids = tuple(eos)
            loop.eos = torch.tensor(eos, dtype=torch.long, device=ids.device) if eos else None
        done_at = None
        for i in range(1, new):
            if loop.graph is None:
                if i == 1:  # the first decode step runs uncaptured (compiles; warms kernels and the FFN dispatcher)
                    fast.first_step(lambda f: loop.run_step(f, cache_kw, cache), cache)
                    if fast.compile != key[3]:  # compiling failed: the loop moves to the uncompiled key
                        fast._loops[(*key[:3], fast.compile)] = fast._loops.pop(key)
                    continue
                _capture_loop(loop, fast.decode_forward(), cache_kw, cache, fast)
            loop.graph.replay()
            fast.replays += 1
            if eos and (i + 1) % EOS_CHECK == 0 and _finished(loop.out[:, : i + 1], eos):
                done_at = i + 1
                break
        tokens = loop.out[:, : done_at or new].clone()
    if fast.timing:
        sync()
        fast.last["decode_s"] = time.perf_counter() - t1
        fast.last["steps"] = tokens.shape[1] - 1
    if eos:  # as transformers: pad after each row's first end-of-sequence, stop when every row has one
        hit = torch.isin(tokens, torch.tensor(eos, device=tokens.device))
        seen = hit.cumsum(1)
        after = (seen - hit.long()) > 0  # strictly after the first eos
        tokens = tokens.masked_fill(after, pad)
        ended = hit.any(1)
        if bool(ended.all()):
            last = int((hit.float().argmax(1)).max()) + 1
            tokens = tokens[:, :last]
    fast.loops += 1
    return torch.cat([ids, tokens], dim=1)


def _finished(tokens: torch.Tensor, eos: list[int]) -> bool:
    return bool(torch.isin(tokens, torch.tensor(eos, device=tokens.device)).any(1).all())


# The step check: the FFN dispatcher decides per layer from the FFN timed alone, so a whole step with TwELL
# layers can still come out slower than the same step all dense (measured on the H200: SmolLM2-135M and a
# 1B at batch 8 under torch.compile, 0.98x). When a captured decode step (the greedy loop's, or the forward
# transformers' loop replays for sampling and the other options) runs TwELL in some layer, the same step is
# captured again with every layer dense, both are replayed in alternating rounds, and the dense one is kept
# unless TwELL's is at least 1% faster: a step never pays for a layer's wrong call.
STEP_CHECK_ROUNDS = 5  # timed batches per graph (median)
STEP_CHECK_REPLAYS = 4  # replays per batch: they write the captured step's position and the next 3
STEP_CHECK_MARGIN = 0.99


def _twell_in_step(model, batch: int) -> bool:
    """Whether some SparseMLP on "auto" runs TwELL when a step of `batch` tokens is captured now."""
    if twell_in_capture is None or model is None:
        return False
    return any(m.ffn_backend == "auto" and twell_in_capture(m._weights()[0], batch)
               for m in model.modules() if isinstance(m, SparseMLP))


def _time_graphs(graphs: list, restore) -> list[float]:
    """Median ms per replay of each graph: one untimed replay each, then STEP_CHECK_ROUNDS batches of
    STEP_CHECK_REPLAYS replays, graphs alternating in an order that flips every round; restore() undoes
    each batch's writes (cache counters, loop buffers)."""
    for g in graphs:
        g.replay()
        restore()
    times: list[list[float]] = [[] for _ in graphs]
    for r in range(STEP_CHECK_ROUNDS):
        for i in (range(len(graphs)) if r % 2 == 0 else reversed(range(len(graphs)))):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(STEP_CHECK_REPLAYS):
                graphs[i].replay()
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end) / STEP_CHECK_REPLAYS)
            restore()
    return [sorted(t)[len(t) // 2] for t in times]


def _free_positions(cache) -> int:
    """Cache positions past the one the next decode step writes (0 when the cache does not say): the step
    check's timed replays write that many positions ahead, which must stay inside the cache."""
    layer = cache.layers[0]
    length, written = getattr(layer, "max_cache_len", None), getattr(layer, "cumulative_length", None)
    if length is None or written is None:
        return 0
    return int(length) - int(written) - 1


def _step_check(fast: "FastDecode", capture, restore, batch: int, cache, first: tuple, loop: str) -> tuple:
    """The (graph, output) to replay for a decode step: `first` = capture(), or, when that step runs TwELL
    in some layer and the cache has room for the timed replays, the faster of it and capture() again with
    every layer dense (the dense one unless TwELL's is >= 1% faster). restore() undoes a replay's writes."""
    if not fast.check_step or not _twell_in_step(fast.model, batch) or _free_positions(cache) <= STEP_CHECK_REPLAYS:
        return first
    with dense_in_capture():
        dense = capture()
    twell_ms, dense_ms = _time_graphs([first[0], dense[0]], restore)
    kept = "twell" if twell_ms <= STEP_CHECK_MARGIN * dense_ms else "dense"
    fast.step_checks.append({"loop": loop, "batch": batch, "twell_ms": twell_ms, "dense_ms": dense_ms, "kept": kept})
    logger.info("sparsify: decode step at batch %d (%s loop): TwELL layers %.3f ms, all dense %.3f ms: kept %s",
                batch, loop, twell_ms, dense_ms, kept)
    return first if kept == "twell" else dense


def _capture_step(loop: _Loop, forward, cache_kw: str, cache, restore) -> tuple:
    """The greedy step (loop.run_step) as (graph, output) (_capture_call)."""
    return _capture_call(lambda: loop.run_step(forward, cache_kw, cache), restore, loop.token.is_cuda)


def _capture_loop(loop: _Loop, forward, cache_kw: str, cache, fast: "FastDecode") -> None:
    """Capture loop.run_step (checked against its all-dense twin: _step_check)."""
    saved = _cache_counters(cache) + [(t, t.clone()) for t in (loop.token, loop.step, loop.out)]

    def restore() -> None:
        _restore(saved)

    def capture():
        return _capture_step(loop, forward, cache_kw, cache, restore)

    loop.graph = _step_check(fast, capture, restore, loop.token.shape[0], cache, capture(), "greedy")[0]
    fast.captures += 1


def _no_sliding_window(config) -> bool:
    """True when every attention layer is full attention (a static cache then has only StaticLayers)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    if types:
        return all(t == "full_attention" for t in types)
    return getattr(text, "sliding_window", None) in (None, 0) or not getattr(text, "use_sliding_window", True)


CACHE_ROUND = 256  # reused static caches are sized up to a multiple of this many positions


def _cache_kwarg(model) -> str:
    """The name generate() and forward() give the KV cache: `cache` (transformers >= 5.2x) or the older
    `past_key_values`."""
    fn = type(model).forward
    while hasattr(fn, "__wrapped__"):  # transformers' decorators wrap forward with functools.wraps
        fn = fn.__wrapped__
    code = fn.__code__
    return "cache" if "cache" in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount] else "past_key_values"


def _reused_cache(model, fast: "FastDecode", args: tuple, kwargs: dict):
    """A StaticCache for this call, reset and reused across generate() calls of the same batch size and
    length class, so the decode graphs captured on it are replayed again instead of captured anew. None
    when the prompt or the token budget cannot be read off the call (generate then makes its own)."""
    from transformers import StaticCache

    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    config = kwargs.get("generation_config") or model.generation_config
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or new is None:
        return None
    need = ids.shape[1] + int(new)
    length = -(-need // CACHE_ROUND) * CACHE_ROUND
    key = (ids.shape[0], length)
    if fast.cache_key != key:
        fast.drop_graphs()  # one reused cache at a time (its memory is the KV of every position)
        fast.cache = None
        try:
            fast.cache = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=length)
        except TypeError:  # another StaticCache signature: let generate make its own
            return None
        fast.cache_key = key
    else:
        fast.cache.reset()
    return fast.cache


def _fast_generate_kwargs(model, args: tuple, kwargs: dict) -> dict:
    """generate() kwargs with a static cache as the default on CUDA (unless the caller chose a cache)."""
    fast = model.__dict__.get("_fast_decode")
    on_device = model.device.type == "cuda" or (fast is not None and fast.cpu_emulation)
    if fast is None or not fast.enabled or not on_device or not _no_sliding_window(model.config):
        return kwargs
    chosen = kwargs.get("generation_config") or model.generation_config
    if any(k in kwargs for k in ("cache_implementation", "cache", "past_key_values")) or getattr(
            chosen, "cache_implementation", None) is not None or kwargs.get("use_cache") is False:
        return kwargs
    # disable_compile: our graphs replace transformers' automatic torch.compile of static-cache decoding
    cache = _reused_cache(model, fast, args, kwargs)
    if cache is None:
        return {**kwargs, "cache_implementation": "static", "disable_compile": True}
    return {**kwargs, _cache_kwarg(model): cache, "disable_compile": True}


def enable_fast_decode(model, enabled: bool = True, compile: bool | None = None) -> "FastDecode":
    """Give a loaded causal LM (a sparsify model, or any transformers one, e.g. the dense original) the fast
    decode regime: generate() on CUDA defaults to a static cache and replays decode steps from CUDA graphs.
    `compile=True` also runs those steps through torch.compile (fewer, fused kernels per step; a compile on
    the first batch size and cache length, then one dynamic-shape compile serves the other lengths and
    batch sizes above 1); None leaves the setting as it is. Returns the FastDecode object
    (`.enabled`, `.compile`, `.replays`, `.captures`). Sparsify models have it from load."""
    fast = model.__dict__.get("_fast_decode")
    if fast is None:
        forward, generate = model.forward, model.generate  # bound methods of the class

        @functools.wraps(forward)
        def fast_forward(*args, **kwargs):
            cache = fast.cache_of(args, kwargs)
            return forward(*args, **kwargs) if cache is None else fast(cache, kwargs)

        @functools.wraps(generate)
        def fast_generate(*args, **kwargs):
            fast.last = {}
            new = _fast_generate_kwargs(model, args, kwargs)
            if new is not kwargs and fast.loop:
                plan = _greedy_plan(model, args, kwargs)
                if plan is not None:
                    return _greedy_generate(model, fast, plan)
            return generate(*args, **new)

        fast = FastDecode(forward, model)
        model.__dict__["_fast_decode"] = fast
        model.__dict__["forward"] = fast_forward
        model.__dict__["generate"] = fast_generate
    fast.enabled = enabled
    if compile is not None:
        fast.compile = bool(compile)
    return fast


_classes: dict[str, type] = {}


def _sparse_class(base_name: str) -> type:
    base = getattr(transformers, base_name)

    def __init__(self, config, *args, **kwargs):
        base.__init__(self, config, *args, **kwargs)
        sparsify_mlps(self)
        set_ffn_backend(self, default_backend(config))
        info = getattr(config, "sparsify", None) or {}
        enable_fast_decode(self, enabled=info.get("fast_decode", True) is not False,
                           compile=info.get("compile_decode", True) is not False)

    cls = type(f"Sparse{base_name}", (base,), {
        "__init__": __init__, "__module__": __name__, "__doc__": f"{base_name} with SparseMLP FFNs.",
        "set_ffn_backend": set_ffn_backend, "enable_fast_decode": enable_fast_decode,
    })
    return cls


def __getattr__(name: str) -> type:
    """`Sparse<Base>` for any transformers `<Base>` causal LM, built once on first access (PEP 562)."""
    if name.startswith("Sparse") and name.endswith("ForCausalLM"):
        if name not in _classes:
            _classes[name] = _sparse_class(name[len("Sparse"):])
        return _classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
