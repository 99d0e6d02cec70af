"""torchao's conventions for a linear config, as data and pure reading; none of it interprets
a scaling word or builds a config class.

- The six cast fields carry torchao's names (`CAST_FIELD`): an operand's primary cast is
  `cast_config_<operand>`, its second `cast_config_<operand>_for_<gemm>`.
- A cast left unset is filled in as torchao fills it (`filled_casts`): the second cast is a
  copy of the primary one, the target dtype the operand's default (e4m3 for input and
  weight, e5m2 for grad_output). A filled value carries its mark (`config_fields`), so
  `dataclasses.replace` derives it again from the new fields.
- A foreign config (torchao.float8's, or any dataclass with its field names) is read field
  by field: a cast or GEMM config into the keyword arguments of this package's
  (`foreign_fields`), a linear config into the fields of this package's
  (`foreign_linear_fields`). A field this package lacks is refused by name.

`fsdp_float8.core.config` builds its classes from what this module returns, so this module
imports nothing of it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from fsdp_float8.core import families
from fsdp_float8.core.config_fields import Float8ConfigError, filled, mark_filled
from fsdp_float8.core.gemms import OPERAND_GEMMS, OPERANDS, PRIMARY_GEMM, SECOND_GEMM, Operand

# the config field that holds each (operand, GEMM) cast
CAST_FIELD = {
    (op, gemm): f"cast_config_{op.value}"
    + ("" if gemm is PRIMARY_GEMM[op] else f"_for_{gemm.value}")
    for op in OPERANDS
    for gemm in OPERAND_GEMMS[op]
}
DEFAULT_DTYPE = {
    Operand.INPUT: torch.float8_e4m3fn,
    Operand.WEIGHT: torch.float8_e4m3fn,
    Operand.GRAD_OUTPUT: torch.float8_e5m2,
}
# the fields of torchao.float8's CastConfig and Float8GemmConfig
FOREIGN_CAST_FIELDS = ("scaling_type", "scaling_granularity", "target_dtype")
FOREIGN_GEMM_FIELDS = ("use_fast_accum",)


def filled_casts(first: Any, second: Any, operand: Operand) -> tuple[Any, Any]:
    """An operand's primary and second `CastConfig` with the unset parts filled in (values
    filled by an earlier resolution, passed back by `dataclasses.replace`, are derived
    again). `second` is None when the user left it unset."""
    first = _with_dtype(_as_given(first), operand)
    if second is None or filled(second) == "copy":
        return first, mark_filled(replace(first), "copy")
    return first, _with_dtype(_as_given(second), operand)


def _as_given(cfg: Any) -> Any:
    """The cast config as the user gave it (undo a target_dtype we filled in)."""
    return replace(cfg, target_dtype=None) if filled(cfg) == "dtype" else cfg


def _with_dtype(cfg: Any, operand: Operand) -> Any:
    if cfg.target_dtype is not None:
        return cfg
    return mark_filled(replace(cfg, target_dtype=DEFAULT_DTYPE[operand]), "dtype")


def type_name(value: object) -> str:
    """The module-qualified name of `value`'s type, as errors about foreign configs say it."""
    return f"{type(value).__module__}.{type(value).__qualname__}"


def foreign_fields(value: Any, where: str, kind: str) -> dict[str, Any]:
    """A foreign cast or GEMM config dataclass (`where`: the field that holds it, `kind`: the
    type of the config around it) as keyword arguments: `FOREIGN_GEMM_FIELDS` for a GEMM
    config, `FOREIGN_CAST_FIELDS` (enums by their values) for a cast config; any other
    dataclass is refused, naming the fields it has beyond those."""
    kw = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if tuple(kw) == FOREIGN_GEMM_FIELDS:
        return kw
    extra = [n for n in kw if n not in FOREIGN_CAST_FIELDS]
    if not set(FOREIGN_CAST_FIELDS) <= set(kw) or extra:
        raise Float8ConfigError(
            f"{where}={value!r} (in a {kind}) is neither a cast config "
            f"({FOREIGN_CAST_FIELDS}) nor a GEMM config (use_fast_accum)"
            f"{'; unknown fields ' + str(extra) if extra else ''}; "
            "build an fsdp_float8.Float8LinearConfig instead"
        )
    for n in ("scaling_type", "scaling_granularity"):
        if isinstance(kw[n], enum.Enum):
            kw[n] = kw[n].value
    return kw


def foreign_linear_fields(
    config: object, argument: str, known: set[str], read: Callable[[Any, str, str], object]
) -> dict[str, Any]:
    """The fields of a foreign linear config (torchao.float8's Float8LinearConfig), each value
    read by `read(value, where, kind)`. A field not in `known` is refused by name; a second
    cast equal to its operand's primary one is left unset, as torchao filled it and this
    package fills it alike. Not a dataclass instance: a TypeError naming what is expected."""
    kind = type_name(config)
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(
            f"{argument}={config!r} has type {kind}; expected an fsdp_float8."
            "Float8LinearConfig (torchao.float8's Float8LinearConfig is converted too), e.g. "
            f"Float8LinearConfig.from_recipe_name({families.DEFAULT_RECIPE!r})"
        )
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if f.name not in known:
            raise Float8ConfigError(
                f"{argument} is a {kind} whose field {f.name}="
                f"{getattr(config, f.name)!r} fsdp_float8.Float8LinearConfig does not have; "
                "build an fsdp_float8.Float8LinearConfig instead (its fields: "
                f"{sorted(known)})"
            )
        fields[f.name] = read(getattr(config, f.name), f"{argument}.{f.name}", kind)
    for op in OPERANDS:
        first, second = (CAST_FIELD[(op, g)] for g in (PRIMARY_GEMM[op], SECOND_GEMM[op]))
        if second in fields and fields[second] == fields.get(first):
            fields[second] = None  # torchao's default, resolved: ours resolves it alike
    return fields
