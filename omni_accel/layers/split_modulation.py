"""AdaLN modulation of every block at once, split over the ranks of a parallel layout.

Each block of a DiT projects the same per-sample vector (the timestep embedding, after its SiLU) through a
large weight of its own: FLUX.1's 57 blocks read 3.2 G parameters for it, bound by memory (its share of a
step: docs/PARALLELISM.md). Block by block, a tensor-parallel rank would compute its slice of the outputs and
all-gather each small output (76 collectives per FLUX step), and a sequence-parallel rank would read every
weight whole. ``SplitModulation`` instead computes, at the first block of a forward, every block's projection:
each rank its share of each output (its tensor-parallel slice, or the same rows of a weight it holds whole),
then one all-gather gives every rank all of them. The blocks take theirs from it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.comm import all_gather_dim
from ..parallel.held_groups import HoldsGroups
from ..parallel.sequence import split_sizes
from ..parallel.tensor import shard_of
from ..utils.versions import version_of
from .fp8 import Fp8Weights
from .projection import LinearWeights, output_rows, project_into, read_linear, with_fp8


@dataclass(frozen=True)
class ModulationSite:
    """One block's modulation projection: ``key`` names it, ``module()`` is the linear as its block holds it
    now (maybe LoRA-wrapped), ``input`` what it projects of the conditioning (AdaLN's SiLU)."""

    key: str
    module: Callable[[], nn.Module]
    input: Callable[[torch.Tensor], torch.Tensor]


class SplitModulation(HoldsGroups):
    """Every site's projection of one conditioning tensor, computed once per forward over ``group``'s ranks
    (the ranks that hold the same batch: a tensor-parallel group or a sequence one)."""

    def __init__(
        self, sites: Sequence[ModulationSite], group: dist.ProcessGroup, fp8: Fp8Weights | None = None
    ) -> None:
        self.sites, self.group = tuple(sites), group
        self.fp8 = fp8  # under quantize="fp8": the weights in e4m3 (weight-only, as on one GPU)
        self.passes = 0  # forwards projected (one all-gather each)
        self._conditioning: torch.Tensor | None = None  # held, so no later tensor can have its identity
        self._version: Hashable = -1
        self._outputs: dict[str, torch.Tensor] = {}

    def describe(self) -> str:
        world = dist.get_world_size(self.group)
        return (
            f"{len(self.sites)} AdaLN projections per forward computed together, each rank 1/{world} of "
            "each, one all-gather"
        )

    def project(self, key: str, conditioning: torch.Tensor) -> torch.Tensor:
        """The projection of site ``key``; the first request for a conditioning tensor (or after it changed
        in place) computes every site's. Every rank must make the same requests (a collective)."""
        version = version_of(conditioning)
        if self._conditioning is not conditioning or self._version != version:
            self._outputs = self.project_sites(self.sites, conditioning)
            self._conditioning, self._version = conditioning, version
            self.passes += 1
        return self._outputs[key]

    def project_sites(
        self, sites: Sequence[ModulationSite], conditioning: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Key -> projection of each of ``sites``, computed now (one all-gather)."""
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        inputs: dict[Callable, torch.Tensor] = {}
        widths: dict[int, list[tuple[str, LinearWeights, torch.Tensor]]] = {}  # by full output width
        for site in sites:
            module = site.module()
            weights, shard = read_linear(module, site.key), shard_of(module)
            if self.fp8 is not None:  # the whole (or tensor-parallel) weight's copy, read by rows below
                weights = with_fp8(weights, self.fp8, weight_only=True)
            if shard is None:  # held whole: this rank's rows of it
                width = weights.weight.shape[0]
                sizes = split_sizes(width, world)
                weights = output_rows(weights, sum(sizes[:rank]), sizes[rank])
            elif shard.group is self.group:  # this rank's tensor-parallel slice: the same rows
                width = weights.weight.shape[0] * shard.size
            else:
                raise RuntimeError(f"{site.key} is split over another group than the modulation")
            if site.input not in inputs:
                inputs[site.input] = site.input(conditioning)
            widths.setdefault(width, []).append((site.key, weights, inputs[site.input]))
        # Each rank's pieces of one width side by side (padded to the largest), so one copy per width
        # unpacks them after the gather.
        batch, dtype = conditioning.shape[0], next(iter(inputs.values())).dtype
        slot = {width: max(split_sizes(width, world)) for width in widths}
        send = conditioning.new_empty(
            sum(len(sites) * batch * slot[width] for width, sites in widths.items()), dtype=dtype
        )
        offset = 0
        for width, sites in widths.items():
            mine = split_sizes(width, world)[rank]
            pieces = send[offset : offset + len(sites) * batch * slot[width]].view(len(sites), batch, -1)
            for piece, (_, weights, x) in zip(pieces, sites, strict=True):
                project_into(x, weights, piece[:, :mine])
            offset += pieces.numel()
        gathered = all_gather_dim(send.unsqueeze(0), 0, self.group)
        outputs, offset = {}, 0
        for width, sites in widths.items():
            count = len(sites) * batch * slot[width]
            per_rank = gathered[:, offset : offset + count].view(world, len(sites), batch, slot[width])
            sizes = split_sizes(width, world)
            full = torch.cat([per_rank[r, ..., :size] for r, size in enumerate(sizes)], dim=-1)
            outputs.update(zip((key for key, _, _ in sites), full.unbind(0), strict=True))
            offset += count
        return outputs
