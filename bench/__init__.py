"""Benchmarks: ``python -m bench PART`` from the repository root (``python -m bench --help``)."""
