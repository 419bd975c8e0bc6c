"""sparsify: make existing SiLU-gated LLMs activation-sparse (ReLU + L1) and fast (TwELL kernels).

Stages, each a folder in and a folder out:
    checkpoint -> convert -> finetune -> eval -> push
"""

__version__ = "0.1.0"


def convert(*args, **kwargs):
    """See :func:`sparsify.convert.convert` (imported lazily: torch/transformers are slow to import)."""
    from .convert import convert as _convert

    return _convert(*args, **kwargs)
