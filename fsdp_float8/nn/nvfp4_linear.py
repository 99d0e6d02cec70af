"""NVFP4Linear: nn.Linear whose three GEMMs take 4-bit NVFP4 operands (`core/nvfp4.py`).

The recipe (NVIDIA's NVFP4 pretraining recipe):
- forward `x @ W.T`: the input in 1x16 blocks along K, the weight in 16x16 tiles; both
  rounded to nearest.
- grad_input `grad_out @ W`: the same quantized weight, transposed (16x16 tiles are
  transpose-invariant: no second quantization); grad_out in 1x16 blocks along N,
  stochastically rounded.
- grad_weight `grad_out.T @ x`: both operands transformed by a 16x16 random Hadamard
  matrix along the token dim (their contraction dim, padded with zero tokens to a multiple
  of 16), then quantized in 1x16 blocks along it; grad_out stochastically rounded.
With `NVFP4Config(four_over_six=True)` every one of these casts (and the weight's FP4
all-gather) scales each block's amax to 6 or to 4, whichever dequantizes closer, with the
tensor factor amax / (6 * 256) (`core/nvfp4.py`); stochastic rounding and the Hadamard
transform act as above.
Every amax is the tensor's own (dynamic), except the weight's under FSDP2, which is the
whole weight's (`weight_wrappers/nvfp4.py`). The GEMMs (`nvfp4_gemm.nvfp4_mm`) are cuBLAS FP4
GEMMs on CUDA SM100+ (Blackwell); on CPU, which has no FP4 GEMM, and with `emulate=True`
they are emulated (each operand dequantized to float32, one float32 matmul). A CUDA device
below SM100 is refused without `emulate=True`, when the layer is built on it or at its
first forward there. The weight is quantized, and on CUDA its two GEMM operands (the output
GEMM's, grad_input's transposed) are built, once per unshard under FSDP2 and once per
version of an unsharded weight's values (`nn/nvfp4_weight_cache.py`); each GEMM takes them
as they are.

Randomness is reproducible and needs no generator state: the Hadamard signs of a layer
come from (seed, the layer's name); the rounding draws of a GEMM are a hash of (seed, the
layer's name, the GEMM, the bits of the gradient being rounded, the element's index)
(`nvfp4.hashed_uniform`), so a rerun, an activation-checkpoint recompute and a compiled
graph draw alike, and each rank and step draws afresh with its own gradients.

A layer is built by `convert_to_float8_training(model, config=NVFP4Config(...))`, which
names each layer; keep sensitive layers in high precision with `module_filter_fn`
(`high_precision_ends` keeps the first and last blocks out).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_float8.core import nvfp4, nvfp4_gemm
from fsdp_float8.core.blocks import expand_block_scale
from fsdp_float8.core.config_fields import Float8ConfigError
from fsdp_float8.core.gemms import PRIMARY_GEMM, Gemm, Operand, refuse_double_backward
from fsdp_float8.core.randomized import layer_seed, pad_tokens, rounding_draws
from fsdp_float8.core.scaling import tensor_amax
from fsdp_float8.experts.nvfp4_experts import EXPERTS_CLASSES
from fsdp_float8.nn.layer import QuantizedLinear
from fsdp_float8.nn.nvfp4_weight_cache import quantized_weight, release, weight_operand
from fsdp_float8.weight_wrappers.base import plain_weight
from fsdp_float8.weight_wrappers.nvfp4 import NVFP4FSDPWeight, NVFP4Weight


@dataclass(frozen=True)
class NVFP4Config:
    """How `convert_to_float8_training` builds NVFP4 layers.

    enable_fsdp_float8_all_gather: FSDP2 all-gathers the weights as NVFP4 (packed codes
      and e4m3 tile factors: 0.504 bytes per element) instead of in high precision.
    hadamard_grad_weight: the random Hadamard transform on grad_weight's operands.
    stochastic_rounding: stochastic rounding of grad_output (both of its GEMMs).
    seed: the seed of the Hadamard signs and the rounding draws.
    four_over_six: every NVFP4 cast of the layer (input, weight, grad_output, both
      grad_weight operands, and the weight's FP4 all-gather) encodes each block scaled to
      6 and to 4 and keeps the closer one, with the tensor factor amax / (6 * 256)
      (`core/nvfp4.py`). Composes with stochastic rounding and the Hadamard transform.
    emulate: emulated GEMMs (dequantize, float32 matmul) on CUDA too, e.g. on a device below
      SM100; CPU always emulates (it has no FP4 GEMM).
    """

    enable_fsdp_float8_all_gather: bool = False
    hadamard_grad_weight: bool = True
    stochastic_rounding: bool = True
    seed: int = 0
    emulate: bool = False
    four_over_six: bool = False
    # what conversion reads of any layer config
    pad_inner_dim: ClassVar[bool] = False
    linear_class: ClassVar[type]  # set below: NVFP4Linear
    weight_wrapper: ClassVar[type]  # set below: NVFP4FSDPWeight (what `wrap_weight` builds)
    experts_classes: ClassVar[dict[str, type]] = EXPERTS_CLASSES  # layout -> experts module

    def __post_init__(self) -> None:
        for name in (
            "enable_fsdp_float8_all_gather",
            "hadamard_grad_weight",
            "stochastic_rounding",
            "emulate",
            "four_over_six",
        ):
            if type(getattr(self, name)) is not bool:
                raise Float8ConfigError(
                    f"NVFP4Config.{name} must be a bool, got {getattr(self, name)!r}"
                )
        if type(self.seed) is not int or not 0 <= self.seed < 2**63:
            raise Float8ConfigError(
                f"NVFP4Config.seed must be an int in [0, 2**63), got {self.seed!r}"
            )
        if self.seed and not (self.hadamard_grad_weight or self.stochastic_rounding):
            raise Float8ConfigError(
                f"NVFP4Config(seed={self.seed}) seeds the Hadamard signs and the rounding "
                "draws, but hadamard_grad_weight and stochastic_rounding are both off: the "
                "seed would change nothing; turn one of them on or leave seed=0"
            )

    def uses_block_scales(self) -> bool:
        return True

    def any_float8(self) -> bool:
        return True


def _amax(t: torch.Tensor) -> torch.Tensor:
    return tensor_amax(t).reshape(())


# |x| / (block factor * tensor factor) beyond this clamps by more than rounding: the e2m1
# max 6 plus half its step to the next power of two (8)
_SATURATES_ABOVE = (nvfp4.E2M1_MAX + 8.0) / 2


def cast_stats(hp: torch.Tensor, q: nvfp4.NVFP4, rows: slice | None = None) -> torch.Tensor:
    """(amax, min scale, max scale, saturation, underflow, SQNR in dB) of `q`, the NVFP4 cast
    of `hp`, as one float32 device tensor (`rows`: `hp` is these rows of `q`). A block's
    scale is 1 / (its e4m3 factor * the tensor factor); saturation: the fraction of elements
    whose scaled magnitude is above the e2m1 max by more than rounding (> 7); underflow:
    non-zero in `hp`, zero in `q`; SQNR: 20 log10(|hp| / |hp - dequantized q|), inf when
    exact. The fractions are over all of `hp`'s elements."""
    hp = hp.detach().to(torch.float32)
    if hp.numel() == 0:  # an empty FSDP shard: nothing saturates or underflows
        zero = torch.zeros((), dtype=torch.float32, device=hp.device)
        return torch.stack([zero, zero, zero, zero, zero, zero + float("inf")])
    inv = q.block_inv_scale.to(torch.float32) * q.tensor_inv_scale
    if rows is not None:  # the factors of the blocks these rows lie in
        block_rows = q.block[0]
        inv = inv[rows.start // block_rows : -(-rows.stop // block_rows)]
    per_element = expand_block_scale(inv, q.block, hp.shape)
    deq = nvfp4.dequantize(q)
    deq = deq if rows is None else deq[rows]
    amax = tensor_amax(hp).reshape(())
    scale = inv.reciprocal()
    saturated = ((hp.abs() / per_element) > _SATURATES_ABOVE).float().mean()
    underflow = ((hp != 0) & (deq == 0)).float().mean()
    noise = (hp - deq).norm()
    sqnr = 20 * torch.log10(hp.norm() / noise)
    return torch.stack([amax, scale.min(), scale.max(), saturated, underflow, sqnr])


class _NVFP4LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, layer: NVFP4Linear):
        x2 = x.reshape(-1, x.shape[-1])
        fos = layer.config.four_over_six
        qx = nvfp4.quantize(x2, _amax(x2), nvfp4.ACTIVATION_BLOCK, four_over_six=fos)
        emulate = layer.config.emulate
        w = quantized_weight(weight, fos)
        operand = weight_operand(w, Gemm.OUTPUT, emulate)
        if operand is None:
            out = nvfp4_gemm.nvfp4_mm(qx, w.record, x.dtype, emulate=emulate)
        else:
            out = nvfp4_gemm.prepared_mm(qx, operand, x.dtype)
        ctx.save_for_backward(x2, weight)
        # the tiles (and operands) backward reuses; an unsharded weight's values cannot
        # change before then (autograd checks the saved weight's version)
        ctx.quantized = w if w.key else None
        ctx.layer = layer  # no shape on ctx: a symbolic one breaks torch 2.11's Dynamo
        # _unsafe_view: the same data, but not an autograd view, so an in-place op on the
        # output is allowed (as on nn.Linear's) and FSDP2 sees no view output
        return torch.ops.aten._unsafe_view(out, (*x.shape[:-1], out.shape[-1]))

    @staticmethod
    def backward(ctx, grad_out):
        x2, weight = ctx.saved_tensors
        refuse_double_backward("NVFP4Linear", weight.shape)
        layer: NVFP4Linear = ctx.layer
        x_shape = (*grad_out.shape[:-1], x2.shape[-1])
        grad_out = grad_out.reshape(-1, grad_out.shape[-1])
        cfg = layer.config
        sr, fos = cfg.stochastic_rounding, cfg.four_over_six
        act = nvfp4.ACTIVATION_BLOCK
        gen = rounding_draws(grad_out, layer.layer_seed, 0) if sr else None
        qgo = nvfp4.quantize(grad_out, _amax(grad_out), act, generator=gen, four_over_six=fos)
        w = ctx.quantized or quantized_weight(weight, fos)
        if ctx.quantized is not None:
            release(weight, ctx.quantized)
        operand = weight_operand(w, Gemm.GRAD_INPUT, cfg.emulate)
        if operand is None:
            qwt = nvfp4.transposed(w.record)
            grad_x = nvfp4_gemm.nvfp4_mm(qgo, qwt, x2.dtype, emulate=cfg.emulate)
        else:
            grad_x = nvfp4_gemm.prepared_mm(qgo, operand, x2.dtype)
        go_t, x_t = pad_tokens(grad_out.t()), pad_tokens(x2.t())
        if cfg.hadamard_grad_weight:
            matrix = layer.hadamard(grad_out.device)
            go_t, x_t = nvfp4.rht(go_t.float(), matrix), nvfp4.rht(x_t.float(), matrix)
        gen = rounding_draws(go_t, layer.layer_seed, 1) if sr else None
        qgo_t = nvfp4.quantize(go_t, _amax(go_t), act, generator=gen, four_over_six=fos)
        qx_t = nvfp4.quantize(x_t, _amax(x_t), act, four_over_six=fos)
        grad_w = nvfp4_gemm.nvfp4_mm(qgo_t, qx_t, weight.dtype, emulate=cfg.emulate)
        return grad_x.reshape(x_shape), grad_w, None


class NVFP4Linear(QuantizedLinear):
    """nn.Linear with NVFP4 GEMMs (module docstring). Build it with `from_float` or
    `convert_to_float8_training(model, config=NVFP4Config())`. `from_float`,
    `wrap_weight_for_fsdp` (the weight as an `NVFP4FSDPWeight`), the state-dict hooks and
    `float8_weight_names` are every quantized linear's (`QuantizedLinear`)."""

    delayed_scaling = None  # NVFP4 scales are dynamic

    def __init__(self, *args, config: NVFP4Config | None = None, **kwargs):
        super().__init__(*args, config=config, **kwargs)

    @classmethod
    def layer_config(cls, config) -> NVFP4Config:
        config = NVFP4Config() if config is None else config
        if not isinstance(config, NVFP4Config):
            raise TypeError(f"config must be an NVFP4Config, got {type(config).__name__}")
        return config

    @classmethod
    def check_device(cls, device: torch.device, config: NVFP4Config) -> None:
        nvfp4_gemm.check_nvfp4_gemm_device(device, emulate=config.emulate)

    def prepare(self) -> None:
        if self.in_features % 16 or self.out_features % 16:
            raise Float8ConfigError(
                f"NVFP4 needs both linear dims to be multiples of 16 (1x16 blocks, 16x16 "
                f"tiles), got ({self.in_features}, {self.out_features}); keep this layer in "
                "high precision with module_filter_fn"
            )
        if self.weight.device.type == "cuda":  # from_float checks its meta-built layers
            self.check_device(self.weight.device, self.config)
        self.fqn = ""  # named by conversion: seeds the layer's random draws

    @property
    def fqn(self) -> str:
        """The layer's name in its model: with the config's seed, it seeds the draws."""
        return self._fqn

    @fqn.setter
    def fqn(self, name: str) -> None:
        self._fqn = name
        self._reseed()

    def _reseed(self) -> None:
        self.layer_seed = layer_seed(self.config.seed, self._fqn)
        gen = torch.Generator().manual_seed(layer_seed(self.config.seed, self._fqn, "hadamard"))
        self._hadamard = nvfp4.random_hadamard(gen)

    # A property, not a `__setattr__` override: FSDP2 swaps the sharded and unsharded
    # weight in and out of the module by a plain dict write only while the class keeps
    # `nn.Module.__setattr__`; otherwise each swap registers the parameter anew.
    @property
    def config(self) -> NVFP4Config:
        return self._config

    @config.setter
    def config(self, config: NVFP4Config) -> None:
        """A new config (its seed) re-seeds the layer's draws once the layer is named."""
        self._config = config
        if "_fqn" in self.__dict__:
            self._reseed()

    def hadamard(self, device: torch.device) -> torch.Tensor:
        return self._hadamard.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            raise ValueError(
                "NVFP4Linear does not support tensor parallelism (a DTensor weight "
                f"{self.weight.placements}); use a float8 recipe for tensor-parallel layers"
            )
        if x.is_cuda:  # a layer built elsewhere and moved: refused before any quantization
            nvfp4_gemm.check_nvfp4_gemm_device(x.device, emulate=self.config.emulate)
        if not x.dtype.is_floating_point or x.dtype.itemsize == 1:
            raise TypeError(f"NVFP4Linear input has dtype {x.dtype}; expected a floating tensor")
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        elif x.dtype != self.weight.dtype:
            raise TypeError(
                f"NVFP4Linear input has dtype {x.dtype} but its weight is {self.weight.dtype}; "
                "both must match, as nn.Linear needs (cast the input or use autocast)"
            )
        with torch.autocast(x.device.type, enabled=False):
            out = _NVFP4LinearFn.apply(x, self.weight, self)
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
        return out

    # -- telemetry (`fsdp_float8.tools.telemetry`: what each cast does to its operand) ----
    TELEMETRY_FORMAT: ClassVar[str] = "nvfp4"  # the records' format word (float8: its dtype)
    # the cast observed per operand: the first GEMM's, as the layer casts it
    TELEMETRY_CASTS: ClassVar[dict[Operand, Gemm]] = PRIMARY_GEMM

    def telemetry_stats(self, operand: Operand, hp: torch.Tensor) -> torch.Tensor:
        """`cast_stats` of the layer's cast of `hp` (2-D) as `operand` for its first GEMM:
        the input in 1x16 blocks, the weight in 16x16 tiles (each with its own amax, as an
        unsharded layer casts them), grad_output in 1x16 blocks with the layer's rounding
        (its stochastic draws, which depend only on the layer and the gradient's bits)."""
        fos = self.config.four_over_six
        if operand is Operand.WEIGHT:
            return cast_stats(
                hp, nvfp4.quantize(hp, _amax(hp), nvfp4.WEIGHT_BLOCK, four_over_six=fos)
            )
        draws = None
        if operand is Operand.GRAD_OUTPUT and self.config.stochastic_rounding:
            draws = rounding_draws(hp, self.layer_seed, 0)
        q = nvfp4.quantize(
            hp, _amax(hp), nvfp4.ACTIVATION_BLOCK, generator=draws, four_over_six=fos
        )
        return cast_stats(hp, q)

    def telemetry_weight_stats(self, sharded: DTensor | None) -> tuple[torch.Tensor, bool]:
        """`cast_stats` of the weight as the forward about to run takes it, and whether its
        saturation, underflow and SQNR are known. An unsharded weight: `telemetry_stats`.
        FSDP2's gathered `NVFP4Weight`: this rank's rows of it against this rank's shard
        (`sharded`, the FSDP2 sharded parameter: exactly what the shard's all-gather cast);
        without it only the amax and scales of the gathered weight are known."""
        weight = self.weight
        if not isinstance(weight, NVFP4Weight):
            return self.telemetry_stats(Operand.WEIGHT, plain_weight(weight)), True
        if sharded is None:
            deq = nvfp4.dequantize(weight.record)
            stats = cast_stats(deq, weight.record)
            stats[3:] = float("nan")
            return stats, False
        shard = plain_weight(sharded.to_local())
        world = sharded.device_mesh.size()
        start = sharded.device_mesh.get_local_rank() * -(-weight.shape[0] // world)
        rows = slice(start, start + shard.shape[0])
        return cast_stats(shard, weight.record, rows), True

    def extra_repr(self) -> str:
        c = self.config
        flags = f"hadamard_gw={c.hadamard_grad_weight}, sr_go={c.stochastic_rounding}"
        fsdp = ", fsdp_nvfp4_all_gather=True" if c.enable_fsdp_float8_all_gather else ""
        emulate = ", emulate=True" if c.emulate else ""
        fos = ", four_over_six=True" if c.four_over_six else ""
        return f"{super().extra_repr()}, nvfp4 {flags}{fsdp}{emulate}{fos}"


NVFP4Config.linear_class = NVFP4Linear
NVFP4Config.weight_wrapper = NVFP4FSDPWeight


def high_precision_ends(model: nn.Module, first: int = 1, last: int = 1, *, blocks: str = "layers"):
    """A `module_filter_fn` for `model` converting the linears (dims multiples of 16) inside
    its blocks `<blocks>.<i>.` except the first `first` and the last `last` blocks, and
    nothing outside the blocks (embeddings, the output head), as NVIDIA's NVFP4 recipe keeps
    them in high precision. Each stack of blocks counts apart (an encoder's
    `encoder.layers.<i>` and a decoder's `decoder.layers.<i>`: the ends of each)."""
    pattern = re.compile(rf"(?:^|\.){re.escape(blocks)}\.(\d+)\.")

    def stack_and_index(name: str) -> tuple[str, int] | None:
        match = pattern.search(name + ".")
        return None if match is None else (name[: match.start()], int(match.group(1)))

    stacks: dict[str, set[int]] = {}
    for name, _ in model.named_modules():
        if (found := stack_and_index(name)) is not None:
            stacks.setdefault(found[0], set()).add(found[1])
    if not stacks:
        raise ValueError(
            f"no blocks named '{blocks}.<i>' in the model; pass blocks= the attribute that "
            "holds the block list (e.g. blocks='layers' for model.layers)"
        )
    fewest = min(stacks, key=lambda s: len(stacks[s]))
    if first < 0 or last < 0 or first + last > len(stacks[fewest]):
        where = f" of the stack '{fewest or blocks}'" if len(stacks) > 1 else ""
        raise ValueError(
            f"first={first}, last={last}: expected two ints >= 0 summing to at most the "
            f"{len(stacks[fewest])} blocks{where}"
        )
    ends = {stack: max(indices) + 1 - last for stack, indices in stacks.items()}

    def keep(module: nn.Module, fqn: str) -> bool:
        found = stack_and_index(fqn)
        if found is None or found[0] not in ends or not isinstance(module, nn.Linear):
            return False
        dims_ok = module.in_features % 16 == 0 and module.out_features % 16 == 0
        return dims_ok and first <= found[1] < ends[found[0]]

    return keep
