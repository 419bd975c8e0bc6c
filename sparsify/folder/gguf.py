"""Reading GGUF checkpoints: dequantised through transformers into a model and its tokenizer.

Used by convert (a .gguf source) and by eval (a .gguf model evaluated as it is).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sparsify.errors import SparsifyError, import_failure
from sparsify.families import supported_list


@contextlib.contextmanager
def no_transformers_bars() -> Iterator[None]:
    """transformers' own progress bars off (loading, writing shards), the GGUF dequantising bar included: that
    one is a bare tqdm that ignores transformers' switch, so its module's tqdm is swapped for a disabled one."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bars, bar = hf_logging.is_progress_bar_enabled(), getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if bars:
            hf_logging.enable_progress_bar()


def _dequantized() -> dict:
    """from_pretrained's argument for a dense model with every weight unpacked at load (what convert saves and eval
    runs). Asked for outright (GgufConfig), transformers does not weigh keeping them packed, nor warn that a packed
    load is fastest in float32 "Pass `dtype=torch.float32`" (not an option of this CLI), even under -q; a
    transformers without GgufConfig unpacks them anyway."""
    import transformers

    config = getattr(transformers, "GgufConfig", None)
    return {"quantization_config": config(dequantize=True)} if config is not None else {}


def load_gguf(path: Path, dtype: str = "float32") -> tuple[Any, Any]:
    """(model, tokenizer) from a .gguf file, dequantised to `dtype` (a torch dtype name), ready to save.

    Bad magic, a missing `gguf` package or a file transformers cannot read become a SparsifyError.
    """
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise SparsifyError(f"{path} is not a GGUF file (bad magic bytes); check the file, or download it again.")
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF)
    except ImportError:
        raise SparsifyError("reading .gguf files needs the `gguf` package: pip install gguf") from None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:  # the config is passed on: each load parses the whole GGUF file, its vocabulary included
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                     dtype=getattr(torch, dtype), **_dequantized())
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:
        if (broken := import_failure(e)) is not None:
            raise SparsifyError(f"cannot read {path}: {broken}") from None
        msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        raise SparsifyError(f"cannot read {path} as a GGUF checkpoint ({msg}). The file may be truncated or "
                            "corrupt (download it again), or its architecture is not one transformers can "
                            f"dequantise. Supported families: {supported_list()}.") from None
    if getattr(model, "hf_quantizer", None) is not None:  # GGUF weights are already dequantised in memory
        model.hf_quantizer.remove_quantization_config(model)
    return model, tokenizer
