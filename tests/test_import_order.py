"""The house by sides: a module's folder says which process runs it and what it may import, and every import
in the tree (in a function, under ``TYPE_CHECKING``, or by a literal ``import_module``) keeps to that order:

    cli / serve / bench / train  ->  client  ->  local  ->  lm, pipefusion, firstblock  ->  wire  ->  plan  ->  leaves
    node                         ->  lm, pipefusion, firstblock  ->  wire  ->  plan  ->  leaves

The client never imports the node; the node never imports the client, the local launcher or a face. Inside
``lm/``, ``pipefusion/`` and ``firstblock/`` a file named ``client*`` runs in the client and one named
``node*`` on a node: neither imports the other side's, and what both read (the rest) imports neither.
Analyzers reach the core through ``plan/`` (the hook specs, analysis, the plan) and the leaves; transports
only through ``diffuse.wire.transport`` (``test_layers``). Also here: no file over 400 lines, no two public
classes of one name, and no module-level mutable state (caches and registries belong to an object a run,
a node or the service owns)."""

from __future__ import annotations

import ast
from pathlib import Path

from test_layers import ROOT, imports, parsed, project_modules, resolve

LEAVES = ("changes", "errors", "flags", "home", "measure", "processes", "text")  # tiny modules on top that import no folder
SPEEDUPS = ("lm", "pipefusion", "firstblock")  # one side per file: client*, node*, or read by both
FACES = ("cli", "serve", "bench", "train", "run", "__init__")  # what a user types or imports (diffuse.split)
BELOW = {  # what each part of diffuse/ may import besides itself
    "leaves": (),
    "plan": ("leaves",),
    "wire": ("plan", "leaves"),
    "lm": ("wire", "plan", "leaves"),
    "pipefusion": ("wire", "plan", "leaves"),
    "firstblock": ("pipefusion", "wire", "plan", "leaves"),  # it tells guidance branches apart as PipeFusion does
    "local": ("wire", "plan", "leaves"),
    "client": ("local", *SPEEDUPS, "wire", "plan", "leaves"),
    "node": (*SPEEDUPS, "wire", "plan", "leaves"),
    "face": ("face", "client", "local", *SPEEDUPS, "node", "wire", "plan", "leaves"),
    "analyzers": ("plan", "leaves"),
}
WHY = {
    "node": "the node never imports the client, the local launcher or a face",
    "client": "the client never imports the node or a face",
    "local": "local nodes are started from wire and plan alone, below the client",
    "analyzers": "analyzers reach the core only through plan/ (hook specs, analysis, the plan) and the leaves",
}
MAX_FILE_LINES = 400


def part_of(module: str) -> str:
    """The part a module belongs to: a folder of ``diffuse/``, ``leaves``, ``face``, or ``analyzers``."""
    top, _, rest = module.partition(".")
    if top == "analyzers":
        return "analyzers"
    if top == "transport":
        return "transport"
    if not rest:
        return "face"  # diffuse/__init__.py: the Python API's names, loaded on first use
    head = rest.split(".")[0]
    if head in LEAVES:
        return "leaves"
    if head in FACES:
        return "face"
    return head


def side_of(module: str) -> str | None:
    """``client`` or ``node`` for a one-sided file of a speed-up or of the language models, else None."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] in SPEEDUPS:
        name = parts[-1]
        for side in ("client", "node"):
            if name == side or name.startswith(side + "_"):
                return side
    return None


def order_breaks(mods: dict[str, Path], base: Path = ROOT) -> list[str]:
    """Each import that goes against the order, with the file, line, target and the rule it breaks."""
    found = []
    for name, path in mods.items():
        part = part_of(name)
        if part == "transport":
            continue  # test_layers holds transports to the transport contract
        for imp in imports(path, name):
            to = resolve(imp.target, mods)
            if to is None or to == name:
                continue
            where, target = f"{path.relative_to(base)}:{imp.line} imports {to}", part_of(to)
            if target == "transport" or (target != part and target not in BELOW[part]):
                rule = WHY.get(part, f"{part} may import {', '.join(BELOW[part]) or 'nothing of Diffuse'}")
                found.append(f"{where}: {part} may not import {target} ({rule})")
                continue
            mine, theirs = side_of(name), side_of(to)
            if theirs and (mine or part) not in (theirs, "face"):
                found.append(f"{where}: a {mine or part} file imports a {theirs} file (one side per file: "
                             f"{'what both sides read imports neither side' if mine is None and part in SPEEDUPS else 'the client and the node never import each other'})")
    return found


def test_the_order_check_sees_planted_wrong_imports(tmp_path):
    """The order reader on files of its own: a node importing the client (under TYPE_CHECKING, still an
    arrow), plan importing wire, a client half of a speed-up importing its node half, and the client
    importing a node half; a face importing anything and the client importing a shared file pass."""
    files = {
        "diffuse/__init__.py": "",
        "diffuse/node/stage.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from diffuse.client import ring\n",
        "diffuse/plan/contracts.py": "def f():\n    from diffuse.wire.frames import x\n",
        "diffuse/wire/frames.py": "x = 1\n",
        "diffuse/client/ring.py": "from diffuse.pipefusion import node\nfrom diffuse.pipefusion.policy import y\n",
        "diffuse/pipefusion/client.py": "import diffuse.pipefusion.node\n",
        "diffuse/pipefusion/node.py": "from diffuse.plan import contracts\n",
        "diffuse/pipefusion/policy.py": "y = 1\n",
        "diffuse/cli/command.py": "from diffuse.node import stage\nfrom diffuse.client import ring\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    for pkg in ("node", "plan", "wire", "client", "pipefusion", "cli"):
        (tmp_path / "diffuse" / pkg / "__init__.py").write_text("")
    from test_layers import module_name

    mods = {module_name(p, tmp_path): p for p in sorted((tmp_path / "diffuse").rglob("*.py"))}
    found = order_breaks(mods, tmp_path)
    assert [f.split(":")[0] + ":" + f.split(":")[1].split(" ")[0] for f in found] == [
        "diffuse/client/ring.py:1", "diffuse/node/stage.py:3", "diffuse/pipefusion/client.py:1",
        "diffuse/plan/contracts.py:2"], found
    assert "the node never imports the client" in found[1] and "plan may not import wire" in found[3]


def test_every_import_keeps_to_the_order_of_the_sides():
    mods = project_modules()
    parts = {part_of(m) for m in mods}
    assert {"plan", "wire", "client", "node", "lm", "pipefusion", "firstblock", "local", "face", "leaves",
            "analyzers"} <= parts, parts  # the whole tree was read
    assert not (parts - set(BELOW) - {"transport"}), f"a folder with no rule: {parts - set(BELOW)}"
    found = order_breaks(mods)
    assert not found, "imports against the order (DESIGN \"Layout\"):\n" + "\n".join(found)


def sources() -> list[Path]:
    """Every Python file of the distribution and the example plugins, tests left out."""
    files = [p for pkg in ("diffuse", "analyzers", "transport") for p in sorted((ROOT / pkg).rglob("*.py"))]
    return files + [p for p in sorted(ROOT.glob("plugins/*/*/*.py")) if p.parent.name != "tests"]


def test_no_file_is_over_400_lines():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sources()
            if (n := len(parsed(p)[0].splitlines())) > MAX_FILE_LINES]
    assert not long, f"over {MAX_FILE_LINES} lines (split it by job):\n" + "\n".join(long)


def test_no_two_public_classes_share_a_name():
    where: dict[str, list[str]] = {}
    for p in sources():
        for node in parsed(p)[1].body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(str(p.relative_to(ROOT)))
    twice = {name: files for name, files in where.items() if len(files) > 1}
    assert not twice, f"one name, two meanings: {twice}"


MUTABLE = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
MUTABLE_CALLS = ("dict", "list", "set", "OrderedDict", "defaultdict", "deque", "WeakKeyDictionary",
                 "WeakValueDictionary")


def module_state(path: Path) -> list[str]:
    """Module-level names bound to a mutable container (a constant's ALL_CAPS name aside: tables filled once
    at import, such as registries of kinds, are read-only after it), and functions that rebind a global."""
    found = []
    tree = parsed(path)[1]
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        call = value.func if isinstance(value, ast.Call) else None
        mutable = isinstance(value, MUTABLE) or getattr(call, "id", getattr(call, "attr", None)) in MUTABLE_CALLS
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if mutable and not n.isupper()
                  and n != "__all__"]
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: global {', '.join(node.names)}")
    return found


def test_no_module_level_mutable_state():
    found = [f for p in sources() for f in module_state(p)]
    assert not found, "module-level state (make it an attribute of what a run, a node or the service owns):\n" + \
        "\n".join(found)
