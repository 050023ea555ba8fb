"""Benchmarks (floor 5): each runs as ``python -m benchmarks.NAME`` and writes its data to benchmarks/data/;
``python -m benchmarks.results`` renders benchmarks/RESULTS.md from that data."""
