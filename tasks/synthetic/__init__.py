"""Synthetic tasks generated from a seed: CPU stand-ins for real benchmarks."""
