"""The few collectives the layers need, written once so every caller gets the same semantics."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ``group``; traceable, so compiled blocks keep their collectives in the graph."""
    if torch.compiler.is_dynamo_compiling():
        import torch.distributed._functional_collectives as funcol  # imports dynamo: only when compiling

        return funcol.all_reduce(tensor, "sum", group)
    tensor = tensor.contiguous()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather_dim(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenates every rank's ``tensor`` along ``dim`` (equal shapes on every rank)."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def all_gather_sizes(
    tensor: torch.Tensor, dim: int, sizes: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Concatenates every rank's ``tensor`` along ``dim`` when rank ``r``'s has ``sizes[r]`` there (padded
    to the largest for the collective: gloo refuses unequal all-gathers)."""
    largest = max(sizes)
    padding = [0, 0] * (tensor.ndim - 1 - dim % tensor.ndim) + [0, largest - tensor.shape[dim]]
    parts = [tensor.new_empty(*tensor.shape[:dim], largest, *tensor.shape[dim + 1 :]) for _ in sizes]
    dist.all_gather(parts, F.pad(tensor, padding).contiguous(), group=group)
    return torch.cat([part.narrow(dim, 0, size) for part, size in zip(parts, sizes, strict=True)], dim=dim)
