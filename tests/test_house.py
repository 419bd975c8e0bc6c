"""The house rules of issue 20, checked on the source: imports flow one way (cli -> stage -> its parts -> shared
helpers), files stay small enough to read, the package top level stays short, the shipped modeling file holds
only model code."""

import ast
from pathlib import Path

from sparsify.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sparsify"
KERNELS = ROOT / "kernels"
ENTRY = {module for module, _ in COMMANDS.values()}  # the stage modules the CLI dispatches to
ON_TOP = {"sparsify", "sparsify.cli", "sparsify.__main__", "sparsify.demo"}  # may import stages (demo runs them)
MAX_LINES = 700


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = ("sparsify", "kernels", *rel.parts[1:]) if rel.parts[0] == "kernels" else rel.parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(parts)


def sources() -> dict[str, Path]:
    files = [*PACKAGE.rglob("*.py"), *KERNELS.rglob("*.py")]
    return {module_name(p): p for p in files}


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """sparsify modules imported anywhere in the file (functions included), resolved to known module names."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known}
    return found - {name}


def graph() -> dict[str, set[str]]:
    src = sources()
    return {name: imports_of(path, name, set(src)) for name, path in src.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert cycles(graph()) == []


def test_imports_never_go_back_up():
    """A stage's parts and the shared helpers never import a stage module (or the CLI); the kernels never
    import the toolkit (they are copied into model folders)."""
    bad = []
    for name, targets in graph().items():
        for t in sorted(targets):
            if name.startswith("sparsify.kernels") and not t.startswith("sparsify.kernels"):
                bad.append(f"{name} -> {t} (kernels are shipped: they import no sparsify module)")
            elif name not in ON_TOP and (t in ON_TOP - {"sparsify"} or (t in ENTRY and name not in ENTRY)):
                bad.append(f"{name} -> {t}")
    assert not bad, "imports back up:\n" + "\n".join(bad)


def test_files_stay_readable():
    long = {str(p.relative_to(ROOT)): n for p in sources().values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_package_top_level_is_short():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 10, top


def test_shipped_modeling_file_holds_model_code_only():
    lines = len((KERNELS / "modeling_sparsify.py").read_text().splitlines())
    assert lines < 300, f"modeling_sparsify.py has {lines} lines: decoding belongs in fast_decode.py"


def test_the_checks_see_a_circle_and_a_climb():
    """The checker itself: a two-module circle is found, and the real graph has edges to judge."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    edges = graph()
    assert "sparsify.train.finetune" in ENTRY and any(edges.values())
    assert "sparsify.errors" in edges["sparsify.folder.convert"]


def test_the_bundle_imported_as_a_top_level_kernels_registers_nothing():
    """With the repository root on sys.path, transformers' probe for the Hub's `kernels` package imports our
    kernels/ folder as `kernels`: that must not import the bundle (its op registration would win over the
    model's own copy, and compiled calls would run a dispatcher nobody reads)."""
    import subprocess
    import sys

    # (the Hub's own `kernels`, where installed, is handed the name: its submodules may load, never ours)
    code = ("import sys, pathlib, kernels, torch; from transformers.utils import import_utils as u; "
            "u.is_kernels_available.cache_clear(); u.is_kernels_available(); ours = pathlib.Path('kernels').resolve(); "
            "print(sorted(k for k, m in list(sys.modules.items()) if (k == 'kernels' or k.startswith('kernels.')) "
            "and getattr(m, '__file__', None) and pathlib.Path(m.__file__).resolve().parent == ours "
            "and pathlib.Path(m.__file__).name != '__init__.py'), "
            "[hasattr(getattr(torch.ops, 'sparsify', None), op) for op in ('ffn_2', 'ffn', 'twell_ffn')])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[] [False, False, False]"
