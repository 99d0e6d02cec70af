"""A transformers 5.x Qwen3-MoE model (small config, random init) trained under FSDP2 on 2
gloo ranks: float8 (rowwise, float8 all-gather of attention and expert weights) against
bf16, 20 steps on the same data. Skips without transformers (an optional extra)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp_float8 import Float8LinearConfig, convert_to_float8_training
from tests.distributed.launcher import cpu_mesh, run_distributed

STEPS = 20


def _model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config)


def _train(rank: int, world_size: int, float8: bool) -> tuple[list[float], dict]:
    mesh = cpu_mesh(world_size)
    model = _model()
    report = {}
    if float8:
        config = Float8LinearConfig.from_recipe_name("rowwise", enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(
            model, config=config, module_filter_fn=lambda m, fqn: fqn != "lm_head"
        )
        r = model.float8_conversion_report
        report = {"experts": r.experts_converted, "linears": len(r.converted)}
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    g = torch.Generator().manual_seed(rank)
    data = torch.randint(0, 256, (4, 2, 32), generator=g)  # 4 batches per rank, cycled
    for step in range(STEPS):
        tokens = data[step % 4]
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, report


def _both(rank: int, world_size: int):
    return _train(rank, world_size, False), _train(rank, world_size, True)


@pytest.mark.extras
def test_qwen3_moe_float8_experts_track_bf16_for_20_steps(tmp_path):
    pytest.importorskip("transformers", minversion="5.0")
    (bf16, _), (fp8, report) = run_distributed(_both, 2, tmp_path, timeout_s=300)[0]
    assert report["experts"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert report["linears"] == 8  # q, k, v, o of 2 layers (lm_head kept out, router is hp)
    assert bf16[-1] < 0.8 * bf16[0]  # it learns
    tail = lambda xs: sum(xs[-5:]) / 5
    # the project's bar: within 2% of bf16 (rank 0's losses, mean of the last 5 steps)
    assert abs(tail(fp8) - tail(bf16)) <= 0.02 * tail(bf16), (fp8, bf16)
