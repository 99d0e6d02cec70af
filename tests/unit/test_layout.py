"""One home per concept (DESIGN.md): the package keeps its collectives, hooks and tables in
place. Each rule is an `ast` finder (tests/layout_rules.py), checked on every module of the
package and, below, on a snippet that breaks it and one that only looks alike:

- `all_reduce` is called only by core/amax_sync.py (tools/comm_stats.py only names the ops
  it counts);
- FSDP2's all-gather hooks are defined only under weight_wrappers/;
- `ScalingType.X` (a branch, a dict key, a comparison) appears only in core/config.py, the
  words -> strategies and words -> weight wrappers maps;
- no module asks a cast by its scaling word's string value (`g == "blockwise"`): the rules
  ask the `CastConfig` and its enums; only the torchtitan integration, whose converter
  fields are strings, checks them as given;
- the operand/GEMM topology (dict literals pairing `Operand.X` with `Gemm.Y`, tuple keys
  included) is spelled only in core/gemms.py, and no helper works out an operand's other
  GEMM by hand;
- delayed-scaling state (its `fp8_*` buffers and host flags) lives only in
  core/delayed_state.py;
- the post-optimizer refresh (precomputed weight scales, delayed syncs) is driven only from
  fsdp/refresh.py;
- no module imports numpy (a scripts-only dependency);
- the amax reduction (max |x|, or the min and max it is made of) is written only in
  core/scaling.py: one choice of reduction op for every cast, precompute and telemetry;
- torch features are probed only in core/_compat.py (no version checks), and nothing loops
  over an Enum class (torch 2.11 dynamo cannot);
- one scale path: `amax_to_scale` is called only in core/scaling.py, the batched MAX
  all-reduce of amaxes in one module of fsdp/, the power-of-two flag read only by
  core/config.py.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import layout_rules as rules
from tests.import_graph import circles, module_graph

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_float8"


@functools.cache
def _trees() -> dict[str, ast.Module]:
    return {
        str(p.relative_to(PACKAGE)): ast.parse(p.read_text(), str(p))
        for p in sorted(PACKAGE.rglob("*.py"))
    }


def _homes(finder) -> set[str]:
    return {f for f, tree in _trees().items() if finder(tree)}


@dataclass(frozen=True)
class Rule:
    finder: object
    homes: frozenset[str]  # the modules allowed to break it
    required: bool  # every home must hold it (the concept lives there)
    violation: str  # a snippet the finder must catch
    lookalike: str  # a snippet it must let through

    def __repr__(self) -> str:
        return self.finder.__name__  # type: ignore[attr-defined]


def _rule(finder, homes=(), *, required=False, violation: str, lookalike: str) -> Rule:
    return Rule(finder, frozenset(homes), required, violation, lookalike)


RULES = [
    _rule(
        rules.all_reduce_calls, {"core/amax_sync.py"}, required=True,
        violation="from torch.distributed import all_reduce as ar\nar(t)",
        lookalike="op = 'all_reduce'\ncounts.all_reduce_bytes(t)",
    ),
    _rule(
        rules.scaling_type_members, {"core/config.py"}, required=True,
        violation="from fsdp_float8.core.config import ScalingType as S\nT = {(S.DELAYED, 1): 2}",
        lookalike="kind = cfg.scaling_type\nname = ScalingType.__name__",
    ),
    _rule(
        rules.scaling_word_compares, {"integrations/torchtitan.py"},
        violation="blockwise = granularity == 'blockwise'\nk = t in ('delayed', 'static')",
        lookalike="c = CastConfig(scaling_granularity='blockwise')\nok = name == 'block'",
    ),
    _rule(
        rules.topology_tables, {"core/gemms.py"}, required=True,
        violation="T = {(Operand.INPUT, Gemm.OUTPUT): -1}",
        lookalike="cast(x, Operand.INPUT, Gemm.OUTPUT)\nT = {Operand.INPUT: 1}",
    ),
    _rule(
        rules.hand_written_second_gemm,
        violation="other = [g for g in gemms if g is not first]",
        lookalike="if g is not None:\n    pass",
    ),
    _rule(
        rules.fp8_buffers, {"core/delayed_state.py"}, required=True,
        violation='self.register_buffer(f"fp8_amax_{name}", t)',
        lookalike='self.register_buffer("running_mean", t)',
    ),
    _rule(
        rules.delayed_flags, {"core/delayed_state.py"},
        violation="a, state.synced_step = 1, 2",
        lookalike="n = state.synced_step",
    ),
    _rule(
        rules.refresh_calls, {"fsdp/refresh.py"}, required=True,
        violation="w.set_precomputed_scale(s)",
        lookalike="def set_precomputed_scale(self, s):\n    pass",
    ),
    _rule(
        rules.numpy_imports,
        violation="def f():\n    import numpy as np",
        lookalike="import numbers",
    ),
    _rule(
        rules.amax_reductions, {"core/scaling.py"}, required=True,
        violation="lo, hi = x.amin(dim=1), x.amax(dim=1)",
        lookalike="a = self.granularity.amax(hp, -1)\nb = history.amax()\nc = scale.max()",
    ),
    _rule(
        rules.version_probes, {"core/_compat.py"},
        violation="if torch.__version__ >= '2.12':\n    pass",
        lookalike="msg = f'torch {torch.__version__}'",
    ),
    _rule(
        rules.enum_class_loops,
        violation="names = [g.value for g in Gemm]",
        lookalike="names = [g.value for g in GEMMS]",
    ),
    _rule(
        rules.pow2_flag_reads, {"core/config.py"}, required=True,
        violation="p = cfg.round_scales_to_power_of_2",
        lookalike="cfg = dict(round_scales_to_power_of_2=True)",
    ),
    _rule(rules.pow2_helpers, violation="def _pow2(x):\n    pass", lookalike="def pow2(x):\n    pass"),
    _rule(
        rules.amax_to_scale_calls, {"core/scaling.py"}, required=True,
        violation="s = amax_to_scale(a, E4M3)",
        lookalike="from fsdp_float8.core.scaling import amax_to_scale",
    ),
]  # fmt: skip


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_each_concept_has_one_home(rule: Rule) -> None:
    homes = _homes(rule.finder)
    assert homes <= rule.homes, sorted(homes - rule.homes)
    if rule.required:
        assert homes == rule.homes, sorted(rule.homes - homes)


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_each_rule_catches_its_violation(rule: Rule) -> None:
    assert rule.finder(ast.parse(rule.violation)), rule.violation
    assert not rule.finder(ast.parse(rule.lookalike)), rule.lookalike


def test_amax_reductions_catch_every_spelling() -> None:
    for code in (
        "m = x.abs().max()",
        "m = torch.max(torch.abs(x))",
        "m = torch.amax(x.abs(), dim=0)",
        "lo, hi = torch.aminmax(x)",
        "m = torch.linalg.vector_norm(x, float('inf'))",
        "m = z.scatter_reduce(0, ids, x, 'amax', include_self=True)",
    ):
        assert rules.amax_reductions(ast.parse(code)), code


def test_one_fsdp_hook_pair_in_the_weight_wrappers_base() -> None:
    # every format packs its shard (`pack_shard`) and rebuilds through its metadata record
    # (`build` / `refill`); the hooks themselves are written once
    homes = _homes(rules.fsdp_hook_defs)
    assert homes == {"weight_wrappers/base.py"}, homes
    assert len(rules.fsdp_hook_defs(_trees()["weight_wrappers/base.py"])) == 2
    assert rules.fsdp_hook_defs(ast.parse("class W:\n    def fsdp_pre_all_gather(self): ..."))
    assert not rules.fsdp_hook_defs(ast.parse("out = w.fsdp_pre_all_gather(mesh)"))


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_a_format_is_one_module_that_says_all_about_its_weight() -> None:
    # each format module: its shard's amax need, its all-gather record, and how its
    # gathered weight becomes each GEMM's operand; no other module decides the last
    format_api = {"NEEDS_GLOBAL_AMAX", "operand_kind", "build_operand"}
    homes = {f for f, tree in _trees().items() if format_api & _top_level_names(tree)}
    formats = {"formats/tensorwise.py", "formats/rowwise.py", "formats/block.py"}
    assert homes == formats, homes
    for name in formats:
        names = _top_level_names(_trees()[name])
        assert format_api <= names, (name, format_api - names)
        assert any(n.endswith("Gather") for n in names), name


def test_the_batched_amax_reduction_is_the_only_one_outside_the_scale_path() -> None:
    # the float8 step's batched reduction (one module of fsdp/) is the only MAX
    # all-reduce of amaxes outside core/amax_sync.py and core/scaling.py
    outside = _homes(rules.amax_all_reduce_calls) - {"core/amax_sync.py", "core/scaling.py"}
    assert len(outside) == 1 and next(iter(outside)).startswith("fsdp/"), outside
    assert rules.amax_all_reduce_calls(ast.parse("all_reduce_amax_(a, group)"))
    assert not rules.amax_all_reduce_calls(ast.parse("all_reduce_amax = None"))


# ------------------------------------------------------------------------ the import graph


def _import_graph() -> dict[str, set[str]]:
    return module_graph(PACKAGE)


def test_the_only_import_circle_is_the_tensor_and_its_op_table():
    # function-level imports count: a lazy import hides a circle, it does not remove it
    found = circles(_import_graph())
    pair = {"fsdp_float8.core.float8_tensor", "fsdp_float8.core.float8_ops"}
    assert found == [pair], found


def test_core_imports_nothing_from_the_other_subpackages():
    outside = {
        f"{module} -> {target}"
        for module, targets in _import_graph().items()
        if module.startswith("fsdp_float8.core")
        for target in targets
        if not target.startswith("fsdp_float8.core")
    }
    assert outside == set(), sorted(outside)


def test_subpackage_faces_import_nothing_of_the_package():
    # fsdp_float8/__init__.py is the public face; the architecture's folders (core, nn,
    # fsdp, experts, tensor_parallel, tools) keep a docstring-only __init__, so importing one
    # module of a folder never loads its siblings
    graph = _import_graph()
    folders = [p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()]
    assert len(folders) >= 6, folders
    heavy = {f: graph[f"fsdp_float8.{f}"] for f in folders if graph[f"fsdp_float8.{f}"]}
    assert heavy == {}, heavy


def test_the_import_graph_sees_function_level_imports():
    graph = _import_graph()
    # blocks.block_scaled_mm imports the CUDA GEMM inside the function
    assert "fsdp_float8.core.blocks_cuda" in graph["fsdp_float8.core.blocks"]
    # and a circle made that way is found
    assert circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [{"a", "b"}]


NVFP4_FILES = {
    "__init__.py",
    "core/nvfp4.py",
    "core/nvfp4_gemm.py",
    "experts/nvfp4_experts.py",
    "nn/nvfp4_linear.py",
    "nn/nvfp4_weight_cache.py",
    "weight_wrappers/nvfp4.py",
}


def test_nvfp4_lives_in_its_seven_files():
    # the 4-bit format (numerics and GEMMs, the experts modules and their FSDP2 weight,
    # the layer and its quantized-weight cache, the FSDP2 weight, the export) is named
    # nowhere else in the package: other modules reach it through a config's
    # `linear_class` / `experts_classes` and the weight wrapper hooks
    naming = {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if "nvfp4" in p.read_text().lower()
    }
    assert naming == NVFP4_FILES, sorted(naming ^ NVFP4_FILES)
