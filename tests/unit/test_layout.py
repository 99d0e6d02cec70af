"""One home per concept (DESIGN.md): the package keeps its collectives and hooks in place.

- `all_reduce` is called only by amax_sync.py (comm_stats only names ops it counts);
- FSDP2's all-gather hooks are defined only under weight_wrappers/;
- ScalingType words (if/elif, dict keys, any `ScalingType.X`) live only in config.py (the
  words -> strategies and words -> weight wrappers maps);
- the operand/GEMM topology (`Operand.X: Gemm.Y` tables) is spelled only in gemms.py;
- delayed-scaling state (its buffers and host flags) lives only in delayed_state.py;
- the post-optimizer refresh (precomputed weight scales, delayed syncs) only in fsdp.py;
- no module imports numpy (a scripts-only dependency);
- the amax reduction (max |x|) is written only in scaling.py (`tensor_amax`, `axis_amax`,
  `tensor_amaxes`): one choice of reduction op for every cast, precompute and telemetry;
- torch features are probed only in _compat.py (no version checks), and nothing loops over
  an Enum class (torch 2.11 dynamo cannot).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.import_graph import circles, imported_names

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_float8"


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in PACKAGE.rglob("*.py")}


def test_all_reduce_is_called_only_by_amax_sync():
    callers = [f for f, text in _sources().items() if re.search(r"\ball_reduce\(", text)]
    assert callers == ["core/amax_sync.py"]


def test_fsdp_hooks_live_in_weight_wrappers():
    homes = [
        f for f, text in _sources().items() if re.search(r"def fsdp_(pre|post)_all_gather", text)
    ]
    assert homes and all(f.startswith("fsdp/weight_wrappers/") for f in homes), homes


def test_scaling_type_branches_only_in_config():
    branching = [
        f for f, text in _sources().items() if re.search(r"(if|elif) .*ScalingType\.\w+", text)
    ]
    assert set(branching) <= {"core/config.py"}, branching


def test_amax_reduction_lives_in_scaling():
    pattern = r"abs\(\)\.amax\(|vector_norm\(|_foreach_norm\(|\baminmax\("
    homes = [f for f, text in _sources().items() if re.search(pattern, text)]
    assert homes == ["core/scaling.py"], homes


def test_package_does_not_import_numpy():
    # numpy is the scripts' dependency (pyproject extra `f8train`), not the library's
    importers = [
        f for f, text in _sources().items() if re.search(r"^\s*(import|from) numpy\b", text, re.M)
    ]
    assert importers == [], importers


def test_torch_features_are_probed_only_in_compat():
    # Support for torch 2.11-2.15 is by feature checks in one place, never by version.
    pattern = r"torch\.__version__\s*[<>=!]|TorchVersion|version\.parse|_make_nccl_premul_sum\("
    homes = [f for f, text in _sources().items() if re.search(pattern, text)]
    assert set(homes) <= {"core/_compat.py"}, homes


def test_no_loop_over_an_enum_class():
    # dynamo in torch 2.11 cannot iterate an Enum class inside a compiled function: loop
    # over config.OPERANDS / config.GEMMS instead.
    pattern = r"\bin (Operand|Gemm|ScalingType|ScalingGranularity)\b(?!\.)"
    loops = [f for f, text in _sources().items() if re.search(pattern, text)]
    assert loops == [], loops


def _homes(pattern: str) -> set[str]:
    return {f for f, text in _sources().items() if re.search(pattern, text)}


def test_scaling_type_words_only_in_config():
    # catches dict dispatch ({ScalingType.DYNAMIC: ...}) and comparisons, not only if/elif
    assert _homes(r"ScalingType\.[A-Z]") <= {"core/config.py"}


def test_operand_gemm_topology_only_in_gemms():
    assert _homes(r"Operand\.\w+\s*:\s*\(?Gemm\.") <= {"core/gemms.py"}
    assert _homes(r"Gemm\.\w+\s*:\s*\(Operand\.") == {"core/gemms.py"}  # GEMM_OPERANDS
    assert _homes(r"g is not first|\bsecond_gemm\(") == set()


def test_delayed_state_lives_in_one_module():
    buffers = _homes(r"register_buffer\(\s*f?[\"']fp8_")
    flags = _homes(r"\b(weight_ready|synced_step|syncs|sync_group|forwards_since_sync)\s*=[^=]")
    assert buffers == {"fsdp/delayed_state.py"}, buffers
    assert flags <= {"fsdp/delayed_state.py"}, flags


def test_post_optimizer_refresh_lives_in_fsdp():
    homes = _homes(r"\.(set_precomputed_scale|apply_reduced|slots)\(")
    assert homes == {"fsdp/refresh.py"}, homes


# ------------------------------------------------------------------------ the import graph


def _module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    return files


def _import_graph() -> dict[str, set[str]]:
    files = _module_files()
    known = set(files)
    return {
        module: (imported_names(path, module) & known) - {module} for module, path in files.items()
    }


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


# ---------------------------------------------------------------------- one scale path


def test_scales_come_from_amaxes_in_scaling_only():
    # amax -> (reduce over a group) -> scale is written once: everyone else asks a strategy
    assert _homes(r"\bamax_to_scale\(") == {"core/scaling.py"}
    # the float8 step's batched reduction (one module of fsdp/) is the only MAX
    # all-reduce outside the path
    outside = _homes(r"\ball_reduce_amax_\(") - {"core/amax_sync.py", "core/scaling.py"}
    assert len(outside) == 1 and next(iter(outside)).startswith("fsdp/"), outside


def test_power_of_two_flag_has_one_reader():
    # config.strategy() reads it into the strategies; config_blocks validates it
    assert _homes(r"\.round_scales_to_power_of_2\b") == {"core/config.py"}
    assert _homes(r"class TPReducedScaling|def _pow2\(") == set()
