"""Tensor, sequence and CFG parallelism: the mesh, the collectives, and ``parallelize``, which applies a
layout to a Diffusers module from the plans its native model declares."""

from .parallelize import Parallelized, ParallelPlan, check_parallel, parallelize
from .sequence_hooks import SequencePlan, Split
from .tensor import Colwise, Rowwise

__all__ = [
    "Colwise",
    "ParallelPlan",
    "Parallelized",
    "Rowwise",
    "SequencePlan",
    "Split",
    "check_parallel",
    "parallelize",
]
