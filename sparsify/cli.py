"""The `sparsify` command: parses the subcommand and dispatches. No logic lives here.

Each stage module exposes `add_arguments(parser)` and `main(args) -> int`; it is imported only when its
subcommand runs, so `sparsify --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading

from sparsify.version import __version__
from sparsify.errors import SparsifyError, Stopped

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "convert": ("sparsify.folder.convert", "turn a SiLU-gated checkpoint (Hub id, folder, .gguf) into a ReLU model folder"),
    "gendata": ("sparsify.train.gendata", "sample training text from the original model (teacher data for finetune)"),
    "finetune": ("sparsify.train.finetune", "continued pretraining of the ReLU model (L1 penalty or thresholded gate) to a zeros target"),
    "eval": ("sparsify.evaluation.evaluate", "accuracy, perplexity, sparsity and speed reports for one or more models"),
    "synth": ("sparsify.folder.synth", "a random-weight model folder of any config at a chosen sparsity (speed, not quality)"),
    "bench": ("sparsify.evaluation.bench", "end-to-end generation speed (time to first token, decode tokens/s), "
              "dense vs sparse, on a CUDA GPU or (--device cpu) the CPU"),
    "push": ("sparsify.folder.push", "upload a model folder to the Hugging Face Hub with a model card"),
    "demo": ("sparsify.demo", "the whole pipeline offline on the embedded SmolLM2-135M"),
}


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `sparsify` parser and its subcommand parsers (only the chosen one has its arguments)."""
    parser = argparse.ArgumentParser(
        prog="sparsify",
        description="Make existing SiLU-gated LLMs activation-sparse and fast. "
        "Pipeline: convert -> finetune -> eval -> push.",
    )
    parser.add_argument("--version", action="version", version=f"sparsify {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # import only the module that will run
            importlib.import_module(module).add_arguments(p)
            p.set_defaults(_module=module)
    return parser, sub.choices


def parse(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """Options may come before, between or after a command's positionals (`finetune r.yaml --resume
    train.max_steps=3`): the command's own parser parses intermixed; top-level options go before the command."""
    parser, commands = build_parser(argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    if chosen not in commands:
        return parser, parser.parse_args(argv)  # no command, or argparse's "invalid choice" with the list
    at = argv.index(chosen)
    parser.parse_args(argv[:at])  # --version, --help
    args = commands[chosen].parse_intermixed_args(argv[at + 1:])
    args.command = chosen
    return parser, args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, args = parse(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    installed, previous = _terminate_like_ctrl_c()
    try:
        return int(importlib.import_module(args._module).main(args) or 0)
    except Stopped as e:  # a command that caught the signal itself and kept its work (finetune's checkpoint)
        print(f"sparsify {args.command}: {_stopped_by(e.signum)}; {e}", file=sys.stderr)
        return e.exit_code
    except SparsifyError as e:
        print(f"sparsify {args.command}: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except (KeyboardInterrupt, Terminated) as e:
        signum = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
        note = getattr(e, "note", None) or "nothing was left half-written."  # a command's own word on what it kept
        print(f"sparsify {args.command}: {_stopped_by(signum)}; {note}", file=sys.stderr)
        return 128 + signum
    finally:
        if installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _stopped_by(signum: int) -> str:
    """One wording for every command: what stopped it (the exit code is 128 + signum either way)."""
    return "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted"


class Terminated(BaseException):
    """SIGTERM, raised where the program is, so output being written is cleaned up as after Ctrl-C."""


def _raise_terminated(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM (Slurm and torchrun both send one)
    raise Terminated                                # must not cut the cleanup short; SIGKILL still ends it


def _child_default() -> None:
    """A forked child (a worker pool) dies on SIGTERM as usual, instead of raising Terminated in the worker."""
    if signal.getsignal(signal.SIGTERM) is _raise_terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


os.register_at_fork(after_in_child=_child_default)


def _terminate_like_ctrl_c() -> tuple[bool, object]:
    """SIGTERM raises Terminated (default: the process dies at once, leaving temporary folders behind); returns
    (installed, the handler to put back). Not installed off the main thread (handlers cannot be set there) or
    where SIGTERM is ignored (the parent asked for that). finetune's training loop sets its own handler, which
    stops at a step boundary with a checkpoint. A process blocked in C (an NCCL collective) runs the handler
    only when it returns to Python: torchrun's agent SIGKILLs its workers 30 s after SIGTERM."""
    if threading.current_thread() is not threading.main_thread():
        return False, None
    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        return False, None
    return True, signal.signal(signal.SIGTERM, _raise_terminated)


if __name__ == "__main__":
    sys.exit(main())
