"""The committed list of torchao.float8's public paths and names (tests/fixtures/
torchao_float8_names.json, which tests/unit/test_torchao_paths.py checks the mirror
against) is the installed torchao's, and the mirror's helpers give torchao's numbers."""

from __future__ import annotations

import pytest
import torch

from fsdp_float8.float8 import float8_scaling_utils as ours_scaling
from fsdp_float8.float8 import float8_training_tensor as ours_tt
from fsdp_float8.float8 import float8_utils as ours
from tests.unit.torchao_names import committed_names, derive_names

pytestmark = pytest.mark.extras


def test_committed_names_are_the_installed_torchaos() -> None:
    pytest.importorskip("torchao.float8")
    import torchao

    if not torchao.__version__.startswith("0.18"):
        pytest.fail(f"the committed list is torchao 0.18's; installed {torchao.__version__}")
    assert derive_names() == committed_names()


def test_helpers_give_torchaos_numbers() -> None:
    pytest.importorskip("torchao.float8")
    from torchao.float8 import float8_scaling_utils as ao_scaling
    from torchao.float8 import float8_training_tensor as ao_tt
    from torchao.float8 import float8_utils as ao
    from torchao.float8.config import ScalingGranularity as AoGranularity

    from fsdp_float8 import ScalingGranularity

    torch.manual_seed(0)
    x = torch.randn(64, 48, dtype=torch.bfloat16) * 5
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert torch.equal(ours.tensor_to_scale(x, dtype), ao.tensor_to_scale(x, dtype))
        for dim in (0, -1):
            got = ours.tensor_to_scale(
                x, dtype, False, None, ScalingGranularity.AXISWISE, dim, True
            )
            want = ao.tensor_to_scale(x, dtype, False, None, AoGranularity.AXISWISE, dim, True)
            assert torch.equal(got, want), (dtype, dim)
        scaled = x.float() * 300
        assert torch.equal(ours.to_fp8_saturated(scaled, dtype), ao.to_fp8_saturated(scaled, dtype))
        mine = ours_scaling.hp_tensor_to_float8_dynamic(x, dtype, ours_tt.LinearMMConfig())
        theirs = ao_scaling.hp_tensor_to_float8_dynamic(x, dtype, ao_tt.LinearMMConfig())
        assert torch.equal(mine._data.view(torch.uint8), theirs._data.view(torch.uint8))
        assert torch.equal(mine._scale, theirs._scale)
        assert ours.fp8_tensor_statistics(mine, dtype) == ao.fp8_tensor_statistics(theirs, dtype)
    y = x.float() + 0.01 * torch.randn(64, 48)
    assert torch.equal(ours.compute_error(x.float(), y), ao.compute_error(x.float(), y))
    for dims in (0, 1, (0, 1)):
        t = torch.randn(10, 20)
        assert torch.equal(ours.pad_tensor_for_matmul(t, dims), ao.pad_tensor_for_matmul(t, dims))
    assert tuple(ours_tt.LinearMMConfig()) == tuple(ao_tt.LinearMMConfig())
    assert [r.value for r in ours_tt.GemmInputRole] == [r.value for r in ao_tt.GemmInputRole]
