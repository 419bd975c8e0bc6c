"""The README read top to bottom: every example reads only folders that an example above it writes (its
"Loading a model folder" snippet read out/relu, which only the convert section below it makes: issue 32)."""

import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
OUTPUTS = ("out/", "runs/", "report/", "data/", "sparsify-demo/")  # where the examples write (git-ignored)
WRITE_FLAGS = ("-o", "--output", "--out")


def commands(text: str) -> list[list[str]]:
    """The words of each command in the bash and python blocks, in order: a bash line's continuation lines joined,
    comments dropped, split at && ; and |; a python line's words are its string literals."""
    found = []
    for lang, body in re.findall(r"```(bash|python)\n(.*?)```", text, flags=re.S):
        for line in body.replace("\\\n", " ").splitlines():
            if lang == "python":
                found.append(re.findall(r'"([^"]*)"', line.split("#")[0]))
                continue
            command: list[str] = []
            for word in shlex.split(line, comments=True) + ["&&"]:
                if word in ("&&", "||", ";", "|"):
                    found.append(command)
                    command = []
                else:
                    command.append(word)
    return [c for c in found if c]


def reads_and_writes(words: list[str]) -> tuple[list[str], list[str]]:
    """The output folders a command reads (its NAME=PATH or PATH arguments) and writes (-o/--out/output.dir, and
    `sparsify demo`'s default folder)."""
    writes = [b for a, b in zip(words, words[1:]) if a in WRITE_FLAGS]
    writes += [w.split("=", 1)[1] for w in words if w.startswith("output.dir=")]
    if words[:2] == ["sparsify", "demo"] and not writes:
        writes.append("sparsify-demo")
    paths = [w.split("=", 1)[1] if re.match(r"^\w+=", w) else w for w in words]
    reads = [p for p in paths if p.startswith(OUTPUTS) and p not in writes]
    return reads, writes


def unmade_reads(text: str) -> list[str]:
    made, missing = [], []
    for words in commands(text):
        reads, writes = reads_and_writes(words)
        missing += [f"{p} ({' '.join(words)[:60]}...)" for p in reads
                    if not any(Path(p) == Path(m) or Path(m) in Path(p).parents for m in made)]
        made += writes
    return missing


def test_every_readme_example_reads_only_what_an_example_above_it_writes():
    assert unmade_reads(README.read_text()) == []


def test_the_check_sees_a_folder_read_before_it_is_made():
    text = ('```python\nload("out/relu")\n```\n\n```bash\nsparsify convert x -o out/relu\n'
            'sparsify eval a=out/relu b=sparsify-demo/ft/model --out report/\n```\n')
    assert [m.split(" ")[0] for m in unmade_reads(text)] == ["out/relu", "sparsify-demo/ft/model"]
    made = '```bash\nsparsify demo\nsparsify push sparsify-demo/ft/model --dry-run\n```\n'
    assert unmade_reads(made) == []
