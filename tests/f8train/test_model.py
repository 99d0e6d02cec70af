"""The Llama-style workload model: shapes, causality, deterministic init, preset sizes, FLOPs."""

from __future__ import annotations

import pytest
import torch

from f8train.model import (
    PRESETS,
    ModelArgs,
    Transformer,
    flops_per_token,
    model_args,
    num_params,
    param_count,
)


def _tiny(**overrides: object) -> Transformer:
    model = Transformer(model_args("tiny", n_layers=2, **overrides))
    model.init_weights(seed=0)
    return model


def test_forward_shape_and_dtype() -> None:
    model = _tiny()
    tokens = torch.randint(0, 256, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, 256)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_backward_reaches_every_parameter() -> None:
    model = _tiny()
    tokens = torch.randint(0, 256, (2, 16))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_bf16_params_give_bf16_logits() -> None:
    model = _tiny().to(torch.bfloat16)
    logits = model(torch.randint(0, 256, (1, 8)))
    assert logits.dtype == torch.bfloat16


def test_causality() -> None:
    model = _tiny()
    tokens = torch.randint(0, 256, (2, 32))
    changed = tokens.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :20], after[:, :20], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 20:], after[:, 20:])


def test_init_is_deterministic_and_seed_dependent() -> None:
    a, b, c = _tiny(), _tiny(), _tiny()
    c.init_weights(seed=1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.ndim == 2:
            assert not torch.equal(pa, pc), name


def test_init_takes_every_seed_the_flag_accepts() -> None:
    """--seed takes 0 .. 2**64 - 1; the largest initialises too, differently from seed 0
    (the per-parameter seeds wrap modulo 2**64, which leaves the smaller seeds' values)."""
    largest, zero = _tiny(), _tiny()
    largest.init_weights(seed=2**64 - 1)
    wq = "blocks.0.attention.wq.weight"
    values = dict(largest.named_parameters())[wq]
    assert torch.isfinite(values).all() and not torch.equal(
        values, dict(zero.named_parameters())[wq]
    )


def test_meta_init_to_empty_matches_direct_init() -> None:
    direct = _tiny()
    with torch.device("meta"):
        meta = Transformer(model_args("tiny", n_layers=2))
    meta.to_empty(device="cpu")
    meta.init_weights(seed=0)
    for (name, p), q in zip(direct.named_parameters(), meta.parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(direct.rope_cos, meta.rope_cos)
    assert torch.equal(direct.rope_sin, meta.rope_sin)
    tokens = torch.randint(0, 256, (1, 8))
    torch.testing.assert_close(direct(tokens), meta(tokens), rtol=0, atol=0)


def test_rope_buffers_are_not_in_state_dict() -> None:
    model = _tiny()
    assert not any("rope" in key for key in model.state_dict())
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2


def test_tied_embeddings_share_one_matrix() -> None:
    model = _tiny(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    untied = _tiny()
    assert num_params(untied, exclude_embedding=False) - num_params(
        model, exclude_embedding=False
    ) == (256 * 256)
    assert model(torch.randint(0, 256, (1, 8))).shape == (1, 8, 256)


def test_tiny_linear_dims_divisible_by_16() -> None:
    model = Transformer(PRESETS["tiny"])
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert all(d % 16 == 0 for d in module.weight.shape), name
    assert 1_000_000 < num_params(model, exclude_embedding=False) < 10_000_000


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_num_params_matches_param_count(preset: str) -> None:
    args = PRESETS[preset]
    with torch.device("meta"):
        model = Transformer(args)
    assert num_params(model) == param_count(args)
    assert num_params(model, exclude_embedding=False) == param_count(args, exclude_embedding=False)
    if preset == "small":
        assert 25e6 <= num_params(model, exclude_embedding=False) <= 50e6


def test_llama3_8b_shapes_on_meta() -> None:
    args = PRESETS["llama3_8b"]
    assert args.ffn_hidden_dim == 14336
    assert PRESETS["llama3_70b"].ffn_hidden_dim == 28672
    with torch.device("meta"):
        model = Transformer(args)
    total = num_params(model, exclude_embedding=False)
    assert total == 8_030_261_248  # the published Llama-3-8B count
    block = model.blocks[0]
    assert block.attention.wk.weight.shape == (1024, 4096)  # 8 kv heads x 128
    assert block.feed_forward.w1.weight.shape == (14336, 4096)
    assert model.output.weight.shape == (128256, 4096)
    assert len(model.blocks) == 32


def test_llama3_70b_param_count() -> None:
    assert param_count(PRESETS["llama3_70b"], exclude_embedding=False) == 70_553_706_496


def test_flops_per_token_formula() -> None:
    args = PRESETS["llama3_8b"]
    n = param_count(args)
    assert n == 8_030_261_248 - 128256 * 4096
    assert flops_per_token(args, 8192) == 6 * n + 12 * 32 * 4096 * 8192
    # Dense 6N dominates for the 8B model at 8K context: ~ 58 GFLOP per token.
    assert 5.5e10 < flops_per_token(args, 8192) < 6.0e10
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(args, 0)


def test_model_args_overrides_and_errors() -> None:
    args = model_args("tiny", n_layers=1, max_seq_len=64)
    assert args.n_layers == 1 and args.dim == PRESETS["tiny"].dim
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        model_args("huge")
    with pytest.raises(TypeError, match="n_layer"):
        model_args("tiny", n_layer=3)
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        ModelArgs(dim=256, n_layers=1, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim"):
        ModelArgs(dim=100, n_layers=1, n_heads=8)


def test_sequence_longer_than_max_seq_len_raises() -> None:
    model = Transformer(model_args("tiny", n_layers=1, max_seq_len=8))
    with pytest.raises(ValueError, match="exceeds max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_init_values_are_pinned_across_torch_versions() -> None:
    # The same seed must give the same weights on every supported torch (2.11 to 2.15 were
    # run): init draws only from Tensor.normal_ (nn.init.trunc_normal_ changed after 2.11).
    # Values below were printed by torch 2.11.0, 2.13.0 and 2.15.0 alike.
    params = dict(_tiny().named_parameters())
    wq = params["blocks.0.attention.wq.weight"][0, :3].tolist()
    head = params["output.weight"][-1, -3:].tolist()
    assert wq == [-0.0052261860109865665, 0.027156034484505653, 0.002560393186286092]
    assert head == [0.08809657394886017, -0.009223752655088902, -0.05809110775589943]
    std = {n: 0.02 for n in params if n.endswith(".wq.weight")}
    for name, s in std.items():  # truncated at 3 std
        assert params[name].abs().max() <= 3 * s, name
