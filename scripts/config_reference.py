"""Writes docs/config.md: every config key, its default and its meaning, read from the dataclasses.

    python scripts/config_reference.py --write    # regenerate docs/config.md
    python scripts/config_reference.py            # print it

Each key's meaning is the first sentence of the comment beside its field, or of the comment
lines directly above it, read from the source (``inspect.getsource`` and ``tokenize``): a new
field appears here as soon as it is declared, and a field without a comment is an error naming
it. A new config class is one more entry in ``sections()``. tests/unit/test_config_reference.py
regenerates the page and compares it with the committed one.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import sys
import tokenize
import typing
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "config.md"
REGENERATE = "python scripts/config_reference.py --write"


def sections() -> list[tuple[str, type]]:
    """(title, config dataclass) in the order the page lists them."""
    from draftadapt.adapter import AdapterConfig
    from draftadapt.pretrain import PretrainConfig
    from draftadapt.sidecar import SidecarConfig
    from draftadapt.sim.config import SimConfig
    from draftadapt.rl.config import DemoConfig

    return [
        ("The adapter: `AdapterConfig`", AdapterConfig),
        ("`draftadapt demo`: `DemoConfig`", DemoConfig),
        ("`draftadapt pretrain`: `PretrainConfig`", PretrainConfig),
        ("`draftadapt sidecar`: `SidecarConfig`", SidecarConfig),
        ("`draftadapt simulate`: `SimConfig`", SimConfig),
    ]


class MissingMeaning(ValueError):
    """A config field declared without a comment saying what it does."""


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> its comment: the one on the field's own line(s), else the comment lines
    directly above it (no blank line between), joined into one line."""
    source = inspect.getsource(cls)
    lines = source.splitlines()
    comments: dict[int, str] = {}  # 1-based line in ``source`` -> comment text
    own_line: set[int] = set()  # lines holding nothing but a comment
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            comments[row] = tok.string.lstrip("#").strip()
            if not lines[row - 1][:col].strip():
                own_line.add(row)
    out: dict[str, str] = {}
    (node,) = ast.parse(source).body
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        beside = [comments[r] for r in range(stmt.lineno, stmt.end_lineno + 1) if r in comments and r not in own_line]
        above, row = [], stmt.lineno - 1
        while row in own_line:
            above.insert(0, comments[row])
            row -= 1
        text = " ".join(beside or above)
        if text:
            out[stmt.target.id] = text
    return out


ABBREVIATIONS = ("e.g.", "i.e.", "vs.", "cf.")


def first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence outside brackets and code: a ". " before a
    word (the rest of a field's comment is its why, kept in the source)."""
    depth, code = 0, False
    for i, ch in enumerate(text):
        if ch == "`":
            code = not code
        elif not code and ch in "([":
            depth += 1
        elif not code and ch in ")]":
            depth = max(0, depth - 1)
        elif (ch == "." and not code and depth == 0 and text[i + 1: i + 2] == " " and text[i + 2: i + 3].isalpha()
              and not text[: i + 1].endswith(ABBREVIATIONS)):
            return text[: i + 1]
    return text


def _is_classvar(tp: Any) -> bool:
    return tp is typing.ClassVar or typing.get_origin(tp) is typing.ClassVar


def _default_instance(cls: type) -> Any:
    """``cls()`` with the sections a class makes depend on its other keys (``section_defaults``)
    as load_config gives them when nothing is set."""
    obj = cls()
    given = getattr(cls, "section_defaults", None)
    return dataclasses.replace(obj, **given({})) if callable(given) else obj


def _show(value: Any) -> str:
    if isinstance(value, str):
        root = str(REPO) + "/"
        value = value[len(root):] if value.startswith(root) else value  # package data, as in a checkout
        return f'`"{value}"`'
    if isinstance(value, Path):
        return _show(str(value))
    return f"`{value!r}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def anchor(title: str) -> str:
    """GitHub's link target for a heading."""
    kept = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_")
    return "#" + kept.replace(" ", "-")


def rows(cls: type, obj: Any, prefix: str = "", shown: dict[type, str] | None = None) -> list[tuple[str, str, str]]:
    """(dotted key, default, meaning) of every field of ``cls`` at ``obj`` (its default instance
    there: a section's defaults are what its parent gives it), sections recursed into. A section
    whose class has a part of the page of its own (``shown``: class -> its title) lists only the
    keys whose default differs from that part's, and one row pointing there for the rest."""
    shown = shown or {}
    meanings = field_comments(cls)
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if _is_classvar(hints.get(f.name)):
            continue
        key = prefix + f.name
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            if f.name in meanings:  # a section with a comment: a row of its own above its keys
                out.append((key, "section", first_sentence(meanings[f.name])))
            inner = rows(type(value), value, key + ".")
            if type(value) in shown:
                title = shown[type(value)]
                base = {k: d for k, d, _ in rows(type(value), _default_instance(type(value)))}
                inner = [r for r in inner if base[r[0][len(key) + 1:]] != r[1]]
                out.append((f"{key}.*", f"as in [{_plain(title)}]({anchor(title)})", "every key not listed here"))
            out += inner
            continue
        if f.name not in meanings:
            where = f"{inspect.getsourcefile(cls)}, {cls.__name__}.{f.name}"
            raise MissingMeaning(f"config key {key} has no comment saying what it does ({where}); add one beside "
                                 f"or above the field, then run `{REGENERATE}`")
        out.append((key, _show(value), first_sentence(meanings[f.name])))
    return out


def _plain(title: str) -> str:
    return title.replace("`", "")


def render(parts: list[tuple[str, type]] | None = None) -> str:
    """The reference page, markdown."""
    parts = sections() if parts is None else parts
    out = ["# Configuration reference", "",
           f"Generated from the config dataclasses by `{REGENERATE}`; do not edit by hand "
           "(tests/unit/test_config_reference.py fails when this page is stale). A key is set in a "
           "YAML recipe or as `key=value` on the command line (a dotted key sets a field of a section, "
           "`adapter.schedule.every_n_steps=1`); an unknown key is an error naming the keys that exist. "
           "Each meaning is the first sentence of the comment at the field; the rest of it says why.", ""]
    out += [f"- [{_plain(title)}]({anchor(title)})" for title, _ in parts] + [""]
    for i, (title, cls) in enumerate(parts):
        shown = {c: t for t, c in parts[:i]}  # a section of an earlier part lists what differs
        where = Path(inspect.getsourcefile(cls)).resolve().relative_to(REPO)
        out += [f"## {title}", "", f"Declared in {where}.", "", "| key | default | meaning |", "|---|---|---|"]
        out += [f"| `{key}` | {_cell(default)} | {_cell(meaning)} |" for key, default, meaning
                in rows(cls, _default_instance(cls), shown=shown)]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"write {OUT.relative_to(REPO)} instead of printing it")
    args = p.parse_args(argv)
    try:
        text = render()
    except MissingMeaning as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.write:
        OUT.write_text(text)
        print(f"wrote {OUT.relative_to(REPO)}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # this checkout's dataclasses, whichever one pip installed
    sys.exit(main())
