"""What ``describe(pipe)`` returns: a structured record with a readable ``str``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from . import kernel_builds
from .attention.selection import AttentionSelector
from .cache.projection import ExactProjectionCache
from .cuda_graphs import BlockGraphs, StepGraphs, block_graph_stats
from .forward_hooks import installed
from .layers.fp8_linears import MIN_FP8_ROWS
from .models.base import NativeRuntime
from .models.generic import GenericRuntime
from .parallel.cfg import GuidanceBranches
from .parallel.config import LayoutTuning
from .parallel.sequence import describe_ring, describe_ulysses
from .parallel.token_rows import describe_rows
from .parallel.vae import RowSplit


@dataclass
class ComponentReport:
    """One pipeline component: what was done to it and why."""

    name: str
    diffusers_class: str
    # "native", "generic", "routed" (each "... (shared)" where another pipeline set the module up),
    # "untouched", "replaced", "absent" or "patch-parallel"
    mode: str
    detail: str
    selector: AttentionSelector | None = None
    cache: ExactProjectionCache | None = None
    cfg: GuidanceBranches | None = None
    runtime: NativeRuntime | GenericRuntime | None = None
    graphs: StepGraphs | None = None
    block_graphs: list[BlockGraphs] = field(default_factory=list)  # for steps a hook keeps from one graph
    ulysses_group: Any = None  # the process group of a Ulysses layout's exchanges
    ring_group: Any = None  # the process group of a ring layout's K/V transfers
    tp_group: Any = None  # the TP group of a model whose tokens may be split over it between projections
    tuning: LayoutTuning | None = None  # how the layout's exchanges run
    layout: str = ""  # the parallel layout it runs under, and how it was chosen (empty: none)
    planned_attention: list[tuple[str, str, str, str]] = field(default_factory=list)
    not_accelerated: list[str] = field(default_factory=list)
    falls_back_on: str = ""  # what makes a native block run Diffusers' forward (shown once one did)
    adapted: list[str] = field(default_factory=list)  # where the model's own code was replaced, and how
    row_split: dict[str, nn.Module] = field(default_factory=dict)  # the VAE's coders split by rows, by name
    step_cache: str = ""  # the Diffusers step cache on the module when described (``step_cache_note``)
    # Other components that hold some of its native blocks and call them from their own forward, and how
    # those calls run (read when described).
    holders: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        layout = f"; {self.layout}" if self.layout else ""
        out = [f"{self.name} ({self.diffusers_class}): {self.mode} - {self._detail()}{layout}"]
        if self.selector is not None:
            config = self.selector.config
            out.append(f"  attention config: default={config.default!r}, per_role={dict(config.per_role)}")
            seen = self.selector.decisions()
            rows = seen or self.planned_attention
            label = "resolved" if seen else "planned (no call yet)"
            if not seen and self.runtime is not None and self.runtime.fallbacks:
                label = "planned (no block has run natively yet: see Diffusers' forward below)"
            for role, request, provider, reason in rows:
                out.append(f"  attention {label}: {role} [{request}] -> {provider} ({reason})")
            for (role, reason), count in sorted(self.selector.unrouted.items()):
                out.append(f"  attention left to Diffusers: {role}: {reason} ({count} calls)")
            for role, count in sorted(self.selector.served_without_mask.items()):
                out.append(
                    f"  attention {role}: key-padding mask served by dropping the padded keys, unmasked kernel "
                    f"({count} calls)"
                )
        if self.cache is not None:
            stats = self.cache.stats()
            if stats["hits"] + stats["misses"] + stats["bypasses"]:
                out.append(
                    "  exact projection cache: {hits} hits, {misses} misses, {bypasses} bypassed, {entries} "
                    "entries, {bytes_used} of {max_bytes} bytes".format(**stats)
                )
                for reason, count in sorted(self.cache.bypass_reasons.items()):
                    out.append(f"  exact projection cache: {count} calls bypassed it: {reason}")
                for reason, count in sorted(self.cache.stale.items()):
                    out.append(f"  exact projection cache: {count} stored outputs dropped: {reason}")
            else:
                why = ""
                if self.runtime is not None and self.runtime.fallbacks:
                    ran_natively = self.selector is not None and self.selector.decisions()
                    why = (
                        " (the blocks that ran natively did not consult it, and Diffusers' forward, which ran "
                        "the others, does not: see below)"
                        if ran_natively
                        else " (no block has run natively, and Diffusers' forward does not consult it: see below)"
                    )
                out.append(
                    f"  exact projection cache: on ({stats['max_bytes']} bytes), not consulted yet{why}"
                )
        if self.cfg is not None:
            out.append(f"  {self.cfg.describe()}")
        if self.ulysses_group is not None:
            out.append(f"  ulysses exchanges: {describe_ulysses(self.ulysses_group, self.tuning)}")
        if self.ring_group is not None:
            out.append(f"  ring transfers: {describe_ring(self.ring_group, self.tuning)}")
        if self.tp_group is not None:
            out.append(f"  tensor parallel tokens: {describe_rows(self.tp_group, self.tuning)}")
        stats = self.graphs.stats() if self.graphs is not None else None
        if stats is not None and not _happened(stats):
            out.append("  cuda graphs: on, no step captured yet")
        elif stats is not None:
            out.append(
                f"  cuda graphs: {stats['captures']} captured, {stats['replays']} replays, {stats['graphs']} kept"
                f" ({stats['early_replays']} launched before the module's state was read, "
                f"{stats['early_misses']} of them dropped: the module had changed)"
            )
            for reason, count in sorted(stats["eager"].items()):
                out.append(f"  cuda graphs: {count} calls ran eagerly ({reason})")
        building = kernel_builds.building()
        if stats is not None and building:
            out.append(f"  kernels being built in the background now: {', '.join(sorted(building))}")
        stats = block_graph_stats(self.block_graphs) if self.block_graphs else None
        if stats is not None and _happened(stats):
            out.append(
                f"  cuda graphs of the blocks, for hooked steps: {stats['captures']} captured, "
                f"{stats['replays']} replays, {stats['graphs']} kept, {stats['inputs_in_place']} arguments read "
                "where the block before wrote them (not copied in)"
            )
            for reason, count in sorted(stats["eager"].items()):
                out.append(f"  cuda graphs of the blocks: {count} block calls ran eagerly ({reason})")
        if self.runtime is not None:
            if self.runtime.compiler is not None:
                out.extend(f"  compiled: {line}" for line in self.runtime.compiler.summary())
            if isinstance(self.runtime, NativeRuntime) and self.runtime.modulation is not None:
                out.append(f"  modulation: {self.runtime.modulation.describe()}")
            fp8 = getattr(self.runtime, "fp8", None)
            if fp8 is not None:
                weight_only = (
                    "the AdaLN modulation projections"
                    if isinstance(self.runtime, NativeRuntime)
                    else f"calls of fewer than {MIN_FP8_ROWS} rows (per-sample modulation)"
                )
                out.append(
                    f"  fp8 (lossy): {fp8.copies} projection weights in e4m3 ({fp8.bytes_used} bytes beside "
                    f"the model's own), {fp8.quantized} quantizations; {weight_only} quantize their weight alone"
                )
                for reason, count in sorted(fp8.declined.items()):
                    out.append(f"  fp8: {count} projection calls kept bf16 ({reason})")
                for reason, count in sorted(fp8.kept.items()):
                    out.append(f"  fp8: {count} of {fp8.linears} linears compute as Diffusers' do ({reason})")
            for reason, count in sorted(self.runtime.fallbacks.items()):
                out.append(f"  block calls run by Diffusers' forward: {count} ({reason})")
            if self.runtime.fallbacks and self.falls_back_on:
                out.append(f"  what runs Diffusers' forward of a block: {self.falls_back_on}")
        for name, coder in self.row_split.items():  # read now: a hook added since runs a call whole
            split = installed(coder, RowSplit)
            if split is not None:
                out.extend(f"  {line}" for line in split.describe(name))
        if self.step_cache:
            out.append(f"  {self.step_cache}")
        out.extend(f"  {line}" for line in self.holders)
        out.extend(f"  adapted: {item}" for item in self.adapted)
        out.extend(f"  not accelerated: {item}" for item in self._not_accelerated())
        return out

    def _detail(self) -> str:
        """``detail``, its claims that the projections run in FP8 and that the blocks are compiled replaced by
        what happened where none is quantized or a compile failed."""
        parts = self.detail.split("; ")
        reasons = _fp8_unused(self.runtime)
        if reasons:
            truth = f"quantize='fp8' requested, none quantized: {' / '.join(reasons)}"
            parts = [truth if p.startswith(FP8_CLAIM) else p for p in parts]
        failed, every = _compile_failures(self.runtime)
        if failed:
            parts = [_compile_truth(p, failed, every) if COMPILE_CLAIM.match(p) else p for p in parts]
        return "; ".join(parts)

    def _not_accelerated(self) -> list[str]:
        """``not_accelerated``, the generic tier's note that Diffusers' own layers run compiled corrected
        where every compile failed."""
        if not _compile_failures(self.runtime)[1]:
            return self.not_accelerated
        return [
            item.replace(" (compiled)", " (not compiled: the compile failed)")
            for item in self.not_accelerated
        ]


def shared_mode(tier: str) -> str:
    """The mode of a transformer another pipeline (or another name of this one) set up: its tier, shared."""
    return f"{tier} (shared)"


FP8_CLAIM = "LOSSY: quantize='fp8'"  # how a planned detail says FP8 was asked (``api.plan`` writes it)
# How a planned detail says the repeated blocks compile (``api.plan`` writes it): "2 repeated blocks (A, B)
# compiled ..." in the generic tier, "repeated blocks compiled ..." in the native one.
COMPILE_CLAIM = re.compile(r"(\d+ )?repeated blocks (\([^)]*\) )?compiled\b")


def _compile_failures(runtime: NativeRuntime | GenericRuntime | None) -> tuple[dict[str, str], bool]:
    """The block functions of ``runtime`` whose compile failed, with the one-line reason, and whether that is
    every function compiled so far."""
    compiler = getattr(runtime, "compiler", None)
    if compiler is None:
        return {}, False
    failed = compiler.failures()
    return failed, bool(failed) and len(failed) == len(compiler.calls())


def _compile_truth(claim: str, failed: dict[str, str], every: bool) -> str:
    """``claim`` that the blocks are compiled, said as it went: which block functions failed and why."""
    reasons = " / ".join(f"{name}: {reason}" for name, reason in sorted(failed.items()))
    if every:
        blocks = COMPILE_CLAIM.match(claim).group(0).removesuffix("compiled")
        return f"{blocks}not compiled: the compile failed, so they run eagerly ({reasons})"
    return f"{claim}, except the blocks of a function whose compile failed, which run eagerly ({reasons})"


def _fp8_unused(runtime: NativeRuntime | GenericRuntime | None) -> list[str]:
    """Why no projection of ``runtime``'s transformer holds an e4m3 copy, where none does and that is known
    (the generic tier's linears decide at ``accelerate``; native blocks as they run): the reasons, else []."""
    fp8 = getattr(runtime, "fp8", None)
    if fp8 is None or fp8.copies:
        return []
    if fp8.linears:
        return sorted(fp8.kept) if sum(fp8.kept.values()) == fp8.linears else []
    return sorted({*runtime.fallbacks, *fp8.declined})


# Diffusers' step caches that reuse only what a step would compute alike (its docstring: "exact (lossless)").
_EXACT_STEP_CACHES = ("TextKVCacheConfig",)


def step_cache_note(module: nn.Module) -> str:
    """The step cache enabled on ``module`` by Diffusers' ``enable_cache`` (before or after accelerate), and
    whether it is lossy (steps reuse outputs of earlier ones); "" where none is."""
    config = getattr(module, "_cache_config", None)
    if config is None:
        return ""
    kind = type(config).__name__
    if kind in _EXACT_STEP_CACHES:
        return f"Diffusers step cache: {kind} (exact: reuses projections every step computes alike)"
    return f"Diffusers step cache (lossy): {kind}, steps reuse what earlier steps computed"


def _happened(stats: dict[str, Any]) -> bool:
    """Whether a CUDA graph counter moved: anything captured, replayed or run eagerly."""
    return bool(stats["captures"] or stats["replays"] or stats["eager"])


@dataclass
class AccelerationReport:
    pipeline_class: str
    components: list[ComponentReport]

    def __str__(self) -> str:
        lines = [f"omni_accel report for {self.pipeline_class}"]
        for component in self.components:
            lines.extend(component.lines())
        return "\n".join(lines)

    __repr__ = __str__  # a notebook cell ending in describe(pipe) shows the readable text
