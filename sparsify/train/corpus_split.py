"""Split a folder of text files into training and held-out parts, for data.train / data.heldout.

    python -m sparsify.train.corpus_split /tmp/corpus/text /tmp/corpus/split --heldout 0.02

writes OUT/train/NAME.txt and OUT/heldout/NAME.txt for every SRC/NAME.txt: the held-out part is whole lines
from the END of each file (a `fraction` of its characters, at least `min_chars`), so a domain's held-out text
is contiguous and shares no line with its training text. Then, in a recipe:

    data:
      train: [/tmp/corpus/split/train/*.txt]
      heldout: {general: [/tmp/corpus/split/heldout/*.txt]}

The output folder is written beside itself and renamed into place (a killed run leaves nothing half
written), and a second run with the same files and settings does nothing (OUT/split.json records them).
Standard library only, so it runs before the package's dependencies are installed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path

MIN_CHARS = 4096  # held-out characters per file at least: below that a domain's perplexity is noise


class SplitError(ValueError):
    """A file too short to split, or a source folder without .txt files."""


def split_text(text: str, fraction: float, min_chars: int = MIN_CHARS) -> tuple[str, str]:
    """(training part, held-out part) of `text`: the held-out part is the fewest whole lines from the end that
    hold max(min_chars, fraction * len(text)) characters. Raises SplitError when that is over half the text."""
    want = max(min_chars, math.ceil(fraction * len(text)))
    cut = text.rfind("\n", 0, len(text) - want) + 1 if want < len(text) else 0  # a line start, <= len - want
    if cut == 0 or len(text) - cut > len(text) // 2:
        raise SplitError(f"{len(text)} characters: holding out {want} of them as whole lines from the end would "
                         "leave less than half for training")
    return text[:cut], text[cut:]


def split_corpus(src: str | os.PathLike, out: str | os.PathLike, fraction: float = 0.02,
                 min_chars: int = MIN_CHARS) -> dict[str, tuple[int, int]]:
    """Writes OUT/train/NAME.txt and OUT/heldout/NAME.txt for each SRC/NAME.txt (see the module docstring).

    Returns {NAME: (training characters, held-out characters)}. Does nothing when OUT was split from the same
    files (size and modification time) with the same settings; otherwise replaces OUT as a whole.

    Raises:
        SplitError: SRC holds no .txt file, or one is too short to split (it names the file and the fix).
    """
    if not 0 < fraction < 0.5:
        raise SplitError(f"--heldout {fraction}: must be in (0, 0.5)")
    src, out = Path(src), Path(out)
    files = sorted(src.glob("*.txt"))
    if not files:
        raise SplitError(f"{src}: no .txt file to split")
    record = {"fraction": fraction, "min_chars": min_chars,
              "files": {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}}
    try:
        previous = json.loads((out / "split.json").read_text())
    except (OSError, ValueError):
        previous = None
    written = all((out / part / f.name).is_file() for part in ("train", "heldout") for f in files)
    if previous and {k: previous.get(k) for k in record} == record and written:
        return {k: tuple(v) for k, v in previous["chars"].items()}
    from sparsify.folder.format import atomic_dir  # tmp folder beside OUT, renamed over it on success, removed on failure

    with atomic_dir(out, overwrite=True, flag="OUT", kind="split") as tmp:
        (tmp / "train").mkdir()
        (tmp / "heldout").mkdir()
        chars = {}
        for f in files:
            text = f.read_text(encoding="utf-8")
            try:
                train, heldout = split_text(text, fraction, min_chars)
            except SplitError as err:
                raise SplitError(f"{f}: {err}; lower --min-chars, or move the file out of {src}") from None
            (tmp / "train" / f.name).write_text(train, encoding="utf-8")
            (tmp / "heldout" / f.name).write_text(heldout, encoding="utf-8")
            chars[f.stem] = (len(train), len(heldout))
        manifest = [m for m in (src / "MANIFEST.tsv", src.parent / "MANIFEST.tsv") if m.is_file()]
        if manifest:  # get-corpus.sh's origin and licence of each file (ROOT/MANIFEST.tsv beside ROOT/text)
            shutil.copy2(manifest[0], tmp / "MANIFEST.tsv")
        (tmp / "split.json").write_text(json.dumps({**record, "source": str(src.resolve()), "chars": chars}, indent=1))
    return chars


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparsify.train.corpus_split", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="folder of .txt files (e.g. /tmp/corpus/text from eval/corpus/get-corpus.sh)")
    parser.add_argument("out", help="output folder: OUT/train/*.txt and OUT/heldout/*.txt")
    parser.add_argument("--heldout", type=float, default=0.02, help="share of each file's characters held out "
                        "(default 0.02)")
    parser.add_argument("--min-chars", type=int, default=MIN_CHARS, help=f"held-out characters per file at least "
                        f"(default {MIN_CHARS})")
    args = parser.parse_args(argv)
    from sparsify.errors import SparsifyError

    try:
        chars = split_corpus(args.src, args.out, args.heldout, args.min_chars)
    except (SplitError, SparsifyError) as err:  # SparsifyError: OUT is a folder of other files (atomic_dir)
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name, (train, heldout) in sorted(chars.items()):
        print(f"{name:40s} {train:>12,d} train {heldout:>10,d} held-out characters")
    total = sum(h for _, h in chars.values())
    print(f"{len(chars)} files -> {args.out}/train, {args.out}/heldout ({total:,d} held-out characters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
