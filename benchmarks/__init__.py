"""Benchmark scripts for gpubudget (run them with ``python -m benchmarks.NAME``)."""
