"""torchao.float8.float8_ops has no counterpart: importing this module raises `ImportError`
naming the alternative."""

from fsdp_float8.float8._absent import INTERNAL

raise ImportError(
    "fsdp_float8.float8.float8_ops (torchao.float8.float8_ops, the op table of torchao's "
    f"Float8TrainingTensor) has no counterpart: {INTERNAL} (fsdp_float8.core.float8_ops "
    "is the op table of fsdp_float8.Float8Tensor, an internal module)"
)
