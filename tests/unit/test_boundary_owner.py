"""Only draftadapt/boundary.py orders the adapter's calls at an RL step's boundary (docs/design.md,
"The step boundary"): every other module goes through StepBoundary.

What is ordered is read from boundary.py itself, so a call the boundary takes on is guarded from
then on: the adapter methods StepBoundary and its engine sets call (observe, update_policy,
run_round, report_measured, check_integrity, swap, ...), and the boundary's pieces (its methods
that its other methods call: the steps its orders are made of). A function outside boundary.py
breaks the rule when it

- calls two or more of them (an adapter method on an adapter, a piece on a boundary), counting
  the calls of the functions of its own module it calls (an order split over helpers is still an
  order), or
- calls one of the adapter's boundary methods on an adapter at all, unless it is a method of the
  same name that forwards it (ray.py's AdapterServer and RemoteAdapter stand in for the adapter).

Receivers are known by name, as the package names them: ``adapter``, ``self.adapter``,
``r.adapter`` (and local aliases of those) are adapters; ``boundary``, ``self._boundary`` are
boundaries.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "draftadapt"
BOUNDARY = PACKAGE / "boundary.py"


def _name(node: ast.expr) -> str | None:
    """The last name of a receiver: ``self.adapter`` -> "adapter", ``boundary`` -> "boundary"."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_adapter(node: ast.expr, aliases: set[str]) -> bool:
    name = _name(node)
    return name is not None and (name.lower().endswith("adapter") or isinstance(node, ast.Name) and name in aliases)


def _is_boundary(node: ast.expr) -> bool:
    name = _name(node)
    return name is not None and name.lower().endswith("boundary")


def _adapter_aliases(fn: ast.AST) -> set[str]:
    """Local names bound to an adapter in ``fn`` (``a = self.adapter``)."""
    aliases: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and _is_adapter(node.value, aliases):
            aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return aliases


def _method_calls(fn: ast.AST):
    """(receiver, method name, call) for every ``receiver.method(...)`` in ``fn``."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            yield node.func.value, node.func.attr, node


def _functions(tree: ast.Module):
    """(class name or None, function) for the module's functions and its classes' methods."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield None, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield node.name, item


def boundary_vocabulary(path: Path = BOUNDARY) -> tuple[set[str], set[str]]:
    """(the adapter methods boundary.py calls, StepBoundary's pieces)."""
    tree = ast.parse(path.read_text())
    adapter_methods: set[str] = set()
    pieces: set[str] = set()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        methods = {f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for fn in (f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))):
            aliases = _adapter_aliases(fn)
            for receiver, method, _ in _method_calls(fn):
                if _is_adapter(receiver, aliases):
                    adapter_methods.add(method)
                elif (cls.name == "StepBoundary" and method in methods and isinstance(receiver, ast.Name)
                      and receiver.id == "self"):
                    pieces.add(method)
    return adapter_methods, pieces


def ordered_calls(tree: ast.Module, adapter_methods: set[str],
                  pieces: set[str]) -> dict[str, tuple[list[str], list[str]]]:
    """Each function's ordered calls ("line: adapter.observe"), its own module's helpers' included,
    and the helpers it calls."""
    functions = {(cls, fn.name): fn for cls, fn in _functions(tree)}
    direct: dict[tuple, list[str]] = {}
    helpers: dict[tuple, list[tuple]] = {}
    for (cls, name), fn in functions.items():
        aliases = _adapter_aliases(fn)
        ordered = [(call.lineno, f"{call.lineno}: {_name(receiver)}.{method}")
                   for receiver, method, call in _method_calls(fn)
                   if (method in adapter_methods and _is_adapter(receiver, aliases))
                   or (method in pieces and _is_boundary(receiver))]
        direct[(cls, name)] = [text for _, text in sorted(ordered)]
        called = []
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Name) and (None, f.id) in functions:
                called.append((None, f.id))
            elif (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self"
                  and (cls, f.attr) in functions):
                called.append((cls, f.attr))
        helpers[(cls, name)] = called

    def total(key: tuple, seen: frozenset) -> list[str]:
        out = list(direct[key])
        for h in helpers[key]:
            if h not in seen:
                out += total(h, seen | {h})
        return out

    def label(key: tuple) -> str:
        cls, name = key
        return f"{cls}.{name}" if cls else name

    return {label(key): (total(key, frozenset({key})), [label(h) for h in helpers[key]]) for key in functions}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != BOUNDARY:
            yield path.relative_to(PACKAGE.parent), ast.parse(path.read_text())


def test_the_boundary_wraps_the_adapters_calls_and_is_made_of_pieces():
    adapter_methods, pieces = boundary_vocabulary()
    assert {"observe", "update_policy", "report_measured", "check_integrity", "swap"} <= adapter_methods
    assert pieces, "StepBoundary's orders are made of its own methods; none found"


def test_no_module_but_the_boundary_calls_the_adapters_boundary_methods_in_sequence():
    adapter_methods, pieces = boundary_vocabulary()
    offenders = {}
    for path, tree in _modules():
        functions = ordered_calls(tree, adapter_methods, pieces)
        for fn, (calls, helpers) in functions.items():
            # where the order is assembled: not in a caller of a helper that already holds it
            if len(calls) >= 2 and all(len(functions[h][0]) < 2 for h in helpers if h != fn):
                offenders[f"{path}::{fn}"] = calls
    assert not offenders, ("these functions order the adapter's boundary calls themselves; add the order to "
                           f"StepBoundary (draftadapt/boundary.py) and call that: {offenders}")


def test_an_adapter_method_is_called_outside_the_boundary_only_to_forward_it():
    adapter_methods, _ = boundary_vocabulary()
    offenders = []
    for path, tree in _modules():
        for cls, fn in _functions(tree):
            aliases = _adapter_aliases(fn)
            offenders += [f"{path}:{call.lineno} {fn.name} calls {_name(receiver)}.{method}"
                          for receiver, method, call in _method_calls(fn)
                          if method in adapter_methods and _is_adapter(receiver, aliases) and method != fn.name]
    assert not offenders, f"call these through StepBoundary (draftadapt/boundary.py): {offenders}"


def test_the_check_finds_an_order_split_over_helpers():
    source = '''
class Car:
    def poll(self):
        self._policy()
        self.adapter.run_round()

    def _policy(self):
        self.adapter.update_policy({}, 1)


def loop(boundary):
    boundary._learn([], 0, {}, 1)
    boundary._serve(None)
'''
    calls = ordered_calls(ast.parse(source), {"update_policy", "run_round"}, {"_learn", "_serve"})
    assert calls["Car.poll"] == (["5: adapter.run_round", "8: adapter.update_policy"], ["Car._policy"])
    assert calls["loop"][0] == ["12: boundary._learn", "13: boundary._serve"] and len(calls["Car._policy"][0]) == 1
