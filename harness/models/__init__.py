"""Model builders for CPU-scale runs."""
