"""Module swap: nn.Linear -> Float8Linear, post-order, parameters shared not copied.

`convert_to_float8_training` first plans: it walks the model children first, asks the
filter about each nn.Linear once, and records what it will convert and what it skips with
the reason (`ConversionReport`, kept on the model as `model.float8_conversion_report`).
Every refusal (a config that casts nothing, a layer already converted with another config,
a tied weight under float8 all-gather) is raised from the plan, before any module changes.
Then it swaps. A root nn.Linear is converted too, and the new module is returned.
Mixture-of-experts modules (3-D expert weights, `fsdp_float8.experts.modules`) are planned
and reported the same way, as experts converted or skipped with the reason.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_float8.core.config import Float8LinearConfig, as_float8_linear_config
from fsdp_float8.core.config_fields import Float8ConfigError
from fsdp_float8.core.families import (
    DEFAULT_RECIPE,
    broadcasting,
    families_where,
    recipe_where,
    scaled_per_row,
)
from fsdp_float8.experts import modules as expert_modules
from fsdp_float8.nn.linear import Float8Linear
from fsdp_float8.weight_wrappers.wrap import note_replaced

ModuleFilter = Callable[[nn.Module, str], bool]

# called with each model that conversion gave float8 layers: the float8 step registers one
# (`fsdp_float8.fsdp.step`, a layer above, loaded by `import fsdp_float8`) that turns the
# model's step on, so this module never imports it
AFTER_CONVERSION: list[Callable[[nn.Module], object]] = []


@dataclass
class ConversionReport:
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    experts_converted: list[str] = field(default_factory=list)
    experts_skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"float8: converted {len(self.converted)} linear layers"]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped.items()]
        if self.experts_converted or self.experts_skipped:
            lines.append(f"float8: converted {len(self.experts_converted)} expert modules")
            lines += [f"  skipped experts {n}: {why}" for n, why in self.experts_skipped.items()]
        return "\n".join(lines)


def dims_divisible_by_16(module: nn.Module, fqn: str) -> bool:
    """Default filter: float8 GEMMs need both linear dims to be multiples of 16."""
    if not isinstance(module, nn.Linear):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


@dataclass
class _Swap:
    parent: nn.Module | None  # None for a root nn.Linear
    name: str
    fqn: str
    linear: nn.Module  # an nn.Linear, or an experts module (expert swaps)
    config: Float8LinearConfig | None = None  # expert swaps: the experts' config
    # the same module held by other parents too (the model reaches it under other names)
    also: list[tuple[nn.Module, str]] = field(default_factory=list)

    def put(self, new: nn.Module) -> None:
        for parent, name in [(self.parent, self.name), *self.also]:
            setattr(parent, name, new)


def convert_to_float8_training(
    module: nn.Module,
    *,
    config: Float8LinearConfig | object | None = None,
    module_filter_fn: ModuleFilter | None = None,
    expert_config: Float8LinearConfig | object | None = None,
    expert_filter_fn: ModuleFilter | None = None,
) -> nn.Module:
    """Swap every nn.Linear that the filter accepts for a Float8Linear, in place, and
    return the model (for a root nn.Linear: the new Float8Linear).

    The filter gets `(module, fully_qualified_name)` (the root's name is ""). Without one,
    linears whose dims are not multiples of 16 are skipped (unless `config.pad_inner_dim`).
    With `config.enable_fsdp_float8_all_gather`, each converted weight is wrapped so that
    FSDP2 all-gathers it in float8 (apply `fully_shard` after this call). A torchao.float8
    `Float8LinearConfig` is converted field by field (`core.config.as_float8_linear_config`).
    Experts modules (torchtitan-style w1/w2/w3 or transformers gate_up_proj/down_proj) are
    swapped for float8 experts with `expert_config` (default: `config`) where
    `expert_filter_fn` accepts them (default: all), and reported
    (`report.experts_converted` / `experts_skipped`). The returned model gets its float8
    step (`fsdp_float8.float8_step`): precomputed weight scales and delayed-scaling state
    are refreshed after each optimizer step. The first argument is named `module`, as in
    torchao.
    """
    model = module
    config = _layer_config(config)
    expert_config = _expert_layer_config(expert_config)
    _refuse_high_precision_config(config)
    report = ConversionReport()
    plan = _plan_linears(model, config, module_filter_fn, report)
    expert_plan: list[_Swap] = []
    _plan_experts(model, "", expert_config or config, expert_filter_fn, report, expert_plan)
    model = _swap_linears(model, plan, config, report)
    _swap_experts(expert_plan, report)
    model.float8_conversion_report = report  # type: ignore[assignment]
    if module_filter_fn is None:
        _warn_default_skips(report)
    if expert_filter_fn is None:
        _warn_expert_skips(report)
    if report.converted or report.experts_converted:
        for hook in AFTER_CONVERSION:  # the float8 step: no float8 call in the training loop
            hook(model)
    return model


def _expert_layer_config(expert_config: object) -> object:
    """`expert_config` as the experts conversion reads it: a config that converts experts
    as it is, any other as `as_float8_linear_config` reads it; None stays None."""
    if expert_config is None or expert_modules.converts_experts(expert_config):
        return expert_config
    return as_float8_linear_config(expert_config, "expert_config")


def _plan_linears(
    model: nn.Module, config: Float8LinearConfig, module_filter_fn, report: ConversionReport
) -> list[_Swap]:
    """The nn.Linear swaps (a root nn.Linear included), each skip noted in `report`; raises
    before any module changes for a root with children and, under float8 all-gather, for
    a tied weight."""
    plan: list[_Swap] = []
    if isinstance(model, nn.Linear):
        if any(True for _ in model.children()):
            raise Float8ConfigError(
                f"Does not support a root nn.Linear with children: this {type(model).__name__} "
                f"has {list(dict(model.named_children()))}, which converting it would drop. "
                "Convert a module that holds it instead"
            )
        _plan_linear(_Swap(None, "", "", model), config, module_filter_fn, report, plan)
    else:
        _plan_children(model, "", config, module_filter_fn, report, plan)
    if config.enable_fsdp_float8_all_gather:
        _refuse_tied_weights(model, plan, module_filter_fn)
    return plan


def _swap_linears(
    model: nn.Module, plan: list[_Swap], config: Float8LinearConfig, report: ConversionReport
) -> nn.Module:
    """Put each planned layer in place; the model, or the new layer for a root nn.Linear."""
    for swap in plan:
        assert isinstance(swap.linear, nn.Linear)  # _plan_linear planned it
        new = _to_float8(swap.linear, config, swap.fqn)
        _name_replaced(swap, new, ("weight",))
        if swap.parent is None:
            model = new
        else:
            swap.put(new)
        report.converted.append(swap.fqn)
    return model


def _swap_experts(plan: list[_Swap], report: ConversionReport) -> None:
    """Put each planned float8 experts module in place, under every name it is held by."""
    for swap in plan:
        assert swap.config is not None  # _plan_experts sets it
        experts = expert_modules.to_float8_experts(swap.linear, swap.config)
        if hasattr(experts, "fqn"):  # experts whose random draws are seeded by their name
            cast(Any, experts).fqn = swap.fqn
        _name_replaced(swap, experts, experts.weight_names)
        swap.put(experts)
        report.experts_converted.append(swap.fqn)


def _warn_default_skips(report: ConversionReport) -> None:
    """Name the linears the default filter kept in high precision: torchao.float8 converts
    every linear when given no filter (a layer CUDA's float8 GEMM cannot take fails there),
    so code written for it would otherwise lose those layers without a word."""
    skipped = {n: why for n, why in report.skipped.items() if why.startswith("dims (")}
    if not skipped:
        return
    named = ", ".join(
        f"'{n}' {why[len('dims ') : why.index(')') + 1]}" for n, why in skipped.items()
    )
    warnings.warn(
        f"convert_to_float8_training kept {len(skipped)} linear layer(s) in high precision, "
        f"whose dims are not multiples of 16 (float8 GEMMs need them): {named}. torchao.float8 "
        "would convert them and fail at their first GEMM. To choose yourself pass "
        "module_filter_fn (with emulate=True any dims run); pad_inner_dim=True pads them "
        f"({families_where(broadcasting, 'and')}); model.float8_conversion_report lists "
        "every skip",
        UserWarning,
        stacklevel=3,
    )


# skips that are no loss to tell: the user's filter, a module converted before, 3-D
# parameters in no expert layout (a Conv1d's weight, for one)
_QUIET_EXPERT_SKIPS = ("rejected by expert_filter_fn", "already float8 experts", "3-D parameters")


def _warn_expert_skips(report: ConversionReport) -> None:
    """Name the experts modules kept in high precision by the config or their dims, where
    no expert_filter_fn chose it: the report alone would let a MoE model train its experts
    in high precision without a word."""
    kept = {
        n: w for n, w in report.experts_skipped.items() if not w.startswith(_QUIET_EXPERT_SKIPS)
    }
    if not kept:
        return
    named = "; ".join(f"'{n}': {why}" for n, why in kept.items())
    warnings.warn(
        f"convert_to_float8_training kept {len(kept)} experts module(s) in high precision: "
        f"{named}. To keep them so without this warning pass expert_filter_fn=lambda m, "
        "fqn: False; model.float8_conversion_report lists every skip",
        UserWarning,
        stacklevel=3,
    )


def _layer_config(config: object) -> Float8LinearConfig:
    """A format's own layer config (one that names the layer class implementing it, its
    `linear_class`) as it is; any other config as `as_float8_linear_config` reads it."""
    if getattr(config, "linear_class", None) is not None:
        return config  # type: ignore[return-value]  # read through the same attributes
    return as_float8_linear_config(config)


def _converted(module: nn.Module) -> bool:
    """Whether `module` is a layer conversion made (it names its float8-cast weights)."""
    return getattr(module, "float8_weight_names", None) is not None


def _name_replaced(swap: _Swap, new: nn.Module, names: tuple[str, ...]) -> None:
    """Name each Parameter that float8 all-gather replaced by its fqn (for the optimizer
    check: an optimizer built before conversion still holds the old one)."""
    for name in names:
        old = getattr(swap.linear, name)
        if getattr(new, name) is not old:
            fqn = f"{swap.fqn}.{name}" if swap.fqn else name
            note_replaced(old, f"{fqn!r} {tuple(old.shape)}")


def _to_float8(linear: nn.Linear, config: Float8LinearConfig, fqn: str) -> nn.Linear:
    layer_class = getattr(config, "linear_class", Float8Linear)
    new = layer_class.from_float(linear, config)  # wraps the weight for float8 all-gather
    if hasattr(new, "fqn"):  # a layer whose random draws are seeded by its name
        new.fqn = fqn
    return new


def _seen(parent: nn.Module, name: str, child: nn.Module, plan: list[_Swap], seen: set) -> bool:
    """Whether `child` was met before under another name: the same module is planned (and
    reported) once, at its first fqn, and swapped under every name (not a tied weight)."""
    if id(child) not in seen:
        seen.add(id(child))
        return False
    for swap in plan:
        if swap.linear is child and (swap.parent, swap.name) != (parent, name):
            swap.also.append((parent, name))
    return True


def _plan_children(parent, prefix, config, module_filter_fn, report, plan, seen=None) -> None:
    seen = set() if seen is None else seen
    for name, child in list(parent.named_children()):
        fqn = f"{prefix}.{name}" if prefix else name
        if _seen(parent, name, child, plan, seen):
            continue  # its children were planned with it (their parents are the same)
        _plan_children(child, fqn, config, module_filter_fn, report, plan, seen)
        if isinstance(child, nn.Linear):
            _plan_linear(_Swap(parent, name, fqn, child), config, module_filter_fn, report, plan)


def _plan_experts(parent, prefix, config, filter_fn, report, plan, seen=None) -> None:
    """Experts modules (3-D parameters) below `parent`: planned for a swap or skipped."""
    seen = set() if seen is None else seen
    for name, child in list(parent.named_children()):
        fqn = f"{prefix}.{name}" if prefix else name
        if _seen(parent, name, child, plan, seen):
            continue
        if not (expert_modules.expert_layout(child) or expert_modules.has_3d_parameters(child)):
            _plan_experts(child, fqn, config, filter_fn, report, plan, seen)
            continue
        if not expert_modules.converts_experts(config) and (
            filter_fn is None or filter_fn(child, fqn)
        ):
            raise Float8ConfigError(
                f"{fqn} is an experts module, which a {type(config).__name__} cannot convert "
                "(no grouped GEMM for it); pass expert_config=Float8LinearConfig."
                f"from_recipe_name({recipe_where(scaled_per_row)!r}) (or another float8 "
                "recipe) for the experts, or "
                "expert_filter_fn=lambda m, fqn: False to keep them in high precision"
            )
        why = (
            expert_modules.skip_reason(child, config)
            if expert_modules.converts_experts(config)
            else "rejected by expert_filter_fn"
        )
        if why is None and filter_fn is not None and not filter_fn(child, fqn):
            why = "rejected by expert_filter_fn"
        if why:
            report.experts_skipped[fqn] = why
        else:
            plan.append(_Swap(parent, name, fqn, child, config))


def _plan_linear(swap: _Swap, config, module_filter_fn, report, plan) -> None:
    child, fqn = swap.linear, swap.fqn
    if isinstance(child.weight, DTensor) and not _converted(child):
        raise Float8ConfigError(
            f"{fqn or 'the root'}.weight is already a DTensor {child.weight.placements}: "
            "convert_to_float8_training must run before fully_shard and parallelize_module "
            "(build the model, convert it, apply the tensor-parallel plan with "
            "fsdp_float8.tensor_parallel.styles's float8 styles, then fully_shard the blocks and "
            "the root)"
        )
    why = _skip_reason(child, fqn, config, module_filter_fn)
    if why is None and _converted(child):
        why = _already_converted(child, fqn, config)
    if why:
        report.skipped[fqn] = why
    else:
        plan.append(swap)


def _skip_reason(child, fqn, config, module_filter_fn) -> str | None:
    if module_filter_fn is not None:
        return None if module_filter_fn(child, fqn) else "rejected by module_filter_fn"
    if not config.pad_inner_dim and not dims_divisible_by_16(child, fqn):
        hint = (
            "block recipes cannot pad"
            if config.uses_block_scales()
            else "set pad_inner_dim=True to pad"
        )
        return f"dims ({child.in_features}, {child.out_features}) not multiples of 16 ({hint})"
    return None


def _already_converted(child: nn.Module, fqn: str, config: Float8LinearConfig) -> str:
    if child.config == config:
        return "already a Float8Linear with this config"
    raise Float8ConfigError(
        f"{fqn or 'the root'} is already a Float8Linear with another config "
        f"({child.extra_repr()}; {child.config}); converting again would keep that config. "
        "Convert the original (unconverted) model, or exclude this layer with module_filter_fn"
    )


def _refuse_high_precision_config(config: Float8LinearConfig) -> None:
    if not config.any_float8():
        raise Float8ConfigError(
            "every cast of this Float8LinearConfig is disabled, so no GEMM would run in "
            "float8 while the layers would be reported as converted; enable at least one "
            f"cast (e.g. Float8LinearConfig.from_recipe_name({DEFAULT_RECIPE!r})) or do not "
            "convert"
        )


def _refuse_tied_weights(model: nn.Module, plan: list[_Swap], module_filter_fn) -> None:
    """A float8 all-gathered weight cannot serve another module in high precision. One
    module reached under two names is not a tie: the weight is tied when two modules hold it."""
    owners: dict[int, dict[str, int]] = {}  # parameter -> {its fqn: id of its module}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
            fqn = f"{prefix}.{pname}" if prefix else pname
            owners.setdefault(id(p), {})[fqn] = id(module)
    for swap in plan:
        held = owners.get(id(swap.linear.weight), {})
        if len(set(held.values())) <= 1:
            continue
        names = sorted(held)
        tied = tuple(s.fqn for s in plan if s.linear.weight is swap.linear.weight)
        keep_out = f"fqn != {tied[0]!r}" if len(tied) == 1 else f"fqn not in {tied!r}"
        if module_filter_fn is None:
            remedy = (
                f"`module_filter_fn=lambda m, fqn: {keep_out} and "
                "fsdp_float8.dims_divisible_by_16(m, fqn)` (the default filter, less this layer)"
            )
        else:
            names_out = " and ".join(repr(t) for t in tied)
            remedy = f"your module_filter_fn also returning False for {names_out}"
        raise Float8ConfigError(
            f"{swap.fqn or 'the root'}.weight is tied to {names}; a float8 all-gathered "
            "weight cannot also serve another module in high precision. Untie the weights, "
            f"or keep this layer out of float8 with {remedy}, or set "
            "enable_fsdp_float8_all_gather=False"
        )
