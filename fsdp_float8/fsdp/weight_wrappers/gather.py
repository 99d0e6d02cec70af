"""Deprecated path, kept for one release: the all-gather metadata records live in
`fsdp_float8.formats` (`tensorwise`, `rowwise`, `block`), one module per format. Importing
this alias gives the very objects of their homes (see `fsdp_float8.fsdp.weight_wrappers`).
"""

from fsdp_float8.formats.block import BlockGather
from fsdp_float8.formats.rowwise import RowwiseGather
from fsdp_float8.formats.tensorwise import TensorwiseGather
from fsdp_float8.fsdp.weight_wrappers import _warn

__all__ = ["BlockGather", "RowwiseGather", "TensorwiseGather"]

_warn(__name__, "fsdp_float8.formats")
