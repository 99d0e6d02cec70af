"""Each format family has one place: the library code naming a format stays in a few files.

The count: library files whose code (comments and docstrings stripped) names a format, by
the words of its family (identifiers and strings alike), `__init__.py` files and the
torchao-compatible face `fsdp_float8/float8/` left out. Outside its place a family is
named only by the family table (`fsdp_float8.core.families`), its formats-side line
(`fsdp_float8.formats.weight_operands`) and the public names (config words, recipe names).
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import fsdp_float8
from fsdp_float8.core.config import ScalingGranularity
from fsdp_float8.core.families import FAMILIES, of_granularity
from fsdp_float8.core.recipes import Float8LinearRecipeName

PACKAGE = Path(fsdp_float8.__file__).parent
FAMILY_WORDS = {
    "tensorwise": ("tensorwise",),
    "rowwise": ("rowwise", "axiswise"),
    "blockwise": ("blockwise",),
    "mxfp8": ("mxfp8",),
    "nvfp4": ("nvfp4",),
}
MOST_FILES = 8


def code_of(source: str) -> str:
    """The source's tokens, lower-cased, without comments and docstrings."""
    tree = ast.parse(source)
    docstring_lines: set[int] = set()
    for node in ast.walk(tree):
        scopes = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        if isinstance(node, scopes) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstring_lines.update(range(first.lineno - 1, first.end_lineno or first.lineno))
    lines = source.splitlines(keepends=True)
    kept = "".join(line for i, line in enumerate(lines) if i not in docstring_lines)
    tokens = tokenize.generate_tokens(io.StringIO(kept).readline)
    return " ".join(t.string for t in tokens if t.type != tokenize.COMMENT).lower()


def files_naming(package: Path = PACKAGE) -> dict[str, list[str]]:
    """Format -> the library files whose code names it."""
    found: dict[str, list[str]] = {fmt: [] for fmt in FAMILY_WORDS}
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if path.name == "__init__.py" or relative.parts[0] == "float8":
            continue
        code = code_of(path.read_text())
        for fmt, words in FAMILY_WORDS.items():
            if any(word in code for word in words):
                found[fmt].append(str(relative))
    return found


def test_each_format_is_named_in_at_most_eight_library_files() -> None:
    for fmt, files in files_naming().items():
        assert len(files) <= MOST_FILES, (fmt, len(files), files)


def test_the_count_sees_code_and_skips_comments_and_docstrings() -> None:
    source = (
        '"""A tensorwise docstring."""\n'
        "def f():\n"
        '    """rowwise here too."""\n'
        "    return ScalingGranularity.BLOCKWISE  # mxfp8 in a comment\n"
        'x = "nvfp4"\n'
    )
    code = code_of(source)
    assert "blockwise" in code and "nvfp4" in code
    assert "tensorwise" not in code and "rowwise" not in code and "mxfp8" not in code


def test_the_family_table_lists_exactly_the_families() -> None:
    # the 4-bit family registers itself from its weight wrapper (imported by the package)
    assert sorted(FAMILIES) == ["block", "nvfp4", "rowwise", "tensorwise"]
    # every granularity word and every recipe name belongs to exactly one family
    assert {g.value: g.family.name for g in ScalingGranularity} == {
        "tensorwise": "tensorwise",
        "axiswise": "rowwise",
        "blockwise": "block",
    }
    recipes = [r for f in FAMILIES.values() for r in f.recipes]
    assert sorted(recipes) == sorted(r.value for r in Float8LinearRecipeName)
    assert of_granularity("axiswise").per_row and not of_granularity("blockwise").per_row


def test_only_a_one_scale_shard_needs_the_whole_weights_amax() -> None:
    needs = {name for name, f in FAMILIES.items() if f.needs_global_amax}
    assert needs == {"tensorwise", "nvfp4"}
    from fsdp_float8.formats import block, rowwise, tensorwise

    for place in (tensorwise, rowwise, block):
        assert place.NEEDS_GLOBAL_AMAX is place.FAMILY.needs_global_amax
