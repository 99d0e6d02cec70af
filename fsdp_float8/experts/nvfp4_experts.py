"""NVFP4 experts: the three GEMMs of each expert run as `NVFP4Linear` runs them, and FSDP2
all-gathers the 3-D expert weights as NVFP4 (4-bit codes and e4m3 tile factors).

Mental model: an experts module holds 3-D weights `(E, out, in)` (`experts.modules`), each
`weight[e]` an nn.Linear weight; the tokens arrive grouped by expert (offsets). Per expert
e, on its token rows, the GEMMs are `NVFP4Linear`'s with the same recipe
(`nn/nvfp4_linear.py`): the input in 1x16 blocks and the weight in 16x16 tiles for the
output (round to nearest); grad_output in 1x16 blocks, stochastically rounded, times the
same quantized weight transposed for grad_input; both grad_weight operands through a 16x16
random Hadamard transform along the expert's tokens (zero tokens padded to a multiple of
16), then 1x16 blocks, grad_output stochastically rounded. Four-over-six applies to every
cast as in the linear. Each expert is its own layer: its draws and Hadamard signs are those
of an `NVFP4Linear` named `<experts fqn>.<weight name>.<e>`, so the grouped GEMMs equal E
such linears run one by one, bit for bit (a test checks).

The tensor factor: per expert. Each `weight[e]` is quantized with its own amax (its
tensor factor one float32 per expert: `nvfp4.quantize_per_matrix`), as each activation
and gradient group is quantized with its own amax. Why per expert and not one factor for
the whole (E, out, in) weight: the experts are separate matrices whose magnitudes drift
apart in training, and a shared factor would give a small expert coarse tile factors; and
FSDP2 shards a 3-D weight over dim 0, the experts, so every shard holds whole experts and
its amaxes are its own: no amax collective, no float8-step refresh, and a shard
quantizes exactly as the unsharded weight does. A shard that splits an expert
(`fully_shard(shard_placement_fn=...)` returning Shard(1) or Shard(2)) is refused at its
first all-gather with a ValueError naming the weight and the remedy (Shard(0)).

FP4 all-gather (`NVFP4Config(enable_fsdp_float8_all_gather=True)`): each rank quantizes
its shard (E_local, out, in) and sends three uint8 inputs that gather along dim 0 into the
unsharded layout: the packed codes (E_local, out, in / 2), the tile factors
(E_local, out / 16, in / 16) and the per-expert tensor factors (E_local, 4), the float32
bytes: 0.5 + 1/256 bytes per element plus 4 per expert. The unsharded weight is an
`NVFP4Weight` holding that record (E, out, in): the GEMMs read it as it arrived, nothing
is dequantized or quantized again. The packed shard is kept while the weight's values
stand, so backward's re-gather sends forward's bytes.

Devices: each expert's GEMM is `nvfp4_gemm.nvfp4_mm`, as in the linear: on CPU (no FP4 GEMM)
and with `emulate=True` emulated (operands dequantized to float32, one float32 matmul);
on CUDA SM100+ one cuBLAS FP4 GEMM per expert (a loop: no grouped FP4 GEMM is used); a
CUDA device below SM100 is refused unless `emulate=True`. The loop reads the group
bounds on the host (one device-to-host copy per grouped GEMM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_float8.core import nvfp4, nvfp4_gemm
from fsdp_float8.core.config_fields import Float8ConfigError
from fsdp_float8.core.gemms import refuse_double_backward
from fsdp_float8.core.randomized import layer_seed, pad_tokens, rounding_draws
from fsdp_float8.core.scaling import tensor_amax
from fsdp_float8.experts.modules import (
    _FUSED,
    _TITAN,
    Float8ExpertsBase,
    Float8FusedExperts,
    Float8GroupedExperts,
    _plain_weights_in_state_dict,
)
from fsdp_float8.weight_wrappers.base import Float8WeightWrapper, plain_weight
from fsdp_float8.weight_wrappers.cast import WeightCast
from fsdp_float8.weight_wrappers.nvfp4 import NVFP4Weight, nvfp4_cast

TILE = nvfp4.WEIGHT_BLOCK


def _amax(t: torch.Tensor) -> torch.Tensor:
    return tensor_amax(t).reshape(())


# ------------------------------------------------------------------------ the FP4 gather


class NVFP4ExpertsFSDPWeight(Float8WeightWrapper):
    """A high-precision (E, out, in) experts weight whose FSDP2 all-gather sends NVFP4, each
    expert with its own tensor factor (module docstring)."""

    @classmethod
    def cast_of(cls, config) -> WeightCast:
        return nvfp4_cast(config)

    @property
    def needs_global_amax(self) -> bool:
        return False  # each expert's amax is local to the dim-0 shard that holds it

    @property
    def needs_row_shards(self) -> bool:
        return True  # whole experts per shard (Shard(0)); the base hook refuses the rest

    def pack_shard(self, mesh, outer_size, module):
        if self.dim() != 3:
            raise ValueError(
                f"{type(self).__name__} gathers 3-D experts weights (E, out, in), got the "
                f"{tuple(self.shape)} {self.param_name} of {type(module).__name__}; wrap a "
                "2-D weight with NVFP4FSDPWeight (an NVFP4Linear)"
            )
        q = nvfp4.quantize_per_matrix(self._tensor, four_over_six=self._config.four_over_six)
        tiles = q.block_inv_scale.view(torch.uint8)
        factors = q.tensor_inv_scale.view(torch.uint8).reshape(-1, 4)
        packed: tuple
        if mesh.size() == 1:  # FSDP2 hands the post-hook only the first input
            packed = (q.packed,), NVFP4ExpertsGather(tiles, factors)
        else:
            packed = (q.packed, tiles, factors), NVFP4ExpertsGather()
        # made from this shard's values alone: reusable while they stand
        self._state.remember_pack((mesh, tuple(outer_size), self.shape), packed)
        return packed


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


@dataclass(frozen=True, eq=False)
class NVFP4ExpertsGather:
    """The all-gather metadata: nothing, or at shard size 1 the tile and tensor factors
    (FSDP2 then passes the post-hook only the codes)."""

    local_tiles: torch.Tensor | None = None
    local_factors: torch.Tensor | None = None

    def build(self, outputs: tuple[torch.Tensor, ...], param_dtype):
        packed = outputs[0]
        if self.local_tiles is None or self.local_factors is None:
            tiles, factors = outputs[1], outputs[2]
            inner = [packed, tiles, factors]
        else:  # this shard's, remade at each gather: copies of their own
            tiles, factors = self.local_tiles.clone(), self.local_factors.clone()
            inner = [packed]
        record = nvfp4.NVFP4(
            packed, tiles.view(nvfp4.E4M3), factors.view(torch.float32).reshape(-1), TILE
        )
        return NVFP4Weight(record, param_dtype), inner

    def refill(self, out, outputs: tuple[torch.Tensor, ...]) -> None:
        packed = outputs[0]
        record = out.record if isinstance(out, NVFP4Weight) else None
        if record is None or not _same_storage(record.packed, packed):
            raise TypeError(f"expected the unsharded NVFP4Weight over {tuple(packed.shape)}")
        if self.local_tiles is not None and self.local_factors is not None:
            record.block_inv_scale.view(torch.uint8).copy_(self.local_tiles)
            record.tensor_inv_scale.view(torch.uint8).copy_(self.local_factors.reshape(-1))


# ------------------------------------------------------------------------ the GEMMs


def quantized_experts(weight: torch.Tensor, four_over_six: bool) -> nvfp4.NVFP4:
    """The (E, out, in) weight in 16x16 tiles, one tensor factor per expert: as FSDP2
    gathered it, or quantized here from the high-precision weight."""
    if isinstance(weight, NVFP4Weight):
        return weight.record
    return nvfp4.quantize_per_matrix(plain_weight(weight), four_over_six=four_over_six)


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()  # host copy: one GEMM per expert
    return list(zip([0, *ends[:-1]], ends))


class _NVFP4GroupedFn(torch.autograd.Function):
    """x (M, in) grouped by `offs` times weight (E, out, in) transposed: (M, out)."""

    @staticmethod
    def forward(ctx, x, weight, offs, module: NVFP4ExpertsMixin, name: str):
        cfg = module.config
        fos, emulate = cfg.four_over_six, cfg.emulate
        q = quantized_experts(weight, fos)
        bounds = _bounds(offs)
        out = x.new_zeros((x.shape[0], q.shape[1]))  # rows past the groups: zeros
        for e, (s, t) in enumerate(bounds):
            if t > s:
                xe = x[s:t]
                qx = nvfp4.quantize(xe, _amax(xe), nvfp4.ACTIVATION_BLOCK, four_over_six=fos)
                out[s:t] = nvfp4_gemm.nvfp4_mm(qx, nvfp4.matrix(q, e), x.dtype, emulate=emulate)
        ctx.save_for_backward(x, weight)
        # an unsharded weight's tiles serve backward (autograd checks its version); a
        # gathered one is read again from its record (FSDP2 re-gathers it for backward)
        ctx.quantized = None if isinstance(weight, NVFP4Weight) else q
        ctx.bounds, ctx.module, ctx.name = bounds, module, name
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        refuse_double_backward(type(ctx.module).__name__, weight.shape)
        module: NVFP4ExpertsMixin = ctx.module
        cfg = module.config
        sr, fos, emulate = cfg.stochastic_rounding, cfg.four_over_six, cfg.emulate
        q = ctx.quantized if ctx.quantized is not None else quantized_experts(weight, fos)
        act = nvfp4.ACTIVATION_BLOCK
        grad_x = torch.zeros_like(x)
        grad_w = torch.zeros(weight.shape, dtype=weight.dtype, device=x.device)
        for e, (s, t) in enumerate(ctx.bounds):
            if t == s:
                continue  # no tokens: no grad_input rows, a zero grad_weight
            seed, hadamard = module.expert_seed(ctx.name, e)
            go, xe = grad_out[s:t], x[s:t]
            gen = rounding_draws(go, seed, 0) if sr else None
            qgo = nvfp4.quantize(go, _amax(go), act, generator=gen, four_over_six=fos)
            qwt = nvfp4.transposed(nvfp4.matrix(q, e))
            grad_x[s:t] = nvfp4_gemm.nvfp4_mm(qgo, qwt, x.dtype, emulate=emulate)
            go_t, x_t = pad_tokens(go.t()), pad_tokens(xe.t())
            if cfg.hadamard_grad_weight:
                matrix = hadamard.to(go.device)
                go_t, x_t = nvfp4.rht(go_t.float(), matrix), nvfp4.rht(x_t.float(), matrix)
            gen = rounding_draws(go_t, seed, 1) if sr else None
            qgo_t = nvfp4.quantize(go_t, _amax(go_t), act, generator=gen, four_over_six=fos)
            qx_t = nvfp4.quantize(x_t, _amax(x_t), act, four_over_six=fos)
            grad_w[e] = nvfp4_gemm.nvfp4_mm(qgo_t, qx_t, weight.dtype, emulate=emulate)
        return grad_x, grad_w, None, None, None


# ------------------------------------------------------------------------ the modules


def check_expert_dims(source: nn.Module, names: tuple[str, ...]) -> None:
    """Refuse expert weights whose out or in dim is not a multiple of 16 (1x16 blocks and
    16x16 tiles cannot pad), naming the weight, the dims and the remedy."""
    for name in names:
        shape = tuple(getattr(source, name).shape)
        if len(shape) != 3 or shape[1] % 16 or shape[2] % 16:
            raise Float8ConfigError(
                f"NVFP4 experts need (E, out, in) weights with out and in multiples of 16 "
                f"(1x16 blocks, 16x16 tiles), got {name} {shape}; keep this experts module in "
                "high precision with expert_filter_fn, or give it a float8 expert_config "
                "with pad_inner_dim=True"
            )


class NVFP4ExpertsMixin(Float8ExpertsBase):
    """What the NVFP4 experts modules share: the config, the FP4 all-gather wrapper, the
    per-expert seeds and the grouped GEMM (module docstring)."""

    config: Any  # an NVFP4Config
    # what `wrap_weight` builds of each 3-D weight (`weight_wrappers.wrap.wrapper_class_of`)
    weight_wrapper = NVFP4ExpertsFSDPWeight

    def _setup(self, source: nn.Module, config) -> None:
        if getattr(config, "experts_classes", None) is not EXPERTS_CLASSES:
            raise TypeError(f"config must be an NVFP4Config, got {type(config).__name__}")
        check_expert_dims(source, self.weight_names)
        device = getattr(source, self.weight_names[0]).device
        nvfp4_gemm.check_nvfp4_gemm_device(device, emulate=config.emulate)
        self.config = config
        for name in self.weight_names:
            setattr(self, name, getattr(source, name))  # shared, not copied
        self.num_experts = getattr(source, self.weight_names[0]).shape[0]
        self.fqn = ""  # named by conversion: seeds the experts' random draws
        self._register_state_dict_hook(_plain_weights_in_state_dict)
        self.register_load_state_dict_post_hook(lambda m, keys: m.wrap_weights_for_fsdp())
        self.wrap_weights_for_fsdp()

    @property
    def fqn(self) -> str:
        return self._fqn

    @fqn.setter
    def fqn(self, name: str) -> None:
        self._fqn = name
        self._seeds: dict[tuple[str, int], tuple[int, torch.Tensor]] = {}

    def expert_seed(self, name: str, e: int) -> tuple[int, torch.Tensor]:
        """(draw seed, Hadamard matrix) of expert e of weight `name`: those of an
        NVFP4Linear named `<fqn>.<name>.<e>` with this config's seed."""
        key = (name, e)
        if key not in self._seeds:
            layer = f"{self._fqn}.{name}.{e}" if self._fqn else f"{name}.{e}"
            gen = torch.Generator().manual_seed(layer_seed(self.config.seed, layer, "hadamard"))
            self._seeds[key] = (layer_seed(self.config.seed, layer), nvfp4.random_hadamard(gen))
        return self._seeds[key]

    def grouped(self, x: torch.Tensor, name: str, offs: torch.Tensor) -> torch.Tensor:
        weight = getattr(self, name)
        if x.is_cuda:
            nvfp4_gemm.check_nvfp4_gemm_device(x.device, emulate=self.config.emulate)
        if not x.dtype.is_floating_point or x.dtype.itemsize == 1:
            raise TypeError(f"{type(self).__name__} input has dtype {x.dtype}; expected a floating tensor")  # fmt: skip
        if torch.is_autocast_enabled(x.device.type):  # as NVFP4Linear: the GEMMs' dtype
            x = x.to(torch.get_autocast_dtype(x.device.type))
        elif x.dtype != weight.dtype:
            raise TypeError(
                f"{type(self).__name__} input has dtype {x.dtype} but {name} is "
                f"{weight.dtype}; both must match (cast the input or use autocast)"
            )
        with torch.autocast(x.device.type, enabled=False):
            return _NVFP4GroupedFn.apply(x, weight, offs, self, name)

    def extra_repr(self) -> str:
        c = self.config
        shapes = ", ".join(f"{n}={tuple(getattr(self, n).shape)}" for n in self.weight_names)
        return (
            f"{shapes}, nvfp4 hadamard_gw={c.hadamard_grad_weight}, "
            f"sr_go={c.stochastic_rounding}, fsdp_nvfp4_all_gather="
            f"{c.enable_fsdp_float8_all_gather}, emulate={c.emulate}, "
            f"four_over_six={c.four_over_six}"
        )


class NVFP4GroupedExperts(NVFP4ExpertsMixin, Float8GroupedExperts):
    """torchtitan-style experts (w1/w2/w3, `forward(x, num_tokens_per_expert)`, x grouped
    by expert) with NVFP4 GEMMs (module docstring)."""

    weight_names = _TITAN


class NVFP4FusedExperts(NVFP4ExpertsMixin, Float8FusedExperts):
    """transformers fused experts (gate_up_proj/down_proj, tokens in model order) with
    NVFP4 GEMMs (module docstring)."""

    weight_names = _FUSED


# conversion reads the experts classes off the config (`NVFP4Config.experts_classes`,
# layout -> class), as it reads `linear_class`
EXPERTS_CLASSES: dict[str, type[NVFP4ExpertsMixin]] = {
    "grouped": NVFP4GroupedExperts,
    "fused": NVFP4FusedExperts,
}
