"""The generic tier: any Diffusers transformer without native blocks, made faster from what it declares.

Its repeated blocks (the classes ``_repeated_blocks`` names, as Diffusers' ``compile_repeated_blocks`` finds
them, else every ModuleList of two or more blocks of one class) are compiled regionally: one
``torch.compile`` of each block class's forward (static shapes, the whole block in one graph) serves every
block of that class. Their attention stays inside the graph: the role hooks of the accelerated model make
each routed attention call a custom op of ours (``attention.routing.diffusers_attention``) that resolves
and runs our providers at run time. The compile runs at the first call per input shape, or with
``compile_in_background=True`` beside eager blocks (see ``compiler``), and the steps are replayed from
CUDA graphs (``cuda_graphs.StepGraphs``, with this runtime as its ``StepHooks``). Under a parallel layout
(``generic_parallel_plan``) the model is spread by the plans it declares to Diffusers.

The Diffusers module and its blocks stay what they are: each block gets an instance ``forward`` that runs
the compiled code or, for a call compiled code cannot serve exactly (gradients, active dropout, hooks below
the block, a device the compile is not for), the block's own forward, counted by reason. A Diffusers hook
registered on a block later (a step cache) wraps that ``forward`` like any other, so it decides as in
plain Diffusers and calls the compiled code when it runs the block.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from diffusers.models import attention_processor
from torch import nn

from ..attention.selection import AttentionSelector
from ..forward_hooks import InstanceForward
from ..layers.fp8 import Fp8Weights
from ..parallel import ParallelPlan
from ..parallel.config import ParallelConfig
from ..parallel.diffusers_plan import sequence_plan, tensor_plan
from ..parallel.shares import signature
from ..utils.logging import get_logger
from ..utils.reason_counts import ReasonCounts
from .base import diffusers_only_reason
from .compiler import BlockCompiler, CompiledSteps
from .registry import cp_plan, registered_natives, unbatched_arguments

logger = get_logger(__name__)


def repeated_blocks(transformer: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) of every repeated block, outermost only: the classes ``_repeated_blocks`` names, else
    the members of each ModuleList of modules of one class that have submodules of their own (two or more,
    or any number in a list named like ``transformer_blocks`` / ``layers``: a one-layer model's blocks)."""
    named = set(getattr(transformer, "_repeated_blocks", None) or ())
    found: list[tuple[str, nn.Module]] = []

    def inside(name: str) -> bool:
        return any(name.startswith(f"{outer}.") for outer, _ in found)

    for name, module in transformer.named_modules():
        if not name or inside(name):
            continue
        if named and type(module).__name__ in named:
            found.append((name, module))
        elif not named and isinstance(module, nn.ModuleList) and _one_class_of_blocks(name, module):
            found.extend((f"{name}.{index}", block) for index, block in enumerate(module))
    return found


def _one_class_of_blocks(name: str, modules: nn.ModuleList) -> bool:
    if not len(modules) or len({type(module) for module in modules}) != 1:
        return False
    named_as_blocks = name.rpartition(".")[2].endswith(("blocks", "layers"))
    return (len(modules) >= 2 or named_as_blocks) and any(True for _ in modules[0].children())


class GenericRuntime(CompiledSteps):
    """What the compiled blocks of one transformer share: the attention selector, the compiler (None:
    ``compile`` off), the device types the compile is for (None: any) and the count of calls that ran the
    block's own forward instead, by reason. ``cache`` and ``layout``: none in this tier (read by reports)."""

    cache = None
    layout = None
    fp8: Fp8Weights | None = None  # the e4m3 weight copies under quantize="fp8" (``layers.fp8_linears``)

    def __init__(
        self,
        selector: AttentionSelector,
        compile_options: Mapping[str, Any] | None,
        compile_in_background: bool = True,
        devices: tuple[str, ...] | None = None,
        raise_failures: bool = True,
    ) -> None:
        self.selector = selector
        self.compile_options = compile_options
        self.compile_in_background = compile_in_background
        self.devices = devices
        self.raise_failures = raise_failures
        self.fallbacks = ReasonCounts()
        self.compiler = (
            None
            if compile_options is None
            else BlockCompiler(
                {"fullgraph": True, **compile_options}, compile_in_background, raise_failures=raise_failures
            )
        )

    def _arguments(self) -> tuple:
        return (
            self.selector,
            self.compile_options,
            self.compile_in_background,
            self.devices,
            self.raise_failures,
        )

    def __deepcopy__(self, memo: dict) -> GenericRuntime:
        # A copy keeps the provider choice; compiled code, counts and FP8 copies are its own.
        twin = GenericRuntime(*self._arguments())
        twin.fp8 = copy.deepcopy(self.fp8, memo)
        return twin

    def __reduce__(self):
        return _unpickled_runtime, (self._arguments(), self.fp8)

    def eager_reason(self, block: nn.Module, args: tuple, kwargs: dict) -> str | None:
        """Why this call of ``block`` runs its own forward rather than the compiled code, or None."""
        reason = diffusers_only_reason(block, (args, kwargs))
        if reason is not None or self.devices is None:
            return reason
        device = next((t.device for t in _tensors(args, kwargs)), None)
        if device is not None and device.type not in self.devices:
            return f"the block runs on {device.type}: compile=None compiles on CUDA only (compile=True: here too)"
        return None

    def note_eager(self, reason: str) -> None:
        if self.fallbacks.count(reason):
            logger.info("a repeated block runs its own forward: %s (counted in describe)", reason)


def _tensors(args: tuple, kwargs: dict):
    for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            yield leaf


class RegionForward(InstanceForward):
    """The instance ``forward`` of one repeated block (see the module docstring and ``InstanceForward``)."""

    def __init__(self, block: nn.Module, name: str, runtime: GenericRuntime) -> None:
        super().__init__(block)
        self.name = name
        self.runtime = runtime
        # Read again at each eager call; what a trace calls: Diffusers marks many block classes
        # allow_in_graph, and Dynamo cannot read a method off such a class (fullgraph=True failed).
        self.class_forward = type(block).forward

    @property
    def block(self) -> nn.Module:
        return self.module

    def __deepcopy__(self, memo: dict) -> RegionForward:
        twin = RegionForward(copy.deepcopy(self.block, memo), self.name, copy.deepcopy(self.runtime, memo))
        twin.inner, twin.enabled = copy.deepcopy(self.inner, memo), self.enabled
        return twin

    def __reduce__(self):
        return _unpickle, (self.block, self.name, self.runtime, self.inner, self.enabled)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        block, runtime = self.block, self.runtime
        if self.inner is not None:
            runtime.note_eager("a hook wrapped the block's forward before accelerate")
            return self.inner(*args, **kwargs)
        if torch.compiler.is_dynamo_compiling():  # a compiler tracing us traces the block's forward
            return self.class_forward(block, *args, **kwargs)
        self.class_forward = forward = type(block).forward
        if not self.enabled or runtime.compiler is None:
            return forward(block, *args, **kwargs)
        reason = runtime.eager_reason(block, args, kwargs)
        if reason is not None:
            runtime.note_eager(reason)
            return forward(block, *args, **kwargs)
        return runtime.compiler.math(forward, self.name)(block, *args, **kwargs)


def _unpickle(
    block: nn.Module, name: str, runtime: GenericRuntime, inner: Callable | None, enabled: bool
) -> RegionForward:
    region = RegionForward(block, name, runtime)
    region.inner, region.enabled = inner, enabled
    return region


def install_regions(transformer: nn.Module, runtime: GenericRuntime) -> list[Callable[[], None]]:
    """Gives every repeated block of ``transformer`` its ``RegionForward``; returns the undos."""
    undo = []
    for name, block in repeated_blocks(transformer):
        region = RegionForward(block, name, runtime)
        region.install()
        undo.append(region.uninstall)
    return undo


def generic_parallel_plan(module: nn.Module, config: ParallelConfig, routed: bool) -> ParallelPlan:
    """How ``config``'s layout spreads a transformer without native blocks, by the plans it declares to
    Diffusers (not ones of ours): its sequence split as its ``_cp_plan`` says, attention through our
    exchanges and providers (``routed``: its attention call sites are ours); its linears as its
    ``_tp_plan`` says; its guidance branches by the arguments that carry the batch. Raises for what this
    tier cannot spread yet."""
    name = type(module).__name__
    plan = cp_plan(module)
    tensor = {}
    if config.tp > 1:  # the error names what else the model takes: without a _cp_plan, cfg alone
        instead = "ulysses, ring or cfg" if plan is not None and routed else "cfg"
        tensor = tensor_plan(name, getattr(type(module), "_tp_plan", None), instead)
    if config.sequence_parallel > 1 and not routed:
        raise ValueError(
            f"ulysses/ring split {name}'s attention over the ranks through our providers, and none of its "
            "attention call sites can be routed; use cfg for it (its guidance branches on two ranks), or "
            "run it on one GPU."
        )
    if config.sequence_parallel > 1 and plan is None:
        raise ValueError(
            f"ulysses/ring split a transformer's sequence as its native blocks or its Diffusers _cp_plan say, "
            f"and {name} has neither; use cfg for it (its guidance branches on two ranks), or run it on one "
            f"GPU (native blocks exist for {', '.join(registered_natives())})."
        )
    return ParallelPlan(
        name=name,
        attention_heads="num_attention_heads",
        sequence=sequence_plan(module, plan),
        tensor=tensor,
        tokens_over_tp=False,  # Diffusers' forward of the blocks: each TP rank holds its share's tokens
        batched_inputs=functools.partial(_batch_of_samples, module),
        output_like=LearnedOutputs(),
    )


# Diffusers' perturbed-attention guidance (PAG) processors: a PAG pipeline sets them for its call and stacks
# [uncond,] cond and perturbed inputs in one batch, which they cut in thirds (halves) to treat each part apart
_PAG_PROCESSORS = tuple(
    cls for name, cls in vars(attention_processor).items() if name.startswith("PAG") and isinstance(cls, type)
)


def _runs_pag(module: nn.Module) -> bool:
    """A PAG processor set on ``module`` (read from its ``__dict__``: ``getattr`` of a missing attribute runs
    ``Module.__getattr__``, which raises, at every module of every split call), or one as the module."""
    return isinstance(module.__dict__.get("processor"), _PAG_PROCESSORS) or isinstance(
        module, _PAG_PROCESSORS
    )


def _batch_of_samples(module: nn.Module, arguments: dict[str, Any]) -> tuple[str, ...] | None:
    """``batch_dim_arguments`` of the arguments the registry does not know to be unbatched (RoPE tuples), or
    None (no telling: the call runs whole on every rank, or its two branches apart) while a PAG processor
    runs in ``module``: its batch is not one of samples, and a rank given half of it would perturb the wrong
    part (or fail on a part missing)."""
    if any(_runs_pag(m) for m in module.modules()):
        return None
    unbatched = unbatched_arguments(module)
    return batch_dim_arguments({k: v for k, v in arguments.items() if k not in unbatched})


def batch_dim_arguments(arguments: dict[str, Any]) -> tuple[str, ...] | None:
    """A call's arguments that carry its batch (what CFG parallelism halves or stacks): the tensors whose
    first dimension is the batch of its ``hidden_states``. A model declares no batch dimensions, so this
    is read from the call; the token ids and RoPE tables that lack one are as long as the sequence. None
    where that cannot be told: a tensor of fewer than three dimensions whose first one is the batch while a
    sequence is as long (FLUX's text ids [2, 3] beside two prompts of two tokens), or a list of tensors
    that are not each batched (Z-Image's latents and captions: one tensor per sample), which halving each
    tensor would cut wrong. A list of batched tensors (ControlNet residuals) is halved tensor by tensor."""
    first = arguments.get("hidden_states")
    if not isinstance(first, torch.Tensor):
        first = next((v for v in arguments.values() if isinstance(v, torch.Tensor) and v.ndim), None)
    if first is None or not first.ndim:
        return ()
    batch = first.shape[0]
    tensors = [(name, v) for name, v in arguments.items() if isinstance(v, torch.Tensor) and v.ndim]
    lengths = {v.shape[1] for _, v in tensors if v.ndim >= 3}
    if batch in lengths and any(v.ndim < 3 and v.shape[0] == batch for _, v in tensors):
        return None
    lists = []
    for name, value in arguments.items():
        if not isinstance(value, list | tuple):
            continue
        leaves = [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]
        if any(not leaf.ndim or leaf.shape[0] != batch for leaf in leaves):
            return None
        if leaves:
            lists.append(name)
    return tuple(name for name, v in tensors if v.shape[0] == batch) + tuple(lists)


class LearnedOutputs:
    """``output_like`` for a model without native blocks, which cannot say its output's shape before it
    runs: the shape each paired call gave for inputs of given shapes, learned from the first pipeline step
    of those shapes (that pair runs whole on every rank, see ``GuidanceBranches``)."""

    def __init__(self) -> None:
        self._shapes: dict[tuple, tuple[torch.Size, torch.dtype, torch.device]] = {}

    def __call__(self, module: nn.Module, arguments: dict[str, Any]) -> torch.Tensor | None:
        known = self._shapes.get(signature(arguments))
        return None if known is None else torch.empty(known[0], dtype=known[1], device=known[2])

    def learn(self, arguments: dict[str, Any], output: torch.Tensor) -> None:
        if len(self._shapes) >= 64:
            self._shapes.clear()
        self._shapes[signature(arguments)] = (output.shape, output.dtype, output.device)


def _unpickled_runtime(arguments: tuple, fp8: Fp8Weights | None) -> GenericRuntime:
    """A pickled ``GenericRuntime``: its options, and the store its linears' FP8 forwards share."""
    runtime = GenericRuntime(*arguments)
    runtime.fp8 = fp8
    return runtime
