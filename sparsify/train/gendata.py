"""`sparsify gendata`: text sampled from the original model, as training data for its sparse student.

Teaching the student on what the teacher itself says keeps what the teacher knows better than any one corpus
does (LLM-QAT found the same for quantisation-aware training). The output folder holds `text-NNNNN.jsonl`
shards (one {"text", "prompt", "tokens"} document per line) and `gendata.json` (model, settings, token count):
give the folder as a `data.train` entry, mixed with real text by `data.weights`.

Each row of a batch samples exactly --seq-len tokens and does not stop at end-of-sequence: as in packed
pretraining text, the model starts a new document after an EOS, and the row's text is split there into separate
documents (the first continues the row's prompt, the next ones have prompt ""; a document's `tokens` count its
closing EOS; an EOS right after an EOS makes no document). So every sampled token is kept and counted, and no row
idles while others finish. On CUDA a batch whose prompts are all one length (always so without --prompts: each
row starts from the BOS token alone) is sampled by the fast decode loop (kernels/fast_decode.py: static cache,
the whole step, forward + temperature + top-p + draw, replayed from one CUDA graph); a batch of prompts of
different lengths is left-padded and sampled by transformers' own loop, as before.

Batch k is sampled with its own seed (derived from --seed and k), so the same command writes the same text,
and a killed run continues from its last whole batch: batches land one file each in a work folder beside OUT,
which becomes OUT only when the token budget is reached. OUT holds exactly --tokens tokens: the documents in
order, the one that reaches the count cut there, those after it left out (the work folder keeps whole batches,
so a run asked for more tokens continues them unchanged).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sparsify.errors import SparsifyError
from sparsify.folder.format import atomic_dir
from sparsify.version import __version__

FORMAT = "sparsify-gendata/1"
SHARD_BYTES = 64 * 2**20  # finished output: shards of about this size
WORK_FORMAT = 3  # batch files: one line per document (rows split at EOS, ids with the closing EOS); 2: one line per
# row cut at its first EOS, 1: no token ids


@dataclass
class GenSettings:
    """Everything that decides the text written: a continued run must match all of it but `tokens` (more tokens
    extend a run: batch k's text does not depend on the budget)."""

    model: str
    tokens: int
    seq_len: int = 512
    temperature: float = 0.8
    top_p: float = 0.95
    prompts: str | None = None
    batch_size: int | None = None  # None until gendata() decides it (CPU_BATCH, auto_batch_size, a run's own)
    seed: int = 0


def settings_problems(s: GenSettings) -> list[str]:
    """Every bad value at once, each with the flag to fix."""
    problems = []
    if s.tokens < 1:
        problems.append(f"--tokens {s.tokens}: give at least 1 token to generate.")
    if s.seq_len < 1:
        problems.append(f"--seq-len {s.seq_len}: the new tokens each row samples must be at least 1.")
    if s.batch_size is not None and s.batch_size < 1:
        problems.append(f"--batch-size {s.batch_size}: at least 1 row per batch.")
    if not s.temperature > 0:
        problems.append(f"--temperature {s.temperature}: must be above 0 (sampling; 1.0 is the model's own "
                        "distribution).")
    if not 0 < s.top_p <= 1:
        problems.append(f"--top-p {s.top_p}: must be in (0, 1] (1.0 keeps every token).")
    if s.prompts is not None and not Path(s.prompts).is_file():
        problems.append(f"--prompts {s.prompts}: no such file (one prompt per line).")
    return problems


def work_dir(out: Path) -> Path:
    """Where an unfinished run keeps its batches: beside OUT, hidden, found again by the same command."""
    return out.parent / f".{out.name}.gendata-partial"


def gendata(model: str, out: str | os.PathLike, *, tokens: int, seq_len: int = 512, temperature: float = 0.8,
            top_p: float = 0.95, prompts: str | os.PathLike | None = None, batch_size: int | None = None,
            seed: int = 0, device: str | None = None, progress: bool = True) -> Path:
    """Sample `tokens` new tokens of text from `model` into the folder `out`; returns `out`.

    batch_size None: an unfinished run's own; else CPU_BATCH on the CPU, on CUDA auto_batch_size of the model.
    Refuses an existing `out`; continues an unfinished run of the same settings; refuses one of other settings."""
    out = Path(out).absolute()
    settings = GenSettings(str(model), tokens, seq_len, temperature, top_p,
                           str(prompts) if prompts is not None else None, batch_size, seed)
    problems = settings_problems(settings)
    if out.exists():
        problems.insert(0, f"output folder {out} already exists; choose another -o (gendata never overwrites).")
    if problems:
        raise SparsifyError("\n  ".join(["gendata cannot start:", *problems]))
    from sparsify.evaluation.loading import pick_device

    device = pick_device(device)
    loaded = None
    if settings.batch_size is None:
        saved = work_dir(out) / "settings.json"
        if saved.exists() and _started(work_dir(out)):  # continue as it started, on whatever machine
            settings.batch_size = json.loads(saved.read_text()).get("batch_size")
        elif not str(device).startswith("cuda"):
            settings.batch_size = CPU_BATCH
        else:  # the model decides (its KV cache per row): loaded once, for the sampling too
            loaded = load_sampler(settings, device, progress)
            settings.batch_size = auto_batch_size(loaded[0], seq_len, prompts is not None)
    work = open_work(work_dir(out), settings)
    batches, have = _done_batches(work)
    try:
        tok = sample_batches(settings, work, batches, have, device, progress, loaded) if have < tokens else None
    except BaseException as e:
        if not isinstance(e, Exception):  # Ctrl-C, SIGTERM: the CLI says this instead of "nothing half-written"
            e.note = (f"the batches finished so far are kept in {work} (OUT is not written yet); run the same "
                      "command again to continue, or delete that folder to start over.")
        raise
    _finish(work, out, settings, tok, device, progress)
    return out


CPU_BATCH = 8  # rows per batch on the CPU when none is given
MAX_AUTO_BATCH = 1024  # the largest batch auto_batch_size picks (measured: 74k tokens/s for SmolLM2-135M on an H200)


def auto_batch_size(model: Any, seq_len: int, prompted: bool, total_memory: int | None = None) -> int:
    """Rows per batch on CUDA when none is given: the largest power of two up to MAX_AUTO_BATCH (at least 8) whose
    static KV cache and per-row logits fit half the GPU's memory (`total_memory`, default the model's device's)
    less the model's weights. KV bytes per row: layers x 2 (K, V) x KV heads x head dim x positions x the weights'
    element size, positions = seq_len + 1 (the BOS prompt), + 512 with --prompts; logits: 3 fp32 copies of the
    vocabulary (logits, probabilities, the draw's noise)."""
    import torch

    c = model.config
    c = getattr(c, "text_config", None) or c
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    positions = seq_len + 1 + (512 if prompted else 0)
    per_row = c.num_hidden_layers * 2 * kv_heads * head_dim * positions * params[0].element_size() \
        + 3 * 4 * c.vocab_size
    if total_memory is None:
        total_memory = torch.cuda.get_device_properties(params[0].device).total_memory
    budget = total_memory // 2 - weights
    rows = MAX_AUTO_BATCH
    while rows > CPU_BATCH and rows * per_row > budget:
        rows //= 2
    return rows


def open_work(work: Path, settings: GenSettings) -> Path:
    """The work folder, new or from an unfinished run with the same settings. One that holds no finished batch
    (a start that failed, say on a mistyped model) has nothing to keep: it takes the new settings."""
    path = work / "settings.json"
    if path.exists() and _started(work):
        saved, now = json.loads(path.read_text()), _identity(settings)
        if saved != now:
            diff = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
            raise SparsifyError(f"an unfinished gendata run in {work} used other settings ({diff}: saved, now); "
                                "run the same command again to continue it, or delete that folder to start over.")
        return work
    work.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, json.dumps(_identity(settings), indent=2) + "\n")
    return work


def _identity(settings: GenSettings) -> dict:
    return {**{k: v for k, v in asdict(settings).items() if k != "tokens"}, "work_format": WORK_FORMAT}


def _started(work: Path) -> bool:
    """A work folder with at least one finished batch (an unfinished run to continue, not a failed start)."""
    return (work / "batch-000000.jsonl").exists()


def _done_batches(work: Path) -> tuple[int, int]:
    """(batches written, tokens in them): whole batch files from 0 up; a half-written one never has its name."""
    k, total = 0, 0
    while (path := work / f"batch-{k:06d}.jsonl").exists():
        total += sum(json.loads(line)["tokens"] for line in path.read_text().splitlines())
        k += 1
    return k, total


def load_sampler(s: GenSettings, device: str, progress: bool) -> tuple[Any, Any]:
    """(model, tokenizer) of `s.model` on `device`, as the sampling runs them (on CUDA: fast decode, compiled)."""
    from sparsify.evaluation.loading import load_model, parse_models
    from sparsify.folder.gguf import no_transformers_bars

    with contextlib.nullcontext() if progress else no_transformers_bars():  # -q: transformers' bars too
        model, tok = load_model(parse_models([s.model])[0], device, "auto")
    if str(device).startswith("cuda"):  # the project's decode regime for any model: a static KV cache, the decode
        from sparsify.kernels.fast_decode import enable_fast_decode  # step compiled and replayed from a CUDA graph

        enable_fast_decode(model, compile=True)
    return model, tok


def sample_batches(s: GenSettings, work: Path, start: int, have: int, device: str, progress: bool,
                   loaded: tuple[Any, Any] | None = None) -> Any:
    """Whole batches from `start` on until `have` reaches the budget (the bar stops at it); returns the tokenizer.
    loaded: (model, tokenizer) already loaded by load_sampler, else loaded here."""
    import torch
    from tqdm.auto import tqdm

    model, tok = loaded or load_sampler(s, device, progress)
    prompts = _read_prompts(s.prompts)
    bar = tqdm(total=s.tokens, initial=min(have, s.tokens), unit="tok", disable=not progress, desc="gendata")
    k, rate = start, []  # rate: (tokens, seconds) of each batch this process sampled
    while have < s.tokens:
        torch.manual_seed(s.seed * 1_000_003 + k)  # batch k's own seed: the same text whatever ran before it
        tic = time.perf_counter()
        rows = sample_batch(model, tok, s, _batch_prompts(prompts, k, s.batch_size), device)
        new = sum(r["tokens"] for r in rows)
        rate.append((new, time.perf_counter() - tic))  # (the ids are on the host: the batch is done)
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        _write_atomic(work / f"batch-{k:06d}.jsonl", lines)
        bar.update(min(new, s.tokens - have))
        have += new
        k += 1
    bar.close()
    _write_atomic(work / f"rate-{start:06d}.json", json.dumps(_rate(rate)) + "\n")
    return tok


def _rate(batches: list[tuple[int, float]]) -> dict:
    """Sampling speed of one process: tokens/s over its batches, and without its first (CUDA: graph capture and
    compilation happen in the first generate() of a batch size), the rate of a long run."""
    tokens, seconds = sum(t for t, _ in batches), sum(s for _, s in batches)
    out = {"batches": len(batches), "tokens": tokens, "seconds": round(seconds, 6),  # (a tiny run takes ms)
           "tokens_per_s": round(tokens / seconds, 1) if seconds else None}
    if len(batches) > 1:
        rest_t, rest_s = tokens - batches[0][0], seconds - batches[0][1]
        out.update(first_batch_s=round(batches[0][1], 3), after_first_tokens_per_s=round(rest_t / rest_s, 1))
    return out


def _read_prompts(path: str | None) -> list[str]:
    if path is None:
        return []
    lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise SparsifyError(f"--prompts {path}: the file holds no prompt (one per line).")
    return lines


def _batch_prompts(prompts: list[str], k: int, size: int) -> list[str]:
    """Batch k's prompts, cycling through the file ("" = start from the beginning-of-text token)."""
    if not prompts:
        return [""] * size
    return [prompts[(k * size + i) % len(prompts)] for i in range(size)]


def sample_batch(model: Any, tok: Any, s: GenSettings, prompts: list[str], device: str) -> list[dict]:
    """One batch: each prompt continued by exactly `seq_len` sampled tokens (no stop at EOS; prompts of different
    lengths left-padded), each row split into documents at its EOS tokens (split_documents)."""
    import torch

    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    encoded = [[start] + tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(len(e) for e in encoded)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded], device=device)
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device)
    with torch.inference_mode():  # eos_token_id None: no row stops (unpadded: the fast decode sampling loop)
        gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=s.temperature,
                             top_p=s.top_p, top_k=0, max_new_tokens=s.seq_len, eos_token_id=None, pad_token_id=pad)
    rows = []
    for prompt, row in zip(prompts, gen[:, width:].tolist()):
        for first, ids_ in enumerate(split_documents(row, tok.eos_token_id)):
            rows.append({"text": tok.decode(ids_, skip_special_tokens=True), "prompt": prompt if first == 0 else "",
                         "tokens": len(ids_), "ids": ids_})
    return rows


def split_documents(row: list[int], eos: int | None) -> list[list[int]]:
    """A row's sampled ids split after each `eos`: one id list per document, each with its closing EOS (the last
    one ends without, at --seq-len); an EOS alone (right after another, or first) makes no document."""
    docs, cur = [], []
    for t in row:
        cur.append(t)
        if t == eos:
            if len(cur) > 1:
                docs.append(cur)
            cur = []
    if cur:
        docs.append(cur)
    return docs


def _finish(work: Path, out: Path, s: GenSettings, tok: Any, device: str, progress: bool) -> None:
    """The first `s.tokens` sampled tokens (whole documents in order, the one reaching the count cut there) ->
    shards + gendata.json, written into OUT at once (atomic_dir); then the work folder goes. `tok` decodes the cut
    document (None: loaded here, for a run whose batches were all sampled before)."""
    with atomic_dir(out, kind=None) as final:  # (OUT never exists here: refused at the start)
        shard, size, n, left, k = None, 0, 0, s.tokens, 0
        while left > 0:
            kept = []
            for row in map(json.loads, (work / f"batch-{k:06d}.jsonl").read_text(encoding="utf-8").splitlines()):
                if left == 0:
                    break
                if row["tokens"] > left:  # the document reaching the count: its first `left` tokens
                    tok = tok if tok is not None else load_sampler(s, device, progress)[1]
                    row.update(text=tok.decode(row["ids"][:left], skip_special_tokens=True), tokens=left)
                kept.append({"text": row["text"], "prompt": row["prompt"], "tokens": row["tokens"]})
                left -= row["tokens"]
            data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept).encode()
            if shard is None or size + len(data) > SHARD_BYTES:
                shard = final / f"text-{n:05d}.jsonl"
                n, size = n + 1, 0
            with open(shard, "ab") as f:
                f.write(data)
            size += len(data)
            k += 1
        meta = {"format": FORMAT, "settings": asdict(s), "tokens": s.tokens, "batches": k, "shards": n,
                "sparsify": __version__, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "sampling": [json.loads(p.read_text()) for p in sorted(work.glob("rate-*.json"))]}
        (final / "gendata.json").write_text(json.dumps(meta, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Sample text from a model (the original, before conversion) as training data for its sparse "
                     "student: give OUT as a data.train entry, mixed with real text by data.weights. Every row "
                     "samples --seq-len tokens without stopping at end-of-sequence; its text is split at each EOS "
                     "into separate documents, so every sampled token counts. Same seed, same text; a killed run "
                     "continues when the same command runs again. Fast on CUDA (without --prompts, or prompts of "
                     "one length: the whole sampling step replayed from a CUDA graph); tiny models work on CPU.")
    p.add_argument("model", help="Hub id, local model folder, or smollm2-135m-gguf (the embedded default)")
    p.add_argument("-o", "--output", required=True, help="output folder (must not exist)")
    p.add_argument("--tokens", type=int, required=True,
                   help="new tokens to write in all, exactly (the document that reaches the count is cut there)")
    p.add_argument("--seq-len", type=int, default=512,
                   help="new tokens each row samples (default 512), split into documents at each EOS")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature (default 0.8: SmolLM2-135M at 1.0 with every token allowed wrote "
                        "mostly word salad and mixed languages; at 0.8 / top-p 0.95, English prose and lists)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95; 1.0: off)")
    p.add_argument("--prompts", help="text file, one prompt per line, cycled; each row's first document continues "
                                      "its prompt (default: start from the BOS token; on CUDA a batch of prompts "
                                      "of different token lengths is padded and takes transformers' slower loop)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="rows sampled together (default: an unfinished run's own; else 8 on the CPU, and on CUDA the "
                        "largest power of two up to 1024 whose KV cache fits half the GPU's memory beside the "
                        "weights: 1024 for SmolLM2-135M on an H200)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    out = gendata(args.model, args.output, tokens=args.tokens, seq_len=args.seq_len, temperature=args.temperature,
                  top_p=args.top_p, prompts=args.prompts, batch_size=args.batch_size, seed=args.seed,
                  device=args.device, progress=not args.quiet)
    meta = json.loads((out / "gendata.json").read_text())
    print(f"wrote {meta['tokens']:,} tokens in {meta['shards']} shard(s) to {out} "
          f"(batch size {meta['settings']['batch_size']})")
    for r in meta.get("sampling", []):  # (none when every batch had been sampled by an earlier run)
        after = f", {r['after_first_tokens_per_s']:,.0f} after the first batch" if "after_first_tokens_per_s" in r else ""
        print(f"sampled {r['tokens']:,} tokens in {r['seconds']:.1f} s: {r['tokens_per_s']:,.0f} tokens/s{after}")
    return 0
