"""Grouped float8 GEMMs over experts: tokens grouped by offsets, one weight per expert.

Mental model: the tokens of a mixture-of-experts layer arrive permuted so that expert e
owns rows `offs[e-1]:offs[e]` (`offs`: cumulative token counts, int32, as
`torch._grouped_mm` takes them; an expert may own 0 rows). Two GEMM shapes cover the three
GEMMs of an expert projection (`fsdp_float8.experts.gemm`):

- 2-D x 3-D: `a (M, K) @ b (E, K, N) -> (M, N)`, rows of group e times `b[e]`. Scales:
  `a` per row `(M, 1)`, `b` per column of each expert `(E, 1, N)`, or both 0-d (tensorwise).
- 2-D x 2-D: `a (R, M) @ b (M, C) -> (E, R, C)`, contracting over the tokens of each
  group. Scales: per group and row of `a` `(E, R)`, per group and column of `b` `(E, C)`
  (each column's amax over that expert's tokens only), or both 0-d.

`scale` multiplies hp into float8 (`fp8 = saturate(hp * scale)`, see `float8_tensor`).
Backends, picked from the device and `emulate`, never by a silent fallback:
- CUDA, not emulated: `torch._scaled_grouped_mm` (rowwise only; feature check in `_compat`).
  Follows torch's documented `_scaled_grouped_mm` layouts; checked by the fake-CUDA lane
  (tests/fakecuda/test_experts_cuda.py) and, on a GPU, by tests/gpu.
- `emulate=True`: dequantize to float32, then `torch._grouped_mm` (or a per-group float32
  `mm` loop where this torch has no CPU `_grouped_mm`), rounded once to `out_dtype`.
- CPU, not emulated: a per-group loop of `scaled_mm_data` (CPU `torch._scaled_mm`), the
  very GEMM a `Float8Linear` runs, so a grouped GEMM equals a loop of float8 linears.
"""

from __future__ import annotations

import torch

from fsdp_float8.core._compat import grouped_mm_available, scaled_grouped_mm_available
from fsdp_float8.core.families import recipes_where, scaled_per_row
from fsdp_float8.core.gemm import check_gemm_scales, row_and_column_major, scaled_mm_data
from fsdp_float8.core.scaling import grouped_axis_amax


def expert_of_rows(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """The expert (group) of each of `rows` token rows, int64, without a host sync."""
    ids = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, ids, right=True)


def group_column_amax(hp: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """max |x| of each column over each group's rows: (M, C) -> (E, C) float32; 0 for an
    empty group (`scaling.grouped_axis_amax`, no host sync)."""
    return grouped_axis_amax(hp, expert_of_rows(offs, hp.shape[0]), offs.numel())


def per_row(group_scale: torch.Tensor, offs: torch.Tensor, rows: int) -> torch.Tensor:
    """A per-group scale (E, C) spread to the group's rows (rows, C); 0-d stays 0-d."""
    if group_scale.dim() == 0:
        return group_scale
    return group_scale[expert_of_rows(offs, rows)]


def grouped_scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    offs: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    emulate: bool = False,
    use_fast_accum: bool = False,
    pad_inner_dim: bool = False,
) -> torch.Tensor:
    """The grouped float8 GEMM (2-D x 3-D when `b` is 3-D, else 2-D x 2-D); see the module.
    Checks the scale shapes and lays out `a` row-major and `b` column-major per group, as
    `scaled_mm_data` does (the helpers of `fsdp_float8.core.gemm`: what the hardware GEMM
    needs; the emulation then multiplies the same layouts as a linear)."""
    a_want: tuple[int, ...]
    b_want: tuple[int, ...]
    if b.dim() == 3:  # a (M, K) per token row; b (E, K, N) per expert and column
        a_want, b_want = (a.shape[0], 1), (b.shape[0], 1, b.shape[2])
    else:  # a (R, M) per group and row; b (M, C) per group and column
        a_want, b_want = (offs.numel(), a.shape[0]), (offs.numel(), b.shape[1])
    check_gemm_scales("grouped_scaled_mm", a_scale, a_want, b_scale, b_want)
    a, b = row_and_column_major(a, b)
    if emulate:
        a_hp, b_hp = dequantize_operands(a, a_scale, b, b_scale, offs)
        return grouped_mm_float32(a_hp, b_hp, offs).to(out_dtype)
    if a.is_cuda:
        return _cuda_scaled_grouped_mm(a, a_scale, b, b_scale, offs, out_dtype, use_fast_accum)
    return _loop_scaled_mm(a, a_scale, b, b_scale, offs, out_dtype, use_fast_accum, pad_inner_dim)


def dequantize_operands(a, a_scale, b, b_scale, offs):
    """float32 values of both operands: data * (1 / scale), per-group scales per row."""
    inv_a, inv_b = a_scale.reciprocal(), b_scale.reciprocal()
    if b.dim() == 2:  # 2-D x 2-D: a is (R, M) and b (M, C), groups along M
        inv_a = per_row(inv_a, offs, a.shape[1])
        inv_a = inv_a if inv_a.dim() == 0 else inv_a.t()
        inv_b = per_row(inv_b, offs, b.shape[0])
    return a.to(torch.float32) * inv_a, b.to(torch.float32) * inv_b


def grouped_mm_float32(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm` where this torch runs it on the device and the layouts meet its
    16-byte stride rule, else the same GEMM per group (the same bits: a test checks)."""
    if grouped_mm_available(a.device.type) and _strides_fit(a) and _strides_fit(b):
        return torch._grouped_mm(a, b, offs=offs)
    return _loop(a, b, offs, lambda x, y, e, s: torch.mm(x, y), a.dtype)


def grouped_mm_hp(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out_dtype) -> torch.Tensor:
    """A high-precision grouped GEMM (a GEMM whose casts the config disables)."""
    a, b = a.to(out_dtype), b.to(out_dtype)
    fits = _strides_fit(a) and _strides_fit(b)
    if (
        out_dtype in (torch.float32, torch.bfloat16)
        and grouped_mm_available(a.device.type)
        and fits
    ):
        return torch._grouped_mm(a, b, offs=offs)
    return _loop(a, b, offs, lambda x, y, e, s: torch.mm(x, y), out_dtype)


def _strides_fit(t: torch.Tensor) -> bool:
    """torch._grouped_mm wants every stride but the unit one at a multiple of 16 bytes."""
    return all(st == 1 or st * t.element_size() % 16 == 0 for st in t.stride())


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()  # host copy: the loop backends run per group on the host
    starts = [0, *ends[:-1]]
    return list(zip(starts, ends))


def _loop(a, b, offs, mm, out_dtype) -> torch.Tensor:
    """Run `mm(a_group, b_group, e, first_row)` per group; empty groups give no rows (2-D x 3-D) or a
    zero block (2-D x 2-D), the value of a sum over no tokens."""
    bounds = _bounds(offs)
    if b.dim() == 3:
        out = a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype)
        for e, (s, t) in enumerate(bounds):
            if t > s:
                out[s:t] = mm(a[s:t], b[e], e, s)
        return out
    out = a.new_zeros((len(bounds), a.shape[0], b.shape[1]), dtype=out_dtype)
    for e, (s, t) in enumerate(bounds):
        if t > s:
            out[e] = mm(a[:, s:t], b[s:t], e, s)
    return out


def _loop_scaled_mm(a, a_scale, b, b_scale, offs, out_dtype, fast_accum, pad_inner_dim):
    """Per group, the float8 GEMM a Float8Linear runs (`scaled_mm_data`)."""
    three_d = b.dim() == 3

    def mm(x, y, e, s):  # this group's token-row scales, this expert's column scales
        xs, ys = a_scale, b_scale  # 0-d (tensorwise) ones are shared by every group
        if xs.dim():
            xs = a_scale[s : s + x.shape[0]] if three_d else a_scale[e].unsqueeze(1)
        if ys.dim():
            ys = b_scale[e] if three_d else b_scale[e].unsqueeze(0)
        return scaled_mm_data(
            x,
            xs,
            y,
            ys,
            out_dtype=out_dtype,
            use_fast_accum=fast_accum,
            # 2-D x 2-D contracts over tokens, not the user's to choose: always pad (as linear)
            pad_inner_dim=pad_inner_dim or not three_d,
        )

    return _loop(a, b, offs, mm, out_dtype)


def _cuda_scaled_grouped_mm(a, a_scale, b, b_scale, offs, out_dtype, fast_accum):
    """`torch._scaled_grouped_mm`: a row-major, b column-major per group, inverse scales
    squeezed: (M,) and (E, N) for 2-D x 3-D; (E*R,) and (E*C,) for 2-D x 2-D. The kernel
    takes row scales only: a 0-d (tensorwise) scale goes in as equal row scales, the same
    product (rowwise_with_gw_hp's grad_input weight is tensorwise)."""
    if not scaled_grouped_mm_available(a.device):
        raise ValueError(
            f"float8 grouped GEMM on {a.device}: torch._scaled_grouped_mm needs a CUDA device "
            "of compute capability 9.0+ and a torch that has it; set "
            "Float8LinearConfig(emulate=True) or keep the experts in bf16"
        )
    e4m3 = torch.float8_e4m3fn
    if a.dtype != e4m3 or b.dtype != e4m3 or out_dtype != torch.bfloat16:
        raise ValueError(
            f"torch._scaled_grouped_mm takes e4m3 operands and gives a bfloat16 output; got "
            f"{a.dtype} x {b.dtype} -> {out_dtype}. Use the {recipes_where(scaled_per_row)} "
            "recipe (e4m3 everywhere) with bfloat16 activations, or emulate=True"
        )
    groups = offs.numel()
    if b.dim() == 3:  # a (M, K) per token row; b (E, K, N) per expert and column
        a_rows, b_rows = (a.shape[0],), (b.shape[0], b.shape[2])
    else:  # a (R, M) per group and row; b (M, C) per group and column
        a_rows, b_rows = (groups * a.shape[0],), (groups * b.shape[1],)
        a, b, offs = align_token_groups(a, b, offs)
    inv_a = _row_inverse(a_scale, a_rows)
    inv_b = _row_inverse(b_scale, b_rows)
    return torch._scaled_grouped_mm(
        a, b, inv_a, inv_b, offs=offs, out_dtype=out_dtype, use_fast_accum=fast_accum
    )


def _row_inverse(scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """1 / scale as the kernel's dense float32 row scales of `shape` (a 0-d scale repeated)."""
    inv = scale.reciprocal()
    if inv.dim() == 0:
        return inv.expand(shape).contiguous()
    return inv.reshape(shape)


_ALIGN = 16  # float8 bytes: the grouped kernel's stride and group-start alignment


def align_token_groups(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor):
    """2-D x 2-D (contracting over each group's tokens): `a (R, M)`, `b (M, C)` re-laid so
    that every group starts at a multiple of 16 tokens and the token stride is one too (the
    CUDA kernel's 16-byte rule), with zero tokens in the gaps (they add nothing). Returns
    (a, b column-major, offs); the padded size is a static bound, so no host sync."""
    m = a.shape[1]
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    padded = (counts + _ALIGN - 1) // _ALIGN * _ALIGN
    new_offs = torch.cumsum(padded, 0).to(torch.int32)
    group = expert_of_rows(offs, m)
    shift = (new_offs - padded) - (offs - counts)  # new start - old start, per group
    pos = torch.arange(m, device=a.device) + shift[group].to(torch.int64)
    size = -(-(m + (_ALIGN - 1) * offs.numel()) // _ALIGN) * _ALIGN
    a_bytes = a.view(torch.uint8).new_zeros(a.shape[0], size)
    a_new = a_bytes.index_copy_(1, pos, a.view(torch.uint8)).view(a.dtype)
    bt = b.t().contiguous().view(torch.uint8)  # (C, M): the column-major b, row by row
    b_new = bt.new_zeros(bt.shape[0], size).index_copy_(1, pos, bt).view(b.dtype).t()
    return a_new, b_new, new_offs
