"""Benchmarks: commands that print tables and write JSON (never timed tests)."""
