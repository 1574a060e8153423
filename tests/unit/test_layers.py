"""The package's import layers (docs/design.md, "Layout"): every arrow points down.

Each module sits in one layer of ``LAYERS``; it may import modules of its own layer and of the
layers below, never of one above. Every import is an arrow: a function's lazy import and a
``TYPE_CHECKING`` one count as much as one at the top. No modules import each other in a circle,
within a layer either. A new module must be given a layer here (and in docs/design.md).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "draftadapt"

# Lowest first. A name covers the module of that name and everything inside it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("draftadapt", "draftadapt.fileio", "draftadapt.tensors", "draftadapt.config", "draftadapt.progress")),
    ("metrics", ("draftadapt.metrics",)),
    ("drafts", ("draftadapt.drafts", "draftadapt.precision")),
    ("engine", ("draftadapt.engine",)),
    ("data", ("draftadapt.data", "draftadapt.spool")),
    ("capture", ("draftadapt.capture",)),
    ("train", ("draftadapt.train",)),
    ("adapter", ("draftadapt.publish", "draftadapt.adapter", "draftadapt.boundary", "draftadapt.online_k")),
    ("commands", ("draftadapt.draft_init", "draftadapt.pretrain", "draftadapt.evaluate", "draftadapt.sidecar",
                  "draftadapt.integrations", "draftadapt.sim")),
    ("rl", ("draftadapt.rl",)),  # the demo's RL loop: takes a world, imports none
    ("worlds", ("draftadapt.toy", "draftadapt.smollm2")),
    ("cli", ("draftadapt.demo", "draftadapt.cli")),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest name that covers ``module``."""
    best, index = "", -1
    for i, (_, names) in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > len(best):
                best, index = name, i
    return index


def imports(module: str, source: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, imported draftadapt module) for every import in ``source``, at any depth. ``from
    X import n`` names module X.n when there is one, else X."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub if sub in MODULES else base))
    ours = [(line, name) for line, name in out if name == "draftadapt" or name.startswith("draftadapt.")]
    return list(dict.fromkeys(ours))  # one arrow per line and module


def graph() -> dict[str, list[tuple[int, str]]]:
    return {m: imports(m, p.read_text(), p.name == "__init__.py") for m, p in MODULES.items()}


def upward(edges: dict[str, list[tuple[int, str]]]) -> list[str]:
    bad = []
    for module, targets in edges.items():
        for line, target in targets:
            if layer_of(target) > layer_of(module):
                bad.append(f"{module} (layer {LAYERS[layer_of(module)][0]}) imports {target} "
                           f"(layer {LAYERS[layer_of(target)][0]}) at {MODULES[module].relative_to(REPO)}:{line}")
    return bad


def test_every_module_has_a_layer():
    assert not [m for m in MODULES if layer_of(m) < 0], "give these modules a layer in LAYERS and docs/design.md"


def test_every_arrow_points_down():
    bad = upward(graph())
    assert not bad, "imports of a higher layer (move the code down, or pass it in from above):\n" + "\n".join(bad)


def test_the_rule_sees_lazy_and_relative_imports():
    """A bottom-layer module that reaches up from inside a function, or relatively, is caught."""
    source = "def f():\n    from draftadapt.train.trainer import DraftTrainer\n    from ..capture import hidden\n"
    found = imports("draftadapt.drafts.eagle3", source)
    assert found == [(2, "draftadapt.train.trainer"), (3, "draftadapt.capture.hidden")]
    bad = upward({"draftadapt.drafts.eagle3": found})
    assert len(bad) == 2 and bad[0].startswith("draftadapt.drafts.eagle3 (layer drafts) imports draftadapt.train.trainer")


def test_no_import_circles():
    edges = {m: sorted({t for _, t in ts if t != m}) for m, ts in graph().items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []
    circles = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in edges.get(m, []):
            if state.get(t) == 1:
                circles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in edges:
        if m not in state:
            visit(m)
    assert not circles, "modules that import each other:\n" + "\n".join(circles)


def test_the_engine_loads_no_training_code_and_only_the_command_line_imports_a_world():
    """The issue's two guarantees, stated apart from the order of LAYERS: the engine imports no
    training code; a world (toy/, smollm2/) is imported only by the commands (cli.py, demo.py),
    never by the RL loop or by the other world."""
    edges = graph()
    training = ("draftadapt.train", "draftadapt.capture", "draftadapt.data")
    engine = [f"{m} -> {t}" for m, ts in edges.items() if m.startswith("draftadapt.engine")
              for _, t in ts if t.startswith(training)]
    assert not engine, engine
    for world in ("draftadapt.toy", "draftadapt.smollm2"):
        into = [f"{m} -> {t}" for m, ts in edges.items()
                if not m.startswith(world) and m not in ("draftadapt.cli", "draftadapt.demo")
                for _, t in ts if t == world or t.startswith(world + ".")]
        assert not into, into


def test_method_facts_load_without_torch():
    """What the engine needs to know about a method (drafts/serving.py) imports no torch."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    code = ("import sys, draftadapt.drafts.serving as s; assert s.__file__.startswith(sys.argv[1]), s.__file__; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code, str(PACKAGE)], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", [n for _, names in LAYERS for n in names])
def test_every_layer_name_is_a_module(name):
    assert name in MODULES, f"LAYERS names {name}, which is no module of the package"
