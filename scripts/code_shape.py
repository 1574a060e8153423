"""The package's shape in three counts: the longest functions, the imports that point up the
layers (tests/unit/test_layers.py's LAYERS), the files over 500 lines.

    .venv/bin/python scripts/code_shape.py [--top 10] [--json]

Run it on two checkouts to compare them (issue 46's closing note shows it before and after).
tests/unit/test_code_shape.py counts with ``functions`` and fails on a function over 80 lines.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def functions(path: Path) -> list[tuple[int, str]]:
    """(lines, qualified name) of every function and method in ``path``."""
    tree = ast.parse(path.read_text())
    out = []

    def walk(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((child.end_lineno - child.lineno + 1, f"{prefix}{child.name}"))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")

    walk(tree, "")
    return out


def shape(top: int) -> dict:
    spec = importlib.util.spec_from_file_location("layers", REPO / "tests" / "unit" / "test_layers.py")
    layers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layers)
    files = sorted((REPO / "draftadapt").rglob("*.py"))
    funcs = sorted(((n, f"{p.relative_to(REPO)}::{name}") for p in files for n, name in functions(p)), reverse=True)
    sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(REPO))) for p in files), reverse=True)
    return {"longest_functions": [f"{n} {name}" for n, name in funcs[:top]],
            "functions_over_60_lines": sum(1 for n, _ in funcs if n > 60),
            "imports_up_the_layers": layers.upward(layers.graph()),
            "files_over_500_lines": [f"{n} {name}" for n, name in sizes if n > 500]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    s = shape(args.top)
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    print("longest functions (lines):", *s["longest_functions"], sep="\n  ")
    print(f"functions over 60 lines: {s['functions_over_60_lines']}")
    print(f"imports up the layers: {len(s['imports_up_the_layers'])}", *s["imports_up_the_layers"], sep="\n  ")
    print(f"files over 500 lines: {len(s['files_over_500_lines'])}", *s["files_over_500_lines"], sep="\n  ")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
