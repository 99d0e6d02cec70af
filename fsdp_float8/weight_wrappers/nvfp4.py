"""An NVFP4 weight under FSDP2: each rank quantizes its shard in 16x16 tiles and the
all-gather sends 4-bit codes plus one e4m3 byte per tile (0.504 bytes per element).

Mental model: the two-level NVFP4 cast (`fsdp_float8.core.nvfp4`) needs the amax of the
*whole* weight for its float32 tensor factor; the tile factors depend only on the tile.
So a rank whose shard starts on a tile boundary quantizes exactly as the unsharded weight
would be quantized, once it knows the global amax. That amax comes from the float8 step's
one refresh collective after each optimizer step (stamped into the wrapper, as a dynamic
tensorwise weight's precomputed scale is), or, when no fresh stamp exists, from a MAX
all-reduce of this shard's amax over the shard mesh.

Payload: two uint8 all-gather inputs, the packed codes `(rows, K / 2)` and the tile
factors `(rows / 16, K / 16)`; both gather along dim 0 into the unsharded layout, so the
gathered bytes are the GEMM operand as they arrive. The tensor factor (the same on every
rank) travels in the metadata. Shards must be whole 16-row tiles (the block recipes' rule,
`block.check_block_shards`); one shard takes any row count. With
`NVFP4Config(four_over_six=True)` each shard is quantized with four-over-six (each tile's
choice depends only on the tile and the global amax, so shards agree with the whole).

The unsharded weight is an `NVFP4Weight`: a tensor subclass with the weight's shape and
dtype that holds the quantized record. `NVFP4Linear` reads the record; any other op on it
raises naming the op (nothing dequantizes silently). On CUDA it also holds the record's GEMM
operands (`gemm_operand`: padded codes and swizzled factors for the output GEMM, the
transposed tiles for grad_input), each built at its first use after an unshard into buffers
FSDP2 frees at reshard, as the float8 formats' `GatheredOperands`.

Pack reuse: while the float8 step's amax stamp is fresh, the packed shard is kept
(`WeightState.remember_pack`), so backward's re-gather sends the forward's bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fsdp_float8.core import nvfp4, nvfp4_gemm
from fsdp_float8.core.amax_sync import reduce_amaxes, shard_group
from fsdp_float8.core.blocks import Block, scale_shape
from fsdp_float8.core.families import Family, register
from fsdp_float8.core.float8_tensor import normal_outputs
from fsdp_float8.core.gemms import Gemm
from fsdp_float8.core.scaling import tensor_amax
from fsdp_float8.formats.operands import GatheredOperands
from fsdp_float8.weight_wrappers.block import check_block_shards
from fsdp_float8.weight_wrappers.cast import LayerConfig, WeightCast
from fsdp_float8.weight_wrappers.refreshed import RefreshedWeight

aten = torch.ops.aten
TILE = nvfp4.WEIGHT_BLOCK


class NVFP4Weight(torch.Tensor):
    """The unsharded NVFP4 weight FSDP2 builds after the all-gather: `record` is the
    quantized (N, K) weight in 16x16 tiles; shape and dtype are the high-precision weight's."""

    record: nvfp4.NVFP4
    # the CUDA GEMMs' operands of `record`, each built once per unshard (`gemm_operand`);
    # carried by FSDP2's ops on the weight (detach, alias, as_strided), not flattened
    operands: GatheredOperands | None

    @staticmethod
    def __new__(
        cls, record: nvfp4.NVFP4, dtype: torch.dtype, operands: GatheredOperands | None = None
    ):
        self = torch.Tensor._make_wrapper_subclass(
            cls, record.shape, dtype=dtype, device=record.packed.device
        )
        self.record = record
        self.operands = operands
        return self

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        return f"NVFP4Weight(shape={tuple(self.shape)}, dtype={self.dtype})"

    def __tensor_flatten__(self):
        return ["packed", "tiles", "tensor_inv"], self.dtype

    @property
    def packed(self) -> torch.Tensor:
        return self.record.packed

    @property
    def tiles(self) -> torch.Tensor:
        return self.record.block_inv_scale

    @property
    def tensor_inv(self) -> torch.Tensor:
        return self.record.tensor_inv_scale

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        record = nvfp4.NVFP4(inner["packed"], inner["tiles"], inner["tensor_inv"], TILE)
        return NVFP4Weight(record, dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (aten.detach.default, aten.alias.default):
            with normal_outputs(args, kwargs):
                return NVFP4Weight(args[0].record, args[0].dtype, args[0].operands)
        # FSDP2 views the unsharded parameter as itself (its full size, from offset 0)
        if func is aten.as_strided.default and _whole(args[0], *args[1:]):
            with normal_outputs(args, kwargs):
                return NVFP4Weight(args[0].record, args[0].dtype, args[0].operands)
        raise NotImplementedError(
            f"{func} on an all-gathered NVFP4 weight: only NVFP4Linear's GEMMs read it "
            "(dequantize with fsdp_float8.core.nvfp4.dequantize(weight.record) if needed)"
        )


def _whole(t: NVFP4Weight, size, stride, storage_offset=0) -> bool:
    return list(size) == list(t.shape) and list(stride) == list(t.stride()) and not storage_offset


# the 4-bit family in the family table: one tensor-wide amax (refreshed by the float8 step)
# over 16x16 tiles of e4m3 scales; its place is core/nvfp4.py, this wrapper and its layer
FAMILY = register(
    Family(
        "nvfp4",
        None,
        (),
        "fp4",
        needs_global_amax=True,
        per_row=False,
        broadcast_scales=False,
        saves_float8_input=False,
        all_gather_rule=None,
        place="fsdp_float8.core.nvfp4",
    )
)


def nvfp4_cast(config: LayerConfig) -> WeightCast:
    """What the hooks and the float8 step read of an NVFP4 weight: a tensor-wide amax
    (refreshed in the step's collective), never per row; no float8 scaling strategy (the
    shard is quantized by `nvfp4.quantize`); its tile factors are e4m3."""
    return WeightCast(
        config=config,
        strategy=None,
        float8_dtype=nvfp4.E4M3,
        family=FAMILY,
        power_of_2=False,
        emulate=True,
        static_scale=None,
    )


class NVFP4FSDPWeight(RefreshedWeight):
    """A high-precision weight whose FSDP2 all-gather sends NVFP4 (module docstring). Built
    from an `NVFP4Config` by `wrap_weight` (its layer's `wrap_weight_for_fsdp`)."""

    STAMPS_INVERSE = False  # its stamp is an amax, not a scale

    @classmethod
    def cast_of(cls, config: LayerConfig) -> WeightCast:
        return nvfp4_cast(config)

    @staticmethod
    def stamps_from_amaxes(amaxes, float8_dtype, power_of_2) -> torch.Tensor:
        return amaxes.clone()  # the stamp is the global amax itself

    def global_amax(self, mesh) -> torch.Tensor:
        """The whole weight's amax: the stamp of the last refresh while the weight is
        unchanged since, else this shard's amax MAX-reduced over `mesh`."""
        stamped = self._state.fresh_scale()
        if stamped is not None:
            return stamped
        return reduce_amaxes([tensor_amax(self._tensor)], mesh).reshape(())

    needs_row_shards = True  # 16x16 tiles

    def pack_shard(self, mesh, outer_size, module):
        owner = f"the {tuple(outer_size)} weight of {type(module).__name__} (NVFP4 16x16 tiles)"
        check_block_shards(outer_size[0], mesh.size(), TILE[0], owner=owner)
        sharded = getattr(module, self.param_name, None)
        amax = self.global_amax(shard_group(sharded, None, mesh))
        four_over_six = self._config.four_over_six  # an NVFP4Config
        q = nvfp4.quantize(self._tensor, amax, TILE, four_over_six=four_over_six)
        tiles = q.block_inv_scale.view(torch.uint8)
        if mesh.size() == 1:  # FSDP2 hands the post-hook only the first input
            packed = (q.packed,), NVFP4Gather(q.tensor_inv_scale, tiles)
        else:
            packed = (q.packed, tiles), NVFP4Gather(q.tensor_inv_scale)
        return self.keep_stamped_pack(packed, amax, mesh, outer_size)  # backward reuses it


def gemm_operand(
    record: nvfp4.NVFP4, operands: GatheredOperands, gemm: Gemm
) -> nvfp4_gemm.GemmOperand:
    """The weight `record` (N, K) as the right operand of the CUDA FP4 `gemm`: itself for the
    output GEMM, its transpose (K, N) for grad_input; built at its first use after `record`
    got its values (an unshard, a weight version) and kept in `operands` until the next."""
    transpose = gemm is Gemm.GRAD_INPUT

    def build(out):
        # the buffers outlive this forward (training reuses them): never inference tensors
        with torch.inference_mode(False):
            return nvfp4_gemm.gemm_operand_parts(record, transpose=transpose, out=out)

    parts = operands.operand(gemm, build)
    assert parts[1] is not None
    return nvfp4_gemm.gemm_operand(record, (parts[0], parts[1]), transpose=transpose)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` views the storage of `b` (FSDP2's refill keeps the gathered buffers)."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


@dataclass(frozen=True, eq=False)
class NVFP4Gather:
    """The all-gather metadata: the tensor factor (the same on every rank), and at shard
    size 1 the tile factors (FSDP2 then passes the post-hook only the codes)."""

    tensor_inv: torch.Tensor
    local_tiles: torch.Tensor | None = None

    def build(self, outputs: tuple[torch.Tensor, ...], param_dtype):
        packed, local = outputs[0], self.local_tiles
        # the metadata's tiles are this shard's, remade at each gather: a copy of its own
        tiles = outputs[1] if local is None else local.clone()
        record = nvfp4.NVFP4(packed, tiles.view(nvfp4.E4M3), self.tensor_inv.clone(), TILE)
        # the list FSDP2 keeps: the operands built from the record join it (`gemm_operand`)
        inner = [packed] if local is not None else [packed, tiles]
        return NVFP4Weight(record, param_dtype, GatheredOperands(inner)), inner

    def refill(self, out, outputs: tuple[torch.Tensor, ...]) -> None:
        packed = outputs[0]
        record = out.record if isinstance(out, NVFP4Weight) else None  # its fields: no calls
        if record is None or not _same_storage(record.packed, packed):
            raise TypeError(f"expected the unsharded NVFP4Weight over {tuple(packed.shape)}")
        record.tensor_inv_scale.copy_(self.tensor_inv)
        if self.local_tiles is not None:
            out.tiles.view(torch.uint8).copy_(self.local_tiles)
        if out.operands is not None:
            out.operands.refilled()


def payload_bytes(shape: torch.Size | tuple[int, ...], block: Block) -> int:
    """Bytes of one quantized tensor's all-gather payload: packed nibbles plus one e4m3 byte
    per block (partial blocks count whole); the float32 tensor factor travels apart."""
    *lead, rows, cols = shape
    n_blocks = math.prod(scale_shape(tuple(shape), block))
    return math.prod(lead) * rows * math.ceil(cols / 2) + n_blocks


def bytes_per_element(block: Block) -> float:
    """Payload bytes per element for shapes in whole blocks: 0.5 + 1 / (elements per block)
    (16x16: 0.50390625; 1x16: 0.5625)."""
    return 0.5 + 1 / (block[0] * block[1])
