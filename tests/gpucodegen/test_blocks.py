"""GPU codegen of a float8 transformer block (wq wk wv wo, SwiGLU w1 w2 w3) per recipe, and
of the grouped experts: one forward and one backward graph (no graph break), the scaled
GEMMs the recipe calls, no high-precision `mm` in a float8 layer, no host sync."""

from __future__ import annotations

import pytest

from tests.gpucodegen import cases

pytestmark = pytest.mark.gpucodegen

# recipe -> (gpu, scaled GEMM op, high-precision grad_weight GEMMs per layer)
BLOCK_RECIPES = {
    "tensorwise": ("h100", "_scaled_mm", 0),
    "delayed": ("h100", "_scaled_mm", 0),
    "static": ("h100", "_scaled_mm", 0),
    "rowwise": ("h100", "_scaled_mm", 0),
    "rowwise_with_gw_hp": ("h100", "_scaled_mm", 1),
    "blockwise": ("h100", "_scaled_mm_v2", 0),  # 1x128 / 128x128 GEMMs: SM90 only
    "mxfp8": ("b200", "_scaled_mm", 0),  # e8m0 scales, swizzled: the MX GEMM
    "nvfp4": ("b200", "_scaled_mm_v2", 0),  # [BlockWise1x16, TensorWise] FP4 GEMM
}
# attention (scaled_dot_product_attention, lowered to its math form here): bf16 batched
# GEMMs, 2 forward and 4 backward; NVFP4's random Hadamard transform of grad_weight's
# operands adds batched GEMMs of its own (2 forward for the saved input, 12 backward)
ATTENTION_BMM = {"forward": 2, "backward": 4}
NVFP4_RHT_BMM = {"forward": 2, "backward": 12}


def _check_graphs(compiled: cases.Compiled, regions: int) -> None:
    assert compiled.graph_breaks == 0
    assert compiled.dynamo_graphs == regions
    assert [g.kind for g in compiled.graphs].count("forward") == regions
    assert [g.kind for g in compiled.graphs].count("backward") == regions
    assert len(compiled.graphs) == 2 * regions
    for graph in compiled.graphs:
        assert graph.host_syncs == [], (graph.kind, graph.host_syncs)
        assert graph.triton > 0 and graph.triton_bytes > 0


@pytest.mark.parametrize("recipe", list(BLOCK_RECIPES))
def test_block(recipe):
    gpu, scaled, hp_grad_weight = BLOCK_RECIPES[recipe]
    compiled = cases.block(gpu, recipe)
    _check_graphs(compiled, regions=1)
    (fwd,) = compiled.of_kind("forward")
    (bwd,) = compiled.of_kind("backward")
    n = cases.LINEARS
    bmm = {k: v + (NVFP4_RHT_BMM[k] if recipe == "nvfp4" else 0) for k, v in ATTENTION_BMM.items()}
    assert fwd.gemms == {scaled: n, "bmm": bmm["forward"]}, fwd.gemms
    want_bwd = {scaled: n * (2 - hp_grad_weight), "bmm": bmm["backward"]}
    if hp_grad_weight:
        want_bwd["mm"] = n * hp_grad_weight  # grad_weight in high precision, by design
    assert bwd.gemms == want_bwd, bwd.gemms
    if recipe in cases.CUBIN:  # every kernel built down to a cubin, every autotune config
        assert compiled.configs >= compiled.kernels > 0


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_grouped_experts(recipe):
    compiled = cases.experts("h100", recipe)
    _check_graphs(compiled, regions=1)
    (fwd,) = compiled.of_kind("forward")
    (bwd,) = compiled.of_kind("backward")
    assert fwd.gemms == {"_scaled_grouped_mm": 3}, fwd.gemms
    if recipe == "rowwise":
        assert bwd.gemms == {"_scaled_grouped_mm": 6}, bwd.gemms
    else:  # grad_weight in high precision, by design
        assert bwd.gemms == {"_scaled_grouped_mm": 3, "_grouped_mm": 3}, bwd.gemms
