"""torchao.float8.float8_linear_utils: model conversion."""

from fsdp_float8.core.config import Float8LinearConfig, Float8LinearRecipeName
from fsdp_float8.core.recipes import _auto_filter_for_recipe
from fsdp_float8.float8._absent import module_getattr
from fsdp_float8.nn.convert import convert_to_float8_training
from fsdp_float8.nn.linear import Float8Linear

__getattr__ = module_getattr(
    __name__,
    {
        "swap_linear_layers": "use convert_to_float8_training(model, config=..., "
        "module_filter_fn=...), which swaps the linears it selects (and reports them in "
        "model.float8_conversion_report)"
    },
)

__all__ = [
    "Float8Linear",
    "Float8LinearConfig",
    "Float8LinearRecipeName",
    "_auto_filter_for_recipe",
    "convert_to_float8_training",
]
