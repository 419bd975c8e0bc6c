"""Benchmark: `sparsify convert` of a >= 2 GB safetensors checkpoint vs `cp -r` of the same folder.

Random bf16 weights with the real Llama-3.2-1B config (2.47 GB). Both commands run as child processes in
alternating order, `--reps` times each, after an os.sync() so one run's
writeback does not land on the next; we report median wall time and the peak RSS of each child
(os.wait4). Targets (issue 2): convert time <= 1.5x cp -r, peak RSS <= 1.5 GB.

    python eval/bench/bench_convert.py [--work /tmp/bench-convert] [--reps 5] [--out eval/results/convert-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

# config.json of meta-llama/Llama-3.2-1B, as `sparsify synth` uses it
LLAMA_32_1B = json.loads((Path(__file__).resolve().parents[1] / "configs" / "llama-3.2-1b.json").read_text())


def make_checkpoint(folder: Path) -> int:
    """Random bf16 Llama-3.2-1B weights in two shards + index; returns total bytes."""
    import torch
    from safetensors.torch import save_file

    if (folder / "config.json").is_file():
        return sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    c = LLAMA_32_1B
    d, f, L, kv = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_key_value_heads"] * c["head_dim"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], d), "model.norm.weight": (d,)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
                   p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
                   p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                   p + "mlp.down_proj.weight": (d, f), p + "input_layernorm.weight": (d,),
                   p + "post_attention_layernorm.weight": (d,)}
    names = list(shapes)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map, g = {}, torch.Generator().manual_seed(0)
    for k, part in enumerate(halves):
        shard = f"model-{k + 1:05d}-of-00002.safetensors"
        tensors = {n: (torch.randn(shapes[n], generator=g) * 0.02).to(torch.bfloat16) for n in part}
        save_file(tensors, tmp / shard, metadata={"format": "pt"})
        weight_map |= {n: shard for n in part}
        del tensors
    total = sum(p.stat().st_size for p in tmp.glob("*.safetensors"))
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (tmp / "config.json").write_text(json.dumps(LLAMA_32_1B, indent=2))
    os.rename(tmp, folder)
    return total


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in MB) of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"{cmd} failed: {proc.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/bench-convert")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="eval/results/convert-cpu.json")
    ap.add_argument("--make", metavar="DIR", help=argparse.SUPPRESS)  # internal: write the checkpoint, exit
    args = ap.parse_args()
    if args.make:
        make_checkpoint(Path(args.make))
        return
    work = Path(args.work)
    src = work / "llama-3.2-1b-random"
    # Made in a child process: this parent must stay small, because a forked child's peak RSS (wait4)
    # includes the pages it inherited from the parent.
    subprocess.run([sys.executable, __file__, "--make", str(src)], check=True)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    runs = {"cp -r": [], "sparsify convert": []}
    for rep in range(args.reps):
        order = ["cp -r", "sparsify convert"] if rep % 2 == 0 else ["sparsify convert", "cp -r"]
        for name in order:
            dst = work / f"dst-{name.split()[-1]}"
            shutil.rmtree(dst, ignore_errors=True)
            os.sync()  # flush the previous run's dirty pages so they do not land on this run's clock
            cmd = (["cp", "-r", str(src), str(dst)] if name == "cp -r" else
                   [sys.executable, "-m", "sparsify", "convert", str(src), "-o", str(dst), "-q"])
            runs[name].append(timed(cmd))
            shutil.rmtree(dst, ignore_errors=True)
    cp = statistics.median(w for w, _ in runs["cp -r"])
    conv = statistics.median(w for w, _ in runs["sparsify convert"])
    rss = max(r for _, r in runs["sparsify convert"])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"bench": "convert vs cp -r", "checkpoint": "random bf16, Llama-3.2-1B config, 2 shards",
              "bytes": size, "reps": args.reps, "runs": runs, "cp_median_s": cp, "convert_median_s": conv,
              "time_ratio": conv / cp, "convert_peak_rss_mb": rss, "targets": {"time_ratio": 1.5, "rss_mb": 1536},
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}", "commit": commit,
              "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"checkpoint {size / 1e9:.2f} GB | cp -r {cp:.2f} s | convert {conv:.2f} s | ratio {conv / cp:.2f}x "
          f"(target <= 1.5x) | convert peak RSS {rss:.0f} MB (target <= 1536 MB)")


if __name__ == "__main__":
    main()
