"""Typed dataclass configs: YAML sets fields, ``key=value`` overrides win, unknown keys are errors.

Every recipe is a dataclass tree. ``load_config(Cls, "recipe.yaml", ["train.lr=1e-3"])``
reads the YAML, applies dotted overrides on top, converts each value to the
field's declared type and refuses any key the dataclass does not declare, naming
the key, where it came from and the keys that do exist. A fact several parts need (the demo's
``k``) has one field; the parts it is passed to leave theirs unset (:func:`pass_down`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A recipe or override that does not fit the config schema."""


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert ``value`` (from YAML or a command-line string) to the annotated type ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{where}: cannot read {value!r} as {tp}: " + "; ".join(errors))
    if origin is typing.Literal:
        for arg in args:
            if value == arg or (isinstance(value, str) and str(arg) == value):
                return arg
        raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {value!r}")
        return _build(tp, value, where)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.strip().startswith("[") else [
                v for v in value.split(",") if v.strip()
            ]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp in (int, float, str):
        if isinstance(value, bool) and tp is not str:
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
        try:
            if tp is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            if tp is int and isinstance(value, str):
                return int(float(value)) if "e" in value.lower() else int(value)
            return tp(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}") from None
    return value


def _build(cls: type[T], data: dict[str, Any], where: str) -> T:
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    prefix = f"{where}." if where else ""
    for key in unknown:
        new = getattr(cls, "RENAMED", {}).get(key)  # a class's {old key: new key}
        if new is not None:
            raise ConfigError(f"{prefix}{key} was renamed to {prefix}{new}; write {prefix}{new} instead "
                              "(in the YAML or the key=value override)")
    if unknown:
        raise ConfigError(
            f"{where or cls.__name__}: unknown key(s) {unknown} for {cls.__name__}; known keys: {sorted(types_)}"
        )
    # a class may give a section a default that depends on its other keys (the demo's adapter
    # on its method): ``section_defaults(data) -> {field: default instance}``
    given = getattr(cls, "section_defaults", None)
    section_defaults = given(data) if callable(given) else {}
    kwargs = {k: v for k, v in section_defaults.items() if k not in data}
    for k, v in data.items():
        base = section_defaults[k] if k in section_defaults else _field_default(cls, k)
        if isinstance(v, dict) and dataclasses.is_dataclass(base):
            # a section given in part keeps the parent's own default for it (a recipe's default
            # factory), not the section class's bare defaults, for every key it does not name
            v = _merged(base, v)
        kwargs[k] = _coerce(v, types_[k], f"{where}.{k}" if where else k)
    try:
        obj = cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where or cls.__name__}: {exc}") from None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def _merged(base: Any, given: dict[str, Any]) -> dict[str, Any]:
    """``base`` (a dataclass instance) as a mapping with ``given`` on top, section by section."""
    out = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    for k, v in given.items():
        cur = out.get(k)
        out[k] = _merged(cur, v) if isinstance(v, dict) and dataclasses.is_dataclass(cur) else v
    return out


def _field_default(cls: type, name: str) -> Any:
    """The default a dataclass gives field ``name`` (None when it has none)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            return None if f.default is dataclasses.MISSING else f.default
    return None


def _set_dotted(tree: dict[str, Any], dotted: str, value: str) -> None:
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {part} is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str] | None) -> list[tuple[str, str]]:
    pairs = []
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. train.lr=1e-3)")
        key, value = item.split("=", 1)
        pairs.append((key.strip(), value))
    return pairs


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Read ``path`` (YAML) into ``cls``, apply ``key=value`` overrides, validate everything."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"recipe {path} does not exist; pass a YAML file such as recipes/*.yaml")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"recipe {path} must hold a mapping at the top level")
        data = loaded
    for key, value in parse_overrides(overrides):
        _set_dotted(data, key, value)
    return _build(cls, data, "")


def pass_down(section: T, where: str, **facts: tuple[str, Any]) -> T:
    """``section`` (a config part named ``where``, e.g. "adapter") with facts its owner holds
    passed in: ``facts`` maps a field of ``section`` to (the owner's key, its value).

    One fact, one field: the owner's key is the one to set. The section's own field is left unset
    (None) and filled here, or set to the same value; a different value is a ConfigError naming
    both keys, never silently overwritten.
    """
    for name, (key, value) in facts.items():
        own = getattr(section, name)
        if own is not None and own != value:
            raise ConfigError(f"{where}.{name}={own} conflicts with {key}={value}: set only {key} ({key}={own} if "
                              f"that is what you meant; it is passed down to {where}.{name}) and leave "
                              f"{where}.{name} unset")
    return dataclasses.replace(section, **{name: value for name, (_, value) in facts.items()})


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
