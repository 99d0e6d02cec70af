"""Float8 gradient reduce-scatter for FSDP2: one all-to-all of block-scaled float8 gradients.

Mental model. FSDP2 hands its reduce-scatter a flat input buffer of ``world_size`` equal
chunks (chunk ``j`` holds this rank's gradient contribution to rank ``j``'s shard) and an
output buffer of one chunk. ``Float8ReduceScatter`` replaces the high-precision
reduce-scatter with:

1. quantize: each chunk destined for another rank is cut into blocks of ``block_size``
   elements (the last block zero-padded), and each block gets one scale from its own amax
   (``scaling.DynamicScaling``: amax in float32, division in float64, see its scale floor) and a
   saturating cast to float8;
2. exchange: the float8 bytes and the scale bytes of each chunk are packed side by side in
   one ``uint8`` row (the payload format of ``fsdp_float8.core.payload``, its one e8m0
   convention), and ONE ``dist.all_to_all_single`` swaps the rows (``uint8`` because
   gloo rejects float8 dtypes). A rank's own chunk does not travel: it is never quantized
   and enters the sum in high precision;
3. reduce: every received row is dequantized (``fp8 / scale``) and the contributions are
   summed in float32 in rank order 0..world_size-1 (deterministic), then the reduce op is
   applied (SUM: as is; AVG: / world_size; PREMUL_SUM(f): * f, which equals the pre-multiplied
   sum up to float32 rounding because block scaling is scale-invariant) and the result is
   written into the output buffer in its dtype.

Block sizes are multiples of 4 from 4 to 4096 (``check_block_size``, run when the
reduce-scatter is built and by every codec helper). Blocks tile each chunk of the flat
buffer, so a block may straddle the end of one parameter's gradient and the start of the
next (FSDP2 packs them back to back). Bytes per
element on the wire: 1 (float8) + scale_bytes / block_size, plus the padding of each chunk's
last block: 1.031 at block_size 128 with float32 scales (0.516x of bf16) or 1.008 with
power-of-two scales sent as one ``float8_e8m0fnu`` byte (0.504x of bf16). A non-finite
gradient value comes out NaN (its whole block), so grad-norm checks still see it.
Temporary memory per call: the packed send and receive buffers, ~(n-1)/n x input numel x
1.03 bytes each, plus one float32 output chunk.

The reduce ops FSDP2 passes (torch 2.13, ``_get_gradient_divide_factors``): AVG for a
float32/bf16 reduce dtype (gloo and NCCL alike), PREMUL_SUM(1/f) after
``set_gradient_divide_factor(f)`` with f != world size (which plain gloo refuses; this class
accepts it), SUM with FSDP2's own pre/post division for fp16 or
``set_force_sum_reduction_for_comms(True)``. Any other op raises ``NotImplementedError``:
there is no silent fallback to high-precision communication. Nor for a PREMUL_SUM whose
factor this torch does not expose (2.11's FSDP2 builds it with ``_make_nccl_premul_sum``):
that raises, naming the remedy (``fsdp_float8.core._compat``).

The collective is issued synchronously; with ``async_op=True`` (FSDP2 does not pass it) the
result is ready on return and an already-completed ``Work`` is returned.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from fsdp_float8.core._compat import premul_sum_factor
from fsdp_float8.core.payload import E8M0, SCALE_DTYPES, PayloadLayout
from fsdp_float8.core.scaling import Axiswise, DynamicScaling

__all__ = [
    "MAX_BLOCK_SIZE",
    "Float8ReduceScatter",
    "check_block_size",
    "dequantize_blocks",
    "enable_float8_reduce_scatter",
    "packed_row_bytes",
    "quantize_blocks",
]

# Block sizes: a multiple of 4, so the float32 scales that follow each chunk's float8 bytes
# start 4-byte aligned; at most 4096, since every chunk is padded to whole blocks (a larger
# block sends and allocates padding, ~4 bytes of float32 per element of a block, while its
# scales already cost under 0.1% of the bytes at 4096).
BLOCK_MULTIPLE, MAX_BLOCK_SIZE = 4, 4096
_FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_RedOp = dist.ReduceOp.RedOpType


def check_block_size(block_size: object) -> int:
    """`block_size` if the reduce-scatter accepts it, else an error saying what it takes."""
    if isinstance(block_size, int) and not isinstance(block_size, bool):
        if BLOCK_MULTIPLE <= block_size <= MAX_BLOCK_SIZE and block_size % BLOCK_MULTIPLE == 0:
            return block_size
        error: type[Exception] = ValueError
    else:
        error = TypeError
    raise error(
        f"block_size={block_size!r} is not accepted: the float8 reduce-scatter takes an "
        f"int, a multiple of {BLOCK_MULTIPLE} (the float32 scales after each chunk's "
        f"float8 bytes must stay 4-byte aligned) from {BLOCK_MULTIPLE} to "
        f"{MAX_BLOCK_SIZE} (each chunk is padded to whole blocks, so a larger block "
        "only allocates and sends padding); pass e.g. block_size=128 (the default) or 32"
    )


def _layout(n: int, block_size: int, float8_dtype: torch.dtype, scale_dtype) -> PayloadLayout:
    """A chunk of `n` elements on the wire: whole blocks of float8 bytes, then their scales."""
    check_block_size(block_size)
    n_blocks = math.ceil(n / block_size)
    scale_cols = n_blocks * scale_dtype.itemsize
    return PayloadLayout(float8_dtype, scale_dtype, n_blocks * block_size, scale_cols)


def _block_scaling(scale_dtype: torch.dtype) -> DynamicScaling:
    """One scale per block (the last dim of a (rows, blocks, block_size) view), rounded down
    to a power of two when the scales travel as e8m0."""
    return DynamicScaling(granularity=Axiswise(), power_of_2=scale_dtype == E8M0)


def quantize_blocks(
    hp_rows: torch.Tensor,
    *,
    block_size: int,
    float8_dtype: torch.dtype,
    scale_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """(rows, n) high precision -> (rows, packed_row_bytes(n)) uint8: float8 data, then scales.

    Each row is zero-padded to whole blocks; each block gets the scale of its own amax
    (rounded down to a power of two when the scales travel as ``float8_e8m0fnu``).
    """
    rows, n = hp_rows.shape
    layout = _layout(n, block_size, float8_dtype, scale_dtype)
    padded = nn.functional.pad(hp_rows.to(torch.float32), (0, layout.data_cols - n))
    blocks = padded.view(rows, -1, block_size)
    scaling = _block_scaling(scale_dtype)
    scale = scaling.scale(blocks, -1, float8_dtype)
    data = scaling.granularity.cast(blocks, scale, -1, float8_dtype)
    return layout.encode(data.view(rows, layout.data_cols), scale)


def dequantize_blocks(
    packed: torch.Tensor,
    n: int,
    *,
    block_size: int,
    float8_dtype: torch.dtype,
    scale_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of ``quantize_blocks``: (rows, packed_row_bytes(n)) uint8 -> (rows, n) float32."""
    layout = _layout(n, block_size, float8_dtype, scale_dtype)
    rows, n_blocks = packed.shape[0], layout.data_cols // block_size
    data = layout.data(packed).view(rows, n_blocks, block_size)
    scale = layout.scales(packed, rows, n_blocks)
    hp = data.to(torch.float32) / scale.view(rows, n_blocks, 1)
    return hp.view(rows, layout.data_cols)[:, :n]


def packed_row_bytes(n: int, block_size: int, scale_dtype: torch.dtype) -> int:
    """Bytes one chunk of ``n`` elements takes on the wire (float8 data + scales)."""
    return _layout(n, block_size, torch.float8_e4m3fn, scale_dtype).row_bytes


class Float8ReduceScatter(ReduceScatter):
    """A ``ReduceScatter`` for ``FSDPModule.set_custom_reduce_scatter`` (module docstring).

    Stateless: one instance may serve every FSDP module of a model.
    """

    def __init__(
        self,
        *,
        block_size: int = 128,
        float8_dtype: torch.dtype = torch.float8_e4m3fn,
        scale_dtype: torch.dtype = torch.float32,
    ) -> None:
        check_block_size(block_size)
        if float8_dtype not in _FLOAT8_DTYPES:
            raise ValueError(
                f"float8_dtype must be one of {_FLOAT8_DTYPES}, got {float8_dtype}; "
                "use torch.float8_e4m3fn (the default, more precise for gradients)"
            )
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(
                f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype}; use "
                "torch.float32, or torch.float8_e8m0fnu for 1-byte power-of-two scales"
            )
        self.block_size = block_size
        self.float8_dtype = float8_dtype
        self.scale_dtype = scale_dtype

    def __repr__(self) -> str:
        return (
            f"Float8ReduceScatter(block_size={self.block_size}, "
            f"float8_dtype={self.float8_dtype}, scale_dtype={self.scale_dtype})"
        )

    def allocate(
        self,
        size: Sequence[int | torch.SymInt],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @torch.no_grad()
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        world_size, rank = group.size(), group.rank()
        finish = _reduce_op_finisher(op, world_size)  # raises before any collective
        _check_buffers(output_tensor, input_tensor, world_size)
        n = output_tensor.numel()
        chunks = input_tensor.view(world_size, n)
        received = self._exchange(chunks, group, rank)
        total = torch.zeros(n, dtype=torch.float32, device=output_tensor.device)
        for src in range(world_size):  # fixed order: a deterministic float32 sum
            if src == rank:
                total += chunks[rank]
            else:  # one row at a time: no float32 copy of every received chunk at once
                row = received[src - (src > rank)].unsqueeze(0)
                total += dequantize_blocks(row, n, **self._block_kwargs()).squeeze(0)
        output_tensor.view(-1).copy_(finish(total))
        if async_op:
            done: torch.futures.Future = torch.futures.Future()
            done.set_result([output_tensor])
            return torch._C._distributed_c10d._create_work_from_future(done)  # type: ignore[attr-defined]
        return None

    def _block_kwargs(self) -> dict:
        return dict(
            block_size=self.block_size, float8_dtype=self.float8_dtype, scale_dtype=self.scale_dtype
        )

    def _exchange(self, chunks: torch.Tensor, group: dist.ProcessGroup, rank: int) -> torch.Tensor:
        """Quantize the chunks for the other ranks and swap them in one all-to-all; returns
        the packed rows received from the other ranks, in rank order."""
        world_size = chunks.shape[0]
        # slices, not chunks[list]: indexing with a Python list copies an index tensor from
        # the host (a sync on CUDA)
        others = torch.cat([chunks[:rank], chunks[rank + 1 :]])
        send = quantize_blocks(others, **self._block_kwargs())
        recv = torch.empty_like(send)
        if world_size == 1:  # nothing travels
            return recv
        # Split r goes to / comes from rank r: one packed row each, none to or from itself.
        row_bytes = send.shape[1]
        splits = [0 if r == rank else row_bytes for r in range(world_size)]
        dist.all_to_all_single(
            recv.view(-1), send.view(-1), splits, splits, group=group, async_op=False
        )
        return recv


def _reduce_op_finisher(op, world_size: int):
    """What to apply to the float32 sum for FSDP2's reduce op; raise on an unsupported op."""
    # A RedOpType passes isinstance(op, dist.ReduceOp) too; only a ReduceOp object has .op
    kind = op if isinstance(op, _RedOp) else op.op
    if kind == dist.ReduceOp.SUM:
        return lambda total: total
    if kind == dist.ReduceOp.AVG:
        return lambda total: total.div_(world_size)
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = premul_sum_factor(op)
        if factor is None:
            raise NotImplementedError(
                f"Float8ReduceScatter got PREMUL_SUM from FSDP2 but this torch "
                f"({torch.__version__}) does not expose the op's factor (ReduceOp.factor), so "
                "the float8 sum cannot be scaled by it. Leave set_gradient_divide_factor unset "
                "(FSDP2 then passes AVG), or use a torch whose ReduceOp has .factor (2.13+)."
            )
        return lambda total: total.mul_(factor)
    name = getattr(kind, "name", repr(kind))
    raise NotImplementedError(
        f"Float8ReduceScatter supports the reduce ops SUM, AVG and PREMUL_SUM; FSDP2 passed "
        f"{name}. Remove the float8 reduce-scatter from this module (do not call "
        "enable_float8_reduce_scatter on it) to reduce gradients in high precision."
    )


def _check_buffers(output: torch.Tensor, input: torch.Tensor, world_size: int) -> None:
    if input.numel() != output.numel() * world_size:
        raise ValueError(
            f"reduce-scatter input has {input.numel()} elements, expected output numel "
            f"{output.numel()} x world size {world_size}; pass FSDP2's flat buffers"
        )
    for name, t in (("input", input), ("output", output)):
        if not (t.is_floating_point() and t.is_contiguous()):
            raise ValueError(
                f"reduce-scatter {name} must be a contiguous floating-point tensor, got "
                f"dtype {t.dtype}, contiguous={t.is_contiguous()}"
            )


def enable_float8_reduce_scatter(
    model: nn.Module,
    *,
    block_size: int = 128,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    scale_dtype: torch.dtype = torch.float32,
) -> Float8ReduceScatter:
    """Reduce-scatter the gradients of every ``FSDPModule`` in ``model`` in float8.

    Call after ``fully_shard``. Returns the (shared) ``Float8ReduceScatter``.
    """
    comm = Float8ReduceScatter(
        block_size=block_size, float8_dtype=float8_dtype, scale_dtype=scale_dtype
    )
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not fsdp_modules:
        raise ValueError(
            f"{type(model).__name__} holds no FSDPModule; call fully_shard on its blocks and "
            "root first, then enable_float8_reduce_scatter"
        )
    for module in fsdp_modules:
        module.set_custom_reduce_scatter(comm)
    return comm
