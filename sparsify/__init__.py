"""sparsify: make existing SiLU-gated LLMs activation-sparse (ReLU, then L1 or a gate threshold) and fast (TwELL).

Stages, each a folder in and a folder out:
    checkpoint -> convert -> finetune -> eval -> push
"""

from sparsify.version import __version__

__all__ = ["__version__", "convert"]


def __getattr__(name: str):
    """`sparsify.convert(src, out)`, the convert stage's function (the one the CLI calls), imported on first use:
    `python -m sparsify.<module>` then runs that module fresh, not a copy already imported by the package."""
    if name == "convert":
        from sparsify.folder.convert import convert

        return convert
    raise AttributeError(f"module 'sparsify' has no attribute {name!r}")
