"""The examples in the core's docstrings run as written: every module of ``diffuse/`` whose docstrings hold a
``>>>`` example is run through ``doctest``."""

from __future__ import annotations

import ast
import doctest
import importlib
import io
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "diffuse"


def modules_with_examples() -> list[str]:
    """Modules of the core with an example in a docstring (module, class, function or method), read with
    ``ast`` so that nothing is imported to find them."""
    found = []
    for path in sorted(CORE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        docs = (ast.get_docstring(n, clean=False) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))
        if any(d and ">>>" in d for d in docs):
            parts = list(path.relative_to(CORE.parent).with_suffix("").parts)
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


MODULES = modules_with_examples()


def test_the_core_has_examples_to_run():
    assert len(MODULES) >= 5 and "diffuse.wire.transport" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name):
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report = io.StringIO()
    for test in doctest.DocTestFinder().find(module, name):
        runner.run(test, out=report.write)
    assert runner.tries > 0, f"{name}: a docstring holds '>>>' but doctest found no example to run"
    assert runner.failures == 0, report.getvalue()
