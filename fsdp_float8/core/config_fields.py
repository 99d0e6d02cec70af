"""Config dataclass fields: type checks from the annotations, enum coercion, and the marks
that tell a value `Float8LinearConfig.__post_init__` filled in from one the user gave.

Why the marks: the configs are frozen and resolved at construction (each `*_for_grad_*`
cast config and each `target_dtype` is filled, as torchao fills them), but
`dataclasses.replace(config, cast_config_input=...)` passes every resolved field back to
`__init__`. A filled value carries a mark (an attribute outside the dataclass fields, so
equality, hashing and repr ignore it) and is derived again from the new fields.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
import types
import typing
from typing import Any, TypeVar

# on a CastConfig: "dtype" (target_dtype was filled with the operand's default) or
# "copy" (the whole config was copied from the operand's primary cast config)
FILLED = "_fsdp_float8_filled"
T = TypeVar("T")


class Float8ConfigError(ValueError, AssertionError):
    """A config or a conversion this package refuses (contradictory casts, a layer it
    cannot convert). A ValueError, as documented; also an AssertionError, which is what
    torchao.float8 raises for these, so code written `except AssertionError` for torchao
    catches it too."""


def mark_filled(obj: T, how: str) -> T:
    object.__setattr__(obj, FILLED, how)
    return obj


def filled(obj: object) -> str | None:
    return getattr(obj, FILLED, None)


def check_field_types(obj: Any) -> None:
    """TypeError naming the field, the value and the expected type, for each field of a
    config dataclass whose value does not match its annotation. Numbers are checked as
    numbers (an int is a float, a bool is neither); an enum field also takes its string
    value (coerced later)."""
    hints = _type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        allowed = _allowed_types(hints[f.name])
        if not any(_matches(value, t) for t in allowed):
            names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise TypeError(
                f"{type(obj).__name__}.{f.name}={value!r} has type {type(value).__name__}; "
                f"expected {names}; pass a {names} value (strings are not parsed)"
            )


_HINTS: dict[type, dict[str, Any]] = {}


def _type_hints(cls: type) -> dict[str, Any]:
    # resolving the string annotations is the slow part (~1 ms a class); they never change
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _allowed_types(hint) -> tuple[type, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _matches(value: object, expected: type) -> bool:
    if isinstance(value, bool) or expected is bool:
        return isinstance(value, bool) and expected is bool
    if expected is float:
        return isinstance(value, numbers.Real)
    if expected is int:
        return isinstance(value, numbers.Integral)
    if issubclass(expected, enum.Enum) and isinstance(value, str):
        return True
    return isinstance(value, expected)


def coerce_enum(obj: object, name: str, enum_cls: type[enum.Enum]) -> None:
    value = getattr(obj, name)
    if isinstance(value, enum_cls):
        return
    try:
        object.__setattr__(obj, name, enum_cls(value))
    except ValueError:
        raise Float8ConfigError(
            f"{name}={value!r} is not valid; expected one of {[e.value for e in enum_cls]}"
        ) from None
