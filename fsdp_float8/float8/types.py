"""torchao.float8.types has no counterpart: importing this module raises `ImportError`
naming the alternative."""

from fsdp_float8.float8._absent import INFERENCE

raise ImportError(
    f"fsdp_float8.float8.types (torchao.float8.types) has no counterpart: {INFERENCE}"
)
