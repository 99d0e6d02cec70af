"""Observation tools: float8 telemetry and the collective counter."""
