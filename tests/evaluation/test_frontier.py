"""eval/frontier.py: one row per run from its metrics.jsonl, the OOD headline first, cloze accuracy beside it."""

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "eval" / "frontier.py"


def _run(tmp_path, name, zeros, ood, general):
    run = tmp_path / name
    run.mkdir()
    lines = [{"step": 10, "tokens": 1_000_000, "sparsity": zeros, "per_layer": {"zeros": [zeros - 0.02, zeros + 0.02]}},
             {"step": 10, "tokens": 1_000_000, "val_loss": 2.0, "val_ppl_ratio": 1.05, "ood_ratio": ood,
              "id_ratio": general, "heldout": {"general": {"ratio": general}, "fiction": {"ratio": ood}}}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


def test_frontier_table_leads_with_ood_ratio_and_adds_cloze(tmp_path, monkeypatch):
    runs = [_run(tmp_path, "base", 0.957, 1.8, 1.1), _run(tmp_path, "lever", 0.955, 1.3, 1.12)]
    cloze = tmp_path / "cloze.json"
    cloze.write_text(json.dumps({"models": {"original": {"acc": 0.5, "acc_stderr": 0.02},
                                            "base": {"acc": 0.4, "acc_stderr": 0.02},
                                            "lever": {"acc": 0.47, "acc_stderr": 0.02}}}))
    spec = importlib.util.spec_from_file_location("frontier", SCRIPT)
    frontier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(frontier)
    monkeypatch.setattr(sys, "argv", ["frontier.py", *map(str, runs), "--out", str(tmp_path / "o"),
                                      "--cloze", str(cloze)])
    assert frontier.main() == 0
    table = (tmp_path / "o" / "frontier.md").read_text().splitlines()
    assert table[0].startswith("| run | tokens | zeros (mean) | least sparse layer | ppl ratio: ood_ratio | ppl ratio: id_ratio")
    assert "| lever | 1M | 95.50% | 93.50% (layer 0) | 1.300x | 1.120x | 1.050x |" in table[3]
    assert table[2].endswith("| 0.400 +- 0.020 | -10.0 pts |")
    assert table[3].endswith("| 0.470 +- 0.020 | -3.0 pts |")
