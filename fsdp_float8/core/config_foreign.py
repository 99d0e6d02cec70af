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
from typing import Any

from fsdp_float8.core.config import Float8LinearConfig, foreign_value
from fsdp_float8.core.config_fields import Float8ConfigError
from fsdp_float8.core.families import DEFAULT_RECIPE

_LINEAR_FIELDS = {f.name for f in dataclasses.fields(Float8LinearConfig)}
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
            f"Float8LinearConfig.from_recipe_name({DEFAULT_RECIPE!r})"
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
        fields[f.name] = foreign_value(getattr(config, f.name), f"{argument}.{f.name}", kind)
    for second, first in _SECOND_USE.items():
        if second in fields and fields[second] == fields.get(first):
            fields[second] = None  # torchao's default, resolved: ours resolves it alike
    return Float8LinearConfig(**fields)
