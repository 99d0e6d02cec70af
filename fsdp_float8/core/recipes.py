"""The named float8 recipes (torchao's names and contents), as data.

A recipe is the `Float8LinearConfig` fields it sets: cast configs as `CastConfig` keyword
dicts, plus flags. `Float8LinearConfig.from_recipe_name` builds the config; this module
needs nothing from `config.py`, so both can import it.

`_auto_filter_for_recipe` is torchao's module filter of the same name: it keeps a linear
only where float8 is expected to pay off for that recipe (dims multiples of 16 and above
size thresholds that torchao measured on H100 GPUs; a heuristic, not a rule for other
hardware) and never one whose fqn contains a string of `filter_fqns`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
from torch import nn

from fsdp_float8.core.config_fields import Float8ConfigError

E4M3 = torch.float8_e4m3fn


class Float8LinearRecipeName(enum.Enum):
    TENSORWISE = "tensorwise"
    # dynamic rowwise (axiswise) casts, e4m3 everywhere, power-of-2 scales
    ROWWISE = "rowwise"
    # rowwise forward and grad_input (the grad_input weight tensorwise), grad_weight in
    # high precision
    ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp"
    # (not torchao's; this package's) DeepSeek-V3 style: e4m3 everywhere, activations and
    # grad_output in 1x128 tiles along each GEMM's contraction dim, weights in 128x128
    # blocks, float32 scales (round_scales_to_power_of_2=True makes them powers of two)
    BLOCKWISE = "blockwise"
    # MXFP8: e4m3 data, e8m0 (power-of-two, RCEIL) scales per 32 elements along the
    # contraction dim; weights in 32x32 tiles so both weight GEMMs share one cast
    MXFP8 = "mxfp8"


def recipe_name_of(recipe_name: Float8LinearRecipeName | str) -> Float8LinearRecipeName:
    if isinstance(recipe_name, Float8LinearRecipeName):
        return recipe_name
    valid = [r.value for r in Float8LinearRecipeName]
    if isinstance(recipe_name, str) and recipe_name in valid:
        return Float8LinearRecipeName(recipe_name)
    raise Float8ConfigError(
        f"unknown float8 recipe {recipe_name!r}; expected a Float8LinearRecipeName or one "
        f"of {sorted(valid)}"
    )


# Every cast per row along the GEMM's contraction dim; e4m3 everywhere (the row scales
# give grad_output the range that e5m2 would otherwise buy); power-of-2 scales so the
# scale multiply is exact.
_AXIS = {"scaling_granularity": "axiswise", "target_dtype": E4M3}
# rowwise_with_gw_hp: the weight for grad_input is tensorwise (its contraction dim is the
# one FSDP shards); grad_weight stays in high precision. e4m3 is named on the disabled
# casts too, as torchao does, so an operand's two uses agree on the dtype.
_OFF = {"scaling_type": "disabled", "target_dtype": E4M3}


def _blocks(act: tuple[int, int], weight: tuple[int, int], scale_dtype: torch.dtype):
    def cast(shape):
        return {"scaling_granularity": "blockwise", "target_dtype": E4M3,
                "block_shape": shape, "scale_dtype": scale_dtype}  # fmt: skip

    return {
        "cast_config_input": cast(act),
        "cast_config_weight": cast(weight),
        "cast_config_grad_output": cast(act),
    }


_CASTS: dict[Float8LinearRecipeName, dict[str, dict]] = {
    Float8LinearRecipeName.TENSORWISE: {},
    Float8LinearRecipeName.ROWWISE: {
        "cast_config_input": _AXIS,
        "cast_config_weight": _AXIS,
        "cast_config_grad_output": _AXIS,
    },
    Float8LinearRecipeName.ROWWISE_WITH_GW_HP: {
        "cast_config_input": _AXIS,
        "cast_config_input_for_grad_weight": _OFF,
        "cast_config_weight": _AXIS,
        "cast_config_weight_for_grad_input": {"target_dtype": E4M3},
        "cast_config_grad_output": _AXIS,
        "cast_config_grad_output_for_grad_weight": _OFF,
    },
    Float8LinearRecipeName.BLOCKWISE: _blocks((1, 128), (128, 128), torch.float32),
    Float8LinearRecipeName.MXFP8: _blocks((1, 32), (32, 32), torch.float8_e8m0fnu),
}
_FLAGS: dict[Float8LinearRecipeName, dict[str, object]] = {
    Float8LinearRecipeName.TENSORWISE: {},
    Float8LinearRecipeName.ROWWISE: {"round_scales_to_power_of_2": True},
    Float8LinearRecipeName.ROWWISE_WITH_GW_HP: {"round_scales_to_power_of_2": True},
    Float8LinearRecipeName.BLOCKWISE: {},
    Float8LinearRecipeName.MXFP8: {"round_scales_to_power_of_2": True},
}


def recipe_fields(
    recipe_name: Float8LinearRecipeName | str,
) -> tuple[dict[str, dict], dict[str, object]]:
    """(cast config field -> CastConfig kwargs, other fields) of a named recipe."""
    name = recipe_name_of(recipe_name)
    return {k: dict(v) for k, v in _CASTS[name].items()}, dict(_FLAGS[name])


def _auto_filter_for_recipe(
    recipe: Float8LinearRecipeName | str, filter_fqns: list[str] | str
) -> Callable[[nn.Module, str], bool]:
    """A `module_filter_fn` for `recipe` (torchao's thresholds; see the module docstring).
    `filter_fqns` is a list of strings; a single string is one name (not its characters).
    For the other recipes torchao has no thresholds: NotImplementedError, as there."""
    fqns = names_list(filter_fqns, "filter_fqns")
    name = recipe_name_of(recipe)
    worth_it = _PAYS_OFF.get(name)
    if worth_it is None:
        raise NotImplementedError(
            f"_auto_filter_for_recipe has no size thresholds for {name.value!r} (nor has "
            "torchao's); pass your own module_filter_fn, or the 'rowwise' filter"
        )

    def module_filter_fn(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or any(f in fqn for f in fqns):
            return False
        n, k = module.weight.shape  # out_features, in_features
        return n % 16 == 0 and k % 16 == 0 and worth_it(n, k)

    return module_filter_fn


def names_list(names: object, argument: str) -> list[str]:
    """A list-of-names argument as a list: a string is one name (a JSON or command-line
    override gives one), never iterated character by character; every item must be a
    non-empty str (an empty one would match every fqn)."""
    items: list = [names] if isinstance(names, str) else _as_list(names)
    bad = [n for n in items if not isinstance(n, str) or not n]
    if bad or not isinstance(names, (str, list, tuple, set, frozenset)):
        what = f"{bad[0]!r} ({type(bad[0]).__name__})" if bad else type(names).__name__
        raise TypeError(
            f"{argument}={names!r}: expected a list of non-empty strings (or one string), "
            f"but got {what}; e.g. {argument}=['lm_head']"
        )
    return items


def _as_list(names: object) -> list:
    try:
        return list(names)  # type: ignore[call-overload]
    except TypeError:
        return [names]


def _tensorwise_pays_off(n: int, k: int) -> bool:
    return not (k <= 4096 and n <= 1024)


def _rowwise_pays_off(n: int, k: int) -> bool:
    return n > 2048 and k > 1024 and not (n <= 4096 and k <= 2048)


_PAYS_OFF = {
    Float8LinearRecipeName.TENSORWISE: _tensorwise_pays_off,
    Float8LinearRecipeName.ROWWISE: _rowwise_pays_off,
}
