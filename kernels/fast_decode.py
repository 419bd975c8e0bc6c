"""Fast decode: a static KV cache and the decode step replayed from a CUDA graph.

Eager decode is bound by the host (hundreds of kernel launches per token), so on CUDA generate() defaults
to a static cache and the one-token forward is captured once and replayed. Greedy decoding and plain
temperature / top-p sampling run the ladder below (`prefill` -> `decode_one_token` captured ->
`decode_n_tokens` -> `generate`), the whole step (forward, then argmax or the draw) in one graph; every
other generation option keeps transformers' own loop with the forward replayed. torch.compile is applied in one
place, FastDecode.decode_forward. `enable_fast_decode(model, compile=True)` gives any transformers causal
LM (the dense original too) the same regime, so comparisons are like for like.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import OrderedDict
from types import MappingProxyType

import torch

from .decode_attention import decode_attention_crop
from .decode_capture import (EagerReplay, cache_counters, capture_call, clone_inputs, copy_inputs, ffn_state,
                             restore, signature, static_layers_only, step_check, time_graphs, twell_in_step)

logger = logging.getLogger("sparsify")
EOS_CHECK = 64  # greedy steps between host checks for end-of-sequence tokens (each check syncs)
CACHE_ROUND = 256  # reused static caches are sized up to a multiple of this many positions
_LOOP_KWARGS = frozenset({"input_ids", "inputs", "attention_mask", "max_new_tokens", "min_new_tokens", "do_sample",
                          "pad_token_id", "eos_token_id", "use_cache", "generation_config"})
_NEUTRAL = MappingProxyType({  # generate() options the greedy loop serves only at these (neutral) values
    "num_beams": (None, 1), "num_beam_groups": (None, 1), "repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
    "sequence_bias": (None,), "guidance_scale": (None, 1.0), "min_length": (None, 0),
    "encoder_repetition_penalty": (None, 1.0), "exponential_decay_length_penalty": (None,),
    "renormalize_logits": (None, False), "output_scores": (None, False), "output_logits": (None, False),
    "return_dict_in_generate": (None, False), "output_attentions": (None, False),
    "output_hidden_states": (None, False), "stop_strings": (None,), "max_time": (None,),
    "assistant_model": (None,), "prompt_lookup_num_tokens": (None,), "watermarking_config": (None,),
    "token_healing": (None, False), "dola_layers": (None,), "penalty_alpha": (None,),
})
_SAMPLE_KWARGS = _LOOP_KWARGS | {"temperature", "top_p", "top_k"}
_SAMPLE_NEUTRAL = MappingProxyType({  # sampling warpers the sampling loop serves only at these (off) values
    "min_p": (None,), "top_h": (None,), "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
})


# A one-token step of grouped-query attention (fewer KV heads than query heads: Llama 3, Mistral, Qwen, SmolLM2)
# under transformers' "sdpa" copies the whole KV cache to the query heads' count every step (repeat_kv; transformers
# >= 5.2x folds the query instead, but not under torch.compile, which is how decode steps run here). Measured on
# an H200 (SmolLM2-135M shape, batch 1024, 512 cached positions): repeat_kv + SDPA 1.63 ms per layer, the folded
# query 0.22 ms, SDPA's enable_gqa 0.12 ms; the copies were 76% of the step (eval/bench/bench_gqa_decode.py).
DECODE_SDPA = "sparsify_decode_sdpa"
GQA_DECODE = "fold"  # "fold": queries [B, Hq, 1, D] as [B, Hkv, Hq/Hkv, D] (any SDPA kernel); "enable_gqa": SDPA's own;
# "crop": decode_attention.py's kernel, which reads only the cache blocks the mask keeps (else enable_gqa)


def decode_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                **kwargs):
    """transformers' sdpa attention, except a one-token step of grouped-query attention, which attends on the KV
    heads as they are (GQA_DECODE) instead of a copy of the cache per query head: the same sums and softmax over
    the same keys, so the same result up to the kernel's summation order. Anything else (prefill, softcap,
    position bias, attention weights asked for) is transformers' own function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (query.shape[2] != 1 or groups <= 1 or key.shape[1] * groups != query.shape[1]
            or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
            or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    mask = attention_mask
    if mask is not None and mask.dim() == 4:
        mask = mask[:, :, :, : key.shape[2]]
    batch, heads = query.shape[:2]
    out = decode_attention_crop(query, key, value, mask, scaling) if GQA_DECODE == "crop" and not dropout else None
    if out is None and GQA_DECODE in ("enable_gqa", "crop"):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                               scale=scaling, enable_gqa=True)
    elif out is None:  # the group's query heads become that KV head's queries; a per-head mask is folded the same way
        if mask is not None and mask.dim() == 4 and mask.shape[1] != 1:
            mask = mask.reshape(mask.shape[0], key.shape[1], groups, mask.shape[-1])
        out = torch.nn.functional.scaled_dot_product_attention(query.reshape(batch, key.shape[1], groups, -1), key,
                                                               value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def grouped_decode_attention(model) -> str | None:
    """Switch a model on transformers' "sdpa" with grouped-query attention to DECODE_SDPA (registered once per
    process, with sdpa's mask); returns the implementation now in use, or None when it keeps its own (another
    implementation chosen, no KV grouping, or a transformers without the attention interface)."""
    now = getattr(model.config, "_attn_implementation", None)
    if now == DECODE_SDPA:
        return DECODE_SDPA
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if now != "sdpa" or not heads or not kv or kv >= heads:
        return None
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        AttentionInterface.register(DECODE_SDPA, decode_sdpa)
        AttentionMaskInterface.register(DECODE_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        model.set_attn_implementation(DECODE_SDPA)
    except (ImportError, AttributeError, ValueError, KeyError) as e:
        logger.debug("sparsify: grouped-query decode attention not installed (%s: %s)", type(e).__name__, e)
        return None
    return DECODE_SDPA if model.config._attn_implementation == DECODE_SDPA else None


def _compile_failed(e: Exception, what: str, then: str) -> str:
    """The error of a failed torch.compile as one string, logged once as a warning with what happens instead."""
    error = f"{type(e).__name__}: {e}"
    logger.warning("sparsify: torch.compile of %s failed (%s); %s", what, error.splitlines()[0][:300], then)
    return error


class _Graph:
    __slots__ = ("cache", "graph", "inputs", "output", "failed")

    def __init__(self, cache):
        self.cache = cache  # held: its id keys the entry, so it must not be freed (and the id reused) first
        self.graph = self.inputs = self.output = None
        self.failed = False


class FastDecode:
    """Replays a model's decode step from CUDA graphs: one graph per (static cache, input shapes), made
    on the second decode step (the first runs eagerly and warms kernels, autotuners and the FFN
    dispatcher's graph-replay timing), replayed from the third on. At most MAX_GRAPHS are kept.

    `enabled` switches it off; `replays` / `captures` / `loops` count what it did. `compile` runs the decode
    steps, and so the captured graphs, through torch.compile of the forward (inductor fuses a step's small
    non-FFN kernels; the FFN stays one opaque `sparsify::ffn` op); if compiling fails, a warning is
    logged and decoding goes on uncompiled. `cpu_emulation` (tests) runs the same flow on CPU tensors.
    `capture`, `step_timer` and `twell_in_step` are what the step check uses (tests may replace them).
    """

    MAX_GRAPHS = 4

    def __init__(self, forward, model=None):
        self.forward = forward  # the model's own forward, bound (it holds the model, as does self.model)
        self.model = model
        self.enabled = True
        self.cpu_emulation = False
        self.cpu_pack = None  # called once by the first generate() of the model on the CPU in bf16 (a sparsify model:
        # its layers outside the FFNs onto packed weights, modeling_sparsify.pack_cpu_linears), then None
        self.cache = None  # the static cache generate() reuses (see reused_cache) and its (batch, length)
        self.cache_key = None
        self.loop = True  # greedy / sampling generate() runs the whole decode step (forward + argmax or draw)
        # in one graph
        self.check_step = True  # a captured step with TwELL layers is timed against the same step all dense
        self.step_checks: list[dict] = []  # what those checks measured and kept
        self.capture = capture_call
        self.step_timer = time_graphs
        self.twell_in_step = functools.partial(twell_in_step, model)
        self.loops = 0  # generate() calls served by the greedy or sampling loop
        self.timing = False  # (benchmarks) sync after prefill and at the end: `last` = {"ttft_s", "decode_s"}
        self.last: dict = {}
        self._loops: dict = {}  # (id(cache), batch, FFN backends, sampling, compile) -> _Loop
        self.replays = 0
        self.captures = 0
        self._graphs: OrderedDict = OrderedDict()
        self.compile = False
        self.compile_options: dict = {}  # extra torch.compile arguments (tests: {"backend": "eager"})
        self.compile_error: str | None = None
        self._compiled = None
        self.attention: str | None = None  # DECODE_SDPA when the model's GQA decode steps use it
        self._keep = None  # nucleus_keep compiled (keep_fn)
        self.keep_error: str | None = None

    def set_compile(self, compile: bool, **options) -> None:
        """Decode steps through torch.compile or not, with extra torch.compile `options` (e.g. backend="eager"):
        what was compiled before and any earlier compile failure are dropped, so the next step compiles afresh."""
        self.compile, self.compile_options = bool(compile), dict(options)
        self._compiled = self._keep = None
        self.compile_error = self.keep_error = None

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

    def keep_fn(self):
        """The sampling loop's nucleus step: nucleus_keep through torch.compile when decode steps compile (its 30
        halvings fused, one read of the probabilities each), made once; eager when they do not, or once compiling
        it has failed (a warning; the same set either way). Its first call is a prefill's draw, outside any
        capture, so it compiles before a graph holds it."""
        if not self.compile or self.keep_error is not None:
            return nucleus_keep
        if self._keep is None:
            compiled = torch.compile(nucleus_keep, **self.compile_options)

            def keep(probs, top_p):
                if self.keep_error is None:
                    try:
                        return compiled(probs, top_p)
                    except torch.cuda.OutOfMemoryError:
                        raise
                    except Exception as e:  # noqa: BLE001 - dynamo/inductor failures come in many types
                        self.keep_error = _compile_failed(e, "the nucleus step", "sampling uncompiled")
                return nucleus_keep(probs, top_p)

            self._keep = keep
        return self._keep

    def first_step(self, run, cache):
        """Run a decode step's first (eager, uncaptured) call `run(forward)` on decode_forward(); when
        compiling fails, undo what the step wrote to the cache's counters, log it, turn `compile` off and
        run the step on the plain forward."""
        if not self.compile:
            return run(self.forward)
        counters = cache_counters(cache)
        try:
            return run(self.decode_forward())
        except torch.cuda.OutOfMemoryError:
            raise  # not a compiler failure: the caller's out-of-memory handling applies
        except Exception as e:  # noqa: BLE001 - dynamo/inductor failures come in many types
            restore(counters)
            self.compile, self._compiled = False, None
            self.compile_error = _compile_failed(e, "the decode step", "decoding uncompiled")
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
        return cache if cache is not None and static_layers_only(cache) else None

    def __call__(self, cache, kwargs):
        """transformers' loop: the forward of one decode step, replayed from its graph once captured."""
        try:
            key = (id(cache), signature({k: v for k, v in kwargs.items() if v is not cache}),
                   ffn_state(self.model) if self.model is not None else (), self.compile)
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
            copy_inputs(entry.inputs, kwargs)
        entry.graph.replay()
        self.replays += 1
        out = entry.output.output if isinstance(entry.output, EagerReplay) else entry.output
        result = type(out)(**{k: v for k, v in out.items()})
        result["logits"] = out.logits.clone()  # the graph overwrites its own buffer at the next replay
        return result

    def _capture(self, entry: _Graph, cache, kwargs) -> None:
        inputs = {k: (v if v is cache else clone_inputs(v)) for k, v in kwargs.items()}
        counters = cache_counters(cache)
        forward = self.decode_forward()
        ids = inputs["input_ids"]

        def capture():
            return self.capture(lambda: forward(**inputs), lambda: restore(counters), ids.is_cuda)

        entry.graph, entry.output = step_check(self, capture, lambda: restore(counters), ids.shape[0], cache,
                                               capture(), "transformers")
        entry.inputs = inputs
        self.captures += 1


def greedy_plan(model, args: tuple, kwargs: dict):
    """(ids, max_new, min_new, eos ids, pad id) when this generate() call is plain greedy decoding of an
    unpadded batch that the graph loop serves; else None (transformers' loop runs)."""
    return _plan(model, args, kwargs, sample=False)


def sampling_plan(model, args: tuple, kwargs: dict):
    """(ids, max_new, min_new, eos ids, pad id, (temperature, top_p)) when this generate() call is plain
    sampling of an unpadded batch that the graph loop serves: do_sample with temperature > 0, top_p in (0, 1],
    top_k 0 (transformers reads an unset top_k as 50: that call keeps its loop) and no other warper; else None."""
    plan = _plan(model, args, kwargs, sample=True)
    if plan is None:
        return None
    config, get = _options(model, kwargs)
    temperature, top_p, top_k = get("temperature"), get("top_p"), get("top_k")
    temperature = 1.0 if temperature is None else float(temperature)
    top_p = 1.0 if top_p is None else float(top_p)
    if not temperature > 0 or not 0 < top_p <= 1 or top_k != 0:
        return None
    if any(getattr(config, k, None) not in ok for k, ok in _SAMPLE_NEUTRAL.items()):
        return None
    return (*plan, (temperature, top_p))


def _options(model, kwargs: dict):
    """(generation config, get): get(name, default) reads a generate() option, the call's over the config's."""
    config = kwargs.get("generation_config") or model.generation_config
    return config, lambda k, default=None: kwargs[k] if k in kwargs else getattr(config, k, default)


def _plan(model, args: tuple, kwargs: dict, sample: bool):
    """greedy_plan's checks; `sample` asks for do_sample (and allows the sampling arguments) instead."""
    if len(args) > 1 or set(kwargs) - (_SAMPLE_KWARGS if sample else _LOOP_KWARGS):
        return None
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long or ids.shape[1] == 0:
        return None
    config, get = _options(model, kwargs)
    if bool(get("do_sample", False)) != sample or get("use_cache", True) is False:
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
    """The captured step for one (cache, batch, greedy or sampling): static next-token and output buffers;
    a sampling loop also holds its temperature and top-p as tensors the graph reads (set per call)."""

    def __init__(self, cache, batch: int, length: int, device, sample: bool = False):
        self.cache = cache
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)  # [B, 1] next input
        self.step = torch.zeros((), dtype=torch.long, device=device)  # index of the token being written
        self.out = torch.zeros(batch, length, dtype=torch.long, device=device)  # [B, L] generated tokens
        self.min_new = torch.zeros((), dtype=torch.long, device=device)
        self.graph = None
        self.eos = None  # [E] long tensor the graph masks before min_new_tokens (fixed at capture)
        self.eos_ids: tuple = ()  # its values, compared on the host
        self.temperature = self.top_p = None  # sampling: [] float32 tensors; None: greedy (argmax)
        self.keep_fn = nucleus_keep  # sampling: the nucleus's keep step (generate() sets FastDecode.keep_fn())
        if sample:
            self.temperature = torch.ones((), dtype=torch.float32, device=device)
            self.top_p = torch.ones((), dtype=torch.float32, device=device)


_BISECT_STEPS = 30  # halvings that close [0, bits(max p)] (at most 0x3F800001 < 2**30 values: p <= 1) to one


def nucleus_keep(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B, V] bool: the top-p nucleus of the [B, V] fp32 probabilities, found without a sort (a [B, V] sort costs
    about as much as the decode step's forward at V ~ 50k: 5 ms at B = 1024 on an H200).

    Token i stays when the mass of the tokens with strictly larger probability is below top_p; the top token always
    stays, and top_p >= 1 keeps every token (a float sum of the probabilities can reach 1 before the tail). That
    mass is taken, as transformers' TopPLogitsWarper takes it, as 1 minus the mass at or below p_i: token i stays
    iff h(p_i) > 1 - top_p, h(t) = sum_j p_j [p_j <= t] (equal in exact arithmetic; in fp32 the small side is the
    precise one near top_p = 1, where the boundary tokens are tiny). With distinct probabilities the set is
    TopPLogitsWarper's; tokens tied at the boundary all stay (a sort keeps an arbitrary subset of them).

    Why `probs >= t` is that set, t the smallest fp32 value in [0, max p] with h(t) > 1 - top_p: h does not fall
    as t grows, so if p_i >= t then h(p_i) >= h(t) > 1 - top_p, and if p_i < t then h(p_i) <= 1 - top_p, t being
    the smallest. (If even h(max p) = sum p is not above 1 - top_p, t stays max p: the top tokens.) t is found by
    bisection on the int32 bit patterns of non-negative fp32 values, ordered as the values are: `_BISECT_STEPS`
    fixed halvings, each one compare-and-sum over [B, V] against [B] bounds (no sort, no host sync, static
    shapes: graph-safe and traceable by torch.compile). Compiled, each halving is one fused read of `probs`;
    eager, three kernels, so the sampling loop compiles it with the decode step (FastDecode.keep_fn)."""
    hi = probs.amax(-1).view(torch.int32)  # [B] t's bits lie in [lo, hi]; h(hi) > 1 - top_p unless none does
    lo = torch.zeros_like(hi)
    for _ in range(_BISECT_STEPS):
        mid = (lo + hi) >> 1  # (no overflow: both < 2**30)
        t = mid.view(torch.float32)[:, None]  # [B, 1]
        above = torch.where(probs <= t, probs, 0.0).sum(-1) > 1 - top_p  # [B] h(mid) > 1 - top_p
        hi = torch.where(above, mid, hi)
        lo = torch.where(above, lo, mid + 1)
    return (probs >= hi.view(torch.float32)[:, None]) | (top_p >= 1)  # [B, V]


def nucleus(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, keep_fn=nucleus_keep):
    """(probabilities, keep), both [B, V] in vocabulary order: softmax(logits / temperature) in fp32 and its top-p
    nucleus, nucleus_keep (or `keep_fn`, the same function compiled: FastDecode.keep_fn)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [B, V]
    return probs, keep_fn(probs, top_p)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  keep_fn=nucleus_keep) -> torch.Tensor:
    """[B] tokens drawn from the top-p nucleus of softmax(logits / temperature), graph-safe: the exponential
    race argmax(p_i / E_i) over the nucleus, E_i ~ Exp(1) i.i.d., picks token i with probability p_i / sum(p),
    in vocabulary order (no gather; no host sync, no data-dependent shapes; the noise comes from the default
    generator: under a CUDA graph each replay draws at the generator's next philox offset, so one seed gives one
    token stream and replays differ)."""
    probs, keep = nucleus(logits, temperature, top_p, keep_fn)
    noise = torch.empty_like(probs).exponential_().clamp_min_(torch.finfo(probs.dtype).tiny)  # (never / 0)
    return (torch.where(keep, probs, 0.0) / noise).argmax(-1)  # [B]


def next_token(loop: _Loop, logits: torch.Tensor) -> torch.Tensor:
    """[B] next tokens from [B, V] logits: argmax (greedy loop) or a draw (sampling loop)."""
    if loop.temperature is None:
        return logits.argmax(-1)
    return sample_tokens(logits, loop.temperature, loop.top_p, loop.keep_fn)


def prefill(forward, loop: _Loop, ids: torch.Tensor, cache_kw: str, cache, eos: list[int], min_new: int) -> None:
    """The prompt's forward (eager, through the FFN dispatcher); its argmax (or draw) is the first new token."""
    logits = forward(input_ids=ids, use_cache=True, **{cache_kw: cache}).logits[:, -1, :]  # [B, V]
    if eos and min_new > 0:
        logits[:, eos] = float("-inf")
    first = next_token(loop, logits)  # [B]
    loop.out[:, 0] = first
    loop.token.copy_(first[:, None])
    loop.step.fill_(1)
    loop.min_new.fill_(min_new)


def decode_one_token(loop: _Loop, forward, cache_kw: str, cache) -> None:
    """One step on the loop's buffers (what the graph holds): forward, argmax or draw, bookkeeping."""
    logits = forward(input_ids=loop.token, use_cache=True, **{cache_kw: cache}).logits[:, -1, :]  # [B, V]
    if loop.eos is not None:  # no end-of-sequence before min_new_tokens
        early = loop.step < loop.min_new
        logits = torch.where(early, logits.index_fill(1, loop.eos, float("-inf")), logits)
    nxt = next_token(loop, logits)  # [B]
    loop.out.scatter_(1, loop.step.expand(nxt.shape[0], 1), nxt[:, None])
    loop.token.copy_(nxt[:, None])
    loop.step.add_(1)


def _capture_loop(loop: _Loop, fast: FastDecode, cache_kw: str, cache) -> None:
    """Capture decode_one_token (checked against its all-dense twin: step_check). A sampling step's warm-up
    and timed runs draw from the default generator: its state is put back after them (rng_kept), so a call
    that captures draws the same tokens as one that only replays."""
    forward = fast.decode_forward()
    saved = cache_counters(cache) + [(t, t.clone()) for t in (loop.token, loop.step, loop.out)]

    def capture():
        return fast.capture(lambda: decode_one_token(loop, forward, cache_kw, cache), lambda: restore(saved),
                            loop.token.is_cuda)

    name = "greedy" if loop.temperature is None else "sampling"
    with rng_kept(loop.token.device):
        loop.graph = step_check(fast, capture, lambda: restore(saved), loop.token.shape[0], cache, capture(), name)[0]
    fast.captures += 1


@contextlib.contextmanager
def rng_kept(device: torch.device):
    """Put the default generator of `device` back as it was on entry (draws made inside do not count)."""
    cuda = device.type == "cuda"
    state = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
    try:
        yield
    finally:
        if cuda:
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)


def decode_n_tokens(fast: FastDecode, loop: _Loop, key: tuple, cache_kw: str, cache, new: int, eos: list[int]) -> int:
    """Steps 1..new-1: the first uncaptured (compiles; warms kernels and the FFN dispatcher), the second
    captured, every step replayed; stops early once every row has an eos. Returns the tokens written."""
    for i in range(1, new):
        if loop.graph is None:
            if i == 1:
                fast.first_step(lambda f: decode_one_token(loop, f, cache_kw, cache), cache)
                if fast.compile != key[-1]:  # compiling failed: the loop moves to the uncompiled key
                    fast._loops[(*key[:-1], fast.compile)] = fast._loops.pop(key)
                continue
            _capture_loop(loop, fast, cache_kw, cache)
        loop.graph.replay()
        fast.replays += 1
        if eos and (i + 1) % EOS_CHECK == 0 and _finished(loop.out[:, : i + 1], eos):
            return i + 1
    return new


def _finished(tokens: torch.Tensor, eos: list[int]) -> bool:
    return bool(torch.isin(tokens, torch.tensor(eos, device=tokens.device)).any(1).all())


def _pad_after_eos(tokens: torch.Tensor, eos: list[int], pad: int) -> torch.Tensor:
    """As transformers: pad after each row's first end-of-sequence, stop when every row has one."""
    hit = torch.isin(tokens, torch.tensor(eos, device=tokens.device))
    after = (hit.cumsum(1) - hit.long()) > 0  # strictly after the first eos
    tokens = tokens.masked_fill(after, pad)
    if bool(hit.any(1).all()):
        tokens = tokens[:, : int(hit.float().argmax(1).max()) + 1]
    return tokens


def generate(model, fast: FastDecode, plan) -> torch.Tensor:
    """Greedy decoding (a greedy_plan) or sampling (a sampling_plan) on the reused static cache: prefill, then
    decode_one_token replayed from its graph."""
    ids, new, min_new, eos, pad = plan[:5]
    sampling = plan[5] if len(plan) > 5 else None  # (temperature, top_p)
    cache = reused_cache(model, fast, (ids,), {"max_new_tokens": new})
    cache_kw = cache_kwarg(model)
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    if fast.timing:
        sync()
        t0 = time.perf_counter()
    key = (id(cache), ids.shape[0], ffn_state(model), sampling is not None, fast.compile)
    loop = fast._loops.get(key)
    if loop is None:
        loop = fast._loops[key] = _Loop(cache, ids.shape[0], cache.layers[0].max_cache_len, ids.device,
                                        sample=sampling is not None)
    if sampling is not None:  # values, not part of the graph: another temperature replays the same graph
        loop.temperature.fill_(sampling[0])
        loop.top_p.fill_(sampling[1])
        loop.keep_fn = fast.keep_fn()
    with torch.no_grad():
        prefill(fast.forward, loop, ids, cache_kw, cache, eos, min_new)
        if fast.timing:
            sync()
            fast.last = {"ttft_s": time.perf_counter() - t0}
            t1 = time.perf_counter()
        if loop.graph is None or loop.eos_ids != tuple(eos):  # the graph holds its eos tensor: (re)capture
            loop.graph = None
            loop.eos_ids = tuple(eos)
            loop.eos = torch.tensor(eos, dtype=torch.long, device=ids.device) if eos else None
        done = decode_n_tokens(fast, loop, key, cache_kw, cache, new, eos)
        tokens = loop.out[:, :done].clone()
    if fast.timing:
        sync()
        fast.last["decode_s"] = time.perf_counter() - t1
        fast.last["steps"] = tokens.shape[1] - 1
    if eos:
        tokens = _pad_after_eos(tokens, eos, pad)
    fast.loops += 1
    return torch.cat([ids, tokens], dim=1)


def _no_sliding_window(config) -> bool:
    """True when every attention layer is full attention (a static cache then has only StaticLayers)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    if types:
        return all(t == "full_attention" for t in types)
    return getattr(text, "sliding_window", None) in (None, 0) or not getattr(text, "use_sliding_window", True)


def cache_kwarg(model) -> str:
    """The name generate() and forward() give the KV cache: `cache` (transformers >= 5.2x) or the older
    `past_key_values`."""
    fn = type(model).forward
    while hasattr(fn, "__wrapped__"):  # transformers' decorators wrap forward with functools.wraps
        fn = fn.__wrapped__
    code = fn.__code__
    return "cache" if "cache" in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount] else "past_key_values"


def reused_cache(model, fast: FastDecode, args: tuple, kwargs: dict):
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


def fast_decode_of(model) -> FastDecode | None:
    """The model's FastDecode (`.enabled`, `.compile`, `.replays`, `.captures`, ...): made by enable_fast_decode
    (sparsify models have it from load); None before."""
    return model.__dict__.get("_fast_decode")


def _fast_generate_kwargs(model, args: tuple, kwargs: dict) -> dict:
    """generate() kwargs with a static cache as the default on CUDA (unless the caller chose a cache)."""
    fast = fast_decode_of(model)
    on_device = model.device.type == "cuda" or (fast is not None and fast.cpu_emulation)
    if fast is None or not fast.enabled or not on_device or not _no_sliding_window(model.config):
        return kwargs
    chosen = kwargs.get("generation_config") or model.generation_config
    if any(k in kwargs for k in ("cache_implementation", "cache", "past_key_values")) or getattr(
            chosen, "cache_implementation", None) is not None or kwargs.get("use_cache") is False:
        return kwargs
    # disable_compile: our graphs replace transformers' automatic torch.compile of static-cache decoding
    cache = reused_cache(model, fast, args, kwargs)
    if cache is None:
        return {**kwargs, "cache_implementation": "static", "disable_compile": True}
    return {**kwargs, cache_kwarg(model): cache, "disable_compile": True}


def enable_fast_decode(model, enabled: bool = True, compile: bool | None = None) -> FastDecode:
    """Give a loaded causal LM (a sparsify model, or any transformers one, e.g. the dense original) the fast
    decode regime: generate() on CUDA defaults to a static cache and replays decode steps from CUDA graphs.
    `compile=True` also runs those steps through torch.compile (a compile on the first batch size and
    cache length, then one dynamic-shape compile serves the others); None leaves the setting as it is.
    A model on "sdpa" with grouped-query attention attends its one-token steps on the KV heads as they are
    (DECODE_SDPA, `.attention`). Returns the FastDecode object (`.enabled`, `.compile`, `.replays`,
    `.captures`; fast_decode_of(model) too). Sparsify models have it from load."""
    fast = fast_decode_of(model)
    if fast is None:
        forward, plain_generate = model.forward, model.generate  # bound methods of the class

        @functools.wraps(forward)
        def fast_forward(*args, **kwargs):
            cache = fast.cache_of(args, kwargs)
            return forward(*args, **kwargs) if cache is None else fast(cache, kwargs)

        @functools.wraps(plain_generate)
        def fast_generate(*args, **kwargs):
            fast.last = {}
            if fast.cpu_pack is not None and model.device.type == "cpu" and model.dtype == torch.bfloat16:
                pack, fast.cpu_pack = fast.cpu_pack, None
                pack()
            new = _fast_generate_kwargs(model, args, kwargs)
            if new is not kwargs and fast.loop:
                plan = greedy_plan(model, args, kwargs) or sampling_plan(model, args, kwargs)
                if plan is not None:
                    return generate(model, fast, plan)
            return plain_generate(*args, **new)

        fast = FastDecode(forward, model)
        fast.attention = grouped_decode_attention(model)
        model.__dict__["_fast_decode"] = fast
        model.__dict__["forward"] = fast_forward
        model.__dict__["generate"] = fast_generate
    fast.enabled = enabled
    if compile is not None:
        fast.compile = bool(compile)
    return fast
