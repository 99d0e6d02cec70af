"""Weight formats: what a float8 weight's FSDP2 all-gather sends and what arrives.

One module per format (`tensorwise`, `rowwise`, `block` for the 128x128 'blockwise' and the
32x32 'mxfp8' recipes): how a quantized shard is packed into all-gather inputs, the typed
metadata record that turns the gathered outputs into the unsharded weight (`build`) and
refreshes it in place on the next gather (`refill`), whether the shard's scale needs a
cross-rank amax, and how the gathered weight becomes each GEMM's operand (`operand_kind`,
`build_operand`). Each is one family's place in the family table (`fsdp_float8.core.families`,
whose entries say what generic code asks of a family). `operands` holds what every format
shares: the weight's GEMM operands, built once per unshard; `recast` the grad_input re-cast
of a weight gathered with per-row scales; `weight_operands` maps each family to its place
(`place_of`), and its `weight_for` is the one entry the layers call. The
layer sits between `core/` (the numerics and the GEMM backends) and `weight_wrappers/` (the
FSDP2 hooks, which delegate here).
"""
