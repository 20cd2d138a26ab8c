"""`laminar config --explain KEY`: a key's description, type, default and allowed values, read
from the schema's own Field metadata (the one place they are written); `laminar config` lists
every key with its default.

    explain("trainer.lr")   # 'trainer.lr\n  AdamW learning rate.\n  type: float (> 0.0) ...'

An unknown key is one ConfigError naming the closest keys; a retired or renamed one says what
replaced it."""

from __future__ import annotations

import difflib
import textwrap
import types
from collections.abc import Iterator
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from laminar.config.base import ConfigError
from laminar.config.load import RENAMED, RETIRED
from laminar.config.schema import Config

_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "multiple_of": "a multiple of",
           "min_length": "at least this many items:", "max_length": "at most this many items:"}


def explain(key: str) -> str:
    """The text `laminar config --explain KEY` prints; ConfigError for a key that is not one."""
    key = key.strip()
    if key in RENAMED:
        new, why = RENAMED[key]
        raise ConfigError(f"'{key}' is now {new} ({why}); try --explain {new}")
    if key in RETIRED:
        raise ConfigError(f"'{key}': {RETIRED[key]}")
    field = _find(key)
    if field is None:
        raise ConfigError(f"unknown key '{key}'{_close_matches(key)}")
    lines = [key, textwrap.fill(field.description or "", 92, initial_indent="  ",
                                subsequent_indent="  ")]
    section = _section_of(field.annotation)
    if section is not None:
        kind = ("a list of sections, each with" if get_origin(field.annotation) is list
                else "an optional section (unset by default) with" if field.default is None
                else "a section with")
        lines.append(f"  {kind} keys: {', '.join(section.model_fields)}")
        return "\n".join(lines)
    lines.append(f"  type:    {_type_name(field.annotation)}{_bounds(field)}")
    lines.append(f"  default: {_default(field)}")
    allowed = _literal_values(field.annotation)
    if allowed:
        lines.append(f"  allowed: {', '.join(_show(v) for v in allowed)}")
    return "\n".join(lines)


def every_key() -> str:
    """`laminar config`: one line per key, `key = default`."""
    return "\n".join(f"{key} = {_default(field)}"
                     for key, field in _walk(Config) if _section_of(field.annotation) is None)


def _walk(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    for name, field in model.model_fields.items():
        yield prefix + name, field
        section = _section_of(field.annotation)
        if section is not None:
            yield from _walk(section, f"{prefix}{name}.")


def _find(key: str) -> FieldInfo | None:
    return dict(_walk(Config)).get(key)


def _close_matches(key: str) -> str:
    keys = [k for k, _ in _walk(Config)]
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    names = list(dict.fromkeys(same_leaf + close))[:5]
    if not names:
        return "; `laminar config` lists every key"
    return f". Did you mean {', '.join(repr(n) for n in names)}?"


def _section_of(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds: itself, optional, or a list of them."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _section_of(arg)
        if found is not None:
            return found
    return None


def _literal_values(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    for arg in get_args(annotation):  # Optional[Literal], list[Literal]
        values = _literal_values(arg)
        if values:
            return values
    return ()


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return " | ".join(dict.fromkeys(type(v).__name__ for v in get_args(annotation)))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(annotation))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in get_args(annotation))}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(field: FieldInfo) -> str:
    found = [f"{_BOUNDS[name]} {getattr(m, name)}" for m in field.metadata for name in _BOUNDS
             if getattr(m, name, None) is not None]
    return f" ({', '.join(found)})" if found else ""


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "none: required when its section is set"
    return _show(field.get_default(call_default_factory=True))


def _show(value: Any) -> str:
    if value is None:
        return "null (unset)"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, BaseModel):
        value = value.model_dump()
    return repr(value) if isinstance(value, str) else str(value)
