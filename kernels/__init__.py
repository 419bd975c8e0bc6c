"""TwELL sparse-FFN kernels, importable as `sparsify.kernels` (never as a top-level `kernels`).

Files here are flat and self-contained (torch, optional triton, stdlib, `from .sibling import x`) so the
export can copy them next to modeling_sparsify.py. Public API: `twell_ffn`, `last_backend`,
`transpose_down`; layout and oracle in twell_reference.py.
"""

from .twell_ops import last_backend, transpose_down, twell_ffn
from .twell_reference import TwellPacked, ffn_reference, twell_pack, twell_unpack

__all__ = ["twell_ffn", "last_backend", "transpose_down", "TwellPacked", "ffn_reference", "twell_pack", "twell_unpack"]
