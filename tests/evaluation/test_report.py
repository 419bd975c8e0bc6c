"""report.json -> report.md and plots; the merge CLI."""

from __future__ import annotations

import os

import pytest

from sparsify.errors import SparsifyError
from sparsify.evaluation import evaluate as ev
from sparsify.evaluation import speed as sp


def test_report_cli_missing_path_exits_2_with_a_message(tmp_path, capsys):
    from sparsify.evaluation import report as rp

    with pytest.raises(SystemExit) as exc:
        rp.main([str(tmp_path / "nope" / "report.json"), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert "no such report.json" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_report_with_speed_rows_draws_speed_plot_and_tables(tmp_path):
    from sparsify.evaluation import report as rp

    rows = [{"backend": b, "batch": bs, "seq": 512, "tokens_per_s": tps * bs, "ms": 1.0, "peak_mem_gb": 1.5,
             "path": "torch" if b == "dense" else "twell_ffn:twell"}
            for bs in (1, 8) for b, tps in (("dense", 100.0), ("twell", 130.0))]
    rows.append({"backend": "dense", "repeat": True, "batch": 8, "seq": 512, "tokens_per_s": 780.0})
    speed = {"available": True, "backends": ["dense", "twell"], "device": "GPU", "dtype": "bfloat16",
             "prefill": rows, "decode": [], "ffn_share": {"dense": {"batch": 8, "seq": 512, "ffn_share": 0.4}},
             "speedup": sp.speedups(rows, [])}
    report = {"provenance": ev.provenance("cpu"), "models": [{"name": "m", "source": "x", "speed": speed}]}
    out = tmp_path / "r"
    rp.write_report(report, out)
    assert report["plots"] == ["speed_vs_batch.png"]
    md = (out / "report.md").read_text()
    assert "| prefill b8 s512 | 1.300 | - | 0.025 |" in md and "dense (again)" in md and "| dense | 8 | 512 | 0.400 |" in md
    umask = os.umask(0)
    os.umask(umask)  # a plain copy's modes, not mkdtemp's 0700 / 0600: reports are meant to be shared
    modes = [oct(p.stat().st_mode & 0o777) for p in (out, out / "report.md")]
    assert modes == [oct(0o777 & ~umask), oct(0o666 & ~umask)]
    bare = {"provenance": ev.provenance("cpu"), "models": [{"name": "m", "source": "x"}]}
    with pytest.raises(SparsifyError, match="already exists; pass --overwrite"):
        rp.write_report(bare, out)
    (out / "mine.png").write_bytes(b"kept")  # not the report's: --overwrite must not delete it
    with pytest.raises(SparsifyError, match=r"not part of a report \(mine.png\)"):
        rp.write_report(bare, out, overwrite=True)
    assert (out / "mine.png").read_bytes() == b"kept" and (out / "speed_vs_batch.png").is_file()
    (out / "mine.png").unlink()
    rp.write_report(bare, out, overwrite=True)
    assert not (out / "speed_vs_batch.png").exists(), "a plot of the earlier report was left beside this one"


def test_report_cli_refuses_an_existing_out_and_re_renders_in_place_with_overwrite(tmp_path, capsys):
    from sparsify.evaluation import report as rp

    out = tmp_path / "r"
    rp.write_report({"provenance": ev.provenance("cpu"), "models": [{"name": "m", "source": "x"}]}, out)
    before = (out / "report.md").read_bytes()
    with pytest.raises(SystemExit) as exc:
        rp.main([str(out), "--out", str(out)])
    assert exc.value.code == 2 and "pass --overwrite" in capsys.readouterr().err
    assert rp.main([str(out), "--out", str(out), "--overwrite"]) == 0
    assert (out / "report.md").read_bytes() == before and not [p for p in tmp_path.iterdir() if p.name != "r"]
