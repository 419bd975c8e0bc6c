"""sparsify: make existing SiLU-gated LLMs activation-sparse (ReLU + L1) and fast (TwELL kernels).

Stages, each a folder in and a folder out:
    checkpoint -> convert -> finetune -> eval -> push
"""

__version__ = "0.1.0"

# `sparsify.folder.convert` is the function (the one the CLI calls). Importing it here, eagerly, rebinds the
# package attribute from the submodule to the function; `from sparsify.folder.convert import x` still finds the
# module in sys.modules. The module imports no torch/transformers at import time, so this stays cheap.
from sparsify.folder.convert import convert  # noqa: E402

__all__ = ["__version__", "convert"]
