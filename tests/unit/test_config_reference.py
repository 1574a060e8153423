"""docs/config.md is generated from the config dataclasses (scripts/config_reference.py): it
cannot go stale, and no config key goes without a comment saying what it does."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ref = _load()


def test_committed_reference_is_current():
    committed = (REPO / "docs" / "config.md").read_text()
    assert ref.render() == committed, f"docs/config.md is stale: run `{ref.REGENERATE}` and commit it"


def test_every_key_of_every_section_is_listed():
    text = ref.render()
    from draftadapt.adapter import AdapterConfig
    from draftadapt.rl.config import DemoConfig

    for key in ("schedule.every_n_steps", "validation.margin", "train.ttt_slots", "priority"):
        assert f"| `{key}` |" in text, key
    # the demo's adapter lists what it sets apart from AdapterConfig's defaults, and points there for the rest
    assert f"| `adapter.train.lr` | `{DemoConfig().adapter.train.lr!r}` |" in text
    assert AdapterConfig().train.lr != DemoConfig().adapter.train.lr
    assert "| `adapter.*` | as in [The adapter: AdapterConfig](#the-adapter-adapterconfig) |" in text


@dataclass
class _Inner:
    depth: int = 3  # how deep
    # a block above a field, over two lines. Its first sentence is the meaning
    width: float = 0.5


@dataclass
class _Outer:
    name: str = "x"  # the name
    inner: _Inner = field(default_factory=lambda: _Inner(depth=7))
    undocumented: int = 0


def test_meanings_come_from_the_comment_beside_or_above_each_field():
    assert ref.field_comments(_Inner) == {
        "depth": "how deep",
        "width": "a block above a field, over two lines. Its first sentence is the meaning"}
    assert ref.first_sentence("one (a. B) two, e.g. three. Four.") == "one (a. B) two, e.g. three."


def test_a_section_takes_its_parents_defaults_and_a_key_without_a_comment_is_an_error():
    assert ref.rows(_Inner, _Outer().inner, "inner.") == [
        ("inner.depth", "`7`", "how deep"), ("inner.width", "`0.5`", "a block above a field, over two lines.")]
    with pytest.raises(ref.MissingMeaning, match=r"config key undocumented has no comment .*_Outer.undocumented"):
        ref.rows(_Outer, _Outer())


def test_rendered_rows_escape_the_table_separator():
    text = ref.render([("Inner", _Inner)])
    assert "## Inner\n" in text and "| `depth` | `3` | how deep |" in text
    assert ref._cell("a | b") == "a \\| b"
