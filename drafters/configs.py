"""Strict construction of config dataclasses from plain dicts (recipes, checkpoints).

One function serves the recipe loader (train/config.py) and checkpoint loading: unknown keys are errors that name
the full dotted field, values are coerced to the annotated type (YAML gives "1e-3" as a string), nested dataclasses
recurse.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Mapping


def from_dict(cls: type, data: Mapping[str, Any] | None, path: str = "") -> Any:
    """Build dataclass `cls` from `data`; raise ValueError naming `path.key` for unknown keys or bad values."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{path}." if path else ""
        raise ValueError(f"unknown config key(s) {', '.join(where + k for k in unknown)}; allowed: {sorted(names)}")
    kwargs = {name: coerce(hints[name], value, f"{path}.{name}" if path else name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as err:  # a required field is missing
        raise ValueError(f"{path or cls.__name__}: {err}") from None


def to_dict(config: Any) -> dict[str, Any]:
    """The inverse of from_dict, JSON/YAML friendly (tuples become lists)."""
    return _plain(dataclasses.asdict(config))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def coerce(annotation: Any, value: Any, path: str) -> Any:
    """Convert `value` to `annotation` (bool/int/float/str, Optional, list/tuple, dict, Literal, dataclass)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for arm in (a for a in args if a is not type(None)):
            try:
                return coerce(arm, value, path)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(f"{path}: {value!r} matches none of {annotation}: {'; '.join(errors)}")
    if origin is typing.Literal:
        if value not in args:
            raise ValueError(f"{path}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, Mapping):
            raise ValueError(f"{path}: expected a mapping, got {value!r}")
        return from_dict(annotation, value, path)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v for v in value.strip("[]()").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{path}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        items = [coerce(inner, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or annotation is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError(f"{path}: expected a bool, got {value!r}")
    if annotation in (int, float, str):
        if annotation is not str and isinstance(value, bool):
            raise ValueError(f"{path}: expected {annotation.__name__}, got {value!r}")
        try:
            converted = annotation(value.strip() if isinstance(value, str) else value)
        except (TypeError, ValueError):
            raise ValueError(f"{path}: expected {annotation.__name__}, got {value!r}") from None
        if annotation is int and isinstance(value, float) and value != converted:
            raise ValueError(f"{path}: expected an int, got {value!r}")
        return converted
    return value
