"""What `auto` costs a whole model in eager calls once it decided: the model with the FFN backend "dense", "auto" as
shipped (a decided layer holds auto's answer until the next density refresh: after one attribute test a dense one
runs its torch expression, a TwELL one the backend table's row; the FFN runtime's grants), and "auto" without
(`ffn_runtime.grants = False`: every call asks the dispatcher, a routed call), timed side by side in one run.

    python eval/bench/bench_auto_overhead.py MODEL_FOLDER... [--batch 1] [--prompt 512] [--rounds 7] [--out DIR]

Per model: the prefill forward of a [batch, prompt] prompt (no cache), and one decode step (a 1-token forward
on a cache holding the prompt, cropped back after each call). Each round times every variant once as a loop of
calls, in an order that rotates every round; the table gives the medians of the per-round ratios. A folder written
by `sparsify synth` is a fine input (speed, not quality). On CPU every variant runs the torch path (a smoke run).
Writes auto-overhead.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from sparsify.evaluation.loading import load_model, parse_models, pick_device
from sparsify.kernels.fast_decode import cache_kwarg
from timing import loop_ms, med, paired, rounds_of  # eval/bench/timing.py (this script's folder is on sys.path)


def variants(model) -> dict:
    """{name: prepare()}: set the backend (and whether auto grants) the name stands for."""
    runtime = getattr(model, "ffn_runtime", None)
    if runtime is None:
        raise SystemExit("this folder's modeling code predates the FFN runtime (issue 31): re-export it "
                         "(sparsify synth / convert) to compare auto with and without grants")

    def use(backend: str, grant: bool):
        def prepare() -> None:
            runtime.grants = grant
            model.set_ffn_backend(backend)  # (also ends any grant a layer holds)
        return prepare

    return {"dense": use("dense", False), "auto": use("auto", True), "auto_no_grant": use("auto", False)}


def variant_rounds(fn, prep: dict, calls: int, rounds: int, cuda: bool) -> dict[str, list[float]]:
    """{variant: [ms per call of fn, one per round]}, each variant set by its prep() before its loop; the order
    rotates every round (timing.rounds_of)."""
    for name in prep:  # warm: auto calibrates each layer's bucket on its first calls
        prep[name]()
        for _ in range(3):
            fn()

    def measure(k: str) -> float:
        prep[k]()
        fn()  # the first call after a switch takes the grant (not timed)
        return loop_ms(fn, calls, cuda)

    return rounds_of({k: (lambda k=k: measure(k)) for k in prep}, rounds)


def bench_model(source: str, device: str, batch: int, prompt: int, rounds: int, calls: int) -> dict:
    from transformers import DynamicCache

    spec = parse_models([source])[0]
    model, _ = load_model(spec, device, "auto")
    if not hasattr(model, "set_ffn_backend"):
        raise SystemExit(f"{source}: not a sparsify model (no FFN backends to compare)")
    cuda = device.startswith("cuda")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=gen).to(device)
    step = torch.randint(3, model.config.vocab_size, (batch, 1), generator=gen).to(device)
    prep = variants(model)
    modeling = sys.modules[type(model).__module__]
    modeling.enable_fast_decode(model, enabled=False)  # plain eager forwards: graph replay is another measurement
    name = cache_kwarg(model)  # `cache` (transformers 5.2x) or `past_key_values`
    row = {"model": spec.name, "source": source, "batch": batch, "prompt": prompt, "cases": {}}
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids, use_cache=True, **{name: cache})
        if cache.get_seq_length() != prompt:
            raise SystemExit(f"the prefill did not fill the cache given as {name}= (transformers changed its API?)")

        def decode():
            model(step, use_cache=True, **{name: cache})
            cache.crop(-1)  # (transformers 5: a negative count removes that many tokens)

        for case, fn in (("prefill", lambda: model(ids, use_cache=False)), ("decode", decode)):
            times = variant_rounds(fn, prep, calls if case == "decode" else max(1, calls // 4), rounds, cuda)
            row["cases"][case] = {"ms": {k: med(v) for k, v in times.items()},
                                  "dense_over_auto": paired(times, "dense", "auto"),
                                  "dense_over_auto_no_grant": paired(times, "dense", "auto_no_grant")}
    prep["auto"]()
    del model
    if cuda:
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="[NAME=]FOLDER of a sparsify model (sparsify synth / convert / finetune)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--rounds", type=int, default=7, help="paired rounds (default 7)")
    p.add_argument("--calls", type=int, default=40, help="decode calls per timed loop (prefill: a quarter)")
    p.add_argument("--device", default=None)
    p.add_argument("--out", type=Path, default=None, help="write auto-overhead.json here")
    args = p.parse_args(argv)
    device = pick_device(args.device)
    rows = [bench_model(m, device, args.batch, args.prompt, args.rounds, args.calls) for m in args.models]
    env = {"device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu", "torch": torch.__version__}
    print(f"eager calls, {env['device']}, torch {env['torch']}, batch {args.batch}, prompt {args.prompt}, "
          f"{args.rounds} paired rounds (ratios > 1: faster than dense)")
    print("| model | case | dense ms | auto ms | auto without grant ms | dense / auto | dense / auto without grant |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        for case, c in r["cases"].items():
            ms = c["ms"]
            print(f"| {r['model']} | {case} | {ms['dense']:.3f} | {ms['auto']:.3f} | {ms['auto_no_grant']:.3f} | "
                  f"{c['dense_over_auto']:.3f}x | {c['dense_over_auto_no_grant']:.3f}x |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "auto-overhead.json").write_text(json.dumps({"conditions": env, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
