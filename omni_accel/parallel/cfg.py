"""CFG parallelism: the two guidance branches of a step run at the same time on the two ranks of the
``cfg`` group.

Pipelines that batch both branches (or several prompts) get their batch split in halves, one per rank, and
gathered back. Pipelines that call the transformer twice per step (FLUX's true CFG) get the two calls
paired: the conditional call returns a buffer at once and records its inputs; the unconditional call then
runs both branches concurrently, one per rank, fills the buffer and returns its own result. That is exact
because such pipelines read the conditional result only after the unconditional call returns; the pairing
is switched on only for pipeline calls the model's registry entry says pair this way, and an unpaired call
is an error, never a silent wrong result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .comm import all_gather_dim

_BRANCHES = ("cond", "uncond")


class CfgParallel:
    def __init__(self, group: dist.ProcessGroup, batched_inputs: Sequence[str]) -> None:
        if dist.get_world_size(group) != 2:
            raise ValueError("CFG parallelism runs the two guidance branches on exactly two ranks.")
        self.group = group
        self.rank = dist.get_rank(group)
        self.batched_inputs = tuple(batched_inputs)
        self.pairing = False  # set for the duration of a pipeline call whose calls pair (see patches)
        self.branch: str | None = None  # set by the transformer's cache_context
        self._pending: tuple[dict[str, Any], torch.Tensor] | None = None
        self.split_calls = self.paired_calls = self.replicated_calls = 0

    def run(
        self, model: nn.Module, kwargs: dict[str, Any], output_like: Callable[[dict], torch.Tensor]
    ) -> torch.Tensor:
        if self.pairing:
            return self._paired(model, kwargs, output_like)
        batch = kwargs[self.batched_inputs[0]].shape[0]
        if batch % 2:
            self.replicated_calls += 1  # one sample and no pairing: both ranks compute it
            return model(**kwargs)
        self.split_calls += 1
        return all_gather_dim(model(**self._half(kwargs)), 0, self.group)

    def _half(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        def half(value):
            if isinstance(value, torch.Tensor):
                return value.chunk(2)[self.rank]
            if isinstance(value, list | tuple):
                return type(value)(half(v) for v in value)
            return value

        return {k: half(v) if k in self.batched_inputs else v for k, v in kwargs.items()}

    def _paired(self, model, kwargs, output_like) -> torch.Tensor:
        if self.branch not in _BRANCHES:
            raise RuntimeError(
                f"CFG pairing expects calls inside cache_context('cond'/'uncond'), got {self.branch!r}."
            )
        if self.branch == "cond":
            if self._pending is not None:
                raise RuntimeError("Two conditional calls without the unconditional one between them.")
            buffer = output_like(kwargs)
            self._pending = (dict(kwargs), buffer)
            return buffer
        if self._pending is None:
            raise RuntimeError("An unconditional call without the conditional one before it.")
        cond_kwargs, buffer = self._pending
        self._pending = None
        self.paired_calls += 1
        mine = model(**(cond_kwargs if self.rank == 0 else kwargs))
        both = all_gather_dim(mine.unsqueeze(0), 0, self.group)
        buffer.copy_(both[0])
        return both[1]

    def finish_call(self, completed: bool) -> None:
        """End of a pipeline call: a conditional result still waiting for its pair was never computed."""
        pending, self._pending = self._pending, None
        self.pairing = False
        if pending is not None and completed:
            raise RuntimeError(
                "The pipeline made a conditional transformer call with no unconditional call after it while "
                "CFG pairing was on; its result was never computed. This pipeline's calls do not pair as its "
                "registry entry says."
            )
