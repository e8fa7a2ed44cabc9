"""The native-model contract: what the rest of omni_accel needs from a native model, declared in one place.

A native model does not replace the Diffusers transformer. ``pipe.transformer`` stays the Diffusers module,
of its class, with its config, mixins (LoRA, step caches, offload) and hooks; only its repeated blocks
change class: each becomes an instance of a ``NativeBlock`` subclass of its own Diffusers class. The block
keeps its submodules, parameters and hooks (it is the same object), so Diffusers names, ``state_dict``,
LoRA loading and every hook keep working, and its ``forward`` runs fused math over the weights it reads
from those submodules. Whatever the native math cannot serve exactly (an IP-adapter processor, a DoRA
adapter, hooks on a submodule, training mode) runs Diffusers' own forward of that block, and the report
counts it.

A model file declares a ``NativeModel`` (which block lists become which native classes, its parallel plan,
the CFG pairing rule, limitations) and its block classes, each with its table of packed projections
(``packed``: name -> the Diffusers linears that read one input), its tensor-parallel plan and its pure math.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from omni_accel.patches import hook_chains
from omni_accel.patches.hooks_around_native_math import (
    NotDecidedAhead,
    call_through,
    decided_ahead,
    runs_around,
)

from ..attention.selection import AttentionSelector
from ..cache import ExactProjectionCache
from ..forward_hooks import hooked_submodule
from ..layers.attention import AttentionSite, ModuleCall, forward_in_flight
from ..layers.fp8 import Fp8Weights
from ..layers.projection import (
    LinearWeights,
    Unsupported,
    apply_one,
    prepack,
    read_linear,
    read_packed,
    unpack,
    with_fp8,
)
from ..layers.split_modulation import ModulationSite, SplitModulation
from ..parallel.cfg import Pairing
from ..parallel.parallelize import Parallelized, ParallelPlan
from ..parallel.sequence_hooks import Split
from ..parallel.tensor import TensorPlan
from ..parallel.token_rows import Rows
from ..utils.logging import get_logger
from ..utils.module_settings import settings
from ..utils.reason_counts import ReasonCounts
from .code_watch import CodeWatch
from .compiler import BlockCompiler, CompiledSteps
from .forward_memo import ForwardMemo

logger = get_logger(__name__)


@dataclass(frozen=True)
class NativeModel:
    """One Diffusers transformer class made native.

    ``blocks``: attribute of each repeated-block list -> its native block class. ``parallel``: what
    ``parallel.parallelize`` needs (sequence plan, batched inputs, head count...; the TP plans are the
    block classes' ``tp_plan``). ``cfg_pairing``: tells from a pipeline call's arguments whether the
    transformer is called twice per step (cond, then uncond), or gives a function that tells at each call
    (``parallel.cfg.guided_per_step``, for pipelines that decide per step). ``falls_back_on``: what makes a block call
    run Diffusers' forward instead (the report lists it once such a call happened). ``limitations``: what
    else the native blocks leave to Diffusers, for the report. ``projection_cache``: whether the blocks consult the exact
    projection cache (``NativeBlock.project_conditioning``); without sites none is made.
    ``projection_cache_unpaid``: why, measured, the cache costs this model more than it saves: then it is
    off unless the user gives ``projection_cache_bytes`` (the report says why).
    ``conditioning_sites``: full names (regexes) of model-level modules of one tensor input that repeats
    from call to call (a text refiner over the prompt's embeddings), whose outputs go through that cache too.
    ``compiled_by_default``: the blocks' math leaves elementwise steps (SwiGLU, sandwich norms, per-row
    modulation) to the compiler, having no fused kernels of ours for them: on CUDA they compile (in the
    background) unless ``compile=False``.
    """

    blocks: Mapping[str, type[NativeBlock]]
    parallel: ParallelPlan
    cfg_pairing: Callable[[dict[str, Any]], Pairing] | None = None
    falls_back_on: str = ""
    limitations: tuple[str, ...] = ()
    projection_cache: bool = True
    projection_cache_unpaid: str = ""
    conditioning_sites: tuple[str, ...] = ()
    compiled_by_default: bool = False

    def __post_init__(self) -> None:
        # The TP plan lives with each block class; parallel/ (which never imports models/) gets it as data.
        tensor = {name: cls.tp_plan for name, cls in self.blocks.items()}
        object.__setattr__(self, "parallel", dataclasses.replace(self.parallel, tensor=tensor))


@dataclass
class NativeRuntime(CompiledSteps):
    """What the native blocks of one accelerated transformer share: the attention selector, how their
    math is compiled (``compile_options`` None: not at all), the parallel layout, the e4m3 copies of the
    projection weights under ``quantize="fp8"`` (``fp8``, else None), and the count of calls that ran
    Diffusers' forward instead (by reason)."""

    selector: AttentionSelector
    compile_options: Mapping[str, Any] | None = None
    cache: ExactProjectionCache | None = None
    compile_in_background: bool = True
    fallbacks: ReasonCounts = field(default_factory=ReasonCounts)
    layout: Parallelized | None = None
    modulation: SplitModulation | None = None  # under a layout: every block's modulation at once
    fp8: Fp8Weights | None = None
    code: CodeWatch | None = None  # the Diffusers code the blocks stand in for (set by ``swap_blocks``)
    compiler: BlockCompiler | None = field(init=False)

    def __post_init__(self) -> None:
        options = self.compile_options
        self.compiler = None if options is None else BlockCompiler(options, self.compile_in_background)

    def rows(self, *streams: str) -> Rows | None:
        """How this rank's tokens of ``streams`` sit in its tensor-parallel group (None: not split)."""
        return None if self.layout is None else self.layout.rows(*streams)

    def math(self, fn: Callable, caller: str) -> Callable:
        """``fn`` itself, or what runs it compiled (see ``compiler``), for the block named ``caller``."""
        if self.compiler is None:
            return fn
        return self.compiler.math(fn, caller, background=self.layout is None)

    def step_eager_reason(self) -> str | None:
        """A step whose blocks run patched Diffusers code (``code_watch``) runs eagerly: a replay would skip
        the patch's Python."""
        return None if self.code is None else self.code.reason()

    def __deepcopy__(self, memo: dict) -> NativeRuntime:
        # A copy keeps the provider choice and gets its own (empty) caches and selector (the one its report
        # reads); compiled code is not copied. Under a layout it runs the copy's (sharing the process groups).
        twin = NativeRuntime(
            copy.deepcopy(self.selector, memo),
            self.compile_options,
            copy.deepcopy(self.cache, memo),
            self.compile_in_background,
            fp8=copy.deepcopy(self.fp8, memo),
            code=copy.deepcopy(self.code, memo),
        )
        memo[id(self)] = twin
        twin.layout, twin.modulation = copy.deepcopy((self.layout, self.modulation), memo)
        return twin

    def __reduce__(self):
        args = (self.selector, self.compile_options, self.cache, self.compile_in_background)
        return _runtime, (*args, self.fp8, self.code)


def _runtime(selector, compile_options, cache, compile_in_background, fp8, code=None) -> NativeRuntime:
    return NativeRuntime(selector, compile_options, cache, compile_in_background, fp8=fp8, code=code)


class NativeBlock:
    """Mixin for a native block; the subclass also derives from the Diffusers block class it replaces.

    ``packed``: name -> Diffusers paths of linears that read one input (one GEMM). ``linears``: name ->
    path of the other linears the math reads (``output_parts``: those whose outputs pack several).
    Subclasses implement ``forward`` with Diffusers' signature as one ``native_call`` (the sequence every
    native forward follows); their host-side ``prepare`` starts with ``self.native_weights(...)``, which
    gives the weights or None (Diffusers' forward then runs).
    """

    packed: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    linears: ClassVar[Mapping[str, str]] = {}
    # Name in ``linears`` -> the linear's attribute listing the projections packed in its outputs (read as
    # parts, ``read_linear``).
    output_parts: ClassVar[Mapping[str, str]] = {}
    tp_plan: ClassVar[TensorPlan] = {}
    sites: ClassVar[tuple[AttentionSite, ...]] = ()  # the block's attention call sites (roles)
    # The names in ``linears`` of its AdaLN projections (``modulate``).
    modulations: ClassVar[tuple[str, ...]] = ()
    # Paths of the submodules whose whole forward one part of the math computes (the attention modules): a
    # step cache's hook on one that reads only what it returns (TaylorSeer's) runs around that part
    # (``attention_module_call``) instead of sending the block to Diffusers' forward.
    attention_modules: ClassVar[tuple[str, ...]] = ()
    # Paths of the GELU modules (Diffusers' or torch's) the math computes as the tanh GELU: one set to
    # another ``approximate`` sends the block to Diffusers' forward.
    tanh_gelus: ClassVar[tuple[str, ...]] = ()
    math: ClassVar[Callable[..., Any]]  # the block's pure math over tensors, weights and constants
    # What every block of one forward shares (``forward_memo``): let go of at moves and at restore.
    memos: ClassVar[tuple[ForwardMemo, ...]] = ()
    omni_runtime: NativeRuntime
    omni_name: str  # the block's name in the transformer, naming its projection-cache entries
    omni_structure: Structure  # ``structure()`` at ``accelerate``

    @classmethod
    def diffusers_class(cls) -> type[nn.Module]:
        return next(
            base for base in cls.__mro__[1:] if issubclass(base, nn.Module) and base is not NativeBlock
        )

    def head_dim(self) -> int:
        """The head size of this block's attention (for capability checks at accelerate)."""
        raise NotImplementedError

    def packed_projections(self) -> Mapping[str, tuple[str, ...]]:
        """``packed``, plus any projection only some variants of the model have (override to add them)."""
        return self.packed

    def linear_projections(self) -> Mapping[str, str]:
        """``linears``, plus any linear only some blocks of a class have (override to add them)."""
        return self.linears

    def native_call(
        self,
        diffusers_forward: Callable[[], Any],
        prepare: Callable[[], Any],
        run: Callable[[Callable[..., Any], Any], Any],
    ) -> Any:
        """The forward of every native block, in this order: Diffusers' forward while a compiler traces the
        block (``run_as_diffusers``) or where ``prepare()`` (host-side, never traced: the weights read, the
        projection cache, the constants) returns None (its reason counted); else ``run(math, prepared)``,
        ``math`` being the class's math, compiled where the runtime compiles."""
        traced = self.run_as_diffusers()
        layout = self.omni_runtime.layout
        if traced and layout is not None and layout.splits_blocks:
            _refuse_traced_split(self.omni_name, layout.description)
        prepared = None if traced else prepare()
        if prepared is None:
            return diffusers_forward()
        if self.hooks_around():  # the hooks decide on the host, mid-block: eager math
            return run(type(self).math, prepared)
        return run(self.omni_runtime.math(type(self).math, self.omni_name), prepared)

    def hooks_around(self) -> list[nn.Module]:
        """The attention modules (``attention_modules``) whose hooks the math runs around in this call."""
        return [module for module in self._modules_at(self.attention_modules) if runs_around(module)]

    def _decided_ahead(self) -> bool:
        """Whether the hooks of this call's attention modules decided before it (``decided_calls``)."""
        return any(decided_ahead(module) for module in self._modules_at(self.attention_modules))

    def attention_module_call(self, path: str) -> ModuleCall | None:
        """What runs the part of the math that is the submodule ``path``'s forward through that module's
        hooks (``patches/hooks_around_native_math.py``), or None where it has none: the math then calls the
        part itself. ``path`` is one of ``attention_modules``."""
        module = self._submodule(path)
        return functools.partial(call_through, module) if runs_around(module) else None

    def unsupported_reason(self, *args: Any, **kwargs: Any) -> str | None:
        """A model-specific reason this call must run Diffusers' forward (a custom processor...), or None."""
        return None

    def native_weights(
        self, *args: Any, inputs: Sequence[Any] = (), **kwargs: Any
    ) -> dict[str, LinearWeights] | None:
        """The weights of every projection, read now; None (and the reason counted) when this call must run
        Diffusers' forward. ``inputs``: the call's tensor arguments (nested in tuples, lists or dicts)."""
        reason = self._block_reason(inputs) or self.unsupported_reason(*args, **kwargs)
        if reason is None:
            try:
                weights = {
                    name: read_packed(self._modules_at(paths), paths)
                    for name, paths in self.packed_projections().items()
                }
                weights.update(
                    {
                        name: read_linear(self._submodule(path), path, self.output_parts.get(name, ""))
                        for name, path in self.linear_projections().items()
                    }
                )
                fp8 = self.omni_runtime.fp8
                if fp8 is not None:  # the AdaLN projections (a row per sample): their weights alone
                    for name, projection in weights.items():
                        weights[name] = with_fp8(projection, fp8, weight_only=name in self.modulations)
                return weights
            except Unsupported as exc:
                reason = str(exc)
        layout = self.omni_runtime.layout
        if layout is not None and layout.splits_blocks:
            raise RuntimeError(
                f"{self.omni_name} cannot run natively ({reason}), and under {layout.description} Diffusers' "
                "own forward of a block would be wrong (its weights or its sequence are split over the ranks). "
                "Remove what the reason names, or run without tensor/sequence parallelism."
            )
        if self._decided_ahead():  # its hooks decided for the native math; Diffusers' forward calls them
            raise NotDecidedAhead  # itself: the call is made again undecided (and counted then)
        if self.omni_runtime.fp8 is not None:  # nothing reads its copies now; a native call makes them again
            self.omni_runtime.fp8.drop(self.parameters())
        if self.omni_runtime.fallbacks.count(reason):
            logger.warning("%s runs Diffusers' forward: %s (counted in describe)", self.omni_name, reason)
        return None

    @staticmethod
    def modulation_input(conditioning: torch.Tensor) -> torch.Tensor:
        """What the AdaLN projections read of the per-sample conditioning (Diffusers' AdaLN: its SiLU)."""
        return F.silu(conditioning)

    def modulate(
        self, name: str, conditioning: torch.Tensor, weights: Mapping[str, LinearWeights]
    ) -> torch.Tensor:
        """The AdaLN projection ``linears[name]`` (one of ``modulations``) of ``conditioning``, shared by
        every block of a forward: through the exact projection cache, and under a parallel layout from the
        runtime's ``SplitModulation`` (every block's at once, split over the ranks)."""
        split = self.omni_runtime.modulation
        if split is None:
            compute = lambda: apply_one(self.modulation_input(conditioning), weights[name])  # noqa: E731
        else:
            compute = lambda: split.project(f"{self.omni_name}.{name}", conditioning)  # noqa: E731
        return self.project_conditioning(name, conditioning, compute)

    def project_conditioning(
        self, name: str, conditioning: torch.Tensor, compute: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """``compute()`` of the projection ``linears[name]`` of ``conditioning`` (a tensor every block of a
        forward shares, such as the timestep embedding), reused through the exact projection cache. Not
        while a CUDA graph captures the step: a replay could not consult the cache, so the graph computes it.
        Under a layout ``compute`` may be a collective: every rank decides hits alike (same tensors, calls
        and budget), so every rank calls it or none does."""
        cache = self.omni_runtime.cache
        if cache is None or (conditioning.is_cuda and torch.cuda.is_current_stream_capturing()):
            return compute()
        cache.ensure_prepared(conditioning)
        module = self._submodule(self.linears[name])
        return cache.project(f"{self.omni_name}.{name}", module, conditioning, compute)

    def _block_reason(self, inputs: Sequence[Any]) -> str | None:
        if forward_in_flight() is not self.omni_runtime:
            # Gradient checkpointing recomputes the block in the backward pass, after the forward: name the
            # gradient, as the forward's call did.
            return (
                gradient_reason(self, inputs)
                or "the block was called outside its accelerated transformer's forward"
            )
        code = self.omni_runtime.code
        reason = None if code is None else code.reason()
        if reason is not None:
            return reason
        reason = diffusers_only_reason(self, inputs, around=self.hooks_around()) or self._structure_reason()
        if reason is not None:
            return reason
        for path in self.tanh_gelus:
            approximate = getattr(self._submodule(path), "approximate", None)
            if approximate != "tanh":
                return (
                    f"{path} is not a tanh GELU (approximate={approximate!r}), which the native math computes"
                )
        selector = self.omni_runtime.selector
        for site in self.sites:  # a Diffusers backend chosen process-wide that no provider of ours runs
            reason = selector.unserved_reason(site.role, site.category)
            if reason is not None:
                return reason
        return None

    def structure(self) -> Structure:
        """What the math assumes of the submodules it computes without reading them (activations, norms,
        their eps): see ``Structure``. The projections it reads at every call (``linears``, the packed ones,
        whatever LoRA wraps them in) are left out."""
        skip: dict = {}
        for paths in (*self.packed_projections().values(), *((path,) for path in self.linears.values())):
            for path in paths:
                *parents, last = _split_path(path)
                node = skip
                for name in parents:
                    node = node.setdefault(name, {})
                node[last] = None
        return Structure.of(self, skip)

    def _structure_reason(self) -> str | None:
        """Why the block's submodules are no longer what its math computes (``structure`` changed since
        ``accelerate``: an activation replaced, an eps changed), or None."""
        then = self.omni_structure
        fused: list[str] = []
        if _walk_structure(self, then.skip, fused=fused) == then.fingerprint and not fused:
            return None
        if fused:
            return f"Diffusers' fuse_qkv_projections() is active on {fused[0]} (its fused weights run in Diffusers)"
        changed = then.changed_path(self)
        return f"{changed} was replaced or changed since accelerate (the native math computes what it was)"

    def prepack(self) -> None:
        """Packs each of the block's packed projections now (at ``accelerate``), where no call can observe
        it: tensors a user takes from ``state_dict()`` afterwards stay the weights every call reads. A
        projection that cannot be packed (quantized, offloaded...) is left as it is: its calls say why."""
        for paths in self.packed_projections().values():
            prepack(self._modules_at(paths), paths)

    def unpack(self) -> None:
        """Gives the packed projections' parameters their own storages back (``restore``)."""
        for paths in self.packed_projections().values():
            unpack(self._modules_at(paths), paths)

    def run_as_diffusers(self) -> bool:
        """True while ``torch.compile`` traces this block (a user's ``compile_repeated_blocks()`` or
        ``torch.compile`` of the transformer): the host-side work of the native path cannot be traced, so the
        compiler gets Diffusers' forward of the block, which it traces whole (``fullgraph=True`` works).

        Dynamo's own flag, as everywhere in omni_accel: ``torch.compiler.is_compiling()`` read in eager code
        is a process-wide flag that is also True while another thread compiles (our background compile), so
        eager steps beside a compile would take the traced paths."""
        return torch.compiler.is_dynamo_compiling()

    def own_share(
        self, per_token: torch.Tensor, stream: str, dim: int, length: int, per_row: bool = False
    ) -> torch.Tensor:
        """This rank's share of ``per_token`` (every token of ``stream`` along ``dim``: a mask, an index, a
        RoPE table the model passes whole to every block) under a sequence split, where this block holds
        ``length`` of them; ``per_token`` itself where it is that long already. ``per_row``: one entry per
        row of the block's ``hidden_states`` (a per-token modulation index), split over the TP ranks with
        the rows; otherwise per position, which attention reads on the tokens gathered over them."""
        layout = self.omni_runtime.layout
        if per_token.shape[dim] == length or layout is None or layout.sequence is None:
            return per_token
        return layout.sequence.split(per_token, Split(stream, dim, positions=not per_row))

    def _modules_at(self, paths: tuple[str, ...]) -> list[nn.Module]:
        return [self._submodule(path) for path in paths]

    def _submodule(self, path: str) -> nn.Module:
        """``get_submodule(path)`` read straight from each ``_modules`` (it runs for every projection of
        every block at every call, and always sees the module the parent holds now)."""
        module = self
        for name in _split_path(path):
            module = module._modules[name]
        return module


_TRACED_SPLIT = (
    "a torch.compile of the user's own (torch.compile of the transformer, Module.compile() or "
    "compile_repeated_blocks()) traces Diffusers' forward of the native blocks, which under tensor or sequence "
    "parallelism would be wrong (their weights or their sequence are split over the ranks); drop that compile "
    "and pass compile=True to accelerate to compile the native blocks"
)


@torch.compiler.disable(reason=_TRACED_SPLIT)
def _refuse_traced_split(name: str, layout: str) -> None:
    """Raises, run eagerly (a graph break), where a user's compile traces a native block under a layout that
    splits it: Diffusers' forward there would compute silently wrong results (a fullgraph compile raises
    Dynamo's error, which quotes the reason)."""
    raise RuntimeError(f"{name} under {layout}: {_TRACED_SPLIT}.")


@functools.cache
def _split_path(path: str) -> tuple[str, ...]:
    return tuple(path.split("."))


def processor_reason(attn: nn.Module, processor_class: type, where: str = "attention") -> str | None:
    """Why a block whose attention module ``attn`` the native math replaces must run Diffusers' forward: a
    processor other than the model's own ``processor_class`` (an IP-adapter's, a custom one), a Diffusers
    backend or context-parallel config set on it, or Diffusers' fused projections; None when none is."""
    processor = attn.processor
    if type(processor) is not processor_class:
        return f"{where} processor {type(processor).__name__} (IP-adapter or custom) runs in Diffusers"
    if processor._attention_backend is not None or processor._parallel_config is not None:
        return "a Diffusers attention backend or context-parallel config is set on a processor"
    if attn.fused_projections:
        return "Diffusers' fuse_qkv_projections() is active (its fused weights run in Diffusers)"
    return None


def processor_kwargs_reason(
    processor_class: type, taken: frozenset[str], joint_attention_kwargs: dict[str, Any] | None
) -> str | None:
    """Why a call's ``joint_attention_kwargs`` must go to Diffusers' processor: it names arguments of
    ``processor_class`` besides the ones the native math takes (``taken``); Diffusers' Attention drops the
    other keys, and so do we."""
    if not joint_attention_kwargs:
        return None
    used = sorted(set(joint_attention_kwargs) & _processor_arguments(processor_class, taken))
    return f"joint_attention_kwargs {used} are handled by Diffusers' processor" if used else None


@functools.cache
def _processor_arguments(processor_class: type, taken: frozenset[str]) -> frozenset[str]:
    return frozenset(inspect.signature(processor_class.__call__).parameters) - {"self", "attn"} - taken


def image_output_like(transformer: nn.Module, arguments: dict[str, Any]) -> torch.Tensor:
    """``output_like`` of a model whose output is one row of ``proj_out`` per ``hidden_states`` token."""
    hidden = arguments["hidden_states"]
    return hidden.new_empty(*hidden.shape[:2], transformer.proj_out.out_features)


@dataclass(frozen=True)
class Structure:
    """A block's submodules as its math assumes them, taken at ``accelerate``: depth first, each one's class
    and plain settings (``utils.module_settings``), the subtrees in ``skip`` (a tree of names; None: not
    walked) left out. Compared whole at each call: about as cheap as the walk for hooks."""

    skip: dict
    fingerprint: tuple
    entries: tuple[tuple[str, type, tuple], ...]  # the same, by submodule: (path, class, settings' values)

    @classmethod
    def of(cls, block: nn.Module, skip: dict) -> Structure:
        entries: list = []
        return cls(skip, _walk_structure(block, skip, entries), tuple(entries))

    def changed_path(self, block: nn.Module) -> str:
        """The dotted path of the first submodule whose class or settings differ now."""
        now = Structure.of(block, self.skip).entries
        differ = [a[0] for a, b in zip(now, self.entries, strict=False) if a != b]
        return (differ or [entry[0] for entry in (now[len(self.entries) :] or self.entries[len(now) :])])[0]


def _walk_structure(
    root: nn.Module,
    skip: dict,
    paths: list[tuple[str, type, tuple]] | None = None,
    fused: list[str] | None = None,
) -> tuple:
    """The flat fingerprint of ``Structure``: for each submodule walked, its class, then its settings'
    values. ``paths`` collects each one's (dotted path, class, settings' values); ``fused`` the paths of
    the attention modules fused by Diffusers' ``fuse_qkv_projections()`` now. That state is left out of
    the fingerprint (the fused linears, the flag): fused now runs Diffusers' forward, and unfused again
    (the linears deleted), before or after ``accelerate``, is the structure the native math computes."""
    found: list = []
    stack: list[tuple[nn.Module, dict, str]] = [(root, skip, "")]
    while stack:
        module, skip_here, prefix = stack.pop()
        for name, child in module._modules.items():
            below = skip_here.get(name, _ALL)
            if child is None or below is None or name == "processor":  # processors: ``unsupported_reason``
                continue
            if name in _FUSED_LINEARS and hasattr(module, "fused_projections"):
                continue
            if fused is not None and child.__dict__.get("fused_projections"):
                fused.append(prefix + name)
            values = settings(child)
            found.append(type(child))
            found.extend(values)
            if paths is not None:
                paths.append((prefix + name, type(child), values))
            stack.append((child, below, prefix + name + "."))
    return tuple(found)


_ALL: dict = {}  # walk everything below
# The linears Diffusers' fuse_projections() adds to an attention module (and unfuse_projections() deletes)
_FUSED_LINEARS = frozenset({"to_qkv", "to_kv", "to_added_qkv", "to_added_kv"})


def diffusers_only_reason(block: nn.Module, inputs: Any, around: Sequence[nn.Module] = ()) -> str | None:
    """Why this call of ``block`` must run Diffusers' own forward eagerly (native math and compiled code
    would not compute what it does), or None. ``inputs``: the call's arguments (tensors nested in tuples,
    lists or dicts); ``around``: hooked submodules whose hooks the math runs around their part of it."""
    if block.training and _active_dropout(block):
        return "training mode with active dropout"
    hooked = hooked_submodule(block, around)
    if hooked is not None:
        return (
            f"hooks on {hooked} (e.g. a step cache, layerwise casting or offload of submodules, or a forward "
            "set on the module)"
        )
    return gradient_reason(block, inputs)


def gradient_reason(block: nn.Module, inputs: Any) -> str | None:
    """Why a gradient must flow through this call of ``block`` (to its weights or to its inputs), or None.
    Fused kernels and our attention op have no backward, so Diffusers' forward computes such a call."""
    if torch.is_grad_enabled():
        if any(p.requires_grad for p in block.parameters()):
            return "gradients enabled for parameters that require them"
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(inputs)):
            return "gradients enabled for inputs that require them"
    return None


def _active_dropout(block: nn.Module) -> bool:
    """A dropout that changes the output in training mode (Diffusers' DiTs build theirs with p = 0)."""
    return any(
        isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0 for m in block.modules()
    )


def modulation_sites(transformer: nn.Module) -> list[ModulationSite]:
    """Every native block's AdaLN projections in ``transformer``, in module order (the same on every rank)."""
    return [
        ModulationSite(
            f"{block.omni_name}.{name}",
            functools.partial(block._submodule, block.linears[name]),
            block.modulation_input,
        )
        for block in transformer.modules()
        if isinstance(block, NativeBlock)
        for name in block.modulations
        if name in block.linear_projections()  # some blocks of a class may have none (Z-Image's)
    ]


@dataclass
class SwappedBlocks:
    """The record of one ``swap_blocks``; ``undo`` puts every block back. Plain data, so a deep-copied
    pipeline's record points at the copied blocks and restoring the copy leaves the original alone."""

    transformer: nn.Module
    blocks: list[tuple[nn.Module, type, type]]  # (block, Diffusers class, native class)

    def undo(self) -> None:
        for block, diffusers_cls, native_cls in self.blocks:
            block.unpack()  # block by block: each packed storage may be freed before the next copies are made
            hook_chains.revert(block, diffusers_cls, native_cls)
            block.__class__ = diffusers_cls
            for name in ("omni_runtime", "omni_name", "omni_structure"):  # a swap stopped halfway set fewer
                vars(block).pop(name, None)
        vars(self.transformer).pop("_repeated_blocks", None)
        self.drop_moved()

    def drop_moved(self) -> None:
        """The transformer moved (``omni_accel.moves``) or is restored: its block classes' memos let go
        (made of a forward's inputs, not of the weights: at every move, the next forward makes them again)."""
        for memo in {memo for _, _, native_cls in self.blocks for memo in native_cls.memos}:
            memo.drop()


def native_blocks(transformer: nn.Module, model: NativeModel) -> list[nn.Module]:
    """Every repeated block ``model`` makes native, list by list, in order."""
    return [block for list_name in model.blocks for block in transformer.get_submodule(list_name)]


def swap_blocks(transformer: nn.Module, model: NativeModel, runtime: NativeRuntime) -> SwappedBlocks:
    """Makes every repeated block of ``transformer`` native (its projections are packed on first use)."""
    named: list[tuple[str, nn.Module, type, type]] = []
    for list_name, native_cls in model.blocks.items():
        diffusers_cls = native_cls.diffusers_class()
        _register_block_metadata(native_cls, diffusers_cls)
        for index, block in enumerate(transformer.get_submodule(list_name)):
            if type(block) is not diffusers_cls:
                raise TypeError(
                    f"{list_name} holds a {type(block).__name__}, expected {diffusers_cls.__name__}; "
                    "omni_accel makes only the blocks it knows native."
                )
            named.append((f"{list_name}.{index}", block, diffusers_cls, native_cls))
    swapped = SwappedBlocks(transformer, [])
    try:
        for name, block, diffusers_cls, native_cls in named:
            block.__class__ = native_cls
            swapped.blocks.append((block, diffusers_cls, native_cls))
            block.omni_runtime = runtime
            block.omni_name = name
            hook_chains.apply(block, diffusers_cls, native_cls)
            block.prepack()  # allocates the packed storage: may run out of memory halfway through the blocks
            block.omni_structure = block.structure()
        runtime.code = CodeWatch.of_blocks(
            [entry[1] for entry in named], lambda block: type(block).diffusers_class()
        )
        # Diffusers' compile_repeated_blocks() finds blocks by class name: point it at the native classes.
        object.__setattr__(transformer, "_repeated_blocks", [cls.__name__ for cls in model.blocks.values()])
    except BaseException:
        swapped.undo()  # no block is left native (a half-swapped transformer passes for an accelerated one)
        raise
    return swapped


_REGISTER_LOCK = threading.Lock()


def _register_block_metadata(native_cls: type, diffusers_cls: type) -> None:
    """Diffusers' step caches find blocks through this registry: give the native class the same entry."""
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry

    with _REGISTER_LOCK:
        try:
            TransformerBlockRegistry.get(native_cls)
            return
        except ValueError:
            pass
        try:
            known = TransformerBlockRegistry.get(diffusers_cls)
        except ValueError:
            return
        TransformerBlockRegistry.register(
            native_cls,
            TransformerBlockMetadata(
                return_hidden_states_index=known.return_hidden_states_index,
                return_encoder_hidden_states_index=known.return_encoder_hidden_states_index,
                hidden_states_argument_name=known.hidden_states_argument_name,
                encoder_hidden_states_argument_name=known.encoder_hidden_states_argument_name,
            ),
        )
