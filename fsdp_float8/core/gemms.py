"""The three GEMMs of a linear layer and their operands, spelled once.

`output = input @ weight.T`, `grad_input = grad_output @ weight`,
`grad_weight = grad_output.T @ input`: three operands (`Operand`), each used by two of the
three GEMMs (`Gemm`). Its first use is its primary GEMM (where it is cast first), the
other its second use in backward. Every table here is derived from `GEMM_OPERANDS`, so the
topology has one spelling; the rest of the package loops over `OPERANDS` / `GEMMS` and asks
these tables, never writes a GEMM's operands by hand.
"""

from __future__ import annotations

import enum


class Operand(enum.Enum):
    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"


class Gemm(enum.Enum):
    """output = input @ weight.T; grad_input = grad_output @ weight;
    grad_weight = grad_output.T @ input."""

    OUTPUT = "output"
    GRAD_INPUT = "grad_input"
    GRAD_WEIGHT = "grad_weight"


# The members as tuples: loop over these, not the Enum classes (dynamo in torch 2.11 cannot
# iterate an Enum class inside a compiled function).
OPERANDS: tuple[Operand, ...] = tuple(Operand)
GEMMS: tuple[Gemm, ...] = tuple(Gemm)

# (left operand, right operand) of each GEMM, in the order they are multiplied.
GEMM_OPERANDS: dict[Gemm, tuple[Operand, Operand]] = {
    Gemm.OUTPUT: (Operand.INPUT, Operand.WEIGHT),
    Gemm.GRAD_INPUT: (Operand.GRAD_OUTPUT, Operand.WEIGHT),
    Gemm.GRAD_WEIGHT: (Operand.GRAD_OUTPUT, Operand.INPUT),
}
# Each operand's two GEMMs, in execution order: its "primary" cast (first use) and its
# second use in backward. Derived from GEMM_OPERANDS, the one spelling of the topology.
OPERAND_GEMMS: dict[Operand, tuple[Gemm, Gemm]] = {
    op: tuple(g for g, ops in GEMM_OPERANDS.items() if op in ops)  # type: ignore[misc]
    for op in OPERANDS
}
PRIMARY_GEMM: dict[Operand, Gemm] = {op: gemms[0] for op, gemms in OPERAND_GEMMS.items()}
SECOND_GEMM: dict[Operand, Gemm] = {op: gemms[1] for op, gemms in OPERAND_GEMMS.items()}
# The dim of the operand's 2-D form that the GEMM contracts over: input (M, K),
# weight (N, K), grad_output (M, N). Axiswise scales reduce over this dim.
CONTRACTION_DIM: dict[tuple[Gemm, Operand], int] = {
    (Gemm.OUTPUT, Operand.INPUT): -1,
    (Gemm.OUTPUT, Operand.WEIGHT): -1,
    (Gemm.GRAD_INPUT, Operand.GRAD_OUTPUT): -1,
    (Gemm.GRAD_INPUT, Operand.WEIGHT): 0,
    (Gemm.GRAD_WEIGHT, Operand.GRAD_OUTPUT): 0,
    (Gemm.GRAD_WEIGHT, Operand.INPUT): 0,
}


def refuse_double_backward(layer: str, weight_shape) -> None:
    """Called first in a float8 layer's backward: with `create_graph=True` (grad mode on
    in backward) the gradients it returns would be constants to autograd, so a penalty on
    them (`torch.autograd.grad(loss, x, create_graph=True)`) would lose its own gradient.
    The quantized GEMMs have no derivative of their own: refuse, naming the layer."""
    import torch

    if torch.is_grad_enabled():
        raise RuntimeError(
            f"double backward through a {layer} (weight {tuple(weight_shape)}) is not "
            "supported: its float8/4-bit backward GEMMs are not differentiable, so the "
            "gradients that autograd.grad(..., create_graph=True) returns would carry no "
            "graph and a gradient penalty would be silently dropped. Keep the layers the "
            "penalty differentiates in high precision (module_filter_fn / filter_fqns), or "
            "compute the penalty without create_graph=True"
        )
