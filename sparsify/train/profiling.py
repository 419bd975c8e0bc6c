"""Where a training step's GPU time goes: `train.profile_steps` runs torch.profiler over a few steps.

The report (OUTPUT/profile.txt, also printed) groups GPU kernel time into classes a user can act on (matmuls,
attention, compiled elementwise/reduction kernels, optimizer, copies) and lists the top kernels, so a change
of batch size, attention backend or compile setting can be judged by what it moved.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

WARMUP_STEPS = 10  # compile and autotuning happen in the first steps; the profile starts after them

# (class, pattern on the kernel name), first match wins
KERNEL_CLASSES = [
    ("attention", re.compile(r"flash|fmha|cudnn|sdpa|attention|attn", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|wgmma|matmul|splitK", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|_amp_", re.I)),
    ("compiled (inductor)", re.compile(r"^triton_", re.I)),
    ("copy / cast", re.compile(r"copy|memcpy|memset|cast|to_copy|fill", re.I)),
]


class StepProfiler:
    """Profiles steps WARMUP_STEPS+1 .. WARMUP_STEPS+steps of the run (rank 0), then writes the report once."""

    def __init__(self, steps: int, out: Path, enabled: bool):
        self.steps, self.out = steps, out
        self.enabled = enabled and steps > 0
        self.prof: torch.profiler.profile | None = None
        self.done = False

    def after_step(self, step: int) -> None:
        """Call after each optimizer step with the step count reached."""
        if not self.enabled or self.done:
            return
        if step == WARMUP_STEPS and self.prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
        elif self.prof is not None and step >= WARMUP_STEPS + self.steps:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.done = True
            text = report(self.prof, self.steps)
            (self.out / "profile.txt").write_text(text)
            print(text)


def classify(kernel: str) -> str:
    """The class of a GPU kernel name (KERNEL_CLASSES, first match), "other" when none matches."""
    return next((label for label, pattern in KERNEL_CLASSES if pattern.search(kernel)), "other")


def report(prof: torch.profiler.profile, steps: int, top: int = 25) -> str:
    """GPU time per step by kernel class, then the top kernels (name, calls per step, ms per step, share)."""
    kernels: dict[str, list[float]] = {}  # name -> [total us, calls]
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:  # a kernel, copy or memset on the GPU
            entry = kernels.setdefault(event.name, [0.0, 0])
            entry[0] += event.time_range.elapsed_us()
            entry[1] += 1
    if not kernels:  # no GPU events (CPU run): the profiler's own table
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    total = sum(us for us, _ in kernels.values()) or 1.0
    classes: dict[str, float] = {}
    for name, (us, _) in kernels.items():
        classes[classify(name)] = classes.get(classify(name), 0.0) + us
    lines = [f"GPU kernel time per step: {total / steps / 1e3:.2f} ms (mean of {steps} profiled steps)", "",
             f"{'class':<22}{'ms/step':>10}{'share':>8}"]
    lines += [f"{c:<22}{us / steps / 1e3:>10.2f}{us / total:>8.1%}" for c, us in sorted(classes.items(), key=lambda x: -x[1])]
    lines += ["", f"{'ms/step':>8}{'share':>7}{'calls':>7}  kernel"]
    for name, (us, calls) in sorted(kernels.items(), key=lambda x: -x[1][0])[:top]:
        lines.append(f"{us / steps / 1e3:>8.2f}{us / total:>7.1%}{calls / steps:>7.0f}  {name[:150]}")
    return "\n".join(lines) + "\n"
