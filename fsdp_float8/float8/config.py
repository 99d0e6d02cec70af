"""torchao.float8.config: the configuration types, and the float8 dtypes.

`e4m3_dtype` / `e5m2_dtype` are `torch.float8_e4m3fn` / `torch.float8_e5m2` (torchao picks
the `fnuz` pair on AMD MI300 through `type_config`; fsdp_float8 has no such switch).
"""

from fsdp_float8.core.config import (
    E4M3,
    E5M2,
    CastConfig,
    Float8GemmConfig,
    Float8LinearConfig,
    Float8LinearRecipeName,
    ScalingGranularity,
    ScalingType,
)
from fsdp_float8.float8._absent import module_getattr

e4m3_dtype = E4M3
e5m2_dtype = E5M2

_FNUZ = (
    "fsdp_float8 casts to torch.float8_e4m3fn / torch.float8_e5m2 (no fnuz switch for AMD "
    "MI300): use fsdp_float8.float8.config.e4m3_dtype and e5m2_dtype"
)
__getattr__ = module_getattr(__name__, {"Float8TypeConfig": _FNUZ, "type_config": _FNUZ})

__all__ = [
    "CastConfig",
    "Float8GemmConfig",
    "Float8LinearConfig",
    "Float8LinearRecipeName",
    "ScalingGranularity",
    "ScalingType",
    "e4m3_dtype",
    "e5m2_dtype",
]
