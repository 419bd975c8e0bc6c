"""Perplexity and bits per byte on text files, with the activation-sparsity profile from the same forward
passes: sliding windows moved by half a window, each token scored once, every token past the first window
with at least window/2 tokens of context. (`sparsify finetune` validates on non-overlapping train.seq_len
windows, half a window of context on average, so its validation perplexity on the same text reads higher.)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from sparsify.errors import SparsifyError
from sparsify.evaluation.activations import SparsityRecorder
from sparsify.evaluation.loading import ffn_backend

# The text `sparsify eval` measures when given none: Python HOWTO documents (from Debian's python3.11-doc),
# bundled with the package and kept out of `sparsify demo`'s training text, so it is held out for the demo.
HELDOUT_TEXT = Path(__file__).parents[1] / "corpus" / "python-howto-heldout.txt"


def check_texts(texts: list[str | Path], ood_texts: list[str | Path] = ()) -> list[Path]:
    """Text files (--text, then --ood-text) must exist and hold some text; collects every problem into one error,
    each under the option that named it."""
    paths, problems = [], []
    for flag, group in (("--text", texts), ("--ood-text", ood_texts)):
        for t in group:
            p = Path(t).expanduser()
            if not p.is_file():
                problems.append(f"{flag} {t}: no such file")
            elif not p.read_text(encoding="utf-8", errors="replace").strip():
                problems.append(f"{flag} {t}: empty")
            paths.append(p)
    if problems:
        raise SparsifyError("; ".join(problems) + ". Pass UTF-8 text files (plain prose or docs).")
    return paths


def text_pass(model: Any, tok: Any, text: str, window: int, max_tokens: int | None,
              recorder: SparsityRecorder | None) -> dict:
    """Sliding-window negative log-likelihood of `text`; each token scored once, with >= window/2 context.

    Bits per byte = total NLL / ln 2 / UTF-8 bytes of the scored text (tokenizer-independent).
    """
    import torch

    if max_tokens:  # tokenising a 50 MB file to keep 8k tokens wastes minutes; ~4 chars per token
        text = text[: max_tokens * 16]
    ids, n_bytes = tokenize_text(tok, text, max_tokens)
    if len(ids) < 2:
        raise SparsifyError("--text: a text file holds fewer than 2 tokens; perplexity needs more text.")
    ids = torch.tensor(ids, device=model.device)  # [N]
    stride, scored, prev_end = max(window // 2, 1), 0, 0
    nll = torch.zeros((), dtype=torch.float64, device=model.device)  # summed on the device: no sync per window
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        new = end - prev_end if begin else end - 1  # the first token of the text has no prediction
        if recorder is not None:  # count each position's h once: those not seen in an earlier window
            recorder.keep = slice(prev_end - begin if begin else 0, None)
        with torch.inference_mode():
            logits = _scored_logits(model, ids[None, begin:end], new)  # [new, V]
        nll += torch.nn.functional.cross_entropy(logits, ids[end - new:end], reduction="sum").double()
        scored, prev_end = scored + new, end
        if end == len(ids):
            break
    nll = float(nll)
    return {"tokens": scored, "bytes": n_bytes, "window": window, "nll": nll / max(scored, 1),
            "perplexity": math.exp(nll / max(scored, 1)), "bits_per_byte": nll / math.log(2) / max(n_bytes, 1)}


def _scored_logits(model: Any, ids: Any, new: int) -> Any:
    """fp32 logits predicting the last `new` tokens of ids [1, L]: only those rows go through the lm_head (the
    context half of a window needs no [L, V] logits, a fifth of a small model's work)."""
    try:
        logits = model(ids, use_cache=False, logits_to_keep=new + 1).logits  # [1, new + 1, V]
    except TypeError:  # remote code without logits_to_keep
        logits = model(ids, use_cache=False).logits
    return logits[0, -new - 1:-1].float()


def tokenize_text(tok: Any, text: str, max_tokens: int | None) -> tuple[list[int], int]:
    """Token ids (at most max_tokens) and the UTF-8 byte count of the text they cover."""
    try:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ids = enc["input_ids"][: max_tokens or None]
        covered = text[: enc["offset_mapping"][len(ids) - 1][1]] if ids else ""
    except (NotImplementedError, TypeError, KeyError):  # slow tokenizers have no offsets
        ids = tok(text, add_special_tokens=False)["input_ids"][: max_tokens or None]
        covered = tok.decode(ids)
    return ids, len(covered.encode("utf-8"))


def texts_section(model: Any, tok: Any, texts: list[Path], window: int, max_tokens: int | None) -> tuple[dict, dict]:
    """Perplexity per text file and one sparsity profile over all of them (same forward passes).

    Remote-code models run their dense torch FFN here: the TwELL kernels never call down_proj, so its hook
    would see nothing (the kernels compute the same function; speed is measured separately).
    """
    recorder = SparsityRecorder(model)
    try:
        with ffn_backend(model, "dense"):
            ppl = {p.name: text_pass(model, tok, p.read_text(encoding="utf-8", errors="replace"),
                                     window, max_tokens, recorder) for p in texts}
    finally:
        recorder.remove()
    profile = recorder.summary()
    missed = [i for i, layer in enumerate(profile["layers"]) if layer["tokens"] != profile["tokens"]]
    if missed:
        raise SparsifyError(f"sparsity profile: layers {missed} saw a different number of tokens than layer 0; "
                            "their down_proj was not called on every forward (an unknown fused MLP?).")
    return ppl, profile


def model_window(model: Any, window: int) -> int:
    limit = getattr(model.config, "max_position_embeddings", None) or window
    return max(2, min(window, int(limit)))
