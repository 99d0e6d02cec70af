"""Fake CUDA: the three GEMMs of an NVFP4Linear on B200 (SM100) as `F.scaled_mm` calls
with e2m1 operands and [BlockWise1x16, TensorWise] scales, bf16 and fp32 parameters (the
latter under autocast), token counts and contraction dims that are not multiples of 32; on
H200 (SM90) the refusal with its remedy, and `emulate=True` running the emulated GEMMs;
FSDP2 on 8 fake ranks gathering the weights as NVFP4 into the FP4 GEMMs. The weight's
operands are built once per weight version (unsharded) and per unshard (FSDP2 on 2 fake
ranks): no GEMM re-lays or transposes the weight, and backward's re-gather quantizes nothing.
A broken kernel rule fails naming it (`tests.fakecuda.fake_cuda`)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp_float8 import NVFP4Config, NVFP4Linear, convert_to_float8_training
from fsdp_float8.core import nvfp4, nvfp4_gemm
from tests.fakecuda.cases import PARAMS
from tests.fakecuda.fake_cuda import B200, H200, backward, fake_cuda
from tests.fakecuda.fake_fsdp import fake_world
from tests.models import Transformer, model_args

pytestmark = pytest.mark.fakecuda

# (in, out), token shape: 10 and 7 tokens are not multiples of 16 (grad_weight pads the
# tokens); in=48 and out=80 are not multiples of 32 (the FP4 GEMM pads K)
SHAPES = {"64x32_t2x5": ((64, 32), (2, 5)), "48x80_t7": ((48, 80), (7,))}


def _run(layer: NVFP4Linear, tokens: tuple[int, ...], params: str) -> None:
    """Forward and backward on fake cuda; what comes back has nn.Linear's shapes and dtypes."""
    dtype, autocast = PARAMS[params]
    in_f, out_f = layer.in_features, layer.out_features
    x = torch.randn(*tokens, in_f, dtype=dtype, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = layer(x)
    want = torch.bfloat16 if autocast else dtype
    assert out.shape == (*tokens, out_f) and out.dtype == want, (out.shape, out.dtype)
    backward(out.float().square().sum())
    assert x.grad.shape == x.shape and x.grad.dtype == dtype
    assert layer.weight.grad.shape == (out_f, in_f) and layer.weight.grad.dtype == dtype
    assert layer.bias.grad.shape == (out_f,)


def _counting_emulated_mm():
    return mock.patch.object(nvfp4_gemm, "emulated_mm", wraps=nvfp4_gemm.emulated_mm)


def _layer(dims, params: str, config: NVFP4Config) -> NVFP4Linear:
    dtype, _ = PARAMS[params]
    base = nn.Linear(*dims, dtype=dtype, device="cuda")
    return NVFP4Linear.from_float(base, config)


@pytest.mark.parametrize("params", ["bf16", "fp32_autocast"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("all_gather", [False, True], ids=["plain", "wrapped_weight"])
def test_three_fp4_gemms_on_sm100(shape, params, all_gather):
    dims, tokens = SHAPES[shape]
    with fake_cuda(B200) as rules, _counting_emulated_mm() as emulated:
        layer = _layer(dims, params, NVFP4Config(enable_fsdp_float8_all_gather=all_gather))
        _run(layer, tokens, params)
    assert rules.calls["_scaled_mm_v2"] == 3
    assert emulated.call_count == 0  # nothing fell back to the emulated GEMM


def test_fp32_parameters_without_autocast_get_fp32_gemm_outputs():
    with fake_cuda(B200) as rules:
        _run(_layer((64, 32), "fp32", NVFP4Config()), (16,), "fp32")
    assert rules.calls["_scaled_mm_v2"] == 3


def test_sm90_is_refused_when_the_layer_is_built():
    with fake_cuda(H200), pytest.raises(ValueError, match=r"SM100.*SM90.*emulate=True"):
        _layer((64, 32), "bf16", NVFP4Config())


def test_sm90_is_refused_at_the_first_forward_of_a_layer_built_elsewhere():
    # built on the CPU (always emulated there), then moved: the first CUDA forward refuses
    # before it quantizes anything
    layer = NVFP4Linear.from_float(nn.Linear(64, 32, dtype=torch.bfloat16), NVFP4Config())
    with fake_cuda(H200) as rules:
        layer.to("cuda")
        x = torch.randn(16, 64, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match=r"SM100.*NVFP4Config\(emulate=True\)"):
            layer(x)
    assert rules.calls.get("_scaled_mm_v2", 0) == 0


@pytest.mark.parametrize("params", ["bf16", "fp32_autocast"])
def test_sm90_with_emulate_runs_the_emulated_gemms(params):
    with fake_cuda(H200) as rules, _counting_emulated_mm() as emulated:
        _run(_layer((64, 32), params, NVFP4Config(emulate=True)), (2, 5), params)
    assert rules.calls.get("_scaled_mm_v2", 0) == 0
    assert emulated.call_count == 3


def test_fsdp2_fp4_all_gather_on_sm100():
    # 8 fake ranks, 2 blocks of the tiny model (dims 256): each shard holds whole 16-row
    # tiles; the gathered NVFP4 weights feed the FP4 GEMMs directly
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    config = NVFP4Config(enable_fsdp_float8_all_gather=True)
    with fake_world((8,)) as mesh, fake_cuda(B200) as rules:
        with torch.device("cuda"):
            model = Transformer(model_args("tiny", dim=256, multiple_of=128, n_layers=2))
            data = torch.randint(0, 256, (2, 41))  # 80 tokens
        convert_to_float8_training(model, config=config, module_filter_fn=_blocks_only)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        logits = model(data[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), data[:, 1:].flatten())
        backward(loss)
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing
    layers = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    assert len(layers) == 14 and rules.calls["_scaled_mm_v2"] == 3 * len(layers)
    assert rules.calls["_allgather_base_"] > 0, dict(rules.calls)


def _blocks_only(module: nn.Module, fqn: str) -> bool:
    return fqn.startswith("blocks.")


class _WeightLayouts:
    """Counts, per FP4 GEMM, the weight's re-layouts made for it: the CUDA operand of a
    16x16-tiled record (padding, tile factors expanded and swizzled) and the transposes of
    the weight, outside the operand builds (`nvfp4_gemm.gemm_operand_parts`, counted apart), and
    the weight's quantizations (16x16 tiles)."""

    def __init__(self):
        self.per_gemm: list[tuple[int, int]] = []
        self.builds = {"output": 0, "transposed": 0}
        self.quantizations = 0
        self._layouts = self._transposes = self._building = 0

    def __enter__(self):
        real_operand, real_transposed = nvfp4_gemm._cuda_operand, nvfp4.transposed
        real_parts, real_mm, real_quantize = (
            nvfp4_gemm.gemm_operand_parts,
            nvfp4_gemm.scaled_mm_v2,
            nvfp4.quantize,
        )

        def operand(q):
            self._layouts += q.block == nvfp4.WEIGHT_BLOCK and not self._building
            return real_operand(q)

        def transposed(q):
            self._transposes += not self._building
            return real_transposed(q)

        def parts(q, *, transpose=False, out=None):
            self.builds["transposed" if transpose else "output"] += 1
            self._building += 1
            try:
                return real_parts(q, transpose=transpose, out=out)
            finally:
                self._building -= 1

        def mm(*args, **kwargs):
            self.per_gemm.append((self._layouts, self._transposes))
            self._layouts = self._transposes = 0
            return real_mm(*args, **kwargs)

        def quantize(x, amax, block=nvfp4.ACTIVATION_BLOCK, **kwargs):
            self.quantizations += block == nvfp4.WEIGHT_BLOCK
            return real_quantize(x, amax, block, **kwargs)

        self._patches = [
            mock.patch.object(module, name, fn)
            for module, name, fn in [
                (nvfp4_gemm, "_cuda_operand", operand),
                (nvfp4, "transposed", transposed),
                (nvfp4_gemm, "transposed", transposed),
                (nvfp4_gemm, "gemm_operand_parts", parts),
                (nvfp4_gemm, "scaled_mm_v2", mm),
                (nvfp4, "quantize", quantize),
            ]
        ]
        for patch in self._patches:
            patch.start()
        return self

    def __exit__(self, *exc):
        for patch in reversed(self._patches):
            patch.stop()

    def reset(self) -> None:
        self.per_gemm.clear()
        self.builds = {"output": 0, "transposed": 0}
        self.quantizations = 0


# per GEMM (output, grad_input, grad_weight): (weight re-layouts, weight transposes)
NO_RELAYOUT = [(0, 0)] * 3


@pytest.mark.parametrize("all_gather", [False, True], ids=["plain", "wrapped_weight"])
def test_weight_operands_built_once_per_weight_version(all_gather):
    # an unsharded layer: its weight quantized and each CUDA operand built once per version
    # of its values; every GEMM takes them as they are (48x80: both dims pad to 32)
    config = NVFP4Config(enable_fsdp_float8_all_gather=all_gather)
    with fake_cuda(B200) as rules, _WeightLayouts() as counts:
        layer = _layer((48, 80), "bf16", config)
        _run(layer, (7,), "bf16")
        assert counts.per_gemm == NO_RELAYOUT
        assert counts.builds == {"output": 1, "transposed": 1} and counts.quantizations == 1
        # the layer called twice in one step: the same weight version, nothing rebuilt
        counts.reset()
        x = torch.randn(2, 7, 48, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        backward((layer(x[0]) + layer(x[1])).float().sum())
        assert counts.per_gemm == NO_RELAYOUT * 2
        assert counts.builds == {"output": 1, "transposed": 1} and counts.quantizations == 1
        # an optimizer-like write: a new version, quantized and built again
        counts.reset()
        with torch.no_grad():
            layer.weight.add_(1.0)
        _run(layer, (7,), "bf16")
        assert counts.per_gemm == NO_RELAYOUT
        assert counts.builds == {"output": 1, "transposed": 1} and counts.quantizations == 1
    assert rules.calls["_scaled_mm_v2"] == 12


def test_fsdp2_weight_operands_built_once_per_unshard():
    # 2 fake ranks, one block: FSDP2 gathers each weight for forward and again for backward
    # (reshard_after_forward); each unshard builds the operand its GEMM takes, once, and the
    # backward re-gather sends the shard packed for forward (one quantization per weight)
    config = NVFP4Config(enable_fsdp_float8_all_gather=True)
    with fake_world((2,)) as mesh, fake_cuda(B200), _WeightLayouts() as counts:
        with torch.device("cuda"):
            model = Transformer(model_args("tiny", dim=256, multiple_of=128, n_layers=1))
            data = torch.randint(0, 256, (2, 41))
        convert_to_float8_training(model, config=config, module_filter_fn=_blocks_only)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        layers = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
        # steps: new weights; the same weights (their packs kept); written weights
        for step, quantized in enumerate([len(layers), 0, len(layers)]):
            if step == 2:
                with torch.no_grad():
                    for layer in layers:
                        layer.weight.mul_(0.5)
            counts.reset()
            logits = model(data[:, :-1])
            backward(logits.float().square().mean())
            assert counts.per_gemm == NO_RELAYOUT * len(layers), step
            assert counts.builds == {"output": len(layers), "transposed": len(layers)}, step
            assert counts.quantizations == quantized, step


def test_fsdp2_inference_forward_then_training():
    # an inference-mode forward builds the output GEMM's operand; the training step after it
    # rebuilds it into the same buffers (normal tensors, not inference ones)
    config = NVFP4Config(enable_fsdp_float8_all_gather=True)
    with fake_world((2,)) as mesh, fake_cuda(B200) as rules:
        with torch.device("cuda"):
            model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 32, bias=False))
        convert_to_float8_training(model, config=config)
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.randn(8, 64, device="cuda")
        with torch.inference_mode():
            model(x)
        params = [
            p for layer in model for p in layer._get_fsdp_state()._fsdp_param_group.fsdp_params
        ]
        inner = [t for p in params for t in p._unsharded_inner_tensors]
        # per weight: the gathered codes and tiles (FSDP2's buffers), the output GEMM's
        # swizzled factors (its codes are the gathered ones: K = 64 needs no padding)
        assert len(inner) == 3 * len(params)
        assert not any(t.is_inference() for t in inner[2::3])
        backward(model(x).float().square().sum())
    assert rules.calls["_scaled_mm_v2"] == 2 + 3 * 2
