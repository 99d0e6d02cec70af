"""Every public module path and name of torchao.float8 0.18 has its counterpart under
`fsdp_float8.float8`, so rewriting `torchao` to `fsdp_float8` in an import is enough.

The list of torchao's paths and names is committed (tests/fixtures/torchao_float8_names.json,
see tests/unit/torchao_names.py; the extras lane checks it against the installed torchao).
Each name resolves to this package's own object, or is one of the few documented as absent
(docs/torchao.md), which raise `ImportError` naming the alternative.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

import fsdp_float8
from fsdp_float8.float8 import float8_utils as fu
from tests.unit.torchao_names import committed_names

# modules with no counterpart, and names absent from modules that have one
ABSENT_MODULES = {"float8_ops", "inference", "types"}
ABSENT_NAMES = {
    "FP8Granularity",
    "Float8MMConfig",
    "Float8TrainingTensor",
    "Float8TypeConfig",
    "type_config",
    "matmul_with_hp_or_float8_args",
    "swap_linear_layers",
    "NoopFwToFloat8BwDynamic",
}


def _mirror(module: str) -> str:
    return "fsdp_float8.float8" + (f".{module}" if module else "")


@pytest.mark.parametrize("module", sorted(committed_names()))
def test_every_torchao_path_and_name_has_its_counterpart(module: str) -> None:
    names = committed_names()[module]
    if module in ABSENT_MODULES:
        with pytest.raises(ImportError, match=r"has no counterpart: .*fsdp_float8"):
            importlib.import_module(_mirror(module))
        return
    mirror = importlib.import_module(_mirror(module))
    missing = []
    for name in names:
        if name in ABSENT_NAMES:
            with pytest.raises(ImportError, match=rf"{name}.*no counterpart in fsdp_float8"):
                getattr(mirror, name)
        elif not hasattr(mirror, name):
            missing.append(name)
    assert missing == [], f"{_mirror(module)} lacks torchao's {missing}"


def test_names_are_the_packages_own_objects() -> None:
    from fsdp_float8.float8 import config, float8_linear, float8_tensor_parallel, fsdp_utils
    from fsdp_float8.float8.float8_training_tensor import GemmInputRole

    assert fsdp_float8.float8.Float8LinearConfig is fsdp_float8.Float8LinearConfig
    assert config.CastConfig is fsdp_float8.CastConfig
    assert float8_linear.Float8Linear is fsdp_float8.Float8Linear
    assert fsdp_utils.WeightWithDynamicFloat8CastTensor is fsdp_float8.DynamicFloat8Weight
    assert float8_tensor_parallel.PrepareFloat8ModuleInput is fsdp_float8.PrepareFloat8ModuleInput
    assert GemmInputRole is fsdp_float8.Operand and GemmInputRole.WEIGHT.value == "weight"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = fsdp_float8.float8.nope


def test_importing_one_submodule_loads_no_sibling() -> None:
    code = (
        "import sys, fsdp_float8.float8.config as c; "
        "print(sorted(m for m in sys.modules if m.startswith('fsdp_float8.float8.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # import fsdp_float8 loads the checkpoint stand-ins (and the GEMM configs they use)
    assert "float8_linear" not in out.stdout and "float8_tensor_parallel" not in out.stdout


def test_scale_helpers_follow_the_layers_scale_path() -> None:
    x = torch.randn(32, 64, dtype=torch.bfloat16) * 3
    scale = fu.tensor_to_scale(x, torch.float8_e4m3fn)
    assert scale.dtype == torch.float32
    assert scale == (448.0 / x.abs().max().double()).float()
    rows = fu.tensor_to_scale(
        x,
        torch.float8_e4m3fn,
        scaling_granularity=fsdp_float8.ScalingGranularity.AXISWISE,
        axiswise_dim=-1,
        round_scales_to_power_of_2=True,
    )
    assert rows.shape == (32, 1) and torch.equal(rows, torch.exp2(torch.floor(torch.log2(rows))))
    fp8 = fu.to_fp8_saturated(x.float() * scale * 2, torch.float8_e4m3fn)
    assert fp8.dtype == torch.float8_e4m3fn and fp8.float().abs().max() == 448
    assert float(fu.compute_error(x.float(), x.float() * 1.001)) == pytest.approx(60, abs=1e-3)
    assert fu.pad_tensor_for_matmul(torch.ones(10, 20), dims=(0, 1)).shape == (16, 32)
    with pytest.raises(NotImplementedError, match="tensor_to_scale"):
        fu.tensor_to_amax(x, reduce_amax=True)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fu.amax_to_scale(torch.tensor(1.0), torch.float16)
