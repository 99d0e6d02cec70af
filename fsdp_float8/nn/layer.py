"""What every quantized linear shares (`Float8Linear`, the 4-bit linear): `QuantizedLinear`.

A quantized linear is an `nn.Linear` whose weight, with the config's
`enable_fsdp_float8_all_gather`, is a weight wrapper (`fsdp_float8.weight_wrappers`) so
FSDP2 gathers it quantized. This base holds the plumbing around that weight, once:
- `from_float`: the layer built on the meta device, the float layer's weight and bias
  shared (not copied), the weight wrapped;
- `wrap_weight_for_fsdp`: the weight (or a DTensor weight's local tensor) wrapped by
  `wrap_weight`, the one way a weight becomes a wrapper; every path that builds or reloads
  the layer ends there;
- the state-dict hooks: a state dict holds the plain high-precision weight (checkpoints load
  anywhere), and `load_state_dict(assign=True)` keeps the weight wrapped;
- `float8_weight_names`: what the float8 step asks (`fsdp_float8.fsdp.refresh.Float8Module`).
A subclass says how its config is resolved (`layer_config`), which devices run its GEMMs
(`check_device`), its checks and state (`prepare`), and its forward. The base leaves
`nn.Module.__setattr__` as it is: FSDP2 swaps the sharded and unsharded weight by a plain
dict write only while the class keeps it.
"""

from __future__ import annotations

from typing import Any, Self

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_float8.weight_wrappers.base import Float8WeightWrapper, state_dict_weight
from fsdp_float8.weight_wrappers.wrap import wrap_weight


class QuantizedLinear(nn.Linear):
    """nn.Linear with quantized GEMMs (module docstring). Built by `from_float` (shares the
    parameters) or `convert_to_float8_training`."""

    # what the float8 step asks (`fsdp_float8.fsdp.refresh.Float8Module`): the quantized weights
    float8_weight_names: tuple[str, ...] = ("weight",)
    config: Any  # the layer's config, resolved by `layer_config`

    def __init__(self, *args, config: Any = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.config = self.layer_config(config)
        self.prepare()
        self.register_load_state_dict_post_hook(_keep_weight_wrapped)
        self._register_state_dict_hook(_plain_weight_in_state_dict)
        self.wrap_weight_for_fsdp()

    # -- what subclasses decide -----------------------------------------------------------
    @classmethod
    def layer_config(cls, config: Any) -> Any:
        """`config` as the layer keeps it (None: the default), or TypeError."""
        raise NotImplementedError

    @classmethod
    def check_device(cls, device: torch.device, config: Any) -> None:
        """Refuse a device that cannot run the layer's GEMMs with `config`."""
        raise NotImplementedError

    def prepare(self) -> None:
        """The subclass's checks and state, after the config, before the weight is wrapped
        (a delayed weight's scale source lives in its layer). `from_float` calls it again
        once the float layer's weight is shared (its device is the weight's)."""

    # -- shared -------------------------------------------------------------------------
    @classmethod
    def from_float(cls, mod: nn.Linear, config: Any = None) -> Self:
        if not isinstance(mod, nn.Linear):
            raise TypeError(f"from_float expects an nn.Linear, got {type(mod).__name__}")
        config = cls.layer_config(config)
        cls.check_device(mod.weight.device, config)
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False, config=config)
        new.weight = mod.weight  # shared, not copied
        new.bias = mod.bias
        new.prepare()
        new.wrap_weight_for_fsdp()
        return new

    def wrap_weight_for_fsdp(self) -> None:
        """With `enable_fsdp_float8_all_gather`, make the weight (or a DTensor weight's local
        tensor) a weight wrapper (`wrap_weight`), so FSDP2 gathers it quantized: every path
        that builds or reloads the layer ends here (idempotent; the storage is shared)."""
        if not self.config.enable_fsdp_float8_all_gather:
            return
        weight = self.weight
        if isinstance(weight, DTensor):
            if not isinstance(weight._local_tensor, Float8WeightWrapper):
                weight._local_tensor = wrap_weight(weight._local_tensor, self).data
        elif not isinstance(weight, Float8WeightWrapper):
            self.weight = wrap_weight(weight, self)


def _plain_weight_in_state_dict(module, state_dict, prefix, local_metadata) -> None:
    key = prefix + "weight"
    if key in state_dict:
        # the parameter's own inner tensor (detached by autograd, so it shares the version
        # counter): a loader writing into it in place is seen by the wrapper's WeightState
        weight = module.weight
        state_dict[key] = state_dict_weight(weight, detach=state_dict[key] is not weight)


def _keep_weight_wrapped(module: QuantizedLinear, incompatible_keys) -> None:
    # load_state_dict(assign=True) swaps in the checkpoint's plain tensor
    module.wrap_weight_for_fsdp()
