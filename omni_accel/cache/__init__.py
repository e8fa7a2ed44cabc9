"""Exact (bitwise lossless) reuse of conditioning projections."""

from .projection import ExactProjectionCache

__all__ = ["ExactProjectionCache"]
