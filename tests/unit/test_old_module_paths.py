"""The module paths of earlier releases still import, with a DeprecationWarning.

`fsdp_float8.delayed_state` and `fsdp_float8.comm_stats` moved into subpackages
(`fsdp_float8.core.delayed_state`, `fsdp_float8.tools.comm_stats`), the weight wrappers from
`fsdp_float8.fsdp.weight_wrappers` to `fsdp_float8.weight_wrappers`; the old paths are thin
aliases for one release: importing one warns, names the new path, and gives the very
objects of the new home (so isinstance checks and patches keep working).

A checkpoint written with `torch.save` before the weight wrappers moved names their classes
by the old path (tests/fixtures/old_module_paths/weight_wrappers.pt: one float8 all-gather
weight per scaling kind, saved by the release that had them under `fsdp/`): it loads with
`weights_only=True` (the old names are safe globals) and without (the aliases import).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path

import pytest
import torch

import fsdp_float8

OLD_PATHS = {
    "fsdp_float8.delayed_state": (
        "fsdp_float8.core.delayed_state",
        ["DelayedScalingState", "DelayedState", "export_state_dict"],
    ),
    "fsdp_float8.comm_stats": (
        "fsdp_float8.tools.comm_stats",
        ["CollectiveCounter", "CollectiveKind", "CollectiveRecord"],
    ),
    "fsdp_float8.fsdp.weight_wrappers": (
        "fsdp_float8.weight_wrappers.wrap",
        ["BlockFloat8Weight", "DelayedFloat8Weight", "DynamicFloat8Weight", "StaticFloat8Weight"]
        + ["Float8WeightWrapper", "note_replaced", "plain_weight", "replaced_parameter"]
        + ["wrap_weight", "wrapper_class"],
    ),
    "fsdp_float8.fsdp.weight_wrappers.base": (
        "fsdp_float8.weight_wrappers.base",
        ["Float8WeightWrapper", "_rebuild_weight_wrapper", "plain_weight", "state_dict_weight"],
    ),
    "fsdp_float8.fsdp.weight_wrappers.block": (
        "fsdp_float8.weight_wrappers.block",
        ["BlockFloat8Weight", "check_block_shards"],
    ),
    "fsdp_float8.fsdp.weight_wrappers.delayed": (
        "fsdp_float8.weight_wrappers.delayed",
        ["DelayedFloat8Weight"],
    ),
    "fsdp_float8.fsdp.weight_wrappers.dynamic": (
        "fsdp_float8.weight_wrappers.dynamic",
        ["DynamicFloat8Weight"],
    ),
    "fsdp_float8.fsdp.weight_wrappers.static": (
        "fsdp_float8.weight_wrappers.static",
        ["StaticFloat8Weight"],
    ),
    # one record per format, each in its format's module
    "fsdp_float8.fsdp.weight_wrappers.gather": (
        "fsdp_float8.formats",
        ["block.BlockGather", "rowwise.RowwiseGather", "tensorwise.TensorwiseGather"],
    ),
    "fsdp_float8.fsdp.weight_wrappers.state": (
        "fsdp_float8.weight_wrappers.state",
        ["WeightState", "written_args"],
    ),
}
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


def _fresh_import(name: str):
    sys.modules.pop(name, None)
    __import__(name)  # an import statement's path (importlib.import_module is a frame more)
    return sys.modules[name]


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_old_path_warns_and_gives_the_same_objects(old: str) -> None:
    new, names = OLD_PATHS[old]
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated.*{new}") as caught:
        alias = _fresh_import(old)
    # the warning points at the importing line, not at the import machinery
    assert caught[0].filename == __file__
    for dotted in names:  # a name, or module.name under the new home
        module, _, name = dotted.rpartition(".")
        target = importlib.import_module(f"{new}.{module}" if module else new)
        assert getattr(alias, name) is getattr(target, name), dotted
    assert sorted(alias.__all__) == sorted(n.rpartition(".")[2] for n in names)


def test_from_import_of_an_old_path() -> None:
    sys.modules.pop("fsdp_float8.delayed_state", None)
    with pytest.warns(DeprecationWarning):
        from fsdp_float8.delayed_state import export_state_dict
    import fsdp_float8

    assert export_state_dict is fsdp_float8.export_state_dict


@pytest.mark.parametrize("weights_only", [True, False])
def test_a_checkpoint_with_the_old_weight_wrapper_paths_loads(weights_only: bool) -> None:
    for name in [n for n in sys.modules if n.startswith("fsdp_float8.fsdp.weight_wrappers")]:
        sys.modules.pop(name)  # the unpickler must import the alias itself
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        loaded = torch.load(OLD_CHECKPOINT, weights_only=weights_only)
    assert sorted(k for k in loaded if "." not in k) == sorted(KINDS)
    for kind, cls in KINDS.items():
        weight = loaded[kind]
        assert isinstance(weight, torch.nn.Parameter) and type(weight.data) is cls, kind
        torch.testing.assert_close(weight.data._tensor, loaded[f"{kind}.values"], rtol=0, atol=0)
    # the config travelled with the wrapper: the static scale is the one saved
    assert loaded["static"].data._config.cast_config_weight.static_scale == 0.5
