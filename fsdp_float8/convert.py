"""Module swap: nn.Linear -> Float8Linear, post-order, parameters shared not copied.

`convert_to_float8_training` walks the model children first (so a replaced child is never
visited again), asks the filter about each nn.Linear, and records what it converted and
what it skipped with the reason (`ConversionReport`, kept on the model as
`model.float8_conversion_report`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_float8.config import Float8LinearConfig
from fsdp_float8.linear import Float8Linear

ModuleFilter = Callable[[nn.Module, str], bool]


@dataclass
class ConversionReport:
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"float8: converted {len(self.converted)} linear layers"]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def dims_divisible_by_16(module: nn.Module, fqn: str) -> bool:
    """Default filter: float8 GEMMs need both linear dims to be multiples of 16."""
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_float8_training(
    model: nn.Module,
    *,
    config: Float8LinearConfig | None = None,
    module_filter_fn: ModuleFilter | None = None,
) -> nn.Module:
    """Swap every nn.Linear that the filter accepts for a Float8Linear, in place.

    The filter gets `(module, fully_qualified_name)`. Without one, linears whose dims are
    not multiples of 16 are skipped (unless `config.pad_inner_dim`). With
    `config.enable_fsdp_float8_all_gather`, each converted weight is wrapped so that FSDP2
    all-gathers it in float8 (apply `fully_shard` after this call).
    """
    config = config or Float8LinearConfig()
    report = ConversionReport()
    if isinstance(model, nn.Linear) and not isinstance(model, Float8Linear):
        raise TypeError(
            "convert_to_float8_training swaps children in place, so the root cannot be an "
            "nn.Linear; wrap it (e.g. nn.Sequential(linear)) or use Float8Linear.from_float"
        )
    if config.enable_fsdp_float8_all_gather:
        _refuse_tied_linear_weights(model)
    _swap(model, "", config, module_filter_fn, report)
    model.float8_conversion_report = report
    return model


def _swap(parent, prefix, config, module_filter_fn, report) -> None:
    for name, child in list(parent.named_children()):
        fqn = f"{prefix}.{name}" if prefix else name
        _swap(child, fqn, config, module_filter_fn, report)
        if not isinstance(child, nn.Linear) or isinstance(child, Float8Linear):
            continue
        if isinstance(child.weight, DTensor):
            raise ValueError(
                f"{fqn}.weight is already a DTensor: convert_to_float8_training must run "
                "before fully_shard (build the model, convert it, then fully_shard the "
                "blocks and the root)"
            )
        why = _skip_reason(child, fqn, config, module_filter_fn)
        if why:
            report.skipped[fqn] = why
            continue
        new = Float8Linear.from_float(child, config)
        if config.enable_fsdp_float8_all_gather:
            from fsdp_float8.weight_wrappers import wrap_weight

            new.weight = wrap_weight(new.weight, new)
        setattr(parent, name, new)
        report.converted.append(fqn)


def _skip_reason(child, fqn, config, module_filter_fn) -> str | None:
    if module_filter_fn is not None:
        return None if module_filter_fn(child, fqn) else "rejected by module_filter_fn"
    if not config.pad_inner_dim and not dims_divisible_by_16(child, fqn):
        return (
            f"dims ({child.in_features}, {child.out_features}) not multiples of 16 "
            "(set pad_inner_dim=True to pad)"
        )
    return None


def _refuse_tied_linear_weights(model: nn.Module) -> None:
    owners: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(fqn)
    for fqn, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and len(owners.get(id(mod.weight), [])) > 1:
            names = owners[id(mod.weight)]
            raise ValueError(
                f"{fqn}.weight is tied to {names}; a float8 all-gathered weight cannot also "
                "serve another module in high precision. Untie the weights, or keep this "
                "layer out of float8 with module_filter_fn (e.g. lambda m, fqn: fqn != "
                f"{fqn!r}), or set enable_fsdp_float8_all_gather=False"
            )
