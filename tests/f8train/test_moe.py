"""The trainer's mixture-of-experts block (`f8train.moe`): routed slots per expert and the
load-balancing loss, which reaches the router."""

from __future__ import annotations

import torch

from f8train.model import Transformer, model_args
from f8train.moe import MoEArgs, moe_aux_loss, tokens_per_expert


def _moe_model(**moe):
    args = model_args("moe_tiny", n_layers=2, moe=MoEArgs(**{"hidden_dim": 128, **moe}))
    model = Transformer(args)
    model.init_weights(0)
    return model


def test_moe_aux_loss_and_tokens_per_expert():
    model = _moe_model(top_k=2)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    model(tokens)
    counts = tokens_per_expert(model)
    assert [sum(c) for c in counts] == [2 * 64, 2 * 64]  # every token routed to 2 experts
    aux = moe_aux_loss(model)
    # E * sum f_e p_e >= 1 with equality only when routing is perfectly balanced
    assert aux.item() >= 0.01 * 0.99
    aux.backward()
    assert model.blocks[0].feed_forward.router.grad.abs().sum() > 0
