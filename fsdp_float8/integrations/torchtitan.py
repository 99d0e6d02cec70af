"""torchtitan 0.3.x integration: this library's float8 linear inside torchtitan's config tree.

Mental model. torchtitan 0.3 builds a model from a tree of configs: every linear layer is a
`Linear.Config`, and converters (or `--override.imports` factories) swap configs before the
model is built on the meta device, sharded by FSDP2 and initialized. So nothing here touches
a built model: `Float8TitanLinear.Config` inherits `Linear.Config` (same fields, same
param_init and sharding), and builds this library's `Float8Linear` with the float8 config it
carries (tensorwise with float8 all-gather unless told otherwise). The float8 step (refresh
of precomputed weight scales and delayed-scaling sync, one collective per step) is wired to
the optimizer container once it is built: `float8_post_optimizer_build` as the model spec's
`post_optimizer_build_fn`, or the `float8_step` override on the optimizer config.

Two ways in, from the command line (see docs/integrations.md):

    # a stock config function, float8 added (any llama3_*/qwen3_*/... config name)
    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module fsdp_float8.integrations.torchtitan --config llama3_8b
    # the stock module and config, with overrides
    torchrun --nproc_per_node 8 -m torchtitan.train --module llama3 --config llama3_8b \\
        --override.imports fsdp_float8.integrations.torchtitan.float8_linears,\\
    fsdp_float8.integrations.torchtitan.float8_step

Supported torchtitan: 0.3.x (checked at import: any other version, or none, raises
`UnsupportedTorchtitanVersion` naming the version found and the supported range).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fsdp_float8.core.config import CastConfig, Float8LinearConfig, ScalingType
from fsdp_float8.core.families import DEFAULT_RECIPE
from fsdp_float8.core.recipes import names_list
from fsdp_float8.integrations import check_torchtitan_version

TORCHTITAN_VERSION = check_torchtitan_version()

from torchtitan.components.optimizer import OptimizersContainer  # noqa: E402
from torchtitan.components.quantization import QuantizationConverter  # noqa: E402
from torchtitan.config.override import derive, override  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.protocols.module import Module  # noqa: E402

from fsdp_float8.core.delayed_state import DelayedScalingState  # noqa: E402
from fsdp_float8.integrations.model_parts import enable_float8_steps  # noqa: E402
from fsdp_float8.nn.linear import Float8Linear  # noqa: E402

_SCALING_TYPES = ("dynamic", "delayed", "static")


def float8_config(
    recipe_name: str = DEFAULT_RECIPE,
    *,
    enable_fsdp_float8_all_gather: bool = True,
    scaling_type_input: str = "dynamic",
    scaling_type_weight: str = "dynamic",
    scaling_type_grad_output: str = "dynamic",
    static_scale: float | None = None,
    emulate: bool = False,
) -> Float8LinearConfig:
    """The `Float8LinearConfig` a converter or override builds from its (string) fields: a
    recipe, then per-operand scaling types (tensorwise only: delayed or static scaling of
    rowwise/block recipes is refused by the config with a remedy)."""
    types = {
        "input": scaling_type_input,
        "weight": scaling_type_weight,
        "grad_output": scaling_type_grad_output,
    }
    for operand, value in types.items():
        if value not in _SCALING_TYPES:
            raise ValueError(
                f"scaling_type_{operand}={value!r}; expected one of {_SCALING_TYPES}. Set it "
                "in the converter config or the override's kwargs"
            )
    casts = {}
    for operand, value in types.items():
        if value != "dynamic":
            static = static_scale if value == "static" else None
            casts[f"cast_config_{operand}"] = CastConfig(ScalingType(value), static_scale=static)
    return Float8LinearConfig.from_recipe_name(
        recipe_name,
        enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather,
        emulate=emulate,
        **casts,
    )


class _TitanDelayedScalingState(DelayedScalingState, Module):
    """A layer's delayed-scaling buffers as a torchtitan Module (torchtitan checks that every
    submodule is one); after `to_empty` the state resets itself (DelayedScalingState._apply),
    so `init_states` has nothing to add."""


class Float8TitanLinear(Float8Linear, Module):
    """This library's Float8Linear as a torchtitan Module: built from a `Linear.Config`
    subclass, initialized by torchtitan's `init_states` (param_init or reset_parameters)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        # opaque to torchtitan's CLI parser, as torchtitan's own float8 config field is
        _float8: object = None

    def __init__(self, config: Config):
        float8 = config._float8 if config._float8 is not None else float8_config()
        if not isinstance(float8, Float8LinearConfig):
            raise TypeError(
                f"Float8TitanLinear.Config._float8 is a {type(float8).__name__}; expected an "
                "fsdp_float8 Float8LinearConfig (build one with float8_config(...))"
            )
        Float8Linear.__init__(
            self, config.in_features, config.out_features, bias=config.bias, config=float8
        )
        if self.delayed_scaling is not None:  # same object (the weight wrapper holds it)
            self.delayed_scaling.__class__ = _TitanDelayedScalingState


def _accepts(cfg: Linear.Config, fqn: str | None, filter_fqns: list[str]) -> bool:
    """torchtitan's rule: a plain Linear (a subclass has its own forward) whose dims are
    multiples of 16, not named by `filter_fqns`."""
    if type(cfg) is not Linear.Config:
        return False
    if cfg.in_features % 16 or cfg.out_features % 16:
        return False
    return fqn is None or not any(part in fqn for part in filter_fqns)


def _float8_linear_config(cfg: Linear.Config, float8: Float8LinearConfig):
    return derive(cfg, Float8TitanLinear.Config, _float8=float8)


class Float8Converter(QuantizationConverter):
    """Swap every accepted `Linear.Config` of a model config for `Float8TitanLinear.Config`.
    Listed in `model_registry(..., converters=[Float8Converter.Config(...)])`; also set
    `float8_post_optimizer_build` as the model spec's `post_optimizer_build_fn`."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        # tensorwise, rowwise, rowwise_with_gw_hp, blockwise or mxfp8
        recipe_name: str = DEFAULT_RECIPE
        """A recipe name: a value of fsdp_float8.Float8LinearRecipeName."""
        enable_fsdp_float8_all_gather: bool = True
        """FSDP2 all-gathers converted weights in float8 (1 byte per element)."""
        scaling_type_input: str = "dynamic"
        scaling_type_weight: str = "dynamic"
        scaling_type_grad_output: str = "dynamic"
        """dynamic, delayed or static (delayed and static keep one scale per operand)."""
        static_scale: float | None = None
        """The scale of every operand whose scaling type is static."""
        filter_fqns: list[str] = field(default_factory=lambda: ["lm_head"])
        """Linears whose name contains one of these stay in high precision. One string is
        one name (torchtitan's own converter would test each of its characters)."""
        emulate: bool = False
        """Float32 GEMMs of the float8 operands (GPUs without float8 GEMMs; tests)."""

    def __init__(self, config: Config):
        self.config = config
        # bad names fail here: an empty one would keep every linear in high precision
        self.filter_fqns = names_list(config.filter_fqns, "Float8Converter.Config.filter_fqns")
        kwargs = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        for name in ("filter_fqns", "model_compile_enabled"):
            kwargs.pop(name)
        self.float8 = float8_config(**kwargs)  # bad values fail here, before any build

    def convert(self, model_config):
        for fqn, cfg, parent, attr in list(model_config.traverse(Linear.Config)):
            if not _accepts(cfg, fqn, self.filter_fqns):
                continue
            new = _float8_linear_config(cfg, self.float8)
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        return model_config


def float8_post_optimizer_build(optimizers, model_parts, parallel_dims=None) -> None:
    """The float8 step for a torchtitan run: `fsdp_float8.float8_step(part)` for each model
    part (pipeline stage) that holds float8 layers or experts (`enable_float8_steps`) (a refresh of precomputed weight scales and delayed state
    after each optimizer step, one collective per reduction group). Use as the model spec's
    `post_optimizer_build_fn`."""
    enable_float8_steps(model_parts)


# -- --override.imports: the stock configs, unchanged on disk ------------------------------


@override(
    target=Linear.Config,
    exact=True,
    fqns=["*layers.*"],
    description="fsdp_float8 float8 linears (lm_head stays in high precision)",
)
def float8_linears(cfg: Linear.Config, **kwargs) -> Linear.Config:
    """`--override.imports fsdp_float8.integrations.torchtitan.float8_linears` (kwargs as
    JSON: `...float8_linears={"recipe_name": "rowwise"}`, the converter's fields)."""
    if not _accepts(cfg, None, []):
        return cfg
    return _float8_linear_config(cfg, float8_config(**kwargs))


_stepping_classes: dict[Any, Any] = {}


def _with_float8_step(owner: Any) -> Any:
    """A subclass of the stock optimizer container that wires the float8 step at build."""
    if owner not in _stepping_classes:
        owner_config: Any = owner.Config

        class Float8StepOptimizers(owner):
            @dataclass(kw_only=True, slots=True)
            class Config(owner_config):
                pass

            def __init__(self, config, **kwargs):
                super().__init__(config, **kwargs)
                float8_post_optimizer_build(self, kwargs["model_parts"])

        Float8StepOptimizers.__name__ = Float8StepOptimizers.__qualname__ = (
            f"Float8Step{owner.__name__}"
        )
        _stepping_classes[owner] = Float8StepOptimizers
    return _stepping_classes[owner]


@override(target=OptimizersContainer.Config, description="fsdp_float8 float8 step")
def float8_step(cfg: OptimizersContainer.Config) -> OptimizersContainer.Config:
    """`--override.imports ...torchtitan.float8_step`: the optimizer container wires the
    float8 step (`float8_post_optimizer_build`) once it is built."""
    return derive(cfg, _with_float8_step(type(cfg)._owner).Config)


# -- --module fsdp_float8.integrations.torchtitan --config <stock config function> --------


def with_float8(config, converter: Float8Converter.Config | None = None):
    """A stock `Trainer.Config` with float8 linears and the float8 step: the converter is
    applied to the model config and `float8_post_optimizer_build` runs after the model
    spec's own `post_optimizer_build_fn`, if it has one."""
    converter = converter or Float8Converter.Config()
    spec = config.model_spec
    spec.model = converter.build().convert(spec.model)
    own = spec.post_optimizer_build_fn
    if own is None:
        spec.post_optimizer_build_fn = float8_post_optimizer_build
    elif own is not float8_post_optimizer_build:

        def both(optimizers, model_parts, parallel_dims=None) -> None:
            own(optimizers, model_parts, parallel_dims)
            float8_post_optimizer_build(optimizers, model_parts, parallel_dims)

        spec.post_optimizer_build_fn = both
    return config


def __getattr__(name: str) -> Callable:
    """`--config NAME`: torchtitan's config function NAME (llama3_debugmodel, qwen3_8b...)
    with float8 added by `with_float8`."""
    from torchtitan.models import _supported_models

    for family in sorted(_supported_models, key=len, reverse=True):
        if name.startswith(family + "_"):
            registry = importlib.import_module(f"torchtitan.models.{family}.config_registry")
            stock = getattr(registry, name, None)
            if callable(stock):
                return lambda: with_float8(stock())
    raise AttributeError(
        f"module {__name__!r} has no attribute {name!r}: --config takes the name of a "
        "torchtitan config function (e.g. llama3_debugmodel), prefixed by its model family"
    )
