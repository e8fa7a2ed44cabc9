"""Exact (bitwise lossless) reuse of conditioning projections."""
