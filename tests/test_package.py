"""Packaging invariants: kernels only as sparsify.kernels; model-folder code importable flat (its imports: a house
rule, tests/test_house.py)."""

import importlib
import os
import subprocess
import sys
from pathlib import Path


def test_kernels_importable_only_as_sparsify_kernels(tmp_path):
    """Outside the repo root, our kernels/ folder must not be reachable as a top-level `kernels`."""
    code = ("import importlib.util, pathlib, sparsify.kernels as k; s = importlib.util.find_spec('kernels'); "
            "ours = pathlib.Path(k.__file__).parent; "
            "print('clash' if s and s.origin and pathlib.Path(s.origin).parent == ours else 'ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout.strip() == "ok", out.stderr


ROOT = Path(__file__).resolve().parents[1]


def _from_root(args, **kw):
    """Python started the way a user starts it in the repository root: the root is sys.path[0]."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | kw.pop("env", {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, **kw)


def test_repo_root_keeps_the_real_kernels_package_for_transformers():
    """transformers imports the Hub's `kernels` package for every model class; started in the repository root,
    Python finds our kernels/ folder first under that name. It must hand over to the installed distribution
    (`from kernels import CUDAProperties` gives the real one), or, where none is installed, read as absent."""
    code = """
import importlib.metadata as md, pathlib, sys
assert sys.path[0] in ("", str(pathlib.Path.cwd())), sys.path[0]
try:
    installed = md.version("kernels")
except md.PackageNotFoundError:
    installed = None
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils.import_utils import is_kernels_available
import kernels
ours = pathlib.Path("kernels").resolve()
here = pathlib.Path(kernels.__file__).resolve().parent
if installed:
    assert here != ours, f"the top-level kernels is this repository's folder, not kernels {installed}"
    assert getattr(kernels, "__version__", installed) == installed
    import sparsify.kernels as sk
    assert pathlib.Path(sk.__file__).resolve().parent == ours and hasattr(sk, "twell_ffn")
    assert "twell_ffn" not in vars(kernels)
else:
    assert not is_kernels_available() and not hasattr(kernels, "__version__")
LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1))
print("installed" if installed else "absent", transformers.__version__)
"""
    out = _from_root(["-c", code])
    assert out.returncode == 0, out.stderr[-3000:]
    case, _ = out.stdout.split()
    if case == "installed" and hasattr(importlib.import_module("kernels"), "CUDAProperties"):
        check = _from_root(["-c", "from kernels import CUDAProperties; print(CUDAProperties.__module__)"])
        assert check.returncode == 0 and check.stdout.startswith("kernels."), check.stderr[-2000:]
    cli = _from_root(["-m", "sparsify", "--help"])
    assert cli.returncode == 0 and "convert" in cli.stdout, cli.stderr[-2000:]
    tests = _from_root(["-m", "pytest", "-q", "--collect-only", "tests/test_package.py", "tests/folder"])
    assert tests.returncode == 0, (tests.stdout + tests.stderr)[-3000:]


def test_top_level_kernels_hands_over_to_another_package_of_that_name(tmp_path):
    """The hand-over itself, on a stand-in `kernels` package earlier on sys.path than site-packages: the import
    from the root gives that package, with its submodules, and its own import errors are not swallowed."""
    real = tmp_path / "site" / "kernels"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("from kernels._inner import CUDAProperties\n__version__ = '9.9'\n")
    (real / "_inner.py").write_text("class CUDAProperties: pass\n")
    code = ("import kernels, pathlib; from kernels import CUDAProperties; import kernels._inner as i; "
            "print(kernels.__version__, pathlib.Path(kernels.__file__).parent == pathlib.Path(i.__file__).parent)")
    out = _from_root(["-c", code], env={"PYTHONPATH": str(tmp_path / "site")})
    assert out.returncode == 0 and out.stdout.split() == ["9.9", "True"], out.stderr[-2000:]
    (real / "__init__.py").write_text("import no_such_module_xyz\n")
    out = _from_root(["-c", "import kernels"], env={"PYTHONPATH": str(tmp_path / "site")})
    assert out.returncode != 0 and "No module named 'no_such_module_xyz'" in out.stderr


def test_two_copies_of_the_bundle_on_the_path_do_not_hand_over_to_each_other(tmp_path):
    """Another checkout's kernels/ on sys.path too (a device script that puts two trees on PYTHONPATH): each copy
    would find the other first and hand over to it, for ever (RecursionError inside transformers' imports). Copies
    are skipped: with no real `kernels` (-S: no site-packages) the module stays one of ours, empty; with a real one
    after both copies on the path, that one is handed the name."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(ROOT / "kernels", other / "kernels")
    code = "import kernels, pathlib; print(pathlib.Path(kernels.__file__).parent.name, sorted(vars(kernels).get('__all__', ['?'])))"
    out = _from_root(["-S", "-c", code], env={"PYTHONPATH": str(other)})
    assert out.returncode == 0 and out.stdout.split() == ["kernels", "[]"], out.stderr[-2000:]
    real = tmp_path / "site" / "kernels"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("__version__ = '9.9'\n")
    out = _from_root(["-S", "-c", "import kernels; print(kernels.__version__)"],
                     env={"PYTHONPATH": f"{other}:{tmp_path / 'site'}"})
    assert out.returncode == 0 and out.stdout.strip() == "9.9", out.stderr[-2000:]


def test_a_broken_import_while_loading_is_named_as_such_not_as_a_corrupt_file(tmp_path, monkeypatch):
    """A loader that catches everything while reading a checkpoint says an import failed, naming the module."""
    import pytest
    import transformers

    from sparsify.errors import SparsifyError
    from sparsify.folder.gguf import load_gguf

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))

    def load_message(inner: BaseException, outer: BaseException) -> str:
        """load_gguf's error when transformers raises `outer` from `inner` while reading the file."""
        def raising(*args, **kwargs):
            try:
                raise inner
            except type(inner) as e:
                raise outer from e

        monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", raising)
        with pytest.raises(SparsifyError) as info:
            load_gguf(gguf)
        return str(info.value)

    msg = load_message(ImportError("cannot import name 'CUDAProperties' from 'kernels' (/x/kernels/__init__.py)",
                                   name="kernels", path="/x/kernels/__init__.py"),
                       RuntimeError("while building the model"))
    assert "an import failed" in msg and "'kernels'" in msg and "/x/kernels/__init__.py" in msg
    assert "corrupt" not in msg and "download it again" not in msg
    # transformers' lazy import hides the cause under an ImportError that names no module
    msg = load_message(RecursionError("maximum recursion depth exceeded"),
                       ModuleNotFoundError("Could not import module 'LlamaConfig'."))
    assert "Could not import module 'LlamaConfig'" in msg and "caused by RecursionError" in msg
    assert "a module" not in msg and "corrupt" not in msg


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
    _, args = parse(["finetune", "r.yaml"])
    assert args.overrides == []
    for argv in (["finetune"], ["finetune", "-q"]):  # the overrides are optional: only the recipe is named missing
        with pytest.raises(SystemExit):
            parse(argv)
        assert capsys.readouterr().err.strip().endswith("the following arguments are required: recipe")


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
        with atomic_dir(tmp_path / "out", kind=None) as tmp:
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
