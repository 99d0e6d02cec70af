"""Run torchtitan 0.3 on CPU ranks with gloo: a test-only shim, never part of the library.

What torchtitan needs that a CPU machine lacks, and what stands in for it here:
- it imports triton for expert-parallel kernels it never runs here: a stub of that module;
- it picks its device as "cuda" when no accelerator is found: the device type is "cpu", and
  `torch.cpu` gets the memory-statistics calls its memory monitor makes (zeros);
- FlexAttention has no CPU backward: SDPA with the same document-causal mask (built from the
  positions torchtitan passes) replaces it;
- its gradient reduce-scatter uses PREMUL_SUM, which gloo lacks: FSDP2 is told to reduce
  with SUM (`set_force_sum_reduction_for_comms`);
- after the first step it shortens the process-group timeouts with a device barrier and
  `torch.distributed.set_timeout` (absent in torch 2.13): skipped;
- no download: `make_assets` writes a tiny tokenizer and a tiny text data set where the
  debug config looks for them (./tests/assets/{tokenizer,c4_test} under the run folder).

`python -m tests.integrations.titan_cpu RECORD.json -- <torchtitan.train arguments>` (under
torchrun) runs torchtitan's own entry point with the shim, and writes per rank the loss of
each step and the collectives of each step counted by fsdp_float8.tools.comm_stats.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import torch

WORDS = [f"w{i}" for i in range(300)]


def stub_triton_kernels() -> None:
    """torchtitan's expert-parallel kernels module imports triton at import time (a stub
    `triton` would make torch itself believe triton is there): stand in for that module."""
    try:
        import triton  # noqa: F401

        return
    except ImportError:
        pass
    name = "torchtitan.distributed.minimal_async_ep.kernels"

    def kernel(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*_args, **_kwargs):
            raise RuntimeError(f"{name}.{attr} needs triton (not on this CPU test machine)")

        return unavailable

    module = types.ModuleType(name)
    module.__getattr__ = kernel
    sys.modules[name] = module


def install() -> None:
    """Patch torch for torchtitan on CPU; call before importing torchtitan."""
    stub_triton_kernels()
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    memory = types.SimpleNamespace(total_memory=24 << 30)
    device_calls = {  # what torchtitan's memory monitor asks a device module
        "get_device_name": lambda device=None: "cpu",
        "get_device_properties": lambda device=None: memory,
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
        "memory_stats": lambda device=None: {},
    }
    for name, fn in device_calls.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)
    from torch.distributed.fsdp import FSDPModule

    divide = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self, factor: float) -> None:
        divide(self, factor)
        self.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


def _sdpa_for_flex(
    self,
    q_BLNH,
    k_BLNH,
    v_BLNH,
    *,
    attention_masks,
    score_mod=None,
    scale=None,
    enable_gqa=False,
    out_transform=None,
    **_kwargs,
):
    """FlexAttention.forward on CPU: SDPA under the block mask's own mask_mod, evaluated
    densely (same masking, so the same attention up to summation order)."""
    from torch.nn.attention.flex_attention import create_mask

    assert score_mod is None and out_transform is None, "not used by the llama3 debug model"
    b, seq = q_BLNH.shape[0], q_BLNH.shape[1]
    mask = create_mask(attention_masks.mask_mod, b, None, seq, k_BLNH.shape[1], q_BLNH.device)
    q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )
    return out.transpose(1, 2)


def make_assets(root: Path, *, n_docs: int = 400) -> None:
    """A word-level tokenizer of 300 words + bos/eos, and documents drawn from a fixed
    random bigram table (learnable structure), where the debug config reads them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok_dir = root / "tests" / "assets" / "tokenizer"
    data_dir = root / "tests" / "assets" / "c4_test"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    vocab = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<unk>": 2}
    vocab.update({w: i + 3 for i, w in enumerate(WORDS)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "add_bos_token": True,
        "add_eos_token": True,
    }
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    nxt = torch.randint(0, len(WORDS), (len(WORDS), 4), generator=g)
    with open(data_dir / "data.json", "w") as f:
        for _ in range(n_docs):
            w = int(torch.randint(0, len(WORDS), (1,), generator=g))
            doc = []
            for _ in range(int(torch.randint(40, 120, (1,), generator=g))):
                doc.append(WORDS[w])
                w = int(nxt[w, int(torch.randint(0, 4, (1,), generator=g))])
            f.write(json.dumps({"text": " ".join(doc)}) + "\n")


def main() -> None:
    record_path, args = sys.argv[1], sys.argv[sys.argv.index("--") + 1 :]
    install()
    from torchtitan import train
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention.forward = _sdpa_for_flex
    import torchtitan.distributed.utils as dist_utils

    dist_utils.set_pg_timeouts = lambda *args, **kwargs: None
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.trainer import Trainer

    from fsdp_float8.tools.comm_stats import CollectiveCounter

    steps: list[dict] = []
    losses: dict[int, float] = {}
    real_step, real_log = Trainer.train_step, MetricsProcessor.log

    def train_step(self, data_iterator):
        with CollectiveCounter() as counter:
            real_step(self, data_iterator)
        steps.append({"step": self.step, "collectives": counter.as_dicts()})

    def log(self, step, loss, *args, **kwargs):
        losses[step] = float(loss)
        return real_log(self, step, loss, *args, **kwargs)

    Trainer.train_step, MetricsProcessor.log = train_step, log
    sys.argv = [sys.argv[0], *args]
    train.main()
    for s in steps:
        s["loss"] = losses.get(s["step"])
    rank = int(os.environ.get("RANK", "0"))
    Path(f"{record_path}.rank{rank}").write_text(json.dumps(steps))


if __name__ == "__main__":
    main()
