"""The sampling graph loop on CUDA (GPU only): what the CPU emulation in test_fast_decode.py cannot show, real graph
replays drawing from the CUDA generator's philox offsets, uncompiled and through torch.compile."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from sparsify.folder.synth import synth
from sparsify.kernels.fast_decode import fast_decode_of

from tests.tiny import SYNTH_CONFIG as TINY


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["graphs", "compiled"])
def test_sampling_graph_loop_on_cuda_is_seeded_and_draws_from_the_nucleus(compiled, tmp_path):
    """Same seed, same tokens, in the call that captures the step and in one that replays it; another seed gives
    others; rows differ; every drawn token lies in the nucleus of its step, recomputed here by a plain forward of
    the whole sequence (no cache) and transformers' warpers, with a margin of top-p mass for the two forwards'
    rounding; after a row's first end-of-sequence token, only padding."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    synth(tmp_path / "config.json", tmp_path / "model", zeros=0.9, dtype="fp32", progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", trust_remote_code=True,
                                                 dtype=torch.float32).cuda().eval()
    fast = fast_decode_of(model)
    fast.compile = compiled
    ids = torch.randint(3, TINY["vocab_size"], (4, 6), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    temperature, top_p, new = 1.3, 0.6, 24
    runs, loops = [], fast.loops
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(model.generate(ids, max_new_tokens=new, do_sample=True, temperature=temperature, top_p=top_p,
                                   top_k=0))
    assert fast.loops - loops == 3 and fast.replays > 0  # served by the graph loop, replayed
    first, again, other = runs
    assert first.shape == (4, 6 + new) and torch.equal(first[:, :6], ids)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert len({tuple(r) for r in first[:, 6:].tolist()}) == 4
    # a row that draws an end-of-sequence token is padded after it, as transformers' generate() pads it: those
    # positions were not drawn (the first eos itself was, and is checked)
    eos, pad = model.generation_config.eos_token_id, model.generation_config.pad_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad = eos[0] if pad is None and eos else pad
    hit = torch.isin(first[:, 6:], torch.tensor(eos, device="cuda", dtype=torch.long))
    after = (hit.long().cumsum(1) - hit.long()) > 0  # strictly after the row's first eos
    assert bool((first[:, 6:][after] == pad).all())
    assert int((~after).sum()) >= 2 * new  # most of the draws are checked below, not padding
    with torch.no_grad():
        logits = model(first).logits[:, 5:-1, :].float()  # [B, new, V]: the step that drew each new token
    outside = []
    for i in range(new):
        scores = TopPLogitsWarper(min(1.0, top_p + 0.02))(None, TemperatureLogitsWarper(temperature)(None, logits[:, i]))
        allowed = torch.isfinite(scores)
        outside += [(i, r, t) for r, t in enumerate(first[:, 6 + i].tolist()) if not after[r, i] and not allowed[r, t]]
    assert not outside, outside  # (step, row, token)
