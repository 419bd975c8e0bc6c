"""TwELL sparse-FFN kernels, importable as `sparsify.kernels` (never as a top-level `kernels`)."""
