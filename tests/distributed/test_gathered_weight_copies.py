"""A gathered float8 weight reaches the forward GEMM as it arrives (2 gloo ranks, FSDP2).

Counted with a dispatch mode over one training forward: ops that write a float8 tensor of
the weight's size (`clone`, `copy_`, `_to_copy`: a `.contiguous()` or a re-cast of the whole
gathered weight). The activations (8 rows) and the weight shards (128 rows) have other
sizes, so every counted op is a copy of a gathered weight. Expected 0 for every recipe: the
rowwise payload sends the float8 data and the row scales as two all-gather inputs, so
FSDP2's copy-out leaves the data contiguous, in the layout the GEMM takes.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_float8 import Float8LinearConfig, convert_to_float8_training
from tests.distributed.launcher import cpu_mesh, run_distributed

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise")
DIM = 256  # two 128-row shards: whole blocks for 'blockwise' (128x128)
FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2}
COPIES = {"clone", "copy_", "_to_copy"}


class _WeightCopies(TorchDispatchMode):
    """`count`: float8 writes of a gathered weight's size; `shard_casts`: float8 casts of a
    weight shard's size (the quantize of a pre-all-gather); `inverses`: reciprocals of a
    0-d float32 tensor (a tensorwise scale's inverse, what a GEMM multiplies by)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = self.shard_casts = self.inverses = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in COPIES and isinstance(out, torch.Tensor):
            self.count += out.dtype in FLOAT8 and out.numel() == DIM * DIM
            self.shard_casts += out.dtype in FLOAT8 and out.numel() == DIM * DIM // 2
        if func.overloadpacket.__name__ == "reciprocal" and isinstance(out, torch.Tensor):
            # float32: the scale chain's own reciprocal (of the float64 amax) is not one
            self.inverses += out.dim() == 0 and out.dtype == torch.float32
        return out


def _copies(recipe: str, mesh) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False))
    config = Float8LinearConfig.from_recipe_name(recipe, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, n: True)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(8, DIM)
    model(x).sum().backward()  # the first step: the float8 step's first refresh, warm caches
    with _WeightCopies() as counter:
        model(x)
    return counter.count


def _grid(rank: int, world_size: int):
    mesh = cpu_mesh(world_size)
    return {recipe: _copies(recipe, mesh) for recipe in RECIPES}


def test_no_copy_of_a_gathered_weight_before_the_forward_gemm(tmp_path):
    for per_rank in run_distributed(_grid, 2, tmp_path, timeout_s=300):
        assert per_rank == dict.fromkeys(RECIPES, 0)


def _quantizes(recipe: str, reshard_after_forward: bool, mesh):
    """Per step of 2 (1 micro-batch with reshard_after_forward, else 2): pre-all-gather
    calls for the first linear's weight, float8 casts of a shard (both linears) and
    weight-sized float8 writes (grad_input operands built from a gathered weight, both
    linears); whether every forward saw the same
    unsharded data and scale tensors; and whether the grad_input operand's buffers were
    freed with the gathered weight after each step."""
    from fsdp_float8.weight_wrappers.base import Float8WeightWrapper

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False))
    config = Float8LinearConfig.from_recipe_name(recipe, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, n: True)
    for layer in model:  # not the root: the root keeps its parameters for backward
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    first = model[0].weight.to_local()
    calls, original = [0], Float8WeightWrapper.fsdp_pre_all_gather

    def counted(self, mesh, outer_size, outer_stride, module, mp_policy):  # FSDP2 reads it
        calls[0] += self._state is first._state
        return original(self, mesh, outer_size, outer_stride, module, mp_policy)

    per_step, tensors, copies, freed, casts, inverses = [], set(), [], [], [], []
    record = model[0].register_forward_pre_hook(  # after FSDP2's: the unsharded weight
        lambda m, args: tensors.add((id(m.weight._data), id(m.weight._scale)))
    )
    micro_batches = 1 if reshard_after_forward else 2
    Float8WeightWrapper.fsdp_pre_all_gather = counted  # type: ignore[method-assign]
    try:
        for _ in range(2):
            calls[0] = 0
            with _WeightCopies() as counter:
                for micro in range(micro_batches):
                    last = micro == micro_batches - 1
                    model.set_requires_gradient_sync(last)
                    model.set_reshard_after_backward(last)
                    model(torch.randn(8, DIM)).sum().backward()
            opt.step()
            opt.zero_grad()
            per_step.append(calls[0])
            copies.append(counter.count)
            casts.append(counter.shard_casts)
            inverses.append(counter.inverses)
            freed.append(_operand_buffers_freed(model[0]))
    finally:
        Float8WeightWrapper.fsdp_pre_all_gather = original  # type: ignore[method-assign]
        record.remove()
    return per_step, casts, inverses, len(tensors) == 1, copies, freed


def _operand_buffers_freed(layer) -> bool:
    """The buffers the gathered weight's operands record added to FSDP2's inner tensors
    hold no memory once FSDP2 resharded the weight (none added: True)."""
    (param,) = layer._get_fsdp_state()._fsdp_param_group.fsdp_params
    record = getattr(param._unsharded_param, "_operands", None)
    if record is None:
        return True
    return all(t.untyped_storage().size() == 0 for t in record.inner)


def _lifecycle_grid(rank: int, world_size: int):
    mesh = cpu_mesh(world_size)
    return {
        (recipe, raf): _quantizes(recipe, raf, mesh)
        for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
        for raf in (True, False)
    }


def test_quantize_once_per_all_gather(tmp_path):
    # reshard_after_forward=True: the forward gathers (1) and the backward re-gathers (1);
    # False, 2 micro-batches with gradient sync and the reshard after backward held back
    # until the last: 1 gather per step, reused by both. The shard is quantized once per
    # step and linear either way: the re-gather sends the forward's pack again (the values
    # did not change; a write would have dropped it), except block formats, which
    # quantize per gather (2 linears: 2 casts per step, MX with raf 4). The unsharded weight is refilled
    # in place: one data and one scale tensor throughout. The grad_input operand is built
    # once per gather and linear (2 per step either way: before, False built it in each
    # micro-batch's backward, 4 per step): tensorwise a column-major copy, rowwise a re-cast
    # along the columns; MX's square blocks serve grad_input as they are (emulated block
    # GEMM: no copy). Its buffers go with the gathered weight at reshard.
    for per_rank in run_distributed(_lifecycle_grid, 2, tmp_path, timeout_s=300):
        for (recipe, raf), result in per_rank.items():
            per_step, casts, inverses, same_tensors, copies, freed = result
            assert per_step == ([2, 2] if raf else [1, 1]), (recipe, raf, per_step)
            assert casts == ([4, 4] if raf and recipe == "mxfp8" else [2, 2]), (recipe, casts)
            if recipe == "tensorwise":  # 0-d 1 / scale: x's and grad_output's per
                # micro-batch and linear; none for the weights (the refresh inverts all their
                # scales in one vector op, and the all-gather brings them)
                expected = 2 * 2 * (1 if raf else 2)
                assert inverses == [expected] * 2, (raf, inverses)
            assert same_tensors, (recipe, raf)
            assert copies == ([0, 0] if recipe == "mxfp8" else [2, 2]), (recipe, raf, copies)
            assert freed == [True, True], (recipe, raf)
