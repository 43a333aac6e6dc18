"""Benchmarks: each script measures against a baseline in the same run and prints ratios."""
