"""Where a process sits in a run (rank, world, device under torchrun) and how a run is asked to stop (signals)."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from sparsify.errors import Stopped


@dataclass
class Dist:
    """Where this process sits: rank/world under torchrun, else 0/1."""

    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """All-reduce (sum or max) of a copy of `t`; identity on one process."""
        if self.world == 1:
            return t
        t = t.clone()
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM if op == "sum" else torch.distributed.ReduceOp.MAX)
        return t


def init_distributed() -> Dist:
    """The process group under torchrun (NCCL on GPUs, gloo on CPUs), or one process on the best device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world == 1:
        return Dist(device=torch.device("cuda" if cuda else "cpu"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend="nccl" if cuda else "gloo")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    return Dist(rank=torch.distributed.get_rank(), world=world, device=device)


class RunStopped(Stopped):
    """The run stopped on a signal after writing a checkpoint (or, at its end, the model); the CLI exits 128 + the
    signal's number."""


class StopRequest:
    """SIGTERM or a first SIGINT, caught: the training loop stops at its next step boundary and checkpoints.

    Under torchrun the agent forwards the signal to every rank (the workers run in their own sessions), not
    necessarily before the same step, so ranks agree at logged steps (a max-reduce of the flag, where the
    logging already synchronises); one process checks after every step. The agent kills its workers 30 s after
    forwarding (its shutdown timeout), so train.log_every steps plus a checkpoint must fit in that.
    A second SIGINT raises KeyboardInterrupt as usual. Handlers can only be set from the main thread.
    """

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._previous[s] = signal.signal(s, self._catch)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _catch(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.signum:
            raise KeyboardInterrupt
        self.signum = self.signum or signum

    def due(self, dist: Dist, step: int, log_every: int) -> int:
        """The signal to stop on now (0: none), the same on every rank."""
        if dist.world == 1:
            return self.signum
        if step % log_every:
            return 0
        return int(dist.reduce(torch.tensor([self.signum], device=dist.device), "max").item())
