"""Benchmarks and estimates a user runs by hand through their thin scripts
(`scripts/bench_gpu.py`, `scripts/bench_flow_grpo.py`, `scripts/estimate_memory.py`); here
so that the tests import them as package code."""
