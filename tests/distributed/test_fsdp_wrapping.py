"""Under FSDP2 a layer configured for float8 all-gather gathers float8 whatever built it:
`Float8Linear.from_float`, `convert_to_float8_training`, and after
`load_state_dict(..., assign=True)` of a sharded state_dict (1 rank, explicit CPU mesh).
The unsharded weight the layer sees in forward must be a `Float8Tensor`."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from fsdp_float8 import Float8Linear, Float8LinearConfig, Float8Tensor, convert_to_float8_training
from tests.distributed.launcher import cpu_mesh, run_distributed

CONFIG = Float8LinearConfig.tensorwise(enable_fsdp_float8_all_gather=True)


def _gathered_type(model: nn.Module) -> str:
    seen = []
    handle = model[0].register_forward_pre_hook(lambda m, args: seen.append(type(m.weight)))
    model(torch.randn(4, 32)).sum().backward()
    handle.remove()
    return seen[0].__name__


def _paths(rank, world_size):
    mesh = cpu_mesh(world_size)
    torch.manual_seed(0)
    built = {
        "from_float": nn.Sequential(Float8Linear.from_float(nn.Linear(32, 32), CONFIG)),
        "convert": convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)), config=CONFIG),
    }
    types = {}
    for name, model in built.items():
        fully_shard(model, mesh=mesh)
        types[name] = _gathered_type(model)
    model = built["convert"]
    sd = {k: v.detach().clone() * 2 for k, v in model.state_dict().items()}
    model.load_state_dict(sd, assign=True)
    types["load_state_dict_assign"] = _gathered_type(model)
    return types


def test_float8_all_gather_whatever_built_the_layer(tmp_path):
    types = run_distributed(_paths, 1, tmp_path, timeout_s=120)[0]
    assert types == dict.fromkeys(types, Float8Tensor.__name__) and len(types) == 3, types


# -- fully_shard(shard_placement_fn=...) other than Shard(0), 2 ranks ---------------------------
SHARD_1_RECIPES = {
    "tensorwise": CONFIG,
    "rowwise": Float8LinearConfig.from_recipe_name("rowwise", enable_fsdp_float8_all_gather=True),
    "mxfp8": Float8LinearConfig.from_recipe_name("mxfp8", enable_fsdp_float8_all_gather=True),
    "nvfp4": None,
}


def _shard_1(rank, world_size):
    from torch.distributed.tensor import Shard

    from fsdp_float8 import NVFP4Config

    mesh = cpu_mesh(world_size)
    results = {}
    for name, config in SHARD_1_RECIPES.items():
        config = config or NVFP4Config(enable_fsdp_float8_all_gather=True)
        torch.manual_seed(0)
        model = convert_to_float8_training(
            nn.Sequential(nn.Linear(64, 64, bias=False)), config=config
        )
        fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(1))
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))
        try:
            model(x).sum().backward()
            results[name] = "ran"
        except Exception as err:  # noqa: BLE001 - the message is the result
            results[name] = f"{type(err).__name__}: {err}"
    return results


def test_shard_placement_other_than_dim_0_runs_or_is_refused_by_name(tmp_path):
    for results in run_distributed(_shard_1, 2, tmp_path, timeout_s=120):
        assert results["tensorwise"] == "ran", results
        for name in ("rowwise", "mxfp8", "nvfp4"):
            msg = results[name]
            assert msg.startswith("ValueError") and "Shard(1)" in msg, (name, msg)
            assert "shard_placement_fn" in msg and "enable_fsdp_float8_all_gather" in msg, msg
