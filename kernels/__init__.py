"""TwELL sparse-FFN kernels and the modeling bundle, importable as `sparsify.kernels` (never as `kernels`).

Every flat file here except this one is copied as it is into each model folder (sparsify.folder.format:
shipped_code_files); kernels/NOTES.md lists them. Public API: `twell_ffn`, `last_backend`,
`transpose_down`; layout and oracle in twell_reference.py.

The name `kernels` belongs to the Hugging Face package on PyPI, which transformers imports for every model
class. Python started in the repository root (`python -m pytest`, `python -m sparsify`, `torchrun -m ...`, a
notebook) finds this folder first under that name; it then hands the import over to the installed `kernels`
distribution (`_hand_over`), so `import kernels` anywhere gives the real package. Where none is installed, the
top-level `kernels` stays an empty module without a version, which transformers reads as "not available".
"""

if __name__ == "sparsify.kernels":
    from .twell_ops import last_backend, transpose_down, twell_ffn
    from .twell_reference import TwellPacked, ffn_reference, threshold_act, twell_pack, twell_unpack

    __all__ = ["twell_ffn", "last_backend", "transpose_down", "TwellPacked", "ffn_reference", "twell_pack",
               "twell_unpack", "threshold_act"]
else:
    def _hand_over(name: str) -> None:
        """Replace this module in sys.modules by the package `name` found on sys.path past every copy of this
        bundle (this folder, or another checkout's kernels/ on the path too: each would hand over to the other
        for ever), and run it there: the import statement that reached this file returns that package. Nothing
        found: this module stays, empty. The real package's own import errors propagate unchanged."""
        import importlib.machinery
        import importlib.util
        import os
        import sys

        def bundle(origin: str | None) -> bool:  # a copy of this folder: our modeling file lies beside it
            folder = os.path.dirname(origin) if origin and origin.endswith(".py") else origin
            return bool(folder) and os.path.isfile(os.path.join(folder, "modeling_sparsify.py"))

        candidates = [(importlib.machinery.PathFinder, [entry]) for entry in sys.path if isinstance(entry, str)]
        candidates += [(f, None) for f in sys.meta_path if f is not importlib.machinery.PathFinder]
        for finder, path in candidates:  # sys.path entry by entry, then any other finder (editable installs)
            find = getattr(finder, "find_spec", None)
            try:
                spec = find(name, path) if find is not None else None
            except (ImportError, OSError, ValueError):  # a finder that cannot look there
                continue
            origin = spec and (spec.origin or next(iter(spec.submodule_search_locations or ()), None))
            if spec is None or spec.loader is None or not origin or bundle(os.path.realpath(origin)):
                continue
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # the import system returns what sys.modules holds after this file ran
            spec.loader.exec_module(module)
            return

    if __name__ == "kernels":
        _hand_over(__name__)
    del _hand_over
    __all__ = []
