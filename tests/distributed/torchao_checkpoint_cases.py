"""A torchao.float8 training checkpoint, written with torchao and loaded with fsdp_float8.

`write_torchao_checkpoint` (needs torchao) trains a tiny two-linear model for 2 steps on 2
gloo ranks with torchao's float8 all-gather (tensorwise, emulated GEMMs, AdamW) and writes:
- `dcp/`: `dcp.save` of the model's and the optimizer's state dicts (`get_state_dict`);
- `rank{r}.pt`: each rank's `torch.save(model.state_dict())` (DTensor shards whose local
  tensors are torchao's `WeightWithDynamicFloat8CastTensor`);
- `single.pt`: a one-process torchao model (not sharded, float8 all-gather on, so its
  weights are torchao's wrapper too) saved with `torch.save(model.state_dict())`;
- `expected.pt`: the same values as plain tensors (full weights and optimizer state, and
  the one-process model's weights), to check a load against.

`load_with_fsdp_float8` loads all three into the same model converted with fsdp_float8 and
reports what differs from `expected.pt`, whether torchao was imported, and one training
loss after the load next to the loss of a model given `expected.pt`'s values directly.

Regenerate the committed fixture (tests/fixtures/torchao_float8_tensorwise, with torchao
0.18 installed): `python -m tests.distributed.torchao_checkpoint_cases OUT_DIR`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from tests.distributed.launcher import cpu_mesh

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "torchao_float8_tensorwise"
STEPS = 2


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    # biases keep each FSDP2 group mixed-dtype (gloo refuses an all-float8 buffer)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def _shard(model: nn.Module, world_size: int) -> nn.Module:
    mesh = cpu_mesh(world_size)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + 10 * step + rank))


def _train(model, opt, steps, rank, after_step=None) -> list[float]:
    losses = []
    for step in steps:
        loss = model(_batch(step, rank)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(model)
        losses.append(loss.item())
    return losses


def _full(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """Nested state dicts flattened to {dotted key: plain full tensor} (the weights
    unwrapped from any float8 wrapper: torchao's `_tensor`, fsdp_float8's plain state)."""
    out = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_full(v, f"{key}."))
        elif isinstance(v, torch.Tensor):
            t = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[key] = getattr(t, "_tensor", t).detach().clone()
    return out


def write_torchao_checkpoint(rank: int, world_size: int, out: str) -> None:
    from torchao.float8 import (
        Float8LinearConfig,
        convert_to_float8_training,
        precompute_float8_dynamic_scale_for_fsdp,
    )

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
    model = _shard(convert_to_float8_training(tiny_model(), config=config), world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, range(STEPS), rank, precompute_float8_dynamic_scale_for_fsdp)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out}/dcp")
    torch.save(model.state_dict(), f"{out}/rank{rank}.pt")
    expected = _full({"model": msd, "optim": osd})
    if rank == 0:
        single = convert_to_float8_training(tiny_model(), config=config)
        single_opt = torch.optim.AdamW(single.parameters(), lr=1e-2)
        _train(single, single_opt, range(STEPS), 0)
        torch.save(single.state_dict(), f"{out}/single.pt")
        expected.update({f"single.{k}": v for k, v in _full(single.state_dict()).items()})
        torch.save(expected, f"{out}/expected.pt")


def _fsdp_float8_model(world_size: int | None):
    from fsdp_float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
    model = convert_to_float8_training(tiny_model(), config=config)
    if world_size is not None:
        _shard(model, world_size)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _mismatched(expected: dict, loaded: dict, prefixes: tuple, strip: str = "") -> list[str]:
    """Keys of `expected` under `prefixes` whose loaded tensor (key less `strip`) differs
    in dtype, shape or any bit of any value."""
    keys = [k for k in expected if k.startswith(prefixes)]
    bad = []
    for k in keys:
        got = loaded.get(k.removeprefix(strip))
        if not isinstance(got, torch.Tensor) or got.dtype != expected[k].dtype:
            bad.append(k)
        elif not torch.equal(got, expected[k]):
            bad.append(k)
    return bad if keys else ["(no keys)"]


def _dcp_load(world_size: int, ckpt: str):
    model, opt = _fsdp_float8_model(world_size)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=f"{ckpt}/dcp")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt


# the torch that wrote the committed fixture (with torchao 0.18)
FIXTURE_TORCH = "2.13"


def mesh_pickle_loads() -> bool:
    """Whether this torch can use the per-rank files' DTensors: torch pickles a DeviceMesh
    as its attributes, which change between minor versions (a mesh torch 2.13 wrote has a
    `_FlatLayout`, a class torch 2.11 lacks, and lacks the `_preserve_rank_order` torch 2.15
    reads), so those files load only under the torch minor version that wrote them. The
    DCP checkpoint and the one-process file hold no mesh and load under every torch."""
    return torch.__version__.startswith(FIXTURE_TORCH + ".")


def load_with_fsdp_float8(rank: int, world_size: int, ckpt: str) -> dict:
    expected = torch.load(f"{ckpt}/expected.pt", weights_only=True)
    model, opt = _dcp_load(world_size, ckpt)
    loaded = _full(dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True)))
    report = {"dcp": _mismatched(expected, loaded, ("model.", "optim."))}
    resumed = _train(model, opt, [STEPS], rank)
    # the same model and optimizer given expected.pt's values, not the checkpoint's
    ref, ref_opt = _fsdp_float8_model(world_size)
    ref_msd, ref_osd = get_state_dict(ref, ref_opt)
    _copy_into({"model": ref_msd, "optim": ref_osd}, expected)
    set_state_dict(ref, ref_opt, model_state_dict=ref_msd, optim_state_dict=ref_osd)
    report["losses"] = (resumed, _train(ref, ref_opt, [STEPS], rank))

    report["rank_pt"] = None  # not loadable on this torch: `mesh_pickle_loads`
    if mesh_pickle_loads():
        sharded, _ = _fsdp_float8_model(world_size)
        sharded.load_state_dict(torch.load(f"{ckpt}/rank{rank}.pt", weights_only=True))
        rank_state = _full(sharded.state_dict(), "model.")
        report["rank_pt"] = _mismatched(expected, rank_state, ("model.",))
    single, _ = _fsdp_float8_model(None)
    single.load_state_dict(torch.load(f"{ckpt}/single.pt", weights_only=True))
    report["single_pt"] = _mismatched(
        expected, _full(single.state_dict()), ("single.",), strip="single."
    )
    report["torchao_imported"] = sorted(m for m in sys.modules if m.split(".")[0] == "torchao")
    return report


def _copy_into(state: dict, flat: dict, prefix: str = "") -> None:
    """Write `flat`'s full tensors into the (sharded) tensors of `state`, in place."""
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            _copy_into(v, flat, f"{key}.")
        elif isinstance(v, torch.Tensor) and key in flat:
            with torch.no_grad():
                if hasattr(v, "full_tensor"):
                    from torch.distributed.tensor import distribute_tensor

                    src = distribute_tensor(flat[key], v.device_mesh, v.placements)
                    v.to_local().copy_(src.to_local())
                else:
                    v.copy_(flat[key])


if __name__ == "__main__":
    from tests.distributed.launcher import run_distributed

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    run_distributed(write_torchao_checkpoint, 2, out / "_run", str(out), timeout_s=300)
    import shutil

    shutil.rmtree(out / "_run")
    print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}")
