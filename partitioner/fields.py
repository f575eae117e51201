"""Fields read from JSON files, checked against the type the dataclass declares: a wrong type
(``"balance": "2,2,1,11"``) is a one-line error naming the field, never a TypeError deep inside
the planner or the simulator."""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import MISSING
from typing import Any, Union, get_args, get_origin


def conforms(value: Any, hint: Any) -> bool:
    """Whether the JSON ``value`` has the type ``hint`` (int, float, str, bool, None, list[...],
    tuple[...] as a JSON array, and unions of them). An int is a float; a bool is no number."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(conforms(value, h) for h in get_args(hint))
    if origin in (list, tuple):
        if not isinstance(value, list):
            return False
        args = get_args(hint)
        if origin is tuple and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(map(conforms, value, args))
        return all(conforms(v, args[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def describe(hint: Any) -> str:
    """The type as a reader of the JSON file would say it: ``int``, ``list[int]``."""
    if isinstance(hint, type) and get_origin(hint) is None:
        return "null" if hint is type(None) else hint.__name__
    return str(hint)


def typed(
    data: Mapping[str, Any], key: str, hint: Any, where: str, error: type[Exception],
    default: Any = MISSING,
) -> Any:
    """``data[key]``, checked against ``hint``; ``default`` when it is absent (if given: a
    dataclass field's ``default`` passes straight through), else ``error``. A value of the
    wrong type raises ``error`` naming the field and the type."""
    if key not in data:
        if default is not MISSING:
            return default
        raise error(f"{where} is missing the field {key!r}")
    value = data[key]
    if not conforms(value, hint):
        raise error(f"{where}: field {key!r} must be {describe(hint)}, got {value!r}")
    return value
