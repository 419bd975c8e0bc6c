"""Atomic folder output, for every stage: a folder is built beside OUT and renamed to OUT only when complete, and
an existing OUT is refused unless the caller asks to replace it, and even then unless it is empty or of the kind
the caller writes (`kind`, required of every caller: KINDS, a (description, test) pair, or None for the toolkit's own
internal paths); the current folder, any folder above it and the home folder are never replaced. sparsify.folder.format
re-exports both (this module imports nothing of the toolkit but its errors and sources' config reader, so the report
writer can use it too)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from sparsify.errors import SparsifyError
from sparsify.sources import sparsify_section


# What an existing OUT must look like for --overwrite to replace it (the whole folder goes): the kind of folder the
# stage itself writes, or an empty one. None: the toolkit's own internal paths (token folders, checkpoints), no check.
KINDS = {
    "model": ("a model folder sparsify wrote (config.json with a 'sparsify' section)",
              lambda d: sparsify_section(d) is not None),
    "bench": ("a bench folder (bench.json)", lambda d: (d / "bench.json").is_file()),
    "report": ("an eval report", lambda d: True),  # report.check_report_output checks its files itself
    "split": ("a corpus split (split.json)", lambda d: (d / "split.json").is_file()),
}


Kind = str | tuple[str, Callable[[Path], bool]] | None


def check_output(out: str | os.PathLike, overwrite: bool = False, flag: str = "-o/--output", *, kind: Kind) -> None:
    """Refuses an output path that exists (unless `overwrite`) or is not a folder: call it before long work.
    `flag` is the option that named it, for the message. With `overwrite`, an existing folder is replaced only
    when it is empty or of `kind` (KINDS: what this stage writes), and never when it is the current folder, any
    folder above it or the home folder (refused first, with or without `overwrite`): --overwrite replaces the whole
    folder, so anything else in it would be lost."""
    out = Path(out).absolute()
    if not out.exists():
        return
    if not out.is_dir():
        raise SparsifyError(f"output path {out} exists and is not a folder; choose another {flag}.")
    real, cwd, home = out.resolve(), Path.cwd().resolve(), _home()
    if real == cwd or real in cwd.parents or real == home:  # before the --overwrite advice, which cannot work here
        where = "the current folder" if real == cwd else "the home folder" if real == home \
            else "a folder above the current one"
        raise SparsifyError(f"{flag} {out} is {where}, which is never replaced (--overwrite would replace the whole "
                            f"folder). Choose a folder of its own, e.g. {out / 'out'}.")
    if not overwrite:
        raise SparsifyError(f"output folder {out} already exists; pass --overwrite to replace it, "
                            f"or choose another {flag}.")
    if kind is None or not any(out.iterdir()):
        return
    what, ours = KINDS[kind] if isinstance(kind, str) else kind
    if not ours(out):
        entries = sorted(p.name for p in out.iterdir())
        listed = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise SparsifyError(f"{flag} {out} holds {listed}, and is not {what}: it would be replaced whole, "
                            f"deleting them. Choose another {flag}, or remove the folder yourself if it can go.")


def _home() -> Path | None:
    """The home folder, None where there is none (HOME unset and no passwd entry, as in a container run --user N)."""
    try:
        return Path.home().resolve()
    except (RuntimeError, KeyError, OSError):
        return None


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False, flag: str = "-o/--output", *,
               kind: Kind) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `out`; on success it replaces `out`, on any failure
    (exception, Ctrl-C) it is removed and `out` is left as it was. An existing `out` is refused unless
    `overwrite`, and then unless it is empty or of `kind` (check_output).

    Leftovers of a run killed with SIGKILL (`.NAME.tmp-*`, `.NAME.old-*` beside `out`) are removed on entry.
    """
    out = Path(out).absolute()
    check_output(out, overwrite, flag, kind=kind)
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in [*out.parent.glob(f".{out.name}.tmp-*"), *out.parent.glob(f".{out.name}.old-*")]:
        if _is_dead_leftover(stale):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        yield tmp
        _normal_permissions(tmp)
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _is_dead_leftover(path: Path) -> bool:
    """True for a `.NAME.tmp-PID-*` / `.NAME.old-PID` folder whose process no longer runs (a killed run's)."""
    tag = path.name.split(".tmp-", 1)[1] if ".tmp-" in path.name else path.name.split(".old-", 1)[1]
    try:
        pid = int(tag.split("-", 1)[0])
    except ValueError:
        return False  # not one of ours: leave it alone
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename tmp to out; an existing out is moved aside first and moved back if the second rename fails."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _normal_permissions(folder: Path) -> None:
    """mkdtemp (and transformers' temp-file writes) leave 0700/0600; give what a plain copy would get."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)
