"""FSDP2 weight wrappers: a high-precision weight whose all-gather sends float8.

The layer between `core/` and the modules users swap in (`nn/`, `experts/`): it imports only
`core/`. `wrap.wrap_weight` turns a module's weight into a wrapper; `base` holds the hook
mechanics, `state` the mutation tracking, `gather` the typed all-gather metadata, and
`dynamic` / `delayed` / `static` / `block` say where a weight's scale comes from.
"""
