"""Training text -> token files -> deterministic, resumable batches of packed sequences.

Two stages:
  1. `prepare_data` reads the recipe's sources with the `datasets` library (local .txt/.jsonl/.json/.parquet,
     or Hub datasets streamed), tokenises them (batched, in parallel), and writes one flat token stream per
     split to a folder: train.bin, validation.bin (uint16 when the vocabulary fits, else uint32) and
     meta.json. Done once (by rank 0), reused when the sources and tokenizer are unchanged, and itself a
     valid `data.train` source: a prepared folder can be carried to a machine without `datasets`.
  2. `TokenData` memory-maps the streams. Training sequence i of the whole run (counted over all processes)
     is window perm_epoch[i mod n] of seq_len + 1 tokens, perm_epoch a seeded permutation per epoch. So the
     data position is a single integer (sequences consumed), saved in each checkpoint, and a resumed run, or
     one with another process count, reads exactly the same sequences.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from .errors import SparsifyError
from .recipe import DataSection

FORMAT = "sparsify-tokens/1"
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".text"}
BUILDERS = {**{s: "text" for s in TEXT_SUFFIXES}, ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# Tokens per held-out block (at most; small corpora use N/100 so the fraction is honoured): validation is whole
# blocks of contiguous text, so little of it borders training text.
HOLDOUT_BLOCK = 8192
COPY_TOKENS = 1 << 26  # tokens per write when splitting train.bin (128-256 MiB of RAM at most)


# ----------------------------------------------------------------------------------------------- reading


@dataclass
class TokenData:
    """Memory-mapped train / validation token streams, served as windows of seq_len + 1 tokens."""

    folder: Path
    seq_len: int
    seed: int

    def __post_init__(self) -> None:
        missing = [n for n in ("meta.json", "train.bin", "validation.bin") if not (self.folder / n).is_file()]
        if missing:
            packed = " (train.bin.xz is there: unpack it with `xz -dk train.bin.xz`)" \
                if (self.folder / "train.bin.xz").is_file() else ""
            raise SparsifyError(f"{self.folder} is not a complete token folder: {', '.join(missing)} missing{packed}. "
                                "Point data.train at the text itself to tokenise it again.")
        meta = json.loads((self.folder / "meta.json").read_text())
        dtype = np.dtype(meta["dtype"])
        self.train = np.memmap(self.folder / "train.bin", dtype=dtype, mode="r")
        self.validation = np.memmap(self.folder / "validation.bin", dtype=dtype, mode="r")
        self.n_train = (len(self.train) - 1) // self.seq_len
        # a held-out text shorter than one training window is validated on whole, in one shorter window
        self.val_len = min(self.seq_len, len(self.validation) - 1)
        self.n_validation = (len(self.validation) - 1) // self.val_len if self.val_len > 0 else 0
        if self.n_train < 1:
            raise SparsifyError(
                f"{self.folder}: {len(self.train)} training tokens do not fill one sequence of "
                f"train.seq_len={self.seq_len}; add text to data.train or lower train.seq_len.")
        if self.n_validation < 1:
            raise SparsifyError(
                f"{self.folder}: {len(self.validation)} validation tokens leave nothing to validate on; add text to "
                "data.validation, or raise data.validation_fraction when it is held out of data.train.")
        self._epoch, self._perm = -1, None

    def _window(self, stream: np.ndarray, j: int, length: int) -> np.ndarray:
        return stream[j * length : j * length + length + 1]

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_train)
        return self._perm

    def train_batch(self, first: int, count: int) -> torch.Tensor:
        """Training sequences first .. first+count-1 of the run: [count, seq_len + 1] int64."""
        rows = [self._window(self.train, self._order(i // self.n_train)[i % self.n_train], self.seq_len) for i in
                range(first, first + count)]
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def _validation_shape(self, batch_size: int, max_batches: int, world: int) -> tuple[int, int]:
        """(sequences per batch, batches over all ranks): batch_size x up to max_batches x world, or what the
        held-out text holds when that is less (smaller batches, down to one sequence per rank)."""
        per_batch = min(batch_size, self.n_validation // world)
        if per_batch == 0:
            raise SparsifyError(f"{self.n_validation} validation sequence(s) cannot give one to each of {world} "
                                "processes; add validation text.")
        return per_batch, min(self.n_validation // per_batch, max_batches * world) // world * world

    def validation_batches(self, batch_size: int, max_batches: int, rank: int = 0, world: int = 1
                           ) -> Iterator[torch.Tensor]:
        """This rank's share of the first batch_size * max_batches * world validation sequences: [B, val_len + 1].

        The set is fixed (the same whatever the process count for the same global batch) and every rank gets
        the same number of batches, as FSDP needs; sum the losses over ranks. A short held-out text gives
        what it has (see validation_note).
        """
        per_batch, n_batches = self._validation_shape(batch_size, max_batches, world)
        for b in range(rank, n_batches, world):
            rows = [self._window(self.validation, j, self.val_len) for j in range(b * per_batch, (b + 1) * per_batch)]
            yield torch.from_numpy(np.stack(rows).astype(np.int64))

    def validation_note(self, batch_size: int, max_batches: int, world: int = 1) -> str | None:
        """A line saying that validation runs on less than asked (short held-out text); None when it does not."""
        per_batch, n_batches = self._validation_shape(batch_size, max_batches, world)
        used, asked = per_batch * n_batches, batch_size * max_batches * world
        if used == asked and self.val_len == self.seq_len:
            return None
        return (f"validation runs on {used} sequence(s) of {self.val_len} tokens, all the held-out text holds: less "
                f"than the {asked} of {self.seq_len} tokens asked (train.eval_batches x train.batch_size x processes). "
                "Add validation text or raise data.validation_fraction for a steadier measure.")


# ----------------------------------------------------------------------------------------------- preparing


def prepare_data(cfg: DataSection, tokenizer: Any, out: str | os.PathLike, *, progress: bool = True) -> Path:
    """Tokenise the recipe's text into `out` (train.bin, validation.bin, meta.json); returns the folder to read.

    Reuses `out` when it was prepared from the same sources and tokenizer. When data.train names a single
    prepared folder (and data.validation is empty) that folder is returned as is.
    """
    fingerprint = tokenizer_fingerprint(tokenizer)
    if len(cfg.train) == 1 and not cfg.validation and _is_prepared(Path(cfg.train[0]).expanduser()):
        folder = Path(cfg.train[0]).expanduser()
        _check_tokenizer(folder, fingerprint)
        return folder
    train_sources = [resolve_source(s) for s in cfg.train]
    val_sources = [resolve_source(s) for s in cfg.validation]
    key = _key(cfg, train_sources, val_sources, fingerprint)
    out = Path(out)
    if _is_prepared(out) and json.loads((out / "meta.json").read_text()).get("key") == key:
        return out
    from .folder import atomic_dir  # atomic: a killed run never leaves a half-written token file behind

    dtype = np.uint16 if len(tokenizer) <= 2**16 else np.uint32
    with atomic_dir(out, overwrite=True) as tmp:
        n_train = _write_stream(train_sources, cfg, tokenizer, tmp / "train.bin", dtype, progress)
        if val_sources:
            n_val = _write_stream(val_sources, cfg, tokenizer, tmp / "validation.bin", dtype, progress)
        else:
            n_train, n_val = _hold_out(tmp, dtype, cfg.validation_fraction, cfg.seed)
        meta = {"format": FORMAT, "key": key, "dtype": np.dtype(dtype).name, "train_tokens": n_train,
                "validation_tokens": n_val, "tokenizer": fingerprint, "train": cfg.train,
                "validation": cfg.validation or f"held out: {cfg.validation_fraction} of train (seed {cfg.seed})"}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


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
    files = _match_files(entry)
    if not files:
        raise SparsifyError(f"data source {entry!r} {_no_file(entry)}")
    suffixes = {Path(f).suffix.lower() for f in files}
    builders = {BUILDERS.get(s) for s in suffixes}
    if None in builders or len(builders) != 1:
        raise SparsifyError(f"data source {entry!r} holds files of types {sorted(suffixes)}; each entry must be "
                            f"one type among {sorted(BUILDERS)}. Split it into one entry per type.")
    return Source(builders.pop(), files)


def _match_files(entry: str) -> list[str]:
    """The files a local data entry names (a glob's matches, sorted; `**` recurses)."""
    path = os.path.expanduser(entry)
    files = sorted(glob.glob(path, recursive=True)) if any(c in path for c in "*?[") else [path]
    return [f for f in files if os.path.isfile(f)]


def _no_file(entry: str, fetch: str = "") -> str:
    """Why an entry matched nothing, with the fix: the recipe's data.fetch command when it has one."""
    path = Path(entry).expanduser()
    if path.is_dir():
        return (f"is a folder: name its files with a glob (e.g. {entry.rstrip('/')}/**/*.txt), or give a folder "
                "prepared by an earlier run (OUTPUT/data) as the only data.train entry.")
    where = "" if path.is_absolute() else f" (relative to the current folder {Path.cwd()})"
    if fetch.strip():
        command = "\n".join("      " + line for line in fetch.strip().splitlines())
        return (f"matches no file{where}. This recipe's data.fetch gets the data; run it from {Path.cwd()}, then "
                f"run again:\n{command}")
    return (f"matches no file{where}; give existing files or globs (e.g. data/text/*.txt), or hub:NAME for a Hub "
            "dataset.")


def source_problems(cfg: DataSection) -> list[str]:
    """Every problem with the local entries of data.train / data.validation, found without reading any text:
    entries that match no file (with the recipe's data.fetch command when it has one) or mix file types."""
    if len(cfg.train) == 1 and not cfg.validation and _is_prepared(Path(cfg.train[0]).expanduser()):
        return []
    problems, fetch = [], cfg.fetch
    for key, entries in (("data.train", cfg.train), ("data.validation", cfg.validation)):
        for entry in entries:
            if not entry.startswith("hub:") and not _match_files(entry):
                problems.append(f"{key}: {entry!r} {_no_file(entry, fetch)}")
                fetch = ""  # the command once, with the first missing entry
                continue
            try:
                resolve_source(entry)
            except SparsifyError as err:
                problems.append(f"{key}: {err}")
    return problems


def _key(cfg: DataSection, train: list[Source], val: list[Source], fingerprint: str) -> str:
    def describe(src: Source) -> list:
        if src.builder == "hub":
            return [src.builder, src.files, cfg.hub_split]
        return [src.builder, [(os.path.abspath(f), os.path.getsize(f), os.path.getmtime(f)) for f in src.files]]

    blob = json.dumps([[describe(s) for s in train], [describe(s) for s in val], fingerprint, cfg.text_field,
                       cfg.max_tokens, cfg.validation_fraction if not val else None, cfg.seed, FORMAT])
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _load(src: Source, cfg: DataSection) -> Any:
    """A datasets Dataset (local files) or IterableDataset (Hub, streamed) with the text in cfg.text_field."""
    import datasets

    datasets.disable_progress_bars() if not os.environ.get("SPARSIFY_DATASETS_BARS") else None
    if src.builder == "hub":
        name, config = src.files
        try:
            return datasets.load_dataset(name, config or None, split=cfg.hub_split, streaming=True)
        except Exception as e:  # the Hub raises many types; all mean "cannot read that dataset"
            raise SparsifyError(f"cannot stream Hub dataset {name!r} (config {config or 'default'}, split "
                                f"{cfg.hub_split!r}): {e}. Check the name, data.hub_split, network access "
                                "(HF_DATASETS_OFFLINE), or use local files.") from None
    kwargs = {"sample_by": "paragraph"} if src.builder == "text" else {}
    ds = datasets.load_dataset(src.builder, data_files=src.files, split="train", **kwargs)
    if src.builder == "text" and cfg.text_field != "text":
        ds = ds.rename_column("text", cfg.text_field)
    return ds


def _tokenise(ds: Any, src: Source, cfg: DataSection, tokenizer: Any) -> Any:
    """Adds column "ids": each text's token ids plus a separator (paragraphs: "\\n\\n"; documents: EOS)."""
    if cfg.text_field not in (ds.column_names or [cfg.text_field]):
        raise SparsifyError(f"{src.files[0]}: no column {cfg.text_field!r} (columns: {ds.column_names}); set "
                            "data.text_field to the column holding the text.")
    paragraphs = src.builder == "text"
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    field = cfg.text_field

    def encode(batch: dict) -> dict:
        texts = [t + "\n\n" if paragraphs else t for t in batch[field]]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return {"ids": ids if paragraphs else [x + eos for x in ids]}

    kwargs = {"batched": True, "batch_size": 512, "remove_columns": ds.column_names}
    if src.builder != "hub":  # IterableDataset.map has no num_proc: it tokenises lazily as it streams
        workers = cfg.num_proc or min(os.cpu_count() or 1, 16)
        kwargs["num_proc"] = workers if workers > 1 and len(ds) >= 4 * 512 else None
    return ds.map(encode, **kwargs)


def _write_stream(sources: list[Source], cfg: DataSection, tokenizer: Any, path: Path, dtype: Any,
                  progress: bool) -> int:
    """Tokenises `sources` in order and appends their ids to `path`; returns the token count."""
    from tqdm.auto import tqdm

    total, limit = 0, cfg.max_tokens
    with open(path, "wb") as f, tqdm(desc=f"tokenising -> {path.name}", unit="tok", unit_scale=True,
                                     disable=not progress) as bar:
        for src in sources:
            ds = _tokenise(_load(src, cfg), src, cfg, tokenizer)
            for batch in ds.iter(batch_size=1024):
                ids = np.fromiter((t for row in batch["ids"] for t in row), dtype=np.int64)
                if limit is not None:
                    ids = ids[: limit - total]
                f.write(ids.astype(dtype).tobytes())
                total += len(ids)
                bar.update(len(ids))
                if limit is not None and total >= limit:
                    return total
    return total


def _hold_out(folder: Path, dtype: Any, fraction: float, seed: int) -> tuple[int, int]:
    """Moves a seeded random `fraction` of train.bin, in blocks of contiguous tokens, to validation.bin.

    Streams from a memory map, one run of same-side blocks at a time (at most COPY_TOKENS in RAM), so a
    multi-billion-token train.bin never has to fit in memory.
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
            for at in range(lo, hi, COPY_TOKENS):
                (val_f if side else train_f).write(tokens[at:min(at + COPY_TOKENS, hi)].tobytes())
            counts[side] += hi - lo
    del tokens  # close the map before replacing its file
    os.replace(kept, src)
    return counts[0], counts[1]
