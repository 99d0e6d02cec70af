"""torchao.float8.inference has no counterpart: importing this module raises `ImportError`
naming the alternative."""

from fsdp_float8.float8._absent import INFERENCE

raise ImportError(
    f"fsdp_float8.float8.inference (torchao.float8.inference) has no counterpart: {INFERENCE}"
)
