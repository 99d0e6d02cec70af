"""Float8 payloads: float8 bytes and their scales in one uint8 buffer, and the e8m0 convention.

Mental model. The block-scaled weight all-gather and the float8 gradient reduce-scatter
send one `uint8` matrix of
`rows x (data_cols + scale_cols)` bytes: each row holds `data_cols` float8 bytes, then
`scale_cols` bytes of scales. The scales of a *group* of rows (a weight row, an all-gather
shard, a reduce-scatter chunk) are flattened row-major and laid over that group's rows,
zero-padded to whole rows; `PayloadLayout` is the format, `encode` / `data` / `scales` the
codec. One buffer, because at shard size 1 FSDP2 hands the post-all-gather hook only the
first input, because on CUDA nothing made on the all-gather copy-in stream then outlives
the all-gather output, and because gloo rejects float8 dtypes (the bytes go as uint8).
(The rowwise weight all-gather sends its data and its float32 row scales as two inputs
instead, so the gathered data is contiguous for the GEMM: `fsdp_float8.formats.rowwise`.)

Scales travel as float32 (4 bytes, exact) or as e8m0 (1 byte, for power-of-two scales), in
ONE e8m0 convention, MX's: the byte is the biased exponent (bias 127) of the dequantization
factor `1 / scale`, so the scale 2^7 (an amax near 448 / 128 in e4m3) is byte 120. In
memory a scale is always float32 and multiplies hp into float8 range
(`fsdp_float8.core.float8_tensor`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

E8M0 = torch.float8_e8m0fnu
SCALE_DTYPES = (torch.float32, E8M0)


def e8m0_from_scale(scale: torch.Tensor) -> torch.Tensor:
    """A power-of-two float32 scale as e8m0: the biased exponent of 1 / scale, exact for
    the scales of float8 casts (1 / scale within 2^-126 .. 2^127)."""
    bits = scale.reciprocal().contiguous().view(torch.int32) >> 23
    return (bits & 0xFF).to(torch.uint8).view(E8M0)


def scale_from_e8m0(e8m0: torch.Tensor) -> torch.Tensor:
    """The float32 scale (multiplies hp into float8 range) of e8m0 dequantization factors."""
    bits = e8m0.contiguous().view(torch.uint8).to(torch.int32) << 23
    return bits.view(torch.float32).reciprocal()


def scale_bytes(scale: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """float32 scales as the flat bytes that travel (row-major)."""
    if scale_dtype == E8M0:
        return e8m0_from_scale(scale).view(torch.uint8).reshape(-1)
    return scale.to(torch.float32).contiguous().view(torch.uint8).reshape(-1)


@dataclass(frozen=True)
class PayloadLayout:
    """Rows of `data_cols` float8 bytes (`float8_dtype`), each followed by `scale_cols`
    bytes of scales sent as `scale_dtype` (float32 or e8m0)."""

    float8_dtype: torch.dtype
    scale_dtype: torch.dtype
    data_cols: int
    scale_cols: int

    @classmethod
    def fitting(
        cls,
        float8_dtype: torch.dtype,
        scale_dtype: torch.dtype,
        data_cols: int,
        rows: int,
        n_scales: int,
    ) -> PayloadLayout:
        """The layout whose `rows` rows carry `n_scales` scales (as few columns as fit)."""
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scales travel as {SCALE_DTYPES}, got {scale_dtype}")
        cols = math.ceil(n_scales * scale_dtype.itemsize / max(rows, 1))
        return cls(float8_dtype, scale_dtype, data_cols, cols)

    @property
    def row_bytes(self) -> int:
        return self.data_cols + self.scale_cols

    def encode(self, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """(rows, data_cols) float8 (or its uint8 view) and the float32 scales of those rows
        -> (rows, row_bytes) uint8."""
        rows = data.shape[0]
        raw = scale_bytes(scale, self.scale_dtype)
        pad = rows * self.scale_cols - raw.numel()
        if pad < 0:
            raise ValueError(
                f"{scale.numel()} {self.scale_dtype} scales do not fit {rows} rows of "
                f"{self.scale_cols} scale bytes; build the layout with PayloadLayout.fitting"
            )
        if pad:
            raw = torch.nn.functional.pad(raw, (0, pad))
        return torch.cat([data.view(torch.uint8), raw.view(rows, self.scale_cols)], dim=1)

    def data(self, payload: torch.Tensor) -> torch.Tensor:
        """The float8 data of every row: a view of the payload."""
        return payload[:, : self.data_cols].view(self.float8_dtype)

    def scales(self, payload: torch.Tensor, groups: int, n_scales: int) -> torch.Tensor:
        """The float32 scales, (groups, n_scales): `n_scales` per group of rows. A view of
        the payload where the bytes allow it (float32 scales, one group a row, 4-byte
        aligned), else a copy."""
        raw = payload[:, self.data_cols :]
        if groups != payload.shape[0]:
            raw = raw.reshape(groups, -1)
        raw = raw[:, : n_scales * self.scale_dtype.itemsize]
        if self.scale_dtype == E8M0:
            return scale_from_e8m0(raw.contiguous().view(E8M0))
        if raw.storage_offset() % 4 or raw.stride(0) % 4 or raw.stride(1) != 1:
            raw = raw.contiguous()
        return raw.view(torch.float32)
