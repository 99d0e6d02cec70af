"""FSDP2 weight wrappers: a high-precision weight whose all-gather sends float8.

The layer between `formats/` and the modules users swap in (`nn/`, `experts/`): it imports
only `core/` and `formats/`. `wrap.wrap_weight` turns a module's weight into a wrapper;
`base` holds the hook mechanics (which delegate to the weight's format, `fsdp_float8.formats`),
`refusals` the sharding layouts the all-gather refuses, `state` the mutation tracking, `refreshed` the weights whose stamp the float8 step derives
from the whole weight's amax, and `dynamic` / `delayed` / `static` / `block` say where a
weight's scale comes from; the 4-bit format's weight has a module of its own.
"""
