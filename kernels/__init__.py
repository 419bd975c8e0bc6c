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
        """Replace this module in sys.modules by the package `name` found anywhere but this repository's root,
        and run it there: the import statement that reached this file returns that package. Nothing found:
        this module stays, empty. The real package's own import errors propagate unchanged."""
        import importlib.machinery
        import importlib.util
        import os
        import sys

        ours = os.path.dirname(os.path.realpath(__file__))
        root = os.path.dirname(ours)

        def elsewhere(entry: object) -> bool:
            if not isinstance(entry, str):
                return False
            try:
                return os.path.realpath(entry or os.getcwd()) != root
            except OSError:  # a working directory that was removed
                return False

        path = [p for p in sys.path if elsewhere(p)]
        for finder in sys.meta_path:  # the path finder over sys.path without the root; then any other finder
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(name, path if finder is importlib.machinery.PathFinder else None)
            origin = spec and (spec.origin or next(iter(spec.submodule_search_locations or ()), None))
            if spec is None or spec.loader is None or not origin:
                continue
            if os.path.dirname(os.path.realpath(origin)) == ours or os.path.realpath(origin) == ours:
                continue  # ourselves again (another path to this folder)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # the import system returns what sys.modules holds after this file ran
            spec.loader.exec_module(module)
            return

    if __name__ == "kernels":
        _hand_over(__name__)
    del _hand_over
    __all__ = []
