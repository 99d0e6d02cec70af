"""Configs from elsewhere: torchao.float8's `Float8LinearConfig` (or any config object with
the same field names) becomes this package's, field by field.

A user switching by import may still build the config with torchao (a library, a launcher or
a checkpointed job that pickled it). `as_float8_linear_config` reads such an object's
dataclass fields: cast configs by their `scaling_type`, `scaling_granularity` and
`target_dtype` (enums by value), GEMM configs by `use_fast_accum`, flags as they are. A
`*_for_grad_*` cast equal to its operand's primary cast is left for this package to fill
in, as torchao filled it. A field this package does not have is refused by name, and so is
an object that is not a dataclass; nothing is guessed.

Imports config.py (which does not import this module).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from fsdp_float8.core.config import CastConfig, Float8GemmConfig, Float8LinearConfig
from fsdp_float8.core.config_fields import Float8ConfigError

_LINEAR_FIELDS = {f.name for f in dataclasses.fields(Float8LinearConfig)}
_CAST_FIELDS = ("scaling_type", "scaling_granularity", "target_dtype")
_SECOND_USE = {
    "cast_config_input_for_grad_weight": "cast_config_input",
    "cast_config_weight_for_grad_input": "cast_config_weight",
    "cast_config_grad_output_for_grad_weight": "cast_config_grad_output",
}


def as_float8_linear_config(config: object, argument: str = "config") -> Float8LinearConfig:
    """`config` itself when it is a `Float8LinearConfig` (None: the default one); a foreign
    config with the same fields (torchao.float8's) converted field by field; else an error
    naming the type and what is expected."""
    if config is None:
        return Float8LinearConfig()
    if isinstance(config, Float8LinearConfig):
        return config
    kind = f"{type(config).__module__}.{type(config).__qualname__}"
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(
            f"{argument}={config!r} has type {kind}; expected an fsdp_float8."
            "Float8LinearConfig (torchao.float8's Float8LinearConfig is converted too), e.g. "
            "Float8LinearConfig.from_recipe_name('tensorwise')"
        )
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if f.name not in _LINEAR_FIELDS:
            raise Float8ConfigError(
                f"{argument} is a {kind} whose field {f.name}="
                f"{getattr(config, f.name)!r} fsdp_float8.Float8LinearConfig does not have; "
                "build an fsdp_float8.Float8LinearConfig instead (its fields: "
                f"{sorted(_LINEAR_FIELDS)})"
            )
        fields[f.name] = _value(getattr(config, f.name), f"{argument}.{f.name}", kind)
    for second, first in _SECOND_USE.items():
        if second in fields and fields[second] == fields.get(first):
            fields[second] = None  # torchao's default, resolved: ours resolves it alike
    return Float8LinearConfig(**fields)


def foreign_part(value: object, field: str) -> CastConfig | Float8GemmConfig:
    """A foreign cast or GEMM config (torchao.float8's) given inside this package's
    `Float8LinearConfig`, as this package's."""
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    return _value(value, f"Float8LinearConfig.{field}", kind)  # type: ignore[return-value]


def _value(value: Any, where: str, kind: str) -> object:
    if isinstance(value, (CastConfig, Float8GemmConfig)) or not dataclasses.is_dataclass(value):
        return value.value if isinstance(value, enum.Enum) else value
    kw = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if tuple(kw) == ("use_fast_accum",):
        return Float8GemmConfig(kw["use_fast_accum"])
    extra = [n for n in kw if n not in _CAST_FIELDS]
    if not set(_CAST_FIELDS) <= set(kw) or extra:
        raise Float8ConfigError(
            f"{where}={value!r} (in a {kind}) is neither a cast config ({_CAST_FIELDS}) nor a "
            f"GEMM config (use_fast_accum){'; unknown fields ' + str(extra) if extra else ''}; "
            "build an fsdp_float8.Float8LinearConfig instead"
        )
    for n in ("scaling_type", "scaling_granularity"):
        if isinstance(kw[n], enum.Enum):
            kw[n] = kw[n].value
    return CastConfig(**kw)
