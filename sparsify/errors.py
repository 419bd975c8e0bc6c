"""User-facing errors: the CLI prints the message as one paragraph and exits 2, without a traceback."""

from __future__ import annotations


class SparsifyError(Exception):
    """A problem with the user's input or environment, with a message that says how to fix it."""


def import_failure(e: BaseException) -> str | None:
    """A sentence naming the failed import when `e`, or an exception it was raised from, is an ImportError;
    None otherwise. Loaders that catch every exception while reading a checkpoint put this first, so that a
    broken Python environment is never reported as a corrupt file."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ImportError):
            first = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            module = e.name or "a module"
            where = f" (found at {e.path})" if e.path else ""
            return (f"an import failed, so this is a problem with the Python environment, not with the file: "
                    f"{type(e).__name__}: {first}. Check that `python -c \"import {module}\"` works here{where}; "
                    f"a folder named {module.split('.')[0]!r} in the current directory can hide the installed "
                    "package, and a missing one installs with pip.")
        e = e.__cause__ or e.__context__
    return None
