"""Training text -> token files -> deterministic, resumable batches of packed sequences.

Two stages:
  1. `prepare_data` reads the recipe's sources with the `datasets` library (local .txt/.jsonl/.json/.parquet,
     or Hub datasets streamed; without it, local .txt/.jsonl files as PlainTexts), tokenises them (batched, in parallel), and writes one flat token stream per
     split to a folder: train.bin (the data.train entries one after another; meta.json records each one's
     token span), validation.bin, heldout-NAME.bin per data.heldout domain (uint16 when the vocabulary fits,
     else uint32) and meta.json. Done once (by rank 0), reused when the sources and tokenizer are unchanged,
     and itself a valid `data.train` source: a prepared folder can be carried to a machine without `datasets`.
  2. `TokenData` memory-maps the streams. Training sequence i of the whole run (counted over all processes)
     is a window of seq_len + 1 tokens inside one source, chosen by seeded permutations from i, the seed and
     data.weights alone (see TokenData). So the data position is a single integer (sequences consumed), saved
     in each checkpoint, and a resumed run, or one with another process count, reads exactly the same
     sequences.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from sparsify.errors import SparsifyError, import_failure
from sparsify.train.config import DataSection

FORMAT = "sparsify-tokens/1"
HELDOUT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a domain name becomes heldout-NAME.bin
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".text"}
BUILDERS = {**{s: "text" for s in TEXT_SUFFIXES}, ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# Tokens per held-out block (at most; small corpora use N/100 so the fraction is honoured): validation is whole
# blocks of contiguous text, so little of it borders training text.
HOLDOUT_BLOCK = 8192
COPY_TOKENS = 1 << 26  # tokens per write when splitting train.bin (128-256 MiB of RAM at most)
# Seed tags keeping the mixture's shuffle and each source's order (k >= 1) apart from source 0's [seed, epoch].
MIX_TAG, SOURCE_TAG = 0x6D6978, 0x737263


@dataclass
class EvalStream:
    """One held-out token stream (validation, or a named domain) served as a fixed set of windows."""

    tokens: np.ndarray  # [n_tokens] memory-mapped
    length: int  # tokens per window before the +1 target: seq_len, or less for a text shorter than one window
    n: int  # windows
    what: str  # names it in messages: "validation", "held-out domain 'docs'"
    fix: str  # how to give it more text

    @classmethod
    def open(cls, path: Path, dtype: np.dtype, seq_len: int, what: str, fix: str) -> EvalStream:
        tokens = np.memmap(path, dtype=dtype, mode="r")
        length = min(seq_len, len(tokens) - 1)  # a text shorter than one training window is used whole
        stream = cls(tokens, length, (len(tokens) - 1) // length if length > 0 else 0, what, fix)
        if stream.n < 1:
            raise SparsifyError(f"{path.parent}: {len(tokens)} {what} tokens leave nothing to validate on; {fix}.")
        return stream


@dataclass
class TokenData:
    """Memory-mapped train / validation / held-out token streams, served as windows of seq_len + 1 tokens.

    train.bin is the concatenation of the training sources (meta.json `sources`: one token span per data.train
    entry). Windows never cross a span, so each sequence comes from one
    source. Sequences are read in virtual epochs of N = (windows of all sources) sequences, counts[k] of them
    from source k: counts = windows per source (proportional to size) without `weights`, else
    round(N * w_k / sum w). The epoch's order is a seeded shuffle of those N draws; the j-th draw of source k
    in the run is window perm_k,e[j mod n_k] of that source, e = j // n_k being the source's own epoch (seeded
    permutation). So training sequence i is a pure function of (i, seed, weights, the folder), found in
    O(N) at most (the epoch's shuffle, cached) without walking the sequences before it: a checkpoint stores
    only i. A source smaller than its share repeats, reshuffled; a larger one is subsampled. With one source
    sequence i is window perm_e[i mod n] of a single seeded permutation per epoch.
    """

    folder: Path
    seq_len: int
    seed: int
    weights: list[float] | None = None  # data.weights: one per training source; None or [] = by size

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)
        meta = self._read_meta()
        dtype = np.dtype(meta["dtype"])
        self.train = np.memmap(self.folder / "train.bin", dtype=dtype, mode="r")
        self.sources = _spans(meta, len(self.train), self.folder)  # [(entry, start, end)] in train.bin
        spans = np.array([(s, e) for _, s, e in self.sources], dtype=np.int64).reshape(-1, 2)  # [K, 2]
        self.starts = spans[:, 0]  # [K] first token of each source
        self.windows = np.maximum(spans[:, 1] - spans[:, 0] - 1, 0) // self.seq_len  # [K] whole windows of each
        self.n_train = int(self.windows.sum())
        if self.n_train < 1:
            raise SparsifyError(
                f"{self.folder}: {len(self.train)} training tokens do not fill one sequence of "
                f"train.seq_len={self.seq_len}; add text to data.train or lower train.seq_len.")
        self.counts = self._mixture_counts()  # [K] sequences of each source per virtual epoch
        self.epoch_len = int(self.counts.sum())
        self.val = EvalStream.open(self.folder / "validation.bin", dtype, self.seq_len, "validation",
                                   "add text to data.validation, or raise data.validation_fraction when validation "
                                   "is held out of data.train")
        self.domains = list(meta.get("heldout", {}))  # held-out domain names, in recipe order
        self._heldout = {name: EvalStream.open(self.folder / f"heldout-{name}.bin", dtype, self.seq_len,
                                               f"held-out domain {name!r}", f"add text to data.heldout.{name}")
                         for name in self.domains}
        self._mix_epoch, self._mix = -1, (np.zeros(0, np.int32), np.zeros(0, np.int64))
        self._perms: dict[int, tuple[int, np.ndarray]] = {}  # source -> (its epoch, its permutation)

    def _read_meta(self) -> dict:
        heldout = []
        if (self.folder / "meta.json").is_file():
            heldout = [f"heldout-{n}.bin" for n in json.loads((self.folder / "meta.json").read_text()).get("heldout", {})]
        missing = [n for n in ("meta.json", "train.bin", "validation.bin", *heldout) if not (self.folder / n).is_file()]
        if missing:
            packed = " (train.bin.xz is there: unpack it with `xz -dk train.bin.xz`)" \
                if (self.folder / "train.bin.xz").is_file() else ""
            raise SparsifyError(f"{self.folder} is not a complete token folder: {', '.join(missing)} missing{packed}. "
                                "Point data.train at the text itself to tokenise it again.")
        return json.loads((self.folder / "meta.json").read_text())

    def _mixture_counts(self) -> np.ndarray:
        """[K] sequences drawn from each source per virtual epoch of about n_train sequences."""
        if not self.weights:
            return self.windows.copy()
        names = ", ".join(f"[{k}] {e!r}" for k, (e, _, _) in enumerate(self.sources))
        w = np.asarray(self.weights, dtype=np.float64)  # [K]
        if len(w) != len(self.sources):
            raise SparsifyError(f"data.weights: {len(w)} weight(s) for the {len(self.sources)} training source(s) of "
                                f"{self.folder} ({names}); give one weight per source, in that order.")
        if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
            raise SparsifyError(f"data.weights: got {list(self.weights)}; give finite numbers >= 0, at least one "
                                "of them positive.")
        empty = [k for k in range(len(w)) if w[k] > 0 and self.windows[k] == 0]
        if empty:
            k = empty[0]
            _, lo, hi = self.sources[k]
            raise SparsifyError(f"data.weights: source [{k}] {self.sources[k][0]!r} has {hi - lo} tokens, fewer than "
                                f"one sequence of train.seq_len={self.seq_len} + 1, but weight {w[k]:g}; add text to "
                                "it, lower train.seq_len, or give it weight 0.")
        exact = self.n_train * w / w.sum()  # [K]
        counts = np.floor(exact).astype(np.int64)
        rest = np.argsort(counts - exact, kind="stable")[: self.n_train - int(counts.sum())]  # largest remainders
        counts[rest] += 1
        counts[(w > 0) & (counts == 0)] = 1  # a tiny positive weight still draws its source
        return counts

    def _epoch_mix(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Virtual epoch `epoch`: (source [N], draw [N]); position p reads the draw[p]-th sequence (0-based,
        counted within this epoch) of source source[p]."""
        if epoch != self._mix_epoch:
            n = self.epoch_len
            slots = np.repeat(np.arange(len(self.counts), dtype=np.int32), self.counts)  # [N] sorted by source
            source = slots[np.random.default_rng([self.seed, epoch, MIX_TAG]).permutation(n)]  # [N]
            by_source = np.argsort(source, kind="stable")  # [N] positions grouped by source, in order
            first = np.repeat(np.cumsum(self.counts) - self.counts, self.counts)  # [N] prefix counts
            draw = np.empty(n, dtype=np.int64)
            draw[by_source] = np.arange(n) - first
            self._mix_epoch, self._mix = epoch, (source, draw)
        return self._mix

    def _source_order(self, k: int, epoch: int) -> np.ndarray:
        """Source k's window order in its own epoch `epoch` (source 0 is seeded by [seed, epoch] alone)."""
        if self._perms.get(k, (-1,))[0] != epoch:
            key = [self.seed, epoch] if k == 0 else [self.seed, epoch, SOURCE_TAG, k]
            self._perms[k] = (epoch, np.random.default_rng(key).permutation(int(self.windows[k])))
        return self._perms[k][1]

    def train_offsets(self, first: int, count: int) -> np.ndarray:
        """[count] int64: where training sequences first .. first+count-1 start in train.bin."""
        out = np.empty(count, dtype=np.int64)
        for n, i in enumerate(range(first, first + count)):
            epoch, p = divmod(i, self.epoch_len)
            if len(self.counts) == 1:  # one source: no shuffle of sources to draw
                k, d = 0, p
            else:
                source, draw = self._epoch_mix(epoch)
                k, d = int(source[p]), int(draw[p])
            own_epoch, j = divmod(epoch * int(self.counts[k]) + d, int(self.windows[k]))
            out[n] = self.starts[k] + int(self._source_order(k, own_epoch)[j]) * self.seq_len
        return out

    def source_of(self, offsets: np.ndarray) -> np.ndarray:
        """[n] index of the training source each train.bin offset lies in."""
        return np.searchsorted(self.starts, offsets, side="right") - 1

    def train_batch(self, first: int, count: int) -> torch.Tensor:
        """Training sequences first .. first+count-1 of the run: [count, seq_len + 1] int64."""
        rows = [self.train[o : o + self.seq_len + 1] for o in self.train_offsets(first, count)]
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def _stream(self, name: str) -> EvalStream:
        if name not in self._heldout:
            known = ", ".join(self.domains) or "none (data.heldout was empty when it was prepared)"
            raise SparsifyError(f"{self.folder} has no held-out domain {name!r}; its domains: {known}.")
        return self._heldout[name]

    @staticmethod
    def _eval_chunks(s: EvalStream, batch_size: int, max_batches: int, world: int) -> list[tuple[int, int]]:
        """The windows evaluated, as (first, end) window ranges, one per batch; batch b goes to rank b % world.

        The set is the first min(n, batch_size x max_batches x world) windows of the stream, whatever the process
        count. Every rank gets the same number of batches (FSDP runs a collective per forward), so when the text
        holds fewer windows than asked, they are split evenly into world x ceil(W / (batch_size x world))
        batches of at most batch_size windows (sizes differ by at most one): all of the held-out text is scored,
        none dropped to fill whole batches."""
        if s.n < world:
            raise SparsifyError(f"{s.n} {s.what} sequence(s) cannot give one to each of {world} processes; {s.fix}.")
        used = min(s.n, batch_size * max_batches * world)
        n_batches = world * -(-used // (batch_size * world))  # ceil, a multiple of world
        while n_batches > used:  # batches of one window cannot go round evenly: drop the last few windows
            used -= 1
            n_batches = world * -(-used // (batch_size * world))
        bounds = np.linspace(0, used, n_batches + 1).round().astype(int)  # even split: sizes differ by <= 1
        return list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))

    def _eval_batches(self, s: EvalStream, batch_size: int, max_batches: int, rank: int, world: int
                      ) -> Iterator[torch.Tensor]:
        chunks = self._eval_chunks(s, batch_size, max_batches, world)
        for first, end in chunks[rank::world]:
            rows = [s.tokens[j * s.length : j * s.length + s.length + 1] for j in range(first, end)]
            yield torch.from_numpy(np.stack(rows).astype(np.int64))

    def _eval_note(self, s: EvalStream, batch_size: int, max_batches: int, world: int) -> str | None:
        used, asked = self._eval_chunks(s, batch_size, max_batches, world)[-1][1], batch_size * max_batches * world
        if used == asked and s.length == self.seq_len:
            return None
        return (f"{s.what} runs on {used} sequence(s) of {s.length} tokens, all the held-out text holds: less "
                f"than the {asked} of {self.seq_len} tokens asked (train.eval_batches x train.batch_size x processes). "
                f"For a steadier measure, {s.fix}.")

    def validation_batches(self, batch_size: int, max_batches: int, rank: int = 0, world: int = 1
                           ) -> Iterator[torch.Tensor]:
        """This rank's share of the first batch_size * max_batches * world validation sequences: [B, val_len + 1].

        The set is fixed (the same whatever the process count for the same global batch) and every rank gets
        the same number of batches, as FSDP needs; sum the losses over ranks. A short held-out text gives
        what it has (see validation_note).
        """
        return self._eval_batches(self.val, batch_size, max_batches, rank, world)

    def validation_note(self, batch_size: int, max_batches: int, world: int = 1) -> str | None:
        """A line saying that validation runs on less than asked (short held-out text); None when it does not."""
        return self._eval_note(self.val, batch_size, max_batches, world)

    def heldout_batches(self, name: str, batch_size: int, max_batches: int, rank: int = 0, world: int = 1
                        ) -> Iterator[torch.Tensor]:
        """Held-out domain `name` (one of `domains`), served like validation_batches: [B, length + 1]."""
        return self._eval_batches(self._stream(name), batch_size, max_batches, rank, world)

    def heldout_note(self, name: str, batch_size: int, max_batches: int, world: int = 1) -> str | None:
        """Like validation_note, for held-out domain `name`."""
        return self._eval_note(self._stream(name), batch_size, max_batches, world)


def _spans(meta: dict, n_tokens: int, folder: Path) -> list[tuple[str, int, int]]:
    """meta.json's training sources as (entry, start, end) token spans of train.bin."""
    spans = [(str(s["entry"]), int(s["start"]), int(s["end"])) for s in meta["sources"]]
    bounds = [b for _, s, e in spans for b in (s, e)]
    if bounds[0] != 0 or bounds[-1] != n_tokens or bounds != sorted(bounds) or \
            any(spans[k][2] != spans[k + 1][1] for k in range(len(spans) - 1)):
        raise SparsifyError(f"{folder}/meta.json: its training source spans do not tile train.bin's {n_tokens} "
                            "tokens (a file was changed after it was prepared); point data.train at the text "
                            "itself to tokenise it again.")
    return spans


def prepare_data(cfg: DataSection, tokenizer: Any, out: str | os.PathLike, *, progress: bool = True) -> Path:
    """Tokenise the recipe's text into `out`; returns the folder to read.

    Writes train.bin (the data.train entries one after another, their token spans in meta.json `sources`),
    validation.bin, heldout-NAME.bin per data.heldout domain, and meta.json. Reuses `out` when it was prepared
    from the same sources, held-out domains and tokenizer (data.weights only changes the sampling, so it is not
    part of that key). When data.train names a single prepared folder (and data.validation is empty) that
    folder is returned as is, with the held-out domains it carries.
    """
    fingerprint = tokenizer_fingerprint(tokenizer)
    folder = single_prepared(cfg)
    if folder is not None:
        _check_tokenizer(folder, fingerprint)
        mismatch = heldout_mismatch(cfg, folder)
        if mismatch:
            raise SparsifyError(mismatch)
        return folder
    for name in cfg.heldout:  # it becomes a file name
        if not HELDOUT_NAME.fullmatch(name):
            raise SparsifyError(f"data.heldout: name {name!r} is not a simple identifier; rename it.")
    overlap = overlap_problems(cfg)
    if overlap:
        raise SparsifyError("\n".join(overlap))
    train_sources = [resolve_source(s) for s in cfg.train]
    val_sources = [resolve_source(s) for s in cfg.validation]
    heldout_sources = {name: [resolve_source(s) for s in files] for name, files in cfg.heldout.items()}
    key = _key(cfg, train_sources, val_sources, heldout_sources, fingerprint)
    out = Path(out)
    if _is_prepared(out) and json.loads((out / "meta.json").read_text()).get("key") == key:
        return out
    from sparsify.folder.format import atomic_dir  # atomic: a killed run never leaves a half-written token file behind

    dtype = np.uint16 if len(tokenizer) <= 2**16 else np.uint32
    with atomic_dir(out, overwrite=True, kind=None) as tmp:
        ends = np.cumsum(_write_stream(train_sources, cfg, tokenizer, tmp / "train.bin", dtype, progress)).tolist()
        spans = list(zip([0, *ends[:-1]], ends))  # [(start, end)] per data.train entry
        if val_sources:
            n_train, n_val = ends[-1], sum(_write_stream(val_sources, cfg, tokenizer, tmp / "validation.bin", dtype,
                                                         progress))
        else:
            n_train, n_val, spans = hold_out(tmp, dtype, cfg.validation_fraction, cfg.seed, spans)
        heldout = {}
        for name, sources in heldout_sources.items():
            n = sum(_write_stream(sources, cfg, tokenizer, tmp / f"heldout-{name}.bin", dtype, progress))
            heldout[name] = {"entries": cfg.heldout[name], "tokens": n}
        meta = {"format": FORMAT, "key": key, "dtype": np.dtype(dtype).name, "train_tokens": n_train,
                "validation_tokens": n_val, "tokenizer": fingerprint, "train": cfg.train,
                "validation": cfg.validation or f"held out: {cfg.validation_fraction} of train (seed {cfg.seed})",
                "sources": [{"entry": e, "start": a, "end": b} for e, (a, b) in zip(cfg.train, spans)],
                "heldout": heldout}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def single_prepared(cfg: DataSection) -> Path | None:
    """The prepared folder data.train names, when it is the only entry and data.validation is empty."""
    if len(cfg.train) == 1 and not cfg.validation and _is_prepared(Path(cfg.train[0]).expanduser()):
        return Path(cfg.train[0]).expanduser()
    return None


def heldout_mismatch(cfg: DataSection, folder: Path) -> str | None:
    """Why data.heldout cannot be used with the prepared folder given as data.train, or None: such a folder is
    used as it is, with the held-out domains it was prepared with."""
    theirs = {n: d["entries"] for n, d in json.loads((folder / "meta.json").read_text()).get("heldout", {}).items()}
    if not cfg.heldout or cfg.heldout == theirs:
        return None
    has = f"carries the held-out domains {', '.join(theirs)}" if theirs else "carries no held-out domain"
    return (f"data.heldout: data.train is the prepared folder {folder}, which {has}; a prepared folder is used as it "
            "is: remove data.heldout (its own domains are evaluated), or point data.train at the training text so "
            "that it is prepared again with these domains.")


def source_names(cfg: DataSection) -> list[str]:
    """What data.weights refers to, in order: the data.train entries, or the sources a single prepared folder
    records."""
    folder = single_prepared(cfg)
    if folder is None:
        return list(cfg.train)
    return [s["entry"] for s in json.loads((folder / "meta.json").read_text())["sources"]]


def _is_prepared(folder: Path) -> bool:
    try:
        return json.loads((folder / "meta.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def _check_tokenizer(folder: Path, fingerprint: str) -> None:
    theirs = json.loads((folder / "meta.json").read_text())["tokenizer"]
    if theirs != fingerprint:
        raise SparsifyError(f"{folder} was tokenised with another tokenizer ({theirs}) than this model's "
                            f"({fingerprint}); point data.train at the raw text instead so it is re-tokenised.")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Vocabulary size + a hash of the vocabulary: identifies token ids, not the tokenizer object."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]
    return f"{len(tokenizer)}-{digest}"


@dataclass
class Source:
    """One entry of data.train / data.validation, resolved: a builder and its files, or a Hub dataset."""

    builder: str  # text | json | parquet | hub
    files: list[str]  # local files (sorted), or [name, config] for hub


def resolve_source(entry: str) -> Source:
    """A data.train entry -> Source. Raises SparsifyError when a path matches nothing or has an unknown type."""
    if entry.startswith("hub:"):
        name, _, config = entry[4:].partition(":")
        return Source("hub", [name, config])
    files = match_files(entry)
    if not files:
        raise SparsifyError(f"data source {entry!r} {missing_reason(entry)}")
    suffixes = {Path(f).suffix.lower() for f in files}
    builders = {BUILDERS.get(s) for s in suffixes}
    if None in builders or len(builders) != 1:
        raise SparsifyError(f"data source {entry!r} holds files of types {sorted(suffixes)}; each entry must be "
                            f"one type among {sorted(BUILDERS)}. Split it into one entry per type.")
    return Source(builders.pop(), files)


def match_files(entry: str) -> list[str]:
    """The files a local data entry names (a glob's matches, sorted; `**` recurses; a `sparsify gendata` folder:
    its text shards)."""
    path = os.path.expanduser(entry)
    if os.path.isfile(os.path.join(path, "gendata.json")):
        return sorted(glob.glob(os.path.join(path, "text-*.jsonl")))
    files = sorted(glob.glob(path, recursive=True)) if any(c in path for c in "*?[") else [path]
    return [f for f in files if os.path.isfile(f)]


def missing_reason(entry: str) -> str:
    """Why an entry matched nothing, with the fix (a recipe's data.fetch is offered by preflight, which knows it)."""
    path = Path(entry).expanduser()
    if path.is_dir():
        return (f"is a folder: name its files with a glob (e.g. {entry.rstrip('/')}/**/*.txt), give a folder "
                "written by `sparsify gendata`, or a folder prepared by an earlier run (OUTPUT/data) as the only "
                "data.train entry.")
    return (f"matches no file{relative_note(path)}; give existing files or globs (e.g. data/text/*.txt), or "
            "hub:NAME for a Hub dataset.")


def relative_note(path: Path) -> str:
    """Where a relative path is looked for, for messages ("" for an absolute one)."""
    return "" if path.is_absolute() else f" (relative to the current folder {Path.cwd()})"


def overlap_problems(cfg: DataSection) -> list[str]:
    """Held-out files that are also training or validation files (same real path, whatever the glob): a
    held-out domain measures text the model never saw, and apart from validation."""
    def files(entries: list[str]) -> dict[str, str]:  # real path -> the entry that matched it
        return {os.path.realpath(f): e for e in entries if not e.startswith("hub:") for f in match_files(e)}

    problems = []
    pools = [("training", "data.train", files(cfg.train)), ("validation", "data.validation", files(cfg.validation))]
    for name, entries in cfg.heldout.items():
        mine = files(entries)
        for role, key, pool in pools:
            both = sorted(set(mine) & set(pool))
            if not both:
                continue
            shown = ", ".join(both[:3]) + (f" and {len(both) - 3} more" if len(both) > 3 else "")
            problems.append(
                f"data.heldout.{name}: {len(both)} file(s) are also {role} files ({key} {pool[both[0]]!r}): {shown}. "
                f"A held-out domain must be text the model is not {'trained' if role == 'training' else 'validated'} "
                "on: give each file to one of them (`python -m sparsify.train.corpus_split SRC OUT --heldout 0.02` splits "
                "a folder of .txt files into OUT/train and OUT/heldout).")
    return problems


def _key(cfg: DataSection, train: list[Source], val: list[Source], heldout: dict[str, list[Source]],
         fingerprint: str) -> str:
    def describe(src: Source) -> list:
        if src.builder == "hub":
            return [src.builder, src.files, cfg.hub_split]
        return [src.builder, [(os.path.abspath(f), os.path.getsize(f), os.path.getmtime(f)) for f in src.files]]

    blob = json.dumps([[describe(s) for s in train], [describe(s) for s in val], fingerprint, cfg.text_field,
                       cfg.max_tokens, cfg.validation_fraction if not val else None, cfg.seed, FORMAT,
                       [[name, [describe(s) for s in sources]] for name, sources in heldout.items()]])
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


class PlainTexts:
    """Local .txt / .jsonl files read without the `datasets` library (machines without it, such as GPU boxes
    given only torch and transformers), as the few Dataset methods `_tokenise` and `_write_stream` use. A text
    file gives the paragraphs datasets' text builder gives (sample_by="paragraph": the file split at blank
    lines, empty pieces dropped), a .jsonl file one record per non-empty line."""

    def __init__(self, columns: dict[str, list], fn=None):
        self.columns, self.fn = columns, fn  # fn: the batched map applied as batches are read (lazily)
        self.n = len(next(iter(columns.values()), []))

    @classmethod
    def read(cls, src: Source, field: str) -> PlainTexts:
        rows: list = []
        for name in src.files:
            with open(name, encoding="utf-8") as f:  # (universal newlines, as datasets reads text)
                if src.builder == "text":
                    rows += [p for p in f.read().split("\n\n") if p]
                    continue
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line).get(field))
                        except (json.JSONDecodeError, AttributeError) as e:
                            raise SparsifyError(f"{name}, line {n}: not a JSON object ({e}); a .jsonl file holds "
                                                "one object per line.") from None
        if any(r is None for r in rows):
            raise SparsifyError(f"{src.files[0]}: no column {field!r} in some records; set data.text_field to "
                                "the key holding the text.")
        return cls({field: rows})

    @property
    def column_names(self) -> list[str]:
        return list(self.columns)

    def __len__(self) -> int:
        return self.n

    def map(self, fn, **_) -> PlainTexts:
        """`fn` on each batch as it is read (datasets' map arguments, such as num_proc, do not apply)."""
        return PlainTexts(self.columns, fn)

    def iter(self, batch_size: int) -> Iterator[dict[str, list]]:
        for at in range(0, self.n, batch_size):
            batch = {key: values[at:at + batch_size] for key, values in self.columns.items()}
            yield self.fn(batch) if self.fn else batch


def _load(src: Source, cfg: DataSection) -> Any:
    """A datasets Dataset (local files) or IterableDataset (Hub, streamed) with the text in cfg.text_field;
    without `datasets` installed, local .txt / .jsonl files as PlainTexts."""
    try:
        import datasets
    except ImportError:
        if src.builder == "text" or (src.builder == "json" and all(f.endswith(".jsonl") for f in src.files)):
            return PlainTexts.read(src, cfg.text_field)
        raise SparsifyError(f"{src.files[0]}: reading {src.builder} data needs the `datasets` library (pip install "
                            "datasets); without it only local .txt and .jsonl files are read. Or prepare the token "
                            "folder on a machine that has it and give that folder as data.train.") from None

    datasets.disable_progress_bars() if not os.environ.get("SPARSIFY_DATASETS_BARS") else None
    if src.builder == "hub":
        name, config = src.files
        try:
            return datasets.load_dataset(name, config or None, split=cfg.hub_split, streaming=True)
        except Exception as e:  # the Hub raises many types; all mean "cannot read that dataset"
            if (broken := import_failure(e)) is not None:
                raise SparsifyError(f"cannot stream Hub dataset {name!r}: {broken}") from None
            raise SparsifyError(f"cannot stream Hub dataset {name!r} (config {config or 'default'}, split "
                                f"{cfg.hub_split!r}): {e}. Check the name, data.hub_split, network access "
                                "(HF_DATASETS_OFFLINE), or use local files.") from None
    kwargs = {"sample_by": "paragraph"} if src.builder == "text" else {}
    try:
        ds = datasets.load_dataset(src.builder, data_files=src.files, split="train", **kwargs)
    except datasets.exceptions.DatasetGenerationError as e:  # its message alone names neither file nor cause
        shown = ", ".join(src.files[:3]) + (f" and {len(src.files) - 3} more" if len(src.files) > 3 else "")
        raise SparsifyError(f"cannot read {shown} as {src.builder}: {e.__cause__ or e}. Fix or remove the file(s); "
                            "text files are read as UTF-8 paragraphs, .jsonl / .json as one JSON object per line or "
                            "record.") from None
    if src.builder == "text" and cfg.text_field != "text":
        ds = ds.rename_column("text", cfg.text_field)
    return ds


def _tokenise(ds: Any, src: Source, cfg: DataSection, tokenizer: Any) -> Any:
    """Adds column "ids": each text's token ids with its separator (documents: EOS after it; paragraphs of a text
    file: the "\\n\\n" that came before it, put back in front, so the ids are those of the file tokenised in one
    go: a paragraph tokenised with its break at the end would give a "\\n\\n" token that natural text never has)."""
    if cfg.text_field not in (ds.column_names or [cfg.text_field]):
        raise SparsifyError(f"{src.files[0]}: no column {cfg.text_field!r} (columns: {ds.column_names}); set "
                            "data.text_field to the column holding the text.")
    paragraphs = src.builder == "text"
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    field = cfg.text_field

    def encode(batch: dict) -> dict:
        texts = ["\n\n" + t if paragraphs else t for t in batch[field]]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return {"ids": ids if paragraphs else [x + eos for x in ids]}

    kwargs = {"batched": True, "batch_size": 512, "remove_columns": ds.column_names}
    if src.builder != "hub":  # IterableDataset.map has no num_proc: it tokenises lazily as it streams
        workers = cfg.num_proc or min(os.cpu_count() or 1, 16)
        kwargs["num_proc"] = workers if workers > 1 and len(ds) >= 4 * 512 else None
    return ds.map(encode, **kwargs)


def _write_stream(sources: list[Source], cfg: DataSection, tokenizer: Any, path: Path, dtype: Any,
                  progress: bool) -> list[int]:
    """Tokenises `sources` in order and appends their ids to `path`; returns the token count of each source
    (0 for those after data.max_tokens ran out)."""
    from tqdm.auto import tqdm

    counts, limit = [0] * len(sources), cfg.max_tokens
    with open(path, "wb") as f, tqdm(desc=f"tokenising -> {path.name}", unit="tok", unit_scale=True,
                                     disable=not progress) as bar:
        for k, src in enumerate(sources):
            ds = _tokenise(_load(src, cfg), src, cfg, tokenizer)
            for batch in ds.iter(batch_size=1024):
                ids = np.fromiter((t for row in batch["ids"] for t in row), dtype=np.int64)
                if limit is not None:
                    ids = ids[: limit - sum(counts)]
                f.write(ids.astype(dtype).tobytes())
                counts[k] += len(ids)
                bar.update(len(ids))
                if limit is not None and sum(counts) >= limit:
                    return counts
    return counts


def hold_out(folder: Path, dtype: Any, fraction: float, seed: int, spans: list[tuple[int, int]] = (),
             copy_tokens: int = COPY_TOKENS) -> tuple[int, int, list[tuple[int, int]]]:
    """Moves a seeded random `fraction` of train.bin, in blocks of contiguous tokens, to validation.bin.

    Streams from a memory map, one run of same-side blocks at a time (at most copy_tokens in RAM), so a
    multi-billion-token train.bin never has to fit in memory. Returns the train and validation token counts
    and `spans` (token spans of the training sources) moved to where they are in the train.bin that remains.
    """
    src = folder / "train.bin"
    n = src.stat().st_size // np.dtype(dtype).itemsize
    block = max(64, min(HOLDOUT_BLOCK, n // 100))
    n_blocks = -(-n // block)
    k = max(1, round(fraction * n_blocks)) if fraction > 0 else 0
    if k >= n_blocks:
        raise SparsifyError(f"data.train has only {n} tokens: too little to hold out "
                            f"data.validation_fraction={fraction}; add text or give data.validation files.")
    held = np.zeros(n_blocks, dtype=bool)  # [n_blocks] True = validation
    held[np.random.default_rng(seed).choice(n_blocks, size=k, replace=False)] = True
    starts = np.flatnonzero(np.r_[True, held[1:] != held[:-1]])  # first block of each run of equal blocks
    ends = np.r_[starts[1:], n_blocks]
    tokens = np.memmap(src, dtype=dtype, mode="r")  # [n]
    kept = folder / "train.kept.bin"  # beside train.bin: replaced by one rename at the end
    counts = [0, 0]  # tokens written to train, validation
    with open(kept, "wb") as train_f, open(folder / "validation.bin", "wb") as val_f:
        for first, stop in zip(starts, ends):
            side = int(held[first])
            lo, hi = int(first) * block, min(int(stop) * block, n)
            for at in range(lo, hi, copy_tokens):
                (val_f if side else train_f).write(tokens[at:min(at + copy_tokens, hi)].tobytes())
            counts[side] += hi - lo
    del tokens  # close the map before replacing its file
    os.replace(kept, src)
    sizes = np.full(n_blocks, block, dtype=np.int64)  # [n_blocks] tokens per block; the last may be short
    sizes[-1] = n - (n_blocks - 1) * block
    held_before = np.r_[0, np.cumsum(sizes * held)]  # [n_blocks + 1] held-out tokens before each block

    def kept_before(x: int) -> int:  # train.bin position of original token position x
        b = min(x // block, n_blocks - 1)
        return x - int(held_before[b]) - (min(x - b * block, int(sizes[b])) if held[b] else 0)

    return counts[0], counts[1], [(kept_before(a), kept_before(b)) for a, b in spans]
