"""The float8 tensor and its math: `Float8Tensor`, its op table, scaling strategies,
block scales, config and recipes. Imports nothing else of the package."""
