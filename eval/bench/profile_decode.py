"""Where one decode step's GPU time goes: CUDA-event time of the captured greedy step (graph replay) and a
torch.profiler table of the same step run eagerly, per FFN variant of a sparsify folder (CUDA only).

    PYTHONPATH=. python eval/bench/profile_decode.py FOLDER [--batch 1] [--prompt 512] [--rows 12] [--[no-]compile]

--compile / --no-compile: the step through torch.compile before capture or not (default: the folder's
setting, compiled unless its config says otherwise). With compile on, each layer's "FFN path at capture"
is not recorded (the path is chosen inside the compiled op), and the step check may have kept the
all-dense twin (printed as the step checks).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sparsify.evaluation.loading import installed_modeling, load_model, parse_models  # noqa: E402
from sparsify.kernels import fast_decode  # noqa: E402
from timing import loop_ms  # noqa: E402  (eval/bench/timing.py: this script's folder is on sys.path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--variants", default="dense,twell,auto", help="FFN backends to profile")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile the decode step before capture (default: the folder's setting, on "
                         "unless its config says compile_decode false)")
    args = ap.parse_args()
    model, _ = load_model(parse_models([args.folder])[0], "cuda", "bf16")
    modeling = installed_modeling()
    fast = modeling.enable_fast_decode(model, compile=args.compile)  # None: as the folder says
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (args.batch, args.prompt), device="cuda")
    for variant in args.variants.split(","):
        model.set_ffn_backend(variant)
        fast.drop_graphs()  # each variant captures its own step
        model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
        loop = next(iter(fast._loops.values()))
        for _ in range(10):
            loop.graph.replay()
        print(f"{variant}: graph replay {loop_ms(loop.graph.replay, 100, True):.3f} ms per decode step "
              f"(batch {args.batch}, cache {fast.cache_key}, compiled {fast.compile})")
        paths = [m.last_path for m in model.modules() if hasattr(m, "last_path")]
        print(f"{variant}: FFN path per layer at capture {paths}; step checks {fast.step_checks}")
        fast.step_checks.clear()
        kw = fast_decode.cache_kwarg(model)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fast_decode.decode_one_token(loop, fast.decode_forward(), kw, fast.cache)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
