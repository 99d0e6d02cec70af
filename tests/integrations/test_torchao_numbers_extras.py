"""How close fsdp_float8's numbers are to torchao.float8's on the same work (extras lane,
torchao 0.18): tests.models' llama (dim 64, 2 layers), tensorwise, AdamW lr 1e-2, 10 steps,
each library's own training loop (torchao's calls its precompute after each step).

With the float8 GEMMs of torch._scaled_mm (no emulation; the CPU kernel here): every layer's
output is bit-equal at step 0 and the losses are equal, bit for bit, at every step, in one
process and under FSDP2 with float8 all-gather on 2 gloo ranks (slow).

With `emulate=True` the float8 values (data and scales) are still the same, but the two
emulations dequantize differently (torchao divides by the scale, this library multiplies by
its reciprocal, <= 1 ulp apart), so 40-80% of a layer's float32 outputs differ, by <= 1.8 ulp
of the layer's largest output, and the losses drift apart: on 2 ranks equal at the first
step, 9.9e-4 apart at step 10; in one process equal for 6 steps, 2.3e-4 apart at step 10.
Measured (torch 2.13 CPU) with `python -m tests.integrations.test_torchao_numbers_extras`.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from fsdp_float8 import Float8Linear, Float8LinearConfig, convert_to_float8_training
from tests.distributed.float8_cases import Case, batch, build_model, float8_filter, loss_of, shard
from tests.distributed.launcher import cpu_mesh, run_distributed

pytestmark = pytest.mark.extras
STEPS = 10


def _converted(lib: str, emulate: bool, all_gather: bool) -> torch.nn.Module:
    import torchao.float8 as ao

    model = build_model(Case(steps=STEPS))
    fields = {"enable_fsdp_float8_all_gather": all_gather, "emulate": emulate}
    if lib == "fsdp_float8":
        config = Float8LinearConfig.from_recipe_name("tensorwise", **fields)
        return convert_to_float8_training(model, config=config, module_filter_fn=float8_filter)
    config = dataclasses.replace(ao.Float8LinearConfig.from_recipe_name("tensorwise"), **fields)
    return ao.convert_to_float8_training(model, config=config, module_filter_fn=float8_filter)


def _train(lib: str, emulate: bool, rank: int = 0, world_size: int = 1, mesh=None) -> list:
    import torchao.float8 as ao

    case = Case(steps=STEPS)
    model = _converted(lib, emulate, all_gather=mesh is not None)
    if mesh is not None:
        shard(model, case, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for step in range(STEPS):
        loss = loss_of(model, case, batch(case, step, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if lib == "torchao" and mesh is not None:
            ao.precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.item())
    return losses


def _layer_outputs(emulate: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each float8 layer of both libraries' models on the same input (the layer's input in
    the first forward of fsdp_float8's model): {fqn: (fsdp_float8's, torchao's)}."""
    ours, theirs = (_converted(lib, emulate, False) for lib in ("fsdp_float8", "torchao"))
    inputs: dict[str, torch.Tensor] = {}
    for name, mod in ours.named_modules():
        if isinstance(mod, Float8Linear):
            mod.register_forward_pre_hook(lambda m, a, n=name: inputs.setdefault(n, a[0]))
    case = Case(steps=STEPS)
    with torch.no_grad():
        loss_of(ours, case, batch(case, 0, 0, 1))
        return {
            n: (ours.get_submodule(n)(x), theirs.get_submodule(n)(x)) for n, x in inputs.items()
        }


def test_layer_outputs_and_losses_bit_identical_to_torchao() -> None:
    pytest.importorskip("torchao.float8")
    outputs = _layer_outputs(emulate=False)
    assert len(outputs) == 14
    for name, (ours, theirs) in outputs.items():
        assert torch.equal(ours, theirs), name
    assert _train("fsdp_float8", False) == _train("torchao", False)


def _fsdp_grid(rank: int, world_size: int, emulate: bool) -> dict[str, list]:
    mesh = cpu_mesh(world_size)
    return {lib: _train(lib, emulate, rank, world_size, mesh) for lib in ("fsdp_float8", "torchao")}


@pytest.mark.slow
def test_fsdp2_losses_bit_identical_to_torchao(tmp_path) -> None:
    pytest.importorskip("torchao.float8")
    for per_rank in run_distributed(_fsdp_grid, 2, tmp_path, False, timeout_s=600):
        assert per_rank["fsdp_float8"] == per_rank["torchao"]


def _report(tmp: str) -> None:
    """The figures of the module docstring, both GEMM paths."""
    for emulate in (False, True):
        print(f"emulate={emulate}")
        for name, (ours, theirs) in _layer_outputs(emulate).items():
            ulp = torch.finfo(torch.float32).eps * theirs.abs().max()
            diff = ((ours - theirs).abs().max() / ulp).item()
            share = (ours != theirs).float().mean().item()
            print(f"  {name}: {share:.0%} differ, max {diff:.2f} ulp of the largest output")
        one = zip(_train("fsdp_float8", emulate), _train("torchao", emulate), strict=True)
        print("  1 process, |loss difference| per step:", [f"{abs(a - b):.1e}" for a, b in one])
        two = run_distributed(_fsdp_grid, 2, tmp, emulate, timeout_s=600)[0]
        pairs = zip(two["fsdp_float8"], two["torchao"], strict=True)
        print("  FSDP2 2 ranks, rank 0:", [f"{abs(a - b):.1e}" for a, b in pairs])


if __name__ == "__main__":
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        _report(sys.argv[1] if len(sys.argv) > 1 else tmp)
