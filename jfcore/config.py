"""Strict loading of typed configuration.

Every config in the project is a frozen dataclass that validates itself in
``__post_init__``. ``from_dict`` builds one from plain data (a parsed YAML or
JSON file, CLI overrides) and refuses unknown keys and wrongly typed values
with a message that names the key and what would be accepted.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or invalid."""


def from_dict(cls: type[T], data: Mapping[str, Any], where: str | None = None) -> T:
    """Build the dataclass ``cls`` from ``data``; unknown keys are errors."""
    where = where or cls.__name__
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping of keys to values, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{where}: unknown key '{key}'{hint}; valid keys: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    kwargs = {key: _coerce(hints[key], value, f"{where}.{key}") for key, value in data.items()}
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{where}: missing required key(s): {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except ConfigError as err:  # a value check in __post_init__: say where the value sits
        raise ConfigError(f"{where}: {err}") from None


def to_dict(config: Any) -> dict[str, Any]:
    """Plain-data view of a config (for logging and for writing it back out)."""
    return dataclasses.asdict(config)


def load_file(path: str | Path) -> dict[str, Any]:
    """Parse a YAML or JSON file into plain data."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values")
    return data


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """`data` with each `dotted.key=value` (a CLI's `--set`) applied in order; values are YAML (`8`, `true`,
    `[a, b]`, `null`). The result is checked like the file it overrides, so a misspelt key is still an error."""
    import yaml

    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: write key=value, e.g. train.max_steps=100")
        keys, section = key.split("."), data
        for name in keys[:-1]:
            section = section.setdefault(name, {})
            if not isinstance(section, dict):
                raise ConfigError(f"--set {item!r}: {name} is a value, not a section")
        section[keys[-1]] = yaml.safe_load(text)
    return data


def load_sections(
    path: str | Path, sections: Mapping[str, type], required: tuple[str, ...] = (), overrides: Iterable[str] = ()
) -> dict[str, Any]:
    """A recipe file of named sections, each built into its config class (absent ones get the defaults)."""
    recipe = apply_overrides(load_file(path), overrides)
    unknown = sorted(set(recipe) - set(sections))
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {', '.join(unknown)}; use {', '.join(sections)}")
    missing = [name for name in required if name not in recipe]
    if missing:
        raise ConfigError(f"{path}: the {', '.join(missing)} section is required")
    return {name: from_dict(cls, recipe.get(name) or {}, name) for name, cls in sections.items()}


def replace_checked(config: T, where: str | None = None, /, **changes: Any) -> T:
    """A copy of ``config`` with ``changes`` applied and validated like a fresh load; errors name ``where``."""
    return from_dict(type(config), {**to_dict(config), **changes}, where)


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {tp}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(repr(a) for a in args)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        key_type, item = args if args else (Any, Any)
        return {_coerce(key_type, k, where): _coerce(item, v, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return from_dict(tp, value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, Path):
            return str(value)
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
    return value


def check(condition: bool, message: str) -> None:
    """Raise ConfigError(message) unless condition holds (for __post_init__)."""
    if not condition:
        raise ConfigError(message)
