"""How a tensor is scaled: the scale math once, and one small frozen class per strategy.

Scale math (the house rule): amax in float32, floored at `fp8_max / MAX_SCALE`,
`fp8_max / amax` divided in float64 (so eager and torch.compile agree bit for bit),
optionally rounded down to a power of two, then stored as float32. Casting multiplies by
the scale and saturates at fp8_max (no clamp where the scale's own amax makes it a no-op):
`fsdp_float8.core.float8_cast`, re-exported here.

The floor. `MAX_SCALE = 2^126` is the largest scale whose inverse (what the GEMM multiplies
by) is a normal float32, and exactly an e8m0 factor (torchao's MX casts stop there too). A
fixed amax floor (torchao's float8 EPS, 1e-12) would flush every value below ~1e-15 (e4m3)
to zero: a grad_output of 1e-20 would give all-zero gradients. With this floor any amax in
float32's normal range keeps float8 precision; only an amax below fp8_max / 2^126 (e4m3
5.3e-36) is cast with fewer bits. An amax of 0 gives `MAX_SCALE` (all-zero data). Amaxes of
1e-12 and above give torchao's scales bit for bit.

The interfaces (`Granularity`, `ScalingStrategy`, `AmaxRecord`) are protocols in
`fsdp_float8.core.scaling_protocols`, re-exported here; this module holds the reductions
and the granularities and strategies that implement them.

Granularity says what one scale covers: `Tensorwise` (one 0-d scale), `Axiswise` (one
scale per row along the GEMM's contraction dim, kept with `keepdim=True` so it broadcasts)
or `Blockwise` (one scale per block of a 2-D operand, e.g. 1x128 tiles along the
contraction dim, 128x128 weight blocks, MX 1x32 with e8m0 scales; see `fsdp_float8.core.blocks`).
Each granularity also casts with its scale (`cast`), since a block scale does not broadcast.
Strategies say where the scale comes from:
- `DynamicScaling`: from the tensor's own amax, now.
- `DelayedScaling`: from a history of past amaxes (`fsdp_float8.core.delayed_state`, the one
  home of that state); the current amax is recorded for the next sync.
- `StaticScaling`: a fixed user-given number.

The scale path, one for every caller: amax (`Granularity.amax`) -> optionally MAX-reduced
over a group (`amax_sync`: a dynamic strategy's `group`, or the caller's) -> scale
(`amax_to_scale`, with the strategy's power-of-two rule, which a strategy alone owns):
callers that hold an amax already (a batched reduction, a history) ask
`strategy.scale_from_amax`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from fsdp_float8.core.amax_sync import Group, all_reduce_amax_
from fsdp_float8.core.blocks import Block, blocked, cast_to_float8_blocks, expand_block_scale
from fsdp_float8.core.constants import constant
from fsdp_float8.core.float8_cast import (  # noqa: F401  (part of this API)
    _UPCAST_IN_MUL,
    cast_to_float8_data,
    float8_max,
)
from fsdp_float8.core.scaling_protocols import (  # noqa: F401  (part of this API)
    AmaxRecord,
    Granularity,
    ScalingStrategy,
    _FamilyFacts,
)

# the largest scale: its inverse is float32's smallest normal, 2^-126 (see the docstring)
MAX_SCALE = 2.0**126


def amax_to_scale(
    amax: torch.Tensor, float8_dtype: torch.dtype, *, power_of_2: bool = False
) -> torch.Tensor:
    """fp8_max / amax as float32, computed in float64; at most `MAX_SCALE` (amax == 0 too)."""
    fmax = float(torch.finfo(float8_dtype).max)  # `float8_max`, inline: once per cast
    # `MAX_SCALE` as a literal: under dynamic=True Dynamo (2.11-2.13) lifts a read float
    # global to a graph input, which a second float8 layer's Function then fails to trace
    floor = fmax / 2.0**126  # fmax / MAX_SCALE
    if type(amax) is torch.Tensor and not torch.compiler.is_compiling():
        # eager, 4 ops: a float64 floor of the amax's rank promotes the clamp to float64
        amax64 = torch.clamp(amax, min=constant(floor, torch.float64, amax.device, amax.dim()))
    else:  # traced (fused either way): no tensor constant in the graph
        amax64 = amax.to(torch.float64).clamp(min=floor)
    scale = (fmax / amax64).to(torch.float32)  # `fmax / t` is t.reciprocal() * fmax
    if power_of_2:  # `round_down_to_power_of_2`, inline: once per cast
        scale = (scale.contiguous().view(torch.int32) & -(1 << 23)).view(torch.float32)
    return scale


def scale_from_amax(
    amax: torch.Tensor, float8_dtype: torch.dtype, *, power_of_2: bool, group: Group = None
) -> torch.Tensor:
    """The scale path from an amax: MAX over the ranks of `group` (None: none), then
    `amax_to_scale`. Strategies call it with their own power-of-two rule."""
    if group is not None:
        amax = all_reduce_amax_(amax.contiguous(), group)  # in place: one collective
    return amax_to_scale(amax, float8_dtype, power_of_2=power_of_2)


def round_down_to_power_of_2(scale: torch.Tensor) -> torch.Tensor:
    """Exact: keep the sign and exponent bits of the float32, zero the mantissa."""
    return (scale.contiguous().view(torch.int32) & -(1 << 23)).view(torch.float32)


# amax = max |x|, the one home of the reduction: abs, then max, in the tensor's own dtype
# (exact), then float32; one fused reduction compiled. `linalg.vector_norm(inf)` is one op
# but 10-40x slower on CPU (results.md); aminmax and the like are 4-5 ops.


def tensor_amax(hp: torch.Tensor, *, exact: bool = False) -> torch.Tensor:
    """max |x| of the whole tensor as a 0-d float32 (0 for an empty tensor, e.g. an
    FSDP shard of a weight with fewer rows than ranks). `exact`: in the tensor's own
    dtype, which holds the max exactly (for `amax_to_scale`, which takes it to float64:
    the same number, one conversion fewer)."""
    hp = hp.detach()
    if hp.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=hp.device)
    amax = hp.abs().amax()
    return amax if exact else amax.to(torch.float32)


_MAX_GROUPS = 8192  # see `stacked_scales`


def rows_then_tensor_amax(hp: torch.Tensor, *, exact: bool = False) -> torch.Tensor:
    """`tensor_amax` as the max of each row's max |x| (the same value: max is associative).
    Compiled for a GPU, the row maxes join the kernel of a loop over the same rows: the
    cast's, when it does not wait for this amax (a synced delayed scale), or the producer's
    (a norm, a pointwise op); then a small reduction of the row maxes, compiled in equal
    slices of at most 8,192 (one kernel; over more Inductor splits it into two). (Groups of
    rows, as `stacked_scales` reduces, would leave fewer maxes, but Inductor does not fuse
    a reduction over groups with such a loop.)"""
    hp = hp.detach()
    if hp.dim() < 2 or hp.numel() == 0:
        return tensor_amax(hp, exact=exact)
    row_maxes = hp.abs().amax(dim=-1).reshape(-1)
    rows = row_maxes.shape[0]
    parts = next((p for p in range(1, 9) if rows % p == 0 and rows // p <= _MAX_GROUPS), 1)
    if parts == 1 or not torch.compiler.is_compiling():
        amax = row_maxes.amax()
    else:  # equal slices of at most 8,192 row maxes: one kernel reduces them all
        size = rows // parts
        slices = [row_maxes[i * size : (i + 1) * size].amax() for i in range(parts)]
        amax = functools.reduce(torch.maximum, slices)
    return amax if exact else amax.to(torch.float32)


# Inductor splits a reduction over a row longer than this into two kernels when there are
# few rows; up to it, a row's max is one loop of the row's kernel
_UNSPLIT_ROW = 8192


def _rows_first(hp: torch.Tensor) -> bool:
    """Whether a compiled GPU amax of `hp` takes its row maxes first: rows that Inductor
    reduces in one loop each, of a tensor whose whole max Inductor would split into two
    kernels (over at most `_MAX_GROUPS` values it is one kernel, which the cast joins)."""
    return hp.dim() >= 2 and hp.shape[-1] <= _UNSPLIT_ROW and hp.numel() > _MAX_GROUPS


def stacked_scales(
    both: torch.Tensor, m: int, float8_dtype: torch.dtype, *, power_of_2: tuple[bool, bool]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensorwise scales of the two operands stacked in `both`: its first `m` rows and
    the rest (the input and the weight of `formats.tensorwise.joint_cast`, which share K).
    The amax of each group of g rows (g divides both row counts: no group mixes the two),
    in the operands' dtype (exact), then one max per operand over its groups. g is the least
    power of 2 that leaves at most 8,192 groups: Inductor lowers a max over that many values
    as one kernel (over more, as two), and fewer groups spread the first reduction over fewer
    rows of the GPU."""
    rows, k = both.shape
    n = rows - m
    g = 1
    while rows // g > _MAX_GROUPS and m % (2 * g) == 0 and n % (2 * g) == 0:
        g *= 2
    groups = both.view(rows // g, g * k).abs().amax(dim=1)
    first = torch.arange(rows // g, device=both.device) < m // g
    zero = groups.new_zeros(())
    return (
        amax_to_scale(
            torch.where(first, groups, zero).amax(), float8_dtype, power_of_2=power_of_2[0]
        ),
        amax_to_scale(
            torch.where(first, zero, groups).amax(), float8_dtype, power_of_2=power_of_2[1]
        ),
    )


def least_row_scale(row_scale: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The one scale of a tensor cast per row with the same rule (float8 dtype, power-of-two
    rounding), from its (N, 1) row scales, and that scale's inverse: each a (1, k) vector of
    k copies (what a row-scaled GEMM takes for a one-scale operand). A scale falls as its
    amax rises (division, rounding to float32, rounding down to a power of two), so the
    least row scale is the scale of the largest row amax, the tensor's, exactly; the largest
    row inverse is its inverse. Each copy is reduced from the N rows itself: compiled, one
    small kernel makes both vectors."""
    n = row_scale.numel()
    rows = row_scale.reshape(1, n).expand(k, n)
    inverse = row_scale.reciprocal().reshape(1, n).expand(k, n)
    return rows.amin(dim=1).reshape(1, k), inverse.amax(dim=1).reshape(1, k)


def axis_amax(hp: torch.Tensor, dim: int, *, exact: bool = False) -> torch.Tensor:
    """max |x| along `dim` (kept, so it broadcasts back), float32 (or the tensor's dtype
    when `exact`, see `tensor_amax`); 0 where `dim` is empty."""
    hp = hp.detach()
    if hp.shape[dim] == 0:  # no rows to reduce (an empty batch): amax 0, as tensor_amax
        shape = list(hp.shape)
        shape[dim] = 1
        return torch.zeros(shape, dtype=torch.float32, device=hp.device)
    amax = hp.abs().amax(dim=dim, keepdim=True)
    return amax if exact else amax.to(torch.float32)


def block_amax(hp: torch.Tensor, block: Block) -> torch.Tensor:
    """max |x| of each block of `block` elements (`fsdp_float8.core.blocks`), float32, in
    the block scale's shape; a partial last block counts its zero padding (no change)."""
    return blocked(hp.detach(), block).abs().amax(dim=(-3, -1)).to(torch.float32)


def grouped_axis_amax(hp: torch.Tensor, groups: torch.Tensor, n_groups: int) -> torch.Tensor:
    """max |x| of each column over the rows of each group: (M, C) with each row's group id
    in `groups` (M,) -> (n_groups, C) float32; 0 for a group without rows. One scatter of
    |x| into zeros (include_self: |x| >= 0), no host sync."""
    hp = hp.detach()
    zeros = torch.zeros(n_groups, hp.shape[1], dtype=hp.dtype, device=hp.device)
    ids = groups.unsqueeze(1).expand_as(hp)
    return zeros.scatter_reduce(0, ids, hp.abs(), "amax", include_self=True).to(torch.float32)


def tensor_amaxes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensor_amax` of each tensor (0-d float32 each). On CUDA one
    batched `_foreach_norm(inf)` kernel for the whole list; elsewhere (where foreach ops
    loop per tensor anyway) one `tensor_amax` per tensor. Both are exact, so the values agree."""
    if tensors and all([t.is_cuda and t.numel() for t in tensors]):
        norms = torch._foreach_norm([t.detach() for t in tensors], float("inf"))
        return [n.to(torch.float32) for n in norms]
    return [tensor_amax(t) for t in tensors]


@dataclass(frozen=True)
class Tensorwise(_FamilyFacts):
    word = "tensorwise"
    transpose_invariant = True
    scale_dtype = torch.float32

    def block(self, dim: int) -> None:
        return None

    def amax(self, hp: torch.Tensor, dim: int, *, exact: bool = False) -> torch.Tensor:
        # compiled for a GPU, row maxes first: they join the producer's kernel (a norm, a
        # pointwise op), so no pass of its own reads hp for the amax (eager, and on CPU,
        # one reduction is fewer kernels)
        if torch.compiler.is_compiling() and hp.is_cuda and _rows_first(hp):
            return rows_then_tensor_amax(hp, exact=exact)
        return tensor_amax(hp, exact=exact)

    def cast(self, hp, scale, dim, float8_dtype, *, column_major=False, saturate=True):
        return cast_to_float8_data(
            hp, scale, float8_dtype, column_major=column_major, saturate=saturate
        )

    def broadcastable(self, scale, hp, dim):
        return scale


@dataclass(frozen=True)
class Axiswise(_FamilyFacts):
    word = "axiswise"
    transpose_invariant = False
    scale_dtype = torch.float32

    def block(self, dim: int) -> None:
        return None

    def amax(self, hp: torch.Tensor, dim: int, *, exact: bool = False) -> torch.Tensor:
        return axis_amax(hp, dim, exact=exact)  # scales carry no gradient

    def cast(self, hp, scale, dim, float8_dtype, *, column_major=False, saturate=True):
        return cast_to_float8_data(
            hp, scale, float8_dtype, column_major=column_major, saturate=saturate
        )

    def broadcastable(self, scale, hp, dim):
        return scale


@dataclass(frozen=True)
class Blockwise(_FamilyFacts):
    """One scale per block of `shape = (across, along)` elements of a 2-D operand: `along`
    on the dim the GEMM contracts, `across` on the other. (1, 128) is DeepSeek's activation
    tile, (128, 128) its weight block, (1, 32) / (32, 32) MX's; a square block is the same
    whichever dim is contracted, so one cast serves both of a weight's GEMMs.
    `scale_dtype` is how the scale is stored and sent: float32, or `torch.float8_e8m0fnu`
    (MX: the scale must be a power of two, which `DynamicScaling(power_of_2=True)` gives by
    RCEIL, see `fsdp_float8.core.payload.e8m0_from_scale`). In memory the scale is float32 either
    way, in this package's convention (multiplies hp into float8 range)."""

    word = "blockwise"
    shape: tuple[int, int] = (1, 128)
    scale_dtype: torch.dtype = torch.float32

    @property
    def transpose_invariant(self) -> bool:
        return self.shape[0] == self.shape[1]

    def block(self, dim: int) -> tuple[int, int]:
        """(rows, cols) of one block of a 2-D operand contracted along `dim`."""
        across, along = self.shape
        return (across, along) if dim in (-1, 1) else (along, across)

    def amax(self, hp: torch.Tensor, dim: int, *, exact: bool = False) -> torch.Tensor:
        return block_amax(hp, self.block(dim))

    def cast(self, hp, scale, dim, float8_dtype, *, column_major=False, saturate=True):
        return cast_to_float8_blocks(hp, scale, self.block(dim), float8_dtype)

    def broadcastable(self, scale, hp, dim):
        return expand_block_scale(scale, self.block(dim), hp.shape)


@dataclass(frozen=True)
class DynamicScaling:
    """The scale of the tensor's own amax; with a `group` (tensor parallelism), of the amax
    MAX-reduced over it: the scale of the whole operand that the group's ranks hold shards
    of."""

    granularity: Granularity = Tensorwise()
    power_of_2: bool = False
    group: Group = None
    own_amax: ClassVar[bool] = True

    def scale(self, hp, dim, float8_dtype, state=None):
        # without a reduction, the amax in hp's dtype (exact): one conversion fewer
        if self.group is None:  # the amax in hp's dtype (exact); the scale path's last step
            amax = self.granularity.amax(hp, dim, exact=True)
            return amax_to_scale(amax, float8_dtype, power_of_2=self.power_of_2)
        return self.scale_from_amax(self.granularity.amax(hp, dim), float8_dtype)

    def scale_from_amax(
        self, amax: torch.Tensor, float8_dtype: torch.dtype, group: Group = None
    ) -> torch.Tensor:
        """The scale of an amax reduced over `group` (default: the strategy's own)."""
        group = self.group if group is None else group
        return scale_from_amax(amax, float8_dtype, power_of_2=self.power_of_2, group=group)

    def reduced_over(self, group: Group) -> DynamicScaling:
        """This strategy with its amaxes MAX-reduced over `group`."""
        return replace(self, group=group)


@dataclass(frozen=True)
class DelayedScaling:
    """Tensorwise only. The scale comes from the layer's `DelayedState` (its buffers and
    history live in `fsdp_float8.core.delayed_state`); the current amax is recorded there for the
    next sync. Before the first sync the operand is scaled by its own amax, chosen on the
    device (`initialized`); once the host knows the sync happened (`DelayedState.ready`)
    the synced scale is taken as it is, so the cast does not wait for its tensor's amax."""

    history_len: int = 16
    scale_fn_name: str = "max"
    power_of_2: bool = False
    granularity: Granularity = Tensorwise()
    own_amax: ClassVar[bool] = False

    def scale(self, hp, dim, float8_dtype, state=None):
        if state is None:
            raise ValueError("delayed scaling needs the layer's DelayedState; got None")
        amax = rows_then_tensor_amax(hp)
        state.record(amax)
        if state.ready:  # synced, as the host knows: the cast waits for no amax of hp's
            return state.scale  # the buffer itself: its inverse was made with it
        fresh = self.scale_from_amax(amax, float8_dtype)
        return torch.where(state.initialized, state.scale, fresh)

    def scale_from_amax(
        self, amax: torch.Tensor, float8_dtype: torch.dtype, group: Group = None
    ) -> torch.Tensor:
        """The scale of an amax (a history's, or one reduced over `group`)."""
        return scale_from_amax(amax, float8_dtype, power_of_2=self.power_of_2, group=group)


@dataclass(frozen=True)
class StaticScaling:
    scale_value: float = 1.0
    granularity: Granularity = Tensorwise()
    _scale_hex: str = field(default="0x1.0p+0", repr=False, compare=False)
    own_amax: ClassVar[bool] = False

    def __init__(self, scale: float, granularity: Granularity = Tensorwise()):
        object.__setattr__(self, "scale_value", float(scale))
        object.__setattr__(self, "granularity", granularity)
        # the value also as its exact hex string, which Dynamo keeps a constant (guarded on
        # equality) even with dynamic=True: a float attribute becomes a graph input there,
        # which a second float8 layer's autograd.Function fails to trace (torch 2.11-2.13)
        object.__setattr__(self, "_scale_hex", float(scale).hex())

    def scale(self, hp, dim, float8_dtype, state=None):
        return static_scale_tensor(float.fromhex(self._scale_hex), hp.device)


def static_scale_tensor(value: float, device: torch.device) -> torch.Tensor:
    """A static scale as a 0-d float32 tensor on `device` (`constant`): never write into it."""
    if torch.compiler.is_compiling():  # a constant of the graph
        return torch.full((), value, dtype=torch.float32, device=device)
    return constant(value, torch.float32, device)
