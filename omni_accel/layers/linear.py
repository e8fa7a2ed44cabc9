"""Tensor-parallel linears whose parameters carry their own loader and exporter.

The layer owns its sharding: ``param.weight_loader(param, full_tensor, shard_id)`` returns the tensor the
parameter should hold after taking this rank's slice of a checkpoint tensor (the checkpoint tensor itself
when no slicing or packing is needed, so loading costs no copy), and ``param.weight_exporter(param, shard_id)`` gives the full tensor back
(restore and save_pretrained use it). Models therefore only map names; with one rank every slice is the
whole tensor. Inputs may have any number of leading dimensions and need not be contiguous.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..parallel.comm import all_gather_dim, all_reduce_sum


def _group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _empty_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


def check_shape(name: str, tensor: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(
            f"{name}: checkpoint tensor has shape {tuple(tensor.shape)}, expected {tuple(expected)}."
        )


def default_weight_loader(
    param: nn.Parameter, tensor: torch.Tensor, shard_id: str | None = None
) -> torch.Tensor:
    check_shape("parameter", tensor, param.shape)
    return tensor.detach()


def default_weight_exporter(param: nn.Parameter, shard_id: str | None = None) -> torch.Tensor:
    return param.detach()


class ColumnParallelLinear(nn.Module):
    """Output features split over the TP group; several named outputs may be packed into one GEMM.

    ``out_features`` is either an int (one shard, id None) or a mapping ``name -> size`` (e.g. q, k, v or
    q, k, v, mlp). Each named output is split over the ranks on its own, so every rank holds the same
    fraction of every output and ``split`` gives them back as separate tensors. ``align`` is the unit a
    split must respect (the head size for attention projections).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int | Mapping[str, int],
        *,
        bias: bool = True,
        tp_group: dist.ProcessGroup | None = None,
        align: int = 1,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = _group_rank_size(tp_group)
        self.tp_group = tp_group
        sizes = {None: out_features} if isinstance(out_features, int) else dict(out_features)
        for name, size in sizes.items():
            if size % (align * self.tp_size):
                raise ValueError(
                    f"Output {name or 'features'} of size {size} cannot be split evenly over tp={self.tp_size} "
                    f"in units of {align}; use a tp that divides {size // align}."
                )
        self.in_features = in_features
        self.full_sizes = sizes
        self.local_sizes = {name: size // self.tp_size for name, size in sizes.items()}
        offsets, start = {}, 0
        for name, size in self.local_sizes.items():
            offsets[name] = start
            start += size
        self.local_offsets = offsets
        self.weight = _empty_param(start, in_features)
        self.weight.weight_loader = self._load
        self.weight.weight_exporter = self._export
        if bias:
            self.bias = _empty_param(start)
            self.bias.weight_loader = self._load
            self.bias.weight_exporter = self._export
        else:
            self.register_parameter("bias", None)

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: str | None = None) -> torch.Tensor:
        if shard_id not in self.full_sizes:
            raise KeyError(f"Unknown shard {shard_id!r}; this layer packs {list(self.full_sizes)}.")
        full, local = self.full_sizes[shard_id], self.local_sizes[shard_id]
        check_shape(f"shard {shard_id!r}", tensor, (full, *param.shape[1:]))
        piece = tensor.detach().narrow(0, self.tp_rank * local, local)
        if len(self.full_sizes) == 1 and self.tp_size == 1:
            return piece
        target = (
            torch.empty(param.shape, dtype=tensor.dtype, device=tensor.device)
            if param.is_meta
            else param.data
        )
        if (tensor.dtype, tensor.device) != (target.dtype, target.device):
            raise TypeError(
                f"shard {shard_id!r} is {tensor.dtype} on {tensor.device} but the packed parameter holds "
                f"{target.dtype} on {target.device}; put the model on one dtype and device before accelerating."
            )
        target.narrow(0, self.local_offsets[shard_id], local).copy_(piece)
        return target

    def _export(self, param: nn.Parameter, shard_id: str | None = None) -> torch.Tensor:
        local = param.detach().narrow(0, self.local_offsets[shard_id], self.local_sizes[shard_id])
        if self.tp_size == 1:
            return local.clone()
        return all_gather_dim(local.contiguous(), 0, self.tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The packed output back as one tensor per named shard (views, no copy)."""
        return y.split(list(self.local_sizes.values()), dim=-1)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={dict(self.full_sizes)}, tp={self.tp_size}"


class RowParallelLinear(nn.Module):
    """Input features split over the TP group, partial sums all-reduced, bias added once after the reduce.

    ``input_blocks`` describes an input that is a concatenation of independently column-split tensors
    (FLUX's single block feeds ``cat([attention, mlp])``): each block is split on its own.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        tp_group: dist.ProcessGroup | None = None,
        input_blocks: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = _group_rank_size(tp_group)
        self.tp_group = tp_group
        blocks = tuple(input_blocks) if input_blocks else (in_features,)
        if sum(blocks) != in_features:
            raise ValueError(f"input_blocks {blocks} do not add up to in_features={in_features}.")
        for block in blocks:
            if block % self.tp_size:
                raise ValueError(
                    f"Input block of size {block} cannot be split evenly over tp={self.tp_size}."
                )
        self.blocks = blocks
        self.in_features, self.out_features = in_features, out_features
        self.weight = _empty_param(out_features, in_features // self.tp_size)
        self.weight.weight_loader = self._load_weight
        self.weight.weight_exporter = self._export_weight
        if bias:
            self.bias = _empty_param(out_features)
            self.bias.weight_loader = default_weight_loader
            self.bias.weight_exporter = default_weight_exporter
        else:
            self.register_parameter("bias", None)

    def _local_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        pieces, start = [], 0
        for block in self.blocks:
            local = block // self.tp_size
            pieces.append(tensor.narrow(1, start + self.tp_rank * local, local))
            start += block
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def _load_weight(
        self, param: nn.Parameter, tensor: torch.Tensor, shard_id: str | None = None
    ) -> torch.Tensor:
        check_shape("weight", tensor, (self.out_features, self.in_features))
        return self._local_columns(tensor.detach()).contiguous()

    def _export_weight(self, param: nn.Parameter, shard_id: str | None = None) -> torch.Tensor:
        if self.tp_size == 1:
            return param.detach().clone()
        gathered = all_gather_dim(param.detach(), 1, self.tp_group)
        per_rank = gathered.split(param.shape[1], dim=1)
        pieces, start = [], 0
        for block in self.blocks:
            local = block // self.tp_size
            pieces.extend(chunk.narrow(1, start, local) for chunk in per_rank)
            start += local
        return torch.cat(pieces, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.tp_size > 1:
            y = all_reduce_sum(y, self.tp_group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}, blocks={self.blocks}"


class ReplicatedLinear(nn.Linear):
    """A plain linear every rank holds whole (modulation, embedders), with the same loader interface."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias, device="meta")
        for param in self.parameters():
            param.requires_grad_(False)
            param.weight_loader = default_weight_loader
            param.weight_exporter = default_weight_exporter
