"""Exact (bitwise lossless) reuse of conditioning projections."""

from .projection import ExactProjectionCache
from .sites import attach, wrap_sites

__all__ = ["ExactProjectionCache", "attach", "wrap_sites"]
