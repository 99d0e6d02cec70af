"""The FSDP2 extension and the float8 step: weight wrappers with float8 all-gather,
the cross-rank amax reduction, delayed-scaling state, the float8 reduce-scatter."""
