"""The layout rules of tests/unit/test_layout.py as `ast` finders: each takes a parsed module
and returns the line numbers of the code that breaks its rule (empty: none). Names bound by
`from m import X as Y` are resolved, so an alias does not hide a call or a member."""

from __future__ import annotations

import ast
from collections.abc import Iterator

ENUMS = frozenset({"Operand", "Gemm", "ScalingType", "ScalingGranularity"})
DELAYED_FLAGS = frozenset(
    {"weight_ready", "synced_step", "syncs", "sync_group", "forwards_since_sync"}
)
REFRESH_CALLS = frozenset({"set_precomputed_scale", "apply_reduced", "slots"})
# reductions that compute a max |x| (or its ingredients: the min and max of x)
AMAX_OPS = frozenset({"amax", "amin", "aminmax", "vector_norm", "_foreach_norm"})


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> imported name, for every `from m import name as local`."""
    return {
        a.asname: a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for a in node.names
        if a.asname
    }


def _named(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The name a `Name` or the attribute an `Attribute` spells (aliases resolved)."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _calls(tree: ast.Module) -> Iterator[tuple[ast.Call, str | None]]:
    aliases = _aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, _named(node.func, aliases)


def _members(tree: ast.AST, aliases: dict[str, str], enums=ENUMS) -> Iterator[tuple[str, int]]:
    """(enum class, line) of each `Enum.MEMBER` attribute of the given enum classes."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            enum = aliases.get(node.value.id, node.value.id)
            if enum in enums and node.attr[:1].isupper():
                yield enum, node.lineno


def all_reduce_calls(tree: ast.Module) -> list[int]:
    return [c.lineno for c, name in _calls(tree) if name == "all_reduce"]


def fsdp_hook_defs(tree: ast.Module) -> list[int]:
    hooks = {"fsdp_pre_all_gather", "fsdp_post_all_gather"}
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in hooks
    ]


def scaling_type_members(tree: ast.Module) -> list[int]:
    """`ScalingType.X` anywhere: a branch, a dict key, a comparison, a default."""
    return [line for _, line in _members(tree, _aliases(tree), {"ScalingType"})]


def topology_tables(tree: ast.Module) -> list[int]:
    """Dict literals that pair operands with GEMMs, in their keys (tuple keys too) or
    values: the operand/GEMM topology spelled by hand."""
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            if {"Operand", "Gemm"} <= {enum for enum, _ in _members(node, aliases)}:
                found.append(node.lineno)
    return found


def hand_written_second_gemm(tree: ast.Module) -> list[int]:
    """A `second_gemm` helper, or `g is not first` (the other GEMM of an operand, by hand)."""
    found = [c.lineno for c, name in _calls(tree) if name == "second_gemm"]
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "second_gemm":
            found.append(node.lineno)
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.IsNot):
            right = node.comparators[0]
            if isinstance(right, ast.Name) and right.id == "first":
                found.append(node.lineno)
    return found


def _starts_fp8(arg: ast.expr) -> bool:
    if isinstance(arg, ast.JoinedStr) and arg.values:
        arg = arg.values[0]
    return isinstance(arg, ast.Constant) and str(arg.value).startswith("fp8_")


def fp8_buffers(tree: ast.Module) -> list[int]:
    """`register_buffer("fp8_...")` (a plain or f-string name)."""
    return [
        c.lineno
        for c, name in _calls(tree)
        if name == "register_buffer" and c.args and _starts_fp8(c.args[0])
    ]


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    if isinstance(node, ast.Assign):
        for t in node.targets:
            yield from (ast.walk(t) if isinstance(t, (ast.Tuple, ast.List)) else [t])
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        yield node.target


def delayed_flags(tree: ast.Module) -> list[int]:
    """Assignments to the delayed-scaling host flags (names, attributes, `setattr`)."""
    found = []
    for node in ast.walk(tree):
        for t in _targets(node):
            if _named(t, {}) in DELAYED_FLAGS:
                found.append(node.lineno)
    for c, name in _calls(tree):
        if name == "setattr" and len(c.args) > 1 and isinstance(c.args[1], ast.Constant):
            if c.args[1].value in DELAYED_FLAGS:
                found.append(c.lineno)
    return found


def refresh_calls(tree: ast.Module) -> list[int]:
    return [
        c.lineno
        for c, name in _calls(tree)
        if isinstance(c.func, ast.Attribute) and name in REFRESH_CALLS
    ]


def numpy_imports(tree: ast.Module) -> list[int]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        if any(n == "numpy" or n.startswith("numpy.") for n in names):
            found.append(node.lineno)
    return found


def _receiver(call: ast.Call) -> str | None:
    func = call.func
    return _named(func.value, {}) if isinstance(func, ast.Attribute) else None


def _is_abs(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _named(node.func, {}) == "abs"


def amax_reductions(tree: ast.Module) -> list[int]:
    """A max |x| written out: amax/amin/aminmax/vector_norm/_foreach_norm, `scatter_reduce`
    with "amax"/"amin", a max of an abs. Not the scale path's own API (`granularity.amax`)
    nor the max of an amax history (its values are amaxes already)."""
    found = []
    for c, name in _calls(tree):
        receiver = _receiver(c)
        if receiver is not None and (receiver == "granularity" or receiver.endswith("history")):
            continue
        words = {a.value for a in c.args if isinstance(a, ast.Constant)}
        abs_of = (isinstance(c.func, ast.Attribute) and _is_abs(c.func.value)) or any(
            _is_abs(a) for a in c.args
        )
        if (
            name in AMAX_OPS
            or (name == "scatter_reduce" and words & {"amax", "amin"})
            or (name == "max" and abs_of)
        ):
            found.append(c.lineno)
    return found


def version_probes(tree: ast.Module) -> list[int]:
    """A torch version compared, parsed or named (`TorchVersion`), or the 2.11 PREMUL_SUM
    builder called: features are probed in one place."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "__version__" for s in sides):
                found.append(node.lineno)
        elif isinstance(node, (ast.Name, ast.Attribute)) and _named(node, {}) == "TorchVersion":
            found.append(node.lineno)
    for c, name in _calls(tree):
        if name == "_make_nccl_premul_sum" or (name == "parse" and _receiver(c) == "version"):
            found.append(c.lineno)
    return found


def enum_class_loops(tree: ast.Module) -> list[int]:
    """A loop, comprehension or `in` test over an Enum class itself (torch 2.11's dynamo
    cannot iterate one inside a compiled function)."""
    aliases = _aliases(tree)

    def is_enum(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and aliases.get(node.id, node.id) in ENUMS

    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.comprehension)) and is_enum(node.iter):
            found.append(getattr(node, "lineno", node.iter.lineno))
        elif isinstance(node, ast.Compare) and any(
            isinstance(op, (ast.In, ast.NotIn)) and is_enum(right)
            for op, right in zip(node.ops, node.comparators, strict=True)
        ):
            found.append(node.lineno)
    return found


def pow2_flag_reads(tree: ast.Module) -> list[int]:
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr == "round_scales_to_power_of_2"
    ]


def pow2_helpers(tree: ast.Module) -> list[int]:
    """A second owner of the power-of-two rule (a tensor-parallel strategy or `_pow2`)."""
    return [
        n.lineno
        for n in ast.walk(tree)
        if (isinstance(n, ast.ClassDef) and n.name == "TPReducedScaling")
        or (isinstance(n, ast.FunctionDef) and n.name == "_pow2")
    ]


def amax_to_scale_calls(tree: ast.Module) -> list[int]:
    return [c.lineno for c, name in _calls(tree) if name == "amax_to_scale"]


def amax_all_reduce_calls(tree: ast.Module) -> list[int]:
    return [c.lineno for c, name in _calls(tree) if name == "all_reduce_amax_"]


# the string values of `ScalingType` and `ScalingGranularity`
SCALING_WORDS = frozenset(
    {"dynamic", "delayed", "static", "disabled", "tensorwise", "axiswise", "blockwise"}
)


def scaling_word_compares(tree: ast.Module) -> list[int]:
    """A comparison with a scaling word's string value (`g == "blockwise"`, `k in ("delayed",
    "static")`): code that asks a cast config by its word's value instead of its enum."""

    def word(node: ast.expr) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(word(e) for e in node.elts)
        return isinstance(node, ast.Constant) and node.value in SCALING_WORDS

    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare) and any(map(word, [node.left, *node.comparators]))
    ]
