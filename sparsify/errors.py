"""User-facing errors: the CLI prints the message as one paragraph and exits 2, without a traceback."""

from __future__ import annotations


class SparsifyError(Exception):
    """A problem with the user's input or environment, with a message that says how to fix it."""


class Stopped(SparsifyError):
    """Work stopped on a signal (SIGINT: Ctrl-C; SIGTERM) after keeping what it could; the message says what was kept
    and how to go on. The CLI words it as it words any interruption ("interrupted; ...") and exits 128 + signum."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


def import_failure(e: BaseException) -> str | None:
    """A sentence naming the failed import when `e`, or an exception it was raised from, is an ImportError;
    None otherwise. Loaders that catch every exception while reading a checkpoint put this first, so that a
    broken Python environment is never reported as a corrupt file. The innermost cause is named too: transformers
    wraps what went wrong under a lazy import ("Could not import module 'LlamaConfig'") in an ImportError of its own.
    """
    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    imports = [x for x in chain if isinstance(x, ImportError)]
    if not imports:
        return None
    first, root = imports[0], chain[-1]

    def line(x: BaseException) -> str:
        return f"{type(x).__name__}: " + (str(x).splitlines()[0][:300] if str(x) else "")

    named = next((x for x in imports if x.name), None)  # the module that failed to import, where one is named
    cause = f" (caused by {line(root)})" if root is not first else ""
    check = ""
    if named is not None:
        module = named.name
        where = f" (found at {named.path})" if named.path else ""
        check = (f" Check that `python -c \"import {module}\"` works here{where}; a folder named "
                 f"{module.split('.')[0]!r} in the current directory can hide the installed package, and a missing "
                 "one installs with pip.")
    return (f"an import failed, so this is a problem with the Python environment, not with the file: "
            f"{line(first)}{cause}.{check}")
