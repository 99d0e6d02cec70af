"""The float8 modules users hold: `Float8Linear` and the module swap."""
