"""The two guidance branches of a CFG step under a parallel layout.

With a ``cfg`` group of two ranks (CFG parallelism) the branches run at the same time, one per rank:
pipelines that batch both branches (or several prompts) get their batch split in halves, one per rank, and
gathered back. Without one, under a layout that splits the sequence or the heads (tp, ulysses, ring), the
two calls of a step run as one call of both branches' inputs stacked along the batch (``batch_guidance``):
each rank's GEMMs then see twice its tokens, and the layout's exchanges and barriers happen once per step
instead of twice, which pays under a layout; on one GPU, where the GEMMs are large already, it does not,
so it is not used there (docs/PARALLELISM.md).

Pipelines that call the transformer twice per step (FLUX's true CFG, Wan) get the two calls paired: the
conditional call returns a buffer at once and records its inputs; the unconditional call then computes both
branches, fills the buffer and returns its own result. That is exact because such pipelines read the
conditional result only after the unconditional call returns; the pairing is switched on only for pipeline
calls the model's registry entry says pair this way, and an unpaired call is an error, never a silent wrong
result. Two calls that cannot be stacked (inputs other than the batched ones differ, or the batched ones
differ in shape past the batch) run one after the other.

Both run in a hook on the Diffusers module (``SplitGuidance``, registered through Diffusers' HookRegistry);
the branch of a call comes from the pipeline's ``cache_context("cond"/"uncond")``, which Diffusers hands to
every stateful hook. Pipelines that make the two calls outside any cache context (FLUX's img2img, inpaint
and Kontext, Wan's video-to-video in Diffusers 0.42) are paired by order: the first call of a step waits for
the second. Which call is the conditional one does not matter to the result, only that the pipeline reads
the first result after the second call returns, as every Diffusers pipeline the registry pairs does; the
waiting result is NaN until then, so a pipeline that read it early would show it rather than be silently off.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from diffusers.hooks.hooks import StateManager
from torch import nn

from .comm import all_gather_dim
from .held_groups import HoldsGroups
from .hooks import LayoutHook, bound_arguments
from .sequence_hooks import foreign_block_hooks
from .turns import turns

_BRANCHES = ("cond", "uncond")

# What a model's pairing rule tells from a pipeline call's arguments: whether its transformer calls pair
# (cond, then uncond, every step), or a function that tells at each transformer call (``guided_per_step``).
Pairing = bool | Callable[[], bool]


def guided_per_step(pipe: Any) -> Callable[[], bool]:
    """A pairing verdict for pipelines whose loop asks ``pipe.do_classifier_free_guidance`` at every step
    before the unconditional call (Wan's, FLUX.2 Klein's): a step-end callback may turn guidance off midway
    (Diffusers' dynamic-CFG example sets ``pipe._guidance_scale``), and the steps after it make one call, which
    must not wait for a pair that never comes. Read at each call, as the pipeline reads it."""
    return functools.partial(_guides, pipe)


def _guides(pipe: Any) -> bool:
    return bool(pipe.do_classifier_free_guidance)


class _CallState(threading.local):
    """A pipeline call's pairing state, one per thread: calls from several threads at once (a web server's,
    of one pipeline or of ``from_pipe`` siblings sharing the transformer) each pair their own calls. A copy
    (of a deep-copied pipeline) starts empty."""

    def __init__(self) -> None:
        self.pairing: Pairing = False
        self.branch: str | None = None
        self.pending: tuple[dict[str, Any], torch.Tensor] | None = None
        self.same: dict[tuple, tuple] = {}
        self.unpaired = False

    def __deepcopy__(self, memo: dict) -> _CallState:
        return _CallState()


def _per_call(name: str) -> property:
    """An attribute of the thread's call state (``_CallState``)."""
    return property(
        lambda self: getattr(self._call, name), lambda self, value: setattr(self._call, name, value)
    )


class GuidanceBranches(HoldsGroups):
    """How a layout runs a CFG step's two branches: over the two ranks of ``group`` (CFG parallelism), or,
    with ``group`` None, stacked in one call. ``batched_inputs``: the forward arguments with a batch
    dimension, or a function that names them from a call's arguments (None: it cannot tell)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        batched_inputs: Sequence[str] | Callable[[dict[str, Any]], tuple[str, ...] | None],
        per_sample_inputs: Sequence[str] = (),
    ) -> None:
        if group is not None and dist.get_world_size(group) != 2:
            raise ValueError("CFG parallelism runs the two guidance branches on exactly two ranks.")
        self.group = group
        self.rank = 0 if group is None else dist.get_rank(group)
        self._batched = batched_inputs if callable(batched_inputs) else tuple(batched_inputs)
        self._per_sample = frozenset(per_sample_inputs)  # lists of one tensor per sample (see ParallelPlan)
        # Per thread: whether the pipeline call pairs (set for its duration, see patches); the branch of
        # the call in flight (its cache_context); the conditional call waiting for its pair; verdicts on
        # unbatched tensor pairs, for one pipeline call; whether this step's conditional call ran at once
        # (its unconditional one then does too).
        self._call = _CallState()
        self.split_calls = self.paired_calls = self.replicated_calls = 0
        self.stacked_calls = self.unstacked_calls = self.hooked_calls = 0
        self.ordered_calls = 0  # paired calls made outside any cache_context: paired by their order

    branch = _per_call("branch")
    _pending = _per_call("pending")
    _same = _per_call("same")
    _unpaired = _per_call("unpaired")

    @property
    def pairing(self) -> bool:
        """Whether the call in flight pairs: the pairing rule's verdict for the pipeline call, or, where the
        rule gave a function (``guided_per_step``), that function's verdict now."""
        pairing = self._call.pairing
        return bool(pairing()) if callable(pairing) else pairing

    @pairing.setter
    def pairing(self, value: Pairing) -> None:
        self._call.pairing = value

    def run(
        self,
        model: Callable[..., torch.Tensor],
        kwargs: dict[str, Any],
        output_like: Callable[[dict], torch.Tensor],
        may_stack: bool = True,
    ) -> torch.Tensor:
        """``model(**kwargs)`` (the model's output tensor), computed with the other rank's help, or with
        the other branch's call. ``may_stack`` False: hooks on the model decide per branch (a step cache
        keeps a state per ``cache_context``), so without a cfg group each call runs alone, in its context."""
        if self.group is None and self.pairing and not may_stack:
            self.hooked_calls += 1
            return model(**kwargs)
        if self.pairing:
            return self._paired(model, kwargs, output_like)
        if self.group is None:
            return model(**kwargs)
        names = self.batched(kwargs)
        batched = [name for name in names or () if kwargs.get(name) is not None]
        batch = self._batch_of(batched[0], kwargs[batched[0]]) if batched else 1
        if batch % 2 or names is None:
            self.replicated_calls += 1  # one sample, or no telling which arguments carry the batch
            return model(**kwargs)
        self.split_calls += 1
        with turns().turn(kwargs):
            out = model(**self._half(kwargs))
            if isinstance(out, list | tuple):  # one tensor per sample, as the per-sample inputs came
                return list(all_gather_dim(torch.stack(list(out)), 0, self.group).unbind(0))
            return all_gather_dim(out, 0, self.group)

    def waiting(self) -> dict[str, Any] | None:
        """This thread's conditional call waiting for its pair (its inputs), or None."""
        pending = self._pending
        return None if pending is None else pending[0]

    def _batch_of(self, name: str, value: Any) -> int:
        return len(value) if name in self._per_sample else value.shape[0]

    def batched(self, kwargs: dict[str, Any]) -> tuple[str, ...] | None:
        """The arguments of this call with a batch dimension (None: the model's rule cannot tell)."""
        return self._batched(kwargs) if callable(self._batched) else self._batched

    def _half(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        def half(value, per_sample=False):
            if isinstance(value, torch.Tensor):
                return value.chunk(2)[self.rank]
            if per_sample or _per_sample(value):  # one entry per sample: this rank's half of the entries
                size = len(value) // 2
                return type(value)(value[self.rank * size : (self.rank + 1) * size])
            if isinstance(value, list | tuple):
                return type(value)(half(v) for v in value)
            return value

        batched = self.batched(kwargs)
        return {k: half(v, k in self._per_sample) if k in batched else v for k, v in kwargs.items()}

    def _paired(self, model, kwargs, output_like) -> torch.Tensor:
        branch = self.branch
        if branch is None:  # no cache_context around the calls: the first call of a pair, then the second
            branch = "uncond" if self._pending is not None or self._unpaired else "cond"
            self.ordered_calls += 1
        elif branch not in _BRANCHES:
            raise RuntimeError(
                f"CFG pairing expects calls inside cache_context('cond'/'uncond') or none, got {branch!r}."
            )
        if branch == "cond":
            if self._pending is not None:
                raise RuntimeError("Two conditional calls without the unconditional one between them.")
            buffer = output_like(kwargs)
            if buffer is None:  # the output's shape is not known yet: this pair runs whole on every rank
                self._unpaired = True
                self.replicated_calls += 1
                return model(**kwargs)
            # a pipeline that read this result before its pair's second call would read NaN, not stale values
            buffer.fill_(float("nan"))
            # a pipeline may edit a dict argument in place before the unconditional call (IP-adapter
            # embeddings): keep the conditional call's own
            self._pending = ({k: dict(v) if isinstance(v, dict) else v for k, v in kwargs.items()}, buffer)
            return buffer
        if self._unpaired:
            self._unpaired = False
            self.replicated_calls += 1
            return model(**kwargs)
        if self._pending is None:
            raise RuntimeError("An unconditional call without the conditional one before it.")
        cond_kwargs, buffer = self._pending
        self._pending = None
        self.paired_calls += 1
        if self.group is None:
            return self._stacked(model, cond_kwargs, kwargs, buffer)
        with turns().turn((cond_kwargs, kwargs)):
            mine = model(**(cond_kwargs if self.rank == 0 else kwargs))
            both = all_gather_dim(mine.unsqueeze(0), 0, self.group)
        buffer.copy_(both[0])
        return both[1]

    def _stacked(self, model, cond: dict[str, Any], uncond: dict[str, Any], buffer: torch.Tensor):
        """Both branches in one call when their inputs stack along the batch, else one after the other."""
        stacked = self._stack(cond, uncond)
        if stacked is None:
            self.unstacked_calls += 1
            buffer.copy_(model(**cond))
            return model(**uncond)
        self.stacked_calls += 1
        both = model(**stacked)
        buffer.copy_(both[: buffer.shape[0]])
        return both[buffer.shape[0] :]

    def _stack(self, cond: dict[str, Any], uncond: dict[str, Any]) -> dict[str, Any] | None:
        if cond.keys() != uncond.keys():
            return None
        stacked, batched = {}, self.batched(cond)
        if batched is None or not (_one_batch(cond, batched) and _one_batch(uncond, batched)):
            return None
        for name, a in cond.items():
            b = uncond[name]
            if name not in batched or a is None or b is None:
                if not self._equal(a, b):
                    return None
                stacked[name] = a
            elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.ndim and _stackable(a, b):
                stacked[name] = torch.cat([a, b])
            elif (name in self._per_sample or (_per_sample(a) and _per_sample(b))) and type(a) is type(b):
                stacked[name] = type(a)([*a, *b])
            else:
                return None
        return stacked

    def _equal(self, a: Any, b: Any) -> bool:
        """Whether two unbatched arguments are the same. Tensors that are not the same object are compared
        once per pipeline call (it waits for the GPU), keyed by identity and version counter (an in-place
        edit bumps it), and kept alive until the call ends so their identities are not reused."""
        if a is b:
            return True
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if not _stackable(a, b) or a.shape != b.shape:
                return False
            if a.is_inference() or b.is_inference():  # no version counter to key a verdict on
                return torch.equal(a, b)
            key = (id(a), a._version, id(b), b._version)
            if key not in self._same:
                self._same[key] = (a, b, torch.equal(a, b))
            return self._same[key][2]
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(self._equal(a[k], b[k]) for k in a)
        if isinstance(a, list | tuple) and isinstance(b, list | tuple):
            return type(a) is type(b) and len(a) == len(b) and all(map(self._equal, a, b))
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return False
        try:
            return bool(a == b)
        except (TypeError, ValueError, RuntimeError):
            return False

    def finish_call(self, completed: bool) -> None:
        """End of a pipeline call: a conditional result still waiting for its pair was never computed."""
        pending, self._pending = self._pending, None
        self.pairing = self._unpaired = False
        self._same.clear()
        if pending is not None and completed:
            raise RuntimeError(
                "The pipeline made a conditional transformer call with no unconditional call after it while "
                "CFG pairing was on; its result was never computed. This pipeline's calls do not pair as its "
                "registry entry says."
            )

    def describe(self) -> str:
        ordered = (
            f"; {self.ordered_calls} calls paired by their order (no cache_context)"
            if self.ordered_calls
            else ""
        )
        if self.group is None:
            return (
                f"guidance branches stacked in one batch: {self.stacked_calls} cond/uncond pairs in one "
                f"call, {self.unstacked_calls} pairs run one after the other (inputs that do not stack), "
                f"{self.hooked_calls} calls alone (a step cache on the blocks decides per branch){ordered}"
            )
        return (
            f"cfg parallel: {self.split_calls} batch-split calls, {self.paired_calls} paired cond/uncond "
            f"calls, {self.replicated_calls} calls computed on both ranks (a batch of one, a pair whose "
            f"output shape was not known yet, arguments whose batch dimension could not be told, or a PAG call, whose batch is not one of samples){ordered}"
        )


def _per_sample(value: Any) -> bool:
    """A batched argument that is a list of per-sample entries holding no tensor (Qwen-Image's
    ``img_shapes``), split and stacked by its entries (a list holding tensors has its batch on each)."""
    return (
        isinstance(value, list | tuple)
        and len(value) > 0
        and not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value))
    )


def _one_batch(call: dict[str, Any], batched: tuple[str, ...]) -> bool:
    """Whether the batched tensors of one branch's call agree on its batch: a pipeline may pass one negative
    prompt's embeddings beside two samples' latents (FLUX's true CFG), which the model broadcasts; stacked
    with the other branch's, they would no longer line up."""
    sizes = {
        call[name].shape[0]
        for name in batched
        if isinstance(call.get(name), torch.Tensor) and call[name].ndim
    }
    return len(sizes) <= 1


def _stackable(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device and a.ndim == b.ndim and a.shape[1:] == b.shape[1:]


class _NoState:
    def reset(self) -> None:
        pass


class _ContextPerThread(StateManager):
    """Diffusers' StateManager whose cache context is the setting thread's: the pipeline's
    ``cache_context("cond")`` in one thread must not name the branch of another thread's call."""

    def __init__(self) -> None:
        self._local = threading.local()
        super().__init__(_NoState)

    @property
    def _context(self) -> Any:
        return getattr(self._local, "context", None)

    @_context.setter
    def _context(self, value: Any) -> None:
        self._local.context = value

    def __deepcopy__(self, memo: dict) -> _ContextPerThread:
        return _ContextPerThread()


class SplitGuidance(LayoutHook):
    """Runs the module's forward through ``GuidanceBranches``. ``output_like(module, arguments)`` is an empty
    tensor shaped like the output (or None where it is not known yet: that pair then runs whole on every
    rank; an ``output_like`` with a ``learn(arguments, output)`` method is shown each paired call's output);
    ``output_class`` wraps it as the module returns it with ``return_dict``.
    Registered after the step graphs are installed, so it wraps them: its per-call pairing decisions are
    made outside any captured step, which sees only the half batch, the one branch or the stacked pair it
    is given."""

    _is_stateful = True  # so Diffusers hands it the cache context (the branch name)

    def __init__(
        self,
        cfg: GuidanceBranches,
        output_like: Callable[[nn.Module, dict[str, Any]], torch.Tensor],
        output_class: type,
        block_lists: tuple[str, ...],
    ) -> None:
        super().__init__()
        self.cfg, self.output_like, self.output_class = cfg, output_like, output_class
        self.block_lists = block_lists  # whose own hooks keep the branches apart
        self.context = _ContextPerThread()
        self.bare_output = False  # the module's forward returns a tensor, not a tuple, without return_dict

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        arguments = bound_arguments(module, args, kwargs)
        return_dict = arguments.pop("return_dict", True)
        context = self.context._context
        self.cfg.branch = None if context is None else context.name

        def forward(**call: Any) -> torch.Tensor:
            out = self.fn_ref.original_forward(**call, return_dict=False)
            # Kandinsky 5's forward returns its sample bare, not in a tuple: taken whole, and given back so
            self.bare_output = isinstance(out, torch.Tensor)
            if self.bare_output:
                return out
            if len(out) > 1:  # gathering only the first would drop the others silently
                raise NotImplementedError(
                    f"{type(module).__name__} returns {len(out)} outputs (video and audio, say), and cfg "
                    "parallelism gathers one; use tp, ulysses or ring for it."
                )
            return out[0]

        # only stacking needs to know (a walk over the blocks each call otherwise spent for nothing)
        stacking = self.cfg.group is None and self.cfg.pairing
        may_stack = not (stacking and foreign_block_hooks(module, self.block_lists))
        sample = self.cfg.run(forward, arguments, lambda call: self.output_like(module, call), may_stack)
        learn = getattr(self.output_like, "learn", None)  # an output_like that learns shapes from calls
        if learn is not None and self.cfg.pairing:
            learn(arguments, sample)
        if return_dict:
            return self.output_class(sample=sample)
        return sample if self.bare_output else (sample,)

    def reset_state(self, module: nn.Module) -> nn.Module:
        return module
