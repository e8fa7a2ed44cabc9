"""Exact (bitwise lossless) reuse of conditioning projections."""

from .projection import ExactProjectionCache
from .sites import wrap_sites

__all__ = ["ExactProjectionCache", "wrap_sites"]
