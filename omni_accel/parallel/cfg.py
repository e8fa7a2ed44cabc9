"""CFG parallelism: the two guidance branches of a step run at the same time on the two ranks of the
``cfg`` group.

Pipelines that batch both branches (or several prompts) get their batch split in halves, one per rank, and
gathered back. Pipelines that call the transformer twice per step (FLUX's true CFG) get the two calls
paired: the conditional call returns a buffer at once and records its inputs; the unconditional call then
runs both branches concurrently, one per rank, fills the buffer and returns its own result. That is exact
because such pipelines read the conditional result only after the unconditional call returns; the pairing
is switched on only for pipeline calls the model's registry entry says pair this way, and an unpaired call
is an error, never a silent wrong result.

Both run in a hook on the Diffusers module (``SplitGuidance``, registered through Diffusers' HookRegistry);
the branch of a call comes from the pipeline's ``cache_context("cond"/"uncond")``, which Diffusers hands to
every stateful hook.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from diffusers.hooks.hooks import StateManager
from torch import nn

from .comm import all_gather_dim
from .hooks import LayoutHook, bound_arguments

_BRANCHES = ("cond", "uncond")


class CfgParallel:
    def __init__(self, group: dist.ProcessGroup, batched_inputs: Sequence[str]) -> None:
        if dist.get_world_size(group) != 2:
            raise ValueError("CFG parallelism runs the two guidance branches on exactly two ranks.")
        self.group = group
        self.rank = dist.get_rank(group)
        self.batched_inputs = tuple(batched_inputs)
        self.pairing = False  # set for the duration of a pipeline call whose calls pair (see patches)
        self.branch: str | None = None  # the pipeline's cache_context of the call in flight
        self._pending: tuple[dict[str, Any], torch.Tensor] | None = None
        self.split_calls = self.paired_calls = self.replicated_calls = 0

    def run(
        self,
        model: Callable[..., torch.Tensor],
        kwargs: dict[str, Any],
        output_like: Callable[[dict], torch.Tensor],
    ) -> torch.Tensor:
        """``model(**kwargs)`` (the model's output tensor), computed with the other rank's help."""
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


class _NoState:
    def reset(self) -> None:
        pass


class SplitGuidance(LayoutHook):
    """Runs the module's forward through ``CfgParallel``. ``output_like(module, arguments)`` is an empty
    tensor shaped like the output; ``output_class`` wraps it as the module returns it with ``return_dict``.
    Registered after the step graphs are installed, so it wraps them: its per-call pairing decisions are
    made outside any captured step, which sees only the half batch or the one branch it is given."""

    _is_stateful = True  # so Diffusers hands it the cache context (the branch name)

    def __init__(
        self,
        cfg: CfgParallel,
        output_like: Callable[[nn.Module, dict[str, Any]], torch.Tensor],
        output_class: type,
    ) -> None:
        super().__init__()
        self.cfg, self.output_like, self.output_class = cfg, output_like, output_class
        self.context = StateManager(_NoState)

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        arguments = bound_arguments(module, args, kwargs)
        return_dict = arguments.pop("return_dict", True)
        context = self.context._context
        self.cfg.branch = None if context is None else context.name

        def forward(**call: Any) -> torch.Tensor:
            return self.fn_ref.original_forward(**call, return_dict=False)[0]

        sample = self.cfg.run(forward, arguments, lambda call: self.output_like(module, call))
        return self.output_class(sample=sample) if return_dict else (sample,)

    def reset_state(self, module: nn.Module) -> nn.Module:
        return module
