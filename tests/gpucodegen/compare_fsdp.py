"""The lane's transformer block (tests/gpucodegen/test_blocks.py) and FSDP2 training step
(test_fsdp_step.py) for this library and for torchao 0.18, side by side: Triton launches
and non-GEMM MB of the compiled block, forward + backward, H100. torchao is no dependency of the lane; put it on the path:

    PYTHONPATH=.:/work/torchao018 TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 \\
        .venv-fakecuda/bin/python -m tests.gpucodegen.compare_fsdp
"""

from __future__ import annotations

from f8train.bench_common import markdown_table
from tests.gpucodegen import cases


def _totals(compiled: cases.Compiled) -> tuple[str, int, float, str]:
    fwd, bwd = compiled.of_kind("forward")[0], compiled.of_kind("backward")[0]
    scaled = f"{fwd.gemms['_scaled_mm']} + {bwd.gemms['_scaled_mm']}"
    moved = (fwd.triton_bytes + bwd.triton_bytes) / 1e6
    return f"{fwd.triton} + {bwd.triton}", fwd.triton + bwd.triton, moved, scaled


def _row(setting: str, recipe: str, ac: str, ours, theirs) -> list[str]:
    return [
        setting, recipe, ac, ours[0], theirs[0], f"{ours[1] / theirs[1]:.2f}x",
        f"{ours[2]:.2f}", f"{theirs[2]:.2f}", f"{ours[2] / theirs[2]:.2f}x", ours[3], theirs[3],
    ]  # fmt: skip


def main() -> list[list[str]]:
    rows = []
    for recipe in ("tensorwise", "rowwise"):
        # the transformer block alone (attention projections and SwiGLU, no FSDP)
        ours = _totals(cases.block("h100", recipe))
        theirs = _totals(cases.block("h100", recipe, lib="torchao"))
        rows.append(_row("block", recipe, "off", ours, theirs))
        for ac in (False, True):
            ours = _totals(cases.fsdp_step(recipe, ac))
            theirs = _totals(cases.fsdp_step(recipe, ac, lib="torchao"))
            rows.append(_row("FSDP2 step", recipe, "on" if ac else "off", ours, theirs))
    # delayed scaling after the first sync, beside torchao's tensorwise (it has no delayed)
    recipe = "delayed_synced"
    ours = _totals(cases.block("h100", recipe))
    theirs = _totals(cases.block("h100", "tensorwise", lib="torchao"))
    rows.append(_row("block", recipe, "off", ours, theirs))
    for ac in (False, True):
        ours = _totals(cases.fsdp_step(recipe, ac))
        theirs = _totals(cases.fsdp_step("tensorwise", ac, lib="torchao"))
        rows.append(_row("FSDP2 step", recipe, "on" if ac else "off", ours, theirs))
    # a recipe beside the targets: the block alone
    recipe = "rowwise_with_gw_hp"
    ours = _totals(cases.block("h100", recipe))
    theirs = _totals(cases.block("h100", recipe, lib="torchao"))
    rows.append(_row("block", recipe, "off", ours, theirs))
    headers = ["setting", "recipe", "AC", "launches ours", "torchao", "ratio", "MB ours"]
    headers += ["torchao", "ratio", "_scaled_mm ours", "torchao"]
    print(markdown_table(headers, rows))
    return rows


if __name__ == "__main__":
    main()
