"""Arrows point down: read from the source with ``ast``, the core imports no plugin, no two of the project's
modules import each other round a circle, and the transports use only the public transport contract. Sizes stay
small: no function in ``diffuse/`` over 80 lines or 8 parameters, no class over 250 lines, and the client's
stand-in (``standin.py``) and the node's stage (``stage.py``) each under 300 lines."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("diffuse", "analyzers", "transport")  # the distribution's packages (pyproject.toml)
# what a transport, built in or third-party, may import of Diffuse: the contract and nothing behind it
TRANSPORT_API = ("diffuse.wire.transport",)
# circles that exist today and have an open issue; any other circle fails. Remove an entry when its circle goes.
KNOWN_CIRCLES: set[frozenset] = set()
# the size limits: a function's lines and parameters (self and cls not counted), a class's lines, and the lines of
# the two modules a newcomer reads first
MAX_FUNCTION_LINES, MAX_PARAMETERS, MAX_CLASS_LINES, MAX_CORE_MODULE_LINES = 80, 8, 250, 300
CORE_MODULES = ("standin.py", "stage.py")
# functions and classes allowed over a limit, each with why it cannot be split: none today. An entry is
# "path:name" (path from the repository root); remove it when the code gets under the limit.
SIZE_EXCEPTIONS: dict[str, str] = {}


def module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p, ROOT): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def plugin_packages() -> dict[str, Path]:
    """The example plugins' own packages (plugins/NAME/PACKAGE/__init__.py), their tests left out."""
    return {init.parent.name: init.parent for init in sorted(ROOT.glob("plugins/*/*/__init__.py"))
            if init.parent.name != "tests"}


class Import:
    def __init__(self, target: str, line: int, typing_only: bool):
        self.target, self.line, self.typing_only = target, line, typing_only


@functools.lru_cache(maxsize=None)
def parsed(path: Path) -> tuple[str, ast.Module]:
    """A file's text and syntax tree, read once for every check here."""
    text = path.read_text()
    return text, ast.parse(text, str(path))


@functools.lru_cache(maxsize=None)
def imports(path: Path, name: str) -> list[Import]:
    """Every module ``path`` imports, wherever the import sits (module level, in a function, under
    ``TYPE_CHECKING``), relative imports resolved; ``importlib.import_module("x")`` with a literal counts."""
    tree = parsed(path)[1]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in
                   ast.unparse(node.test) for stmt in node.body for n in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names]  # a name, or a submodule: resolved by the caller
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in
              ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        found += [Import(t, node.lineno, id(node) in typing_only) for t in targets]
    return found


def resolve(target: str, known) -> str | None:
    """The longest known module ``target`` names (``pkg.name`` is ``pkg`` when ``name`` is not a module)."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def graph(mods: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {module among ``mods`` it imports: the line} (``TYPE_CHECKING`` imports too: a circle through
    one is still a circle to a reader)."""
    edges: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        edges[name] = {}
        for imp in imports(path, name):
            to = resolve(imp.target, mods)
            if to and to != name:
                edges[name].setdefault(to, imp.line)
    return edges


def circles(edges: dict[str, dict[str, int]]) -> list[set[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(edges[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.add(w)
                    if w == v:
                        break
                if len(group) > 1:
                    groups.append(group)
    return groups


def one_cycle(group: set[str], edges: dict[str, dict[str, int]]) -> str:
    """A readable cycle through ``group``: each step with the file and line of its import."""
    start = min(group)
    path, seen = [start], {start}
    while True:
        nxt = min(w for w in edges[path[-1]] if w in group)
        if nxt in seen:
            path = path[path.index(nxt):] + [nxt]
            break
        path.append(nxt)
        seen.add(nxt)
    mods = project_modules()
    return " -> ".join(f"{a} ({mods[a].relative_to(ROOT)}:{edges[a][b]})" for a, b in zip(path, path[1:])) + \
        f" -> {path[-1]}"


def wrong_way(mods: dict[str, Path], base: Path = ROOT) -> list[str]:
    """Each import from a module of the core (``diffuse``) into an analyzer, a transport or a plugin."""
    forbidden = {"analyzers", "transport", *plugin_packages()}
    return [f"{path.relative_to(base)}:{imp.line} imports {imp.target}" for name, path in mods.items()
            if name.split(".")[0] == "diffuse" for imp in imports(path, name) if imp.target.split(".")[0] in forbidden]


def test_the_reader_sees_a_planted_circle_and_a_planted_wrong_way_import(tmp_path):
    """The graph reader on files of its own: relative, function-level and ``TYPE_CHECKING`` imports count,
    and a literal ``import_module`` is an import."""
    pkg = tmp_path / "diffuse"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from diffuse.a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from diffuse import a\n"
                              "import importlib\nimportlib.import_module('transport.zmq_ring')\n")
    mods = {module_name(p, tmp_path): p for p in sorted(pkg.rglob("*.py"))}
    assert {(i.target, i.typing_only) for i in imports(mods["diffuse.c"], "diffuse.c")} == {
        ("typing.TYPE_CHECKING", False), ("diffuse.a", True), ("importlib", False), ("transport.zmq_ring", False)}
    assert circles(graph(mods)) == [{"diffuse.a", "diffuse.b"}]
    assert wrong_way(mods, tmp_path) == ["diffuse/c.py:5 imports transport.zmq_ring"]


def test_the_core_imports_no_analyzer_transport_or_plugin():
    """``diffuse/`` reaches analyzers, transports and plugins only through entry points and hooks."""
    wrong = wrong_way(project_modules())
    assert not wrong, "the core imports a plugin:\n" + "\n".join(wrong)


def test_no_two_modules_import_each_other_round_a_circle():
    edges = graph(project_modules())
    assert len(edges) > 60 and sum(map(len, edges.values())) > 150  # the whole project was read
    new = [one_cycle(g, edges) for g in circles(edges) if frozenset(g) not in KNOWN_CIRCLES]
    assert not new, "modules import each other round a circle:\n" + "\n".join(new)


def test_transports_import_only_the_public_transport_contract():
    """The built-in ZeroMQ transport and the example plugins need nothing of Diffuse but
    ``diffuse.wire.transport``: a third party can write one from that module alone."""
    files = [("transport", p) for p in sorted((ROOT / "transport").rglob("*.py"))]
    files += [(pkg.name, p) for pkg in plugin_packages().values() for p in sorted(pkg.rglob("*.py"))]
    assert {"transport", "diffuse_ipc", "diffuse_tcp"} <= {own for own, _ in files}

    def public(target: str, own: str) -> bool:
        top = target.split(".")[0]
        return (top == own or top not in PACKAGES
                or any(target == m or target.startswith(m + ".") for m in TRANSPORT_API))

    wrong = [f"{path.relative_to(ROOT)}:{imp.line} imports {imp.target}" for own, path in files
             for imp in imports(path, "") if not public(imp.target, own)]
    assert not wrong, "a transport imports more of Diffuse than diffuse.wire.transport:\n" + "\n".join(wrong)


def oversized(files: list[Path], base: Path = ROOT) -> list[str]:
    """Each function over ``MAX_FUNCTION_LINES`` lines or ``MAX_PARAMETERS`` parameters (``self``/``cls`` not
    counted; ``*args`` and ``**kwargs`` count one each), each class over ``MAX_CLASS_LINES`` lines, and each of
    ``CORE_MODULES`` with ``MAX_CORE_MODULE_LINES`` lines or more, in ``files``."""
    found = []
    for path in files:
        where = path.relative_to(base)
        text, tree = parsed(path)
        if path.name in CORE_MODULES and path.parent.name in ("diffuse", "client", "node") and \
                len(text.splitlines()) >= MAX_CORE_MODULE_LINES:
            found.append(f"{where}: {len(text.splitlines())} lines (under {MAX_CORE_MODULE_LINES} wanted)")
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            key, lines = f"{where}:{node.name}", node.end_lineno - node.lineno + 1
            if key in SIZE_EXCEPTIONS:
                continue
            if isinstance(node, ast.ClassDef):
                if lines > MAX_CLASS_LINES:
                    found.append(f"{key} (line {node.lineno}): class of {lines} lines")
                continue
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
            count = len(params) - (1 if (a.posonlyargs + a.args)[:1] and (a.posonlyargs + a.args)[0].arg in
                                   ("self", "cls") else 0)
            if lines > MAX_FUNCTION_LINES or count > MAX_PARAMETERS:
                found.append(f"{key} (line {node.lineno}): {lines} lines, {count} parameters")
    return found


def test_the_size_check_sees_planted_oversized_code(tmp_path):
    """The size reader on files of its own: a long function, one with too many parameters (self not counted,
    ``*args``/``**kwargs`` counted), a long class, and a long ``stage.py``; code at the limits passes."""
    pkg = tmp_path / "diffuse"
    pkg.mkdir()
    body = "    x = 1\n"
    (pkg / "ok.py").write_text("class C:\n    def m(self, a, b, c, d, e, f, g, h):\n" + ("    " + body) * 78 + "\n"
                               "def f(a, b, c, d, e, f, *g, **h):\n    pass\n")
    (pkg / "big.py").write_text("def long():\n" + body * 80 + "def wide(a, b, c, d, e, f, g, *h, **i):\n"
                                "    pass\nclass K:\n" + body * 250)
    (pkg / "stage.py").write_text("x = 1\n" * 300)
    found = oversized(sorted(pkg.glob("*.py")), tmp_path)
    assert [f.split(" (")[0] for f in found] == ["diffuse/big.py:long", "diffuse/big.py:wide", "diffuse/big.py:K",
                                                 "diffuse/stage.py: 300 lines"], found


def test_functions_classes_and_the_core_modules_stay_small():
    files = sorted((ROOT / "diffuse").rglob("*.py"))
    assert len(files) > 60 and {"standin.py", "stage.py"} <= {p.name for p in files}  # the whole core was read
    found = oversized(files)
    assert not found, "over the size limits (split by responsibility, or list it in SIZE_EXCEPTIONS with why):\n" \
        + "\n".join(found)
    stale = [k for k in SIZE_EXCEPTIONS if not (ROOT / k.split(":")[0]).exists()]
    assert not stale, f"size exceptions for files that are gone: {stale}"
