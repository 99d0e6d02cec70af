"""Internal module paths that are not (or no longer) modules, and checkpoints that name them.

The delayed-scaling state is `fsdp_float8.core.delayed_state`, the collective counter
`fsdp_float8.tools.comm_stats`, the weight wrappers `fsdp_float8.weight_wrappers`; the names
a user needs are exported by `fsdp_float8` and by the torchao-compatible paths
(`fsdp_float8.float8.*`, docs/torchao.md "Public import paths"). Other spellings of those
modules do not import.

A checkpoint pickled while the weight-wrapper classes lived under
`fsdp_float8.fsdp.weight_wrappers` (tests/fixtures/old_module_paths/weight_wrappers.pt: one
float8 all-gather weight per scaling kind) names their classes by those paths. It loads
with `torch.load(weights_only=True)`: `fsdp_float8/__init__.py` registers the classes as
safe globals under those names, and the unpickler takes them from that table without
importing a module. Without `weights_only` the unpickler imports the named module, which
does not exist.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

import fsdp_float8

GONE = [
    "fsdp_float8.comm_stats",
    "fsdp_float8.core.config_blocks",
    "fsdp_float8.core.config_foreign",
    "fsdp_float8.delayed_state",
    "fsdp_float8.fsdp.delayed_state",
    "fsdp_float8.fsdp.weight_wrappers",
    *(
        f"fsdp_float8.fsdp.weight_wrappers.{m}"
        for m in ("base", "block", "delayed", "dynamic", "gather", "state", "static")
    ),
]
# (public path, name) -> (the object's home, its name there)
_DYNAMIC = ("fsdp_float8.weight_wrappers.dynamic", "DynamicFloat8Weight")
PUBLIC = {
    ("fsdp_float8", "export_state_dict"): ("fsdp_float8.core.delayed_state", "export_state_dict"),
    ("fsdp_float8", "DynamicFloat8Weight"): _DYNAMIC,
    ("fsdp_float8", "BlockFloat8Weight"): (
        "fsdp_float8.weight_wrappers.block",
        "BlockFloat8Weight",
    ),
    ("fsdp_float8", "DelayedFloat8Weight"): (
        "fsdp_float8.weight_wrappers.delayed",
        "DelayedFloat8Weight",
    ),
    ("fsdp_float8", "StaticFloat8Weight"): (
        "fsdp_float8.weight_wrappers.static",
        "StaticFloat8Weight",
    ),
    ("fsdp_float8.tools.comm_stats", "CollectiveCounter"): (
        "fsdp_float8.tools.comm_stats",
        "CollectiveCounter",
    ),
    ("fsdp_float8.float8.fsdp_utils", "WeightWithDynamicFloat8CastTensor"): _DYNAMIC,
    ("fsdp_float8.float8.float8_linear", "WeightWithDynamicFloat8CastTensor"): _DYNAMIC,
}
PACKAGE = Path(fsdp_float8.__file__).resolve().parent
OLD_CHECKPOINT = (
    Path(__file__).resolve().parents[1] / "fixtures" / "old_module_paths" / "weight_wrappers.pt"
)
KINDS = {  # fixture key -> the class it must load as
    "tensorwise": fsdp_float8.DynamicFloat8Weight,
    "rowwise": fsdp_float8.DynamicFloat8Weight,
    "blockwise": fsdp_float8.BlockFloat8Weight,
    "static": fsdp_float8.StaticFloat8Weight,
    "delayed": fsdp_float8.DelayedFloat8Weight,
}


@pytest.mark.parametrize("name", GONE)
def test_old_internal_paths_do_not_import(name: str) -> None:
    sys.modules.pop(name, None)
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError:
        return
    finally:
        sys.modules.pop(name, None)
    # a setuptools editable install of another checkout answers, from that checkout, for a
    # top-level submodule this package lacks: what matters is that this package has none
    assert not Path(module.__file__).is_relative_to(PACKAGE), module.__file__


@pytest.mark.parametrize("where,name", sorted(PUBLIC))
def test_public_names_import_from_their_public_paths(where: str, name: str) -> None:
    home, home_name = PUBLIC[where, name]
    obj = getattr(importlib.import_module(where), name)
    assert obj is getattr(importlib.import_module(home), home_name)


def test_a_checkpoint_with_the_old_weight_wrapper_paths_loads_weights_only() -> None:
    loaded = torch.load(OLD_CHECKPOINT, weights_only=True)
    assert sorted(k for k in loaded if "." not in k) == sorted(KINDS)
    for kind, cls in KINDS.items():
        weight = loaded[kind]
        assert isinstance(weight, torch.nn.Parameter) and type(weight.data) is cls, kind
        torch.testing.assert_close(weight.data._tensor, loaded[f"{kind}.values"], rtol=0, atol=0)
    # the config travelled with the wrapper: the static scale is the one saved
    assert loaded["static"].data._config.cast_config_weight.static_scale == 0.5
    # taken from the safe-globals table: no module of the old path was imported
    assert not [n for n in sys.modules if n.startswith("fsdp_float8.fsdp.weight_wrappers")]


def test_the_old_checkpoint_without_weights_only_names_the_missing_module() -> None:
    with pytest.raises(ModuleNotFoundError, match="fsdp_float8.fsdp.weight_wrappers"):
        torch.load(OLD_CHECKPOINT, weights_only=False)
