"""Sequence parallelism as two hooks on the Diffusers module: split its sequence inputs, gather its output.

A model's ``SequencePlan`` says which forward arguments carry a sequence and of which stream (FLUX: the
image tokens and their ids, the text tokens and their ids). Each stream is split evenly over the
Ulysses x ring ranks on its own, so every rank holds a slice of each stream; attention joins the streams
rank by rank, which is exact because attention does not depend on the order of its keys and every query
returns to the rank it came from. Everything between the split and the gather (embedders, RoPE from the
local ids, the blocks) then runs on local tokens; only attention communicates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks import ModelHook
from torch import nn

from .hooks import bound_arguments
from .sequence import SequenceParallel


@dataclass(frozen=True)
class SequencePlan:
    """``inputs``: forward argument -> (stream, sequence dim); a list argument has its dim on each item.
    ``output``: (submodule whose output is the model's output, its stream, its sequence dim). Attention
    joins every stream named in ``inputs``."""

    inputs: Mapping[str, tuple[str, int]]
    output: tuple[str, str, int]


class SequenceState:
    """The sequence layout of the forward in flight, read by the blocks' attention."""

    def __init__(self, ulysses_group, ring_group) -> None:
        self.groups = dict(ulysses_group=ulysses_group, ring_group=ring_group)
        self.joint: SequenceParallel | None = None  # every stream, joined as attention joins them
        self.streams: dict[str, SequenceParallel] = {}


class SplitSequence(ModelHook):
    def __init__(self, plan: SequencePlan, state: SequenceState) -> None:
        super().__init__()
        self.plan, self.state = plan, state

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict[str, Any]]:
        arguments = bound_arguments(module, args, kwargs)
        lengths: dict[str, int] = {}
        for name, (stream, dim) in self.plan.inputs.items():
            value = arguments.get(name)
            if isinstance(value, torch.Tensor):
                lengths.setdefault(stream, value.shape[dim])
        missing = sorted({s for s, _ in self.plan.inputs.values()} - set(lengths))
        if missing:
            raise ValueError(f"sequence parallelism: the call passes no tensor for the {missing} stream(s)")
        streams = {s: SequenceParallel.plan(n, **self.state.groups) for s, n in lengths.items()}
        joint = tuple(map(sum, zip(*(p.sizes for p in streams.values()), strict=True)))
        self.state.streams = streams
        self.state.joint = SequenceParallel(joint, **self.state.groups)
        for name, (stream, dim) in self.plan.inputs.items():
            if arguments.get(name) is not None:
                arguments[name] = _shard(arguments[name], streams[stream], dim)
        return (), arguments

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        self.state.joint = None
        return output


class GatherSequence(ModelHook):
    def __init__(self, plan: SequencePlan, state: SequenceState) -> None:
        super().__init__()
        _, self.stream, self.dim = plan.output
        self.state = state

    def post_forward(self, module: nn.Module, output: torch.Tensor) -> torch.Tensor:
        return self.state.streams[self.stream].gather(output, self.dim)


def _shard(value: Any, plan: SequenceParallel, dim: int) -> Any:
    if isinstance(value, torch.Tensor):
        return plan.shard(value, dim)
    return type(value)(_shard(item, plan, dim) for item in value)
