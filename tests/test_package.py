"""Packaging invariants: kernels only as sparsify.kernels; model-folder code flat and self-contained."""

import ast
import subprocess
import sys

from sparsify.folder.format import shipped_code_files

ALLOWED = {"torch", "triton", "transformers", "__future__", "math", "os", "typing", "dataclasses", "functools",
           "logging", "warnings", "itertools", "collections", "enum", "contextlib", "json", "time", "re", "sys",
           "types"}  # the standard library modules the bundle uses (the brief: torch, transformers, stdlib, siblings)


def test_kernels_importable_only_as_sparsify_kernels(tmp_path):
    """Outside the repo root, our kernels/ folder must not be reachable as a top-level `kernels`."""
    code = ("import importlib.util, pathlib, sparsify.kernels as k; s = importlib.util.find_spec('kernels'); "
            "ours = pathlib.Path(k.__file__).parent; "
            "print('clash' if s and s.origin and pathlib.Path(s.origin).parent == ours else 'ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout.strip() == "ok", out.stderr


def test_shipped_code_is_flat_and_self_contained():
    files = shipped_code_files()
    names = {f.name for f in files}
    assert "modeling_sparsify.py" in names and "twell_ops.py" in names
    assert "twell_train.py" not in names  # fine-tuning kernels stay in the package, not in model folders
    problems = []
    for f in files:
        tree = ast.parse(f.read_text())
        guarded = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for n in ast.walk(t)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                if node.level != 1 or node.module is None or "." in node.module or f"{node.module}.py" not in names:
                    problems.append(f"{f.name}:{node.lineno} relative import must be `from .sibling import x`")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                # inside try blocks too: only triton is optional, nothing else may be imported at all
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                allowed = ALLOWED if id(node) in guarded else ALLOWED - {"triton"}
                problems += [f"{f.name}:{node.lineno} imports {m}" for m in mods if m.split(".")[0] not in allowed]
    assert not problems, "\n".join(problems)


def test_cli_help_lists_every_stage():
    out = subprocess.run([sys.executable, "-m", "sparsify", "--help"], capture_output=True, text=True).stdout
    for cmd in ("convert", "finetune", "eval", "push", "demo"):
        assert cmd in out
    out = subprocess.run([sys.executable, "-m", "sparsify", "convert", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--overwrite" in out.stdout and "--dtype" in out.stdout


def test_cli_options_may_come_between_and_after_positionals(capsys):
    """`finetune r.yaml --resume train.max_steps=3 -q` is one command line (argparse alone stops the overrides at
    the first option); eval's models around its options too; a bad command still lists the good ones."""
    import pytest

    from sparsify.cli import parse

    _, args = parse(["finetune", "r.yaml", "--resume", "train.max_steps=3", "-q", "train.lr=1e-4"])
    assert (args.command, args.recipe, args.overrides, args.resume, args.quiet) == \
        ("finetune", "r.yaml", ["train.max_steps=3", "train.lr=1e-4"], True, True)
    _, args = parse(["eval", "a", "--limit", "5", "b"])
    assert (args.models, args.limit) == (["a", "b"], 5)
    with pytest.raises(SystemExit):
        parse(["finetun", "r.yaml"])
    assert "invalid choice: 'finetun'" in capsys.readouterr().err


def test_sigterm_cleans_up_like_ctrl_c_and_exits_143(tmp_path, monkeypatch, capsys):
    """SIGTERM (a scheduler's stop, `kill`) mid-write leaves no temporary folder beside the output; the exit code
    says which signal; the previous handler is put back."""
    import importlib
    import os
    import signal
    import time

    from sparsify.cli import main
    from sparsify.folder.format import atomic_dir

    def writing(args):
        with atomic_dir(tmp_path / "out") as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # the handler raises in here
        return 0

    monkeypatch.setattr(importlib.import_module("sparsify.folder.convert"), "main", writing)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["convert", "src", "-o", str(tmp_path / "out")]) == 128 + signal.SIGTERM
    assert "terminated (SIGTERM); nothing was left half-written" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == before
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a parent that asked for SIGTERM to be ignored keeps that
    try:
        monkeypatch.setattr(importlib.import_module("sparsify.folder.convert"), "main", lambda args: 0)
        assert main(["convert", "src", "-o", str(tmp_path / "out")]) == 0
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


def test_sparsify_convert_is_the_function(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    import sparsify
    from sparsify.folder.convert import check_safetensors  # the module stays importable

    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, bos_token_id=1,
                                 eos_token_id=2)).save_pretrained(tmp_path / "src")
    assert callable(sparsify.convert) and callable(check_safetensors)
    out = sparsify.convert(tmp_path / "src", tmp_path / "out", progress=False)
    assert (out / "modeling_sparsify.py").is_file()


def test_sigterm_handler_is_one_shot_and_not_inherited_by_forked_workers():
    import os
    import signal
    import time

    import pytest

    from sparsify import cli

    before = signal.getsignal(signal.SIGTERM)
    installed, previous = cli._terminate_like_ctrl_c()
    try:
        assert installed and signal.getsignal(signal.SIGTERM) is cli._raise_terminated
        pid = os.fork()
        if pid == 0:  # a pool worker: SIGTERM must end it the default way, not raise in it
            os._exit(0 if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL else 1)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        with pytest.raises(cli.Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # the handler raises in here
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # a second one cannot cut the cleanup short
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else before)
