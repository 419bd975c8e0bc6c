"""The house rules of issue 20, checked on the source: imports flow one way (cli -> stage -> its parts -> shared
helpers), files stay small enough to read, the package top level stays short, the shipped modeling file holds
only model code. And the tests' own rules: they drive public behaviour (few references to project-private
names), share code through helper modules (no test module imports another), and only this file reads source."""

import ast
from pathlib import Path

from sparsify.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sparsify"
KERNELS = ROOT / "kernels"
ENTRY = {module for module, _ in COMMANDS.values()}  # the stage modules the CLI dispatches to
ON_TOP = {"sparsify", "sparsify.cli", "sparsify.__main__", "sparsify.demo"}  # may import stages (demo runs them)
MAX_LINES = 700
TESTS = ROOT / "tests"
MAX_PRIVATE_REFERENCES = 25  # references to project-private names in the tests (this file aside)


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


BUNDLE_IMPORTS = {"torch", "triton", "transformers", "__future__", "math", "os", "typing", "dataclasses", "functools",
                  "logging", "warnings", "itertools", "collections", "enum", "contextlib", "json", "time", "re", "sys",
                  "types", "weakref"}  # the standard library modules the bundle uses (torch, transformers, stdlib, siblings)
FFN_FILES = ("ffn_runtime", "twell_ops", "dispatch", "modeling_sparsify", "decode_capture", "fast_decode")


def test_shipped_code_is_flat_and_self_contained():
    """Every file a model folder ships imports only its siblings (`from .sibling import x`), torch, transformers
    and the standard library; triton only inside a try block."""
    from sparsify.folder.format import shipped_code_files

    files = shipped_code_files()
    names = {f.name for f in files}
    assert "modeling_sparsify.py" in names and "twell_ops.py" in names
    assert "twell_train.py" not in names  # fine-tuning kernels stay in the package, not in model folders
    problems = []
    for f in files:
        tree = ast.parse(f.read_text())
        guarded = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for n in ast.walk(t)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                if node.level != 1 or node.module is None or "." in node.module or f"{node.module}.py" not in names:
                    problems.append(f"{f.name}:{node.lineno} relative import must be `from .sibling import x`")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                # inside try blocks too: only triton is optional, nothing else may be imported at all
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                allowed = BUNDLE_IMPORTS if id(node) in guarded else BUNDLE_IMPORTS - {"triton"}
                problems += [f"{f.name}:{node.lineno} imports {m}" for m in mods if m.split(".")[0] not in allowed]
    assert not problems, "\n".join(problems)


def test_the_bundle_rebinds_no_global():
    """No file of the bundle rebinds module state (`global x`, or `X += ...` at module level): the registry is the
    one process-wide store (its mutable values: tests/kernels/test_ffn_runtime.py)."""
    from sparsify.folder.format import shipped_code_files

    bad = {}
    for f in shipped_code_files():
        tree = ast.parse(f.read_text())
        found = [f"global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
        found += [ast.unparse(n) for n in tree.body if isinstance(n, ast.AugAssign)]
        if found:
            bad[f.name] = found
    assert not bad, bad


def test_sparse_mlp_forward_is_one_call_into_the_runtime():
    tree = ast.parse((KERNELS / "modeling_sparsify.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SparseMLP"]
    (forward,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward"]
    first = min([d.lineno for d in forward.decorator_list] + [forward.lineno])
    assert forward.end_lineno - first + 1 <= 10, ast.unparse(forward)
    calls = [n for n in ast.walk(forward) if isinstance(n, ast.Call)]
    assert [ast.unparse(c.func) for c in calls] == ["self.runtime.ffn"]


def test_ffn_backends_are_declared_once():
    def declares(name: str) -> bool:
        tree = ast.parse((KERNELS / f"{name}.py").read_text())
        return any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "BACKENDS" for t in n.targets)
                   for n in tree.body)

    assert [name for name in FFN_FILES if declares(name)] == ["ffn_runtime"]


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


# ------------------------------------------------------------------------------------------ the tests' rules
def is_private(name: str) -> bool:
    """One leading underscore (or two, name-mangled), not a dunder."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _string_args(call: ast.Call) -> list[str]:
    return [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]


def _is_attr_call(call: ast.Call, names: tuple[str, ...]) -> bool:
    """getattr(...)-style builtins and monkeypatch.setattr(...)-style methods of those names."""
    f = call.func
    return (isinstance(f, ast.Name) and f.id in names) or (isinstance(f, ast.Attribute) and f.attr in names)


def defined_private_names(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, assigned names and attributes (self._x = ...), import
    aliases, and attributes set by name (setattr(obj, "_x", v), obj.__dict__["_x"] = v)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and isinstance(node.slice, ast.Constant):
            names.add(str(node.slice.value))
        elif isinstance(node, ast.Call) and _is_attr_call(node, ("setattr",)):
            names.update(_string_args(node)[:1])
    return {n for n in names if is_private(n)}


def project_private_names() -> set[str]:
    return set().union(*(defined_private_names(ast.parse(p.read_text())) for p in sources().values()))


def private_references(tree: ast.AST, private: set[str]) -> list[tuple[int, str]]:
    """(line, name) for each attribute access (obj._x, getattr(obj, "_x"), monkeypatch.setattr(obj, "_x", v) or
    monkeypatch.setattr("pkg.mod._x", v)) or import (from sparsify.m import _x) of a name in `private`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("sparsify", "kernels"):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Call) and _is_attr_call(node, ("getattr", "setattr", "hasattr", "delattr")):
            names = [s.rsplit(".", 1)[-1] for s in _string_args(node)]
        else:
            continue
        found += [(node.lineno, n) for n in names if n in private]
    return sorted(found)


def parsed_tests() -> dict[str, ast.AST]:
    """Every Python file under tests/ but this one, parsed, by its path relative to the repository."""
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text()) for p in sorted(TESTS.rglob("*.py"))
            if p.resolve() != Path(__file__).resolve()}


def imported_test_modules(tree: ast.AST, name: str) -> list[str]:
    """Test modules (test_*.py, or a conftest) that the module `name` (dotted) imports, resolved."""
    package = name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found += [t for t in targets if t.rsplit(".", 1)[-1].startswith("test_") or t.rsplit(".", 1)[-1] == "conftest"]
    return sorted(set(found))


def _mentions_source_file(expr: ast.AST, tainted: set[str], direct: bool = False) -> bool:
    """`expr` spells a .py path: a ".py" string, shipped_code_files(), a name bound from one, or (`direct`: the
    expression read itself) a module's __file__ not walked up from (.parent)."""
    nodes = list(ast.walk(expr))
    edits = {id(a) for n in nodes if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr in ("replace", "removesuffix", "endswith") for a in n.args}  # a suffix, not a path
    up = any(isinstance(n, ast.Attribute) and n.attr in ("parent", "parents") for n in nodes)
    return any((isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.endswith(".py")
                and id(n) not in edits)
               or (isinstance(n, ast.Name) and n.id in tainted)
               or (direct and not up and isinstance(n, ast.Attribute) and n.attr == "__file__")
               or (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "shipped_code_files")
               for n in nodes)


def source_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, call) for each reading of Python source: inspect.getsource*/getsourcelines, ast.parse, and the text
    of a .py file (read_text, read_bytes or open on a path spelled with ".py", __file__ or shipped_code_files(),
    or a name bound from one, e.g. `for path in DIR.glob("*.py")`)."""
    tainted: set[str] = set()
    for _ in range(2):  # names bound from a .py path; twice, so that a name bound from such a name is seen too
        for node in ast.walk(tree):
            if isinstance(node, (ast.For, ast.comprehension)) and _mentions_source_file(node.iter, tainted):
                tainted |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
            elif isinstance(node, ast.Assign) and _mentions_source_file(node.value, tainted):
                tainted |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        call = ast.unparse(f)
        if call == "ast.parse" or call.split(".")[-1] in ("getsource", "getsourcelines", "getsourcefile") or (
                call == "compile" and any(_mentions_source_file(a, tainted) for a in node.args)):
            found.append((node.lineno, call))
        elif isinstance(f, ast.Attribute) and f.attr in ("read_text", "read_bytes", "open") and \
                _mentions_source_file(f.value, tainted, direct=True):
            found.append((node.lineno, call))
        elif call == "open" and node.args and _mentions_source_file(node.args[0], tainted, direct=True):
            found.append((node.lineno, call))
    return sorted(found)


def test_tests_drive_public_behaviour():
    """Tests go through what a user calls: at most MAX_PRIVATE_REFERENCES references to names the package or
    the kernel bundle keep private (where a test needs one, a user likely does too: make it public)."""
    private = project_private_names()
    refs = [f"{path}:{line} {name}" for path, tree in parsed_tests().items()
            for line, name in private_references(tree, private)]
    assert len(refs) <= MAX_PRIVATE_REFERENCES, f"{len(refs)} references to private names:\n" + "\n".join(refs)


def test_no_test_module_imports_another():
    """Shared fixtures and helpers live in helper modules (tests/tiny.py, tests/*/helpers.py, conftest.py)."""
    bad = {}
    for path, tree in parsed_tests().items():
        name = ".".join(Path(path).with_suffix("").parts)
        if found := imported_test_modules(tree, name):
            bad[path] = found
    assert not bad, bad


def test_only_the_house_rules_read_source():
    """A test checks what code does; rules about how it is written live here."""
    bad = {path: found for path, tree in parsed_tests().items() if (found := source_reads(tree))}
    assert not bad, bad


def test_the_checks_see_private_names_test_imports_and_source_reads():
    """The checkers themselves, on small synthetic modules."""
    lib = ast.parse("import os as _os\nclass _A:\n    def __init__(self):\n        self._x = 1\n"
                    "def _f(): pass\nm.__dict__['_held'] = 1\nsetattr(m, '_set', 2)\nPUBLIC = 3\n__all__ = []\n"
                    "def _exit(): pass")
    assert defined_private_names(lib) == {"_os", "_A", "_x", "_f", "_held", "_set", "_exit"}
    test = ast.parse("from sparsify.m import _f, PUBLIC\nfrom os import _exit\nobj._x\nobj.__dict__\n"
                     "getattr(m, '_held')\nmonkeypatch.setattr('sparsify.m._set', 1)\nm._other\nm.PUBLIC")
    assert private_references(test, defined_private_names(lib)) == [(1, "_f"), (3, "_x"), (5, "_held"), (6, "_set")]
    assert {"_fast_decode", "_graphs"} <= project_private_names()  # held by name (model.__dict__), and self._x
    imports = ast.parse("from tests.tiny import TEXT\nfrom tests.folder.test_synth import TINY\n"
                        "from .test_finetune import metrics\nfrom . import helpers\nimport tests.train.test_data")
    assert imported_test_modules(imports, "tests.train.test_levers") == [
        "tests.folder.test_synth", "tests.train.test_data", "tests.train.test_finetune"]
    reads = ast.parse("import ast, inspect\ninspect.getsource(m)\nast.parse(text)\n(DIR / 'a.py').read_text()\n"
                      "for p in DIR.glob('*.py'):\n    p.read_text()\nPath(m.__file__).read_text()\n"
                      "(tmp / 'config.json').read_text()\nfor f in shipped_code_files():\n    open(f)\n"
                      "(Path(__file__).parent / 'data.txt').read_text()\n(out / name.replace('.py', '.json')).read_text()\n"
                      "files = DIR.glob('*.py')\ncopy = files\nfor c in copy:\n    c.read_bytes()")
    assert [line for line, _ in source_reads(reads)] == [2, 3, 4, 6, 7, 10, 16]
