"""The interfaces the scale path is written against, as protocols.

A `Granularity` says what one scale covers and how to reduce, cast and broadcast with it;
a `ScalingStrategy` says where the scale comes from, for one granularity; an `AmaxRecord`
is the delayed-scaling state as a cast sees it. Callers type against these, so they need
no import of the classes that implement them (`fsdp_float8.core.scaling`,
`fsdp_float8.core.delayed_state`). `_FamilyFacts` answers the part of `Granularity` that
only repeats its format family's table (`fsdp_float8.core.families`), once for every
granularity.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from fsdp_float8.core.families import Family, of_granularity


class Granularity(Protocol):
    @property
    def family(self) -> Family:
        """Its format family (`fsdp_float8.core.families`)."""
        ...

    @property
    def per_row(self) -> bool:
        """One scale per row along the contraction dim (`Family.per_row`)."""
        ...

    @property
    def broadcast_scales(self) -> bool:
        """Scales that broadcast against the operand, not blocks (`Family.broadcast_scales`)."""
        ...

    @property
    def transpose_invariant(self) -> bool:
        """True when one cast serves the operand contracted along either dim (tensorwise,
        square blocks): the layer then reuses it for the operand's second GEMM."""
        ...

    @property
    def scale_dtype(self) -> torch.dtype:
        """How the scale is sent (all-gather, CUDA GEMM)."""
        ...

    def amax(self, hp: torch.Tensor, dim: int, *, exact: bool = False) -> torch.Tensor:
        """float32; `exact`: any dtype that holds it exactly (see `tensor_amax`)."""
        ...

    def block(self, dim: int) -> tuple[int, int] | None:
        """(rows, cols) of a block of a 2-D operand contracted along `dim`; None when the
        scale broadcasts (tensorwise, axiswise)."""
        ...

    def cast(
        self,
        hp: torch.Tensor,
        scale: torch.Tensor,
        dim: int,
        float8_dtype: torch.dtype,
        *,
        column_major: bool = False,
        saturate: bool = True,
    ) -> torch.Tensor:
        """The float8 data; `column_major` lays a 2-D result out column-major where the
        granularity's GEMM takes it so (`cast_to_float8_data`); block casts keep their
        layout (the block GEMM lays out its operands). `saturate=False`: the scale's amax
        covers `hp` (`cast_to_float8_data`); block casts saturate either way."""
        ...

    def broadcastable(self, scale: torch.Tensor, hp: torch.Tensor, dim: int) -> torch.Tensor:
        """The scale in a form that broadcasts against `hp` (for statistics)."""
        ...


class _FamilyFacts:
    """What generic code asks of a granularity's format family (`core.families`)."""

    word: ClassVar[str]  # its `ScalingGranularity` value

    @property
    def family(self) -> Family:
        return of_granularity(self.word)

    @property
    def per_row(self) -> bool:
        return self.family.per_row

    @property
    def broadcast_scales(self) -> bool:
        return self.family.broadcast_scales


class AmaxRecord(Protocol):
    """One operand's delayed state as a cast sees it (`fsdp_float8.core.delayed_state`)."""

    scale: torch.Tensor  # () float32: the synced scale
    initialized: torch.Tensor  # () bool: a sync has happened

    def record(self, amax: torch.Tensor) -> None: ...


class ScalingStrategy(Protocol):
    # the scale comes from the amax of the very values it casts: they need no clamp
    # (`cast_to_float8_data`), and a cast is reusable while they stand
    own_amax: ClassVar[bool]

    @property
    def granularity(self) -> Granularity: ...

    def scale(
        self,
        hp: torch.Tensor,
        dim: int,
        float8_dtype: torch.dtype,
        state: AmaxRecord | None = None,
    ) -> torch.Tensor: ...
