"""The lane's small graphs of linear layers (`cases.GRAPHS`: one linear, with a bias, a
GELU MLP, a 3-layer ReLU MLP, a float32 linear under bf16 autocast and without it, LayerNorm and a biased
GELU MLP, causal attention around SDPA) for this library and
for torchao 0.18, side by side: Triton launches and non-GEMM MB, forward + backward, H100.
torchao is no dependency of the lane; put it on the path:

    PYTHONPATH=.:/work/torchao018 TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 \\
        .venv-fakecuda/bin/python -m tests.gpucodegen.compare_graphs
"""

from __future__ import annotations

from f8train.bench_common import markdown_table
from tests.gpucodegen import cases

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _totals(compiled: cases.Compiled) -> tuple[int, int, float]:
    fwd, bwd = compiled.of_kind("forward")[0], compiled.of_kind("backward")[0]
    return fwd.triton, bwd.triton, (fwd.triton_bytes + bwd.triton_bytes) / 1e6


def main() -> list[list[str]]:
    rows = []
    for kind in cases.GRAPHS:
        for recipe in RECIPES:
            ours = _totals(cases.graph(kind, recipe))
            theirs = _totals(cases.graph(kind, recipe, lib="torchao"))
            rows.append([
                kind, recipe, f"{ours[0]} + {ours[1]}", f"{theirs[0]} + {theirs[1]}",
                f"{(ours[0] + ours[1]) / (theirs[0] + theirs[1]):.2f}x",
                f"{ours[2]:.2f}", f"{theirs[2]:.2f}", f"{ours[2] / theirs[2]:.2f}x",
            ])  # fmt: skip
    headers = ["graph", "recipe", "launches ours", "torchao", "ratio", "MB ours", "torchao"]
    print(markdown_table(headers + ["ratio"], rows))
    return rows


if __name__ == "__main__":
    main()
