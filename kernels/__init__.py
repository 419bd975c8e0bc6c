"""TwELL sparse-FFN kernels and the modeling bundle, importable as `sparsify.kernels` (never as `kernels`).

Every flat file here except this one is copied as it is into each model folder (sparsify.folder.format:
shipped_code_files); kernels/NOTES.md lists them. Public API: `twell_ffn`, `last_backend`,
`transpose_down`; layout and oracle in twell_reference.py.
"""

if __name__ == "sparsify.kernels":
    from .twell_ops import last_backend, transpose_down, twell_ffn
    from .twell_reference import TwellPacked, ffn_reference, twell_pack, twell_unpack

    __all__ = ["twell_ffn", "last_backend", "transpose_down", "TwellPacked", "ffn_reference", "twell_pack",
               "twell_unpack"]
else:
    # Imported as a top-level `kernels` (the repository root on sys.path): transformers probes for the Hub's
    # `kernels` package by importing that name. Importing nothing keeps that probe harmless: no stray copy of the
    # bundle under a name that belongs to another package registers the sparsify::twell_ffn op.
    __all__ = []
