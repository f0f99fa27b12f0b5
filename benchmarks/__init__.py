"""Benchmarks of optax_accum: `python -m benchmarks --out DIR` runs them all (README.md)."""
