"""Microbenchmarks run as commands (ratios measured side by side)."""
