"""eval/quality/frontier.py: one row per run from its metrics.jsonl, the OOD headline first, cloze accuracy beside it."""

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "eval" / "quality" / "frontier.py"


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
    head = "| run | method | tokens | zeros (mean) | least sparse layer | ppl ratio: ood_ratio | ppl ratio: id_ratio"
    assert table[0].startswith(head)
    # rows by method, then zeros (no recipe.yaml here: the method is unknown, "?")
    assert "| lever | ? | 1M | 95.50% | 93.50% (layer 0) | 1.300x | 1.120x | 1.050x |" in table[2]
    assert table[2].endswith("| 0.470 +- 0.020 | -3.0 pts |")
    assert table[3].startswith("| base |") and table[3].endswith("| 0.400 +- 0.020 | -10.0 pts |")


def _load():
    spec = importlib.util.spec_from_file_location("frontier", SCRIPT)
    frontier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(frontier)
    return frontier


def test_frontier_gives_each_run_its_method_adds_recorded_points_and_what_the_zeros_buy(tmp_path, monkeypatch):
    """The choice a user makes: the method of each run (recipe.yaml), points measured earlier (--recorded), and the
    decode FFN speed each measured zeros level buys (--speed: a decode-bench.json)."""
    l1, thr, ctl = (_run(tmp_path, "l1", 0.95, 1.9, 1.1), _run(tmp_path, "thr", 0.951, 1.6, 1.05),
                    _run(tmp_path, "control", 0.69, 1.16, 0.8))
    (l1 / "recipe.yaml").write_text("sparsity: {target: 0.95, l1: 0.06}\n")
    (thr / "recipe.yaml").write_text("sparsity: {method: threshold, threshold: neuron, threshold_grad: exact, "
                                     "target: 0.95}\n")
    (ctl / "recipe.yaml").write_text("sparsity: {target: null, l1: 0}\n")
    recorded = tmp_path / "recorded.json"
    recorded.write_text(json.dumps([{"run": "old", "method": "l1", "tokens": 20_000_000, "zeros": 0.868,
                                     "min_layer_zeros": 0.848, "ood_ratio": 1.492, "cloze": 0.291,
                                     "source": "an earlier lease"}]))
    speed = tmp_path / "decode-bench.json"
    rows = [{"d": d, "F": f, "M": m, "zeros": z, "measured_zeros": z, "x": {"routed": x}}
            for (d, f), m, z, x in [((2048, 8192), 1, 0.9, 1.7), ((4096, 14336), 1, 0.9, 1.8),
                                    ((2048, 8192), 1, 0.955, 2.1), ((2048, 8192), 8, 0.955, 1.5)]]
    speed.write_text(json.dumps({"meta": {"env": {"gpu": "NVIDIA H200"}}, "rows": rows}))
    monkeypatch.setattr(sys, "argv", ["frontier.py", str(l1), str(thr), str(ctl), "--out", str(tmp_path / "o"),
                                      "--recorded", str(recorded), "--speed", str(speed)])
    assert _load().main() == 0
    md = (tmp_path / "o" / "frontier.md").read_text()
    assert "| l1 | l1 | 1M | 95.00% |" in md and "| thr | threshold (neuron, exact) | 1M | 95.10% |" in md
    assert "| control | no-L1 | 1M | 69.00% |" in md
    assert "| old (recorded) | l1 | 20M | 86.80% | 84.80% | 1.492x |" in md and "(recorded) an earlier lease" in md
    assert "| zeros | M | 2048x8192 | 4096x14336 |" in md and "NVIDIA H200" in md
    assert "| 0.900 | 1 | 1.70x | 1.80x |" in md and "| 0.955 | 8 | 1.50x | - |" in md
    data = json.loads((tmp_path / "o" / "frontier.json").read_text())
    assert len(data["runs"]) == 4 and len(data["speed"]) == 3


def test_frontier_takes_cloze_scores_from_several_files(tmp_path, monkeypatch):
    """Runs scored in different leases: each file's scores go to its runs, each delta against that file's first
    model (the original it was scored beside); a run in both files takes the last file's score."""
    runs = [_run(tmp_path, "old", 0.95, 1.5, 1.0), _run(tmp_path, "new", 0.95, 1.3, 1.0)]
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"models": {"original": {"acc": 0.38, "acc_stderr": 0.02},
                                            "old": {"acc": 0.30, "acc_stderr": 0.02},
                                            "new": {"acc": 0.10, "acc_stderr": 0.02}}}))
    second.write_text(json.dumps({"models": {"original": {"acc": 0.40, "acc_stderr": 0.02},
                                             "new": {"acc": 0.35, "acc_stderr": 0.02}}}))
    monkeypatch.setattr(sys, "argv", ["frontier.py", *map(str, runs), "--out", str(tmp_path / "o"),
                                      "--cloze", str(first), "--cloze", str(second)])
    assert _load().main() == 0
    md = (tmp_path / "o" / "frontier.md").read_text()
    assert [line for line in md.splitlines() if line.startswith("| old |")][0].endswith("| 0.300 +- 0.020 | -8.0 pts |")
    assert [line for line in md.splitlines() if line.startswith("| new |")][0].endswith("| 0.350 +- 0.020 | -5.0 pts |")
