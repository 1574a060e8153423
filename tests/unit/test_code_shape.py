"""No function in draftadapt/ runs over 80 lines (issue 56), counted as scripts/code_shape.py counts
them: its ``functions``, a def from its first line to its last, docstring and nested defs included."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 80


def code_shape():
    spec = importlib.util.spec_from_file_location("code_shape", REPO / "scripts" / "code_shape.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_functions_counts_every_def_by_its_qualified_name(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    def g():\n        pass\n    return g\n\n\n"
                      "class C:\n    async def h(self):\n        return 1\n")
    assert sorted(code_shape().functions(source)) == [(2, "C.h"), (2, "f.g"), (4, "f")]


def test_no_function_in_the_package_is_over_80_lines():
    functions = code_shape().functions
    long = sorted(((n, f"{path.relative_to(REPO)}::{name}") for path in sorted((REPO / "draftadapt").rglob("*.py"))
                   for n, name in functions(path) if n > MAX_LINES), reverse=True)
    assert not long, (f"over {MAX_LINES} lines; split each along the steps it already names: "
                      + ", ".join(f"{name} ({n})" for n, name in long))
