"""The version of sparsify: one home, read by the package, the folders it writes and pyproject.toml."""

__version__ = "0.1.0"
