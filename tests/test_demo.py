"""The README's first command: `sparsify demo`, end to end offline, with CPU-small settings."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs_whole_pipeline_and_resumes(tmp_path):
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "sparsify", "demo", "-o", str(out), "--steps", "2", "--limit", "2",
           "--text-tokens", "256", "-q"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[3/3] eval" in proc.stdout
    report = json.loads((out / "report" / "report.json").read_text())
    rows = {r["name"]: r for r in report["models"]}
    assert set(rows) == {"orig", "relu", "ft"}
    assert rows["orig"]["sparsity"]["summary"]["zeros"] == 0.0
    assert rows["relu"]["sparsity"]["summary"]["zeros"] > 0.5  # the swap alone zeroes most of h
    ppl = {k: next(iter(r["perplexity"].values()))["perplexity"] for k, r in rows.items()}
    assert ppl["relu"] > 10 * ppl["orig"]  # the bare swap breaks the model, as the demo says
    assert (out / "ft" / "model" / "config.json").is_file()
    assert (out / "report" / "report.md").is_file()
    # a second run reuses the finished stages instead of redoing them
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "convert: reusing" in again.stdout and "finetune: reusing" in again.stdout
