"""TwELL sparse-FFN kernels and the modeling bundle, importable as `sparsify.kernels` (never as `kernels`).

Every flat file here except this one is copied as it is into each model folder (sparsify.folder.format:
shipped_code_files); kernels/NOTES.md lists them. Public API: `twell_ffn`, `last_backend`,
`transpose_down`; layout and oracle in twell_reference.py.
"""

from .twell_ops import last_backend, transpose_down, twell_ffn
from .twell_reference import TwellPacked, ffn_reference, twell_pack, twell_unpack

__all__ = ["twell_ffn", "last_backend", "transpose_down", "TwellPacked", "ffn_reference", "twell_pack", "twell_unpack"]
