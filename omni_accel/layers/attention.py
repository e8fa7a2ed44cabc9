"""The attention call native blocks make: provider resolution by role, around one kernel call.

``attention`` is where sequence parallelism plugs in: pre-communication -> provider kernel ->
post-communication. The provider never knows about the layout, and the model never knows the kernel: any
provider with the needed capability (the log-sum-exp, for ring attention) works under any layout.
``qkv_attention`` makes q, k and v (the fused q/k kernel) and attends over them, so that where a layout
wants its inputs in its exchange's buffers the kernel writes them there (eager or compiled);
``attention_beside`` runs independent work while the exchanges travel.

Which selector resolves the provider and which layout splits the sequence is the runtime of the native
forward in flight (``enter_forward``, bound around each native block call of an accelerated model), read
when the call runs, also inside compiled graphs: the graphs name no pipeline, so every model of a block
class shares them. A call made with ``split=False`` attends locally (cross attention over K/V every rank
holds whole, a refiner ahead of the split).
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from ..attention.key_padding import attend_kept, kept_keys
from ..attention.selection import AttentionSelector
from ..parallel.overlap import NOTHING, Overlap
from ..parallel.parallelize import Parallelized
from ..parallel.placement import Placement
from ..parallel.routed_attention import with_mask_column
from ..parallel.sequence import SequenceParallel
from .fused import Segment, qkv_norm_rope

T = TypeVar("T")
U = TypeVar("U")


class ForwardRuntime(Protocol):
    """What attention reads of the accelerated model whose forward is in flight."""

    selector: AttentionSelector
    layout: Parallelized | None


_IN_FLIGHT: contextvars.ContextVar[ForwardRuntime | None] = contextvars.ContextVar(
    "omni_accel_native_forward", default=None
)


# Runs a computation as the forward of one of a block's submodules, through that module's hooks (a step
# cache's: they compute it or predict its outputs): ``NativeBlock.attention_module_call``.
ModuleCall = Callable[[Callable[[], Any]], Any]


def through_module(call: ModuleCall | None, compute: Callable[[], Any]) -> Any:
    """``compute()``, the part of a block's math that one of its submodules' forward is, as that module's
    hooks return it where ``call`` runs it through them (None: computed here, as without hooks)."""
    return compute() if call is None else call(compute)


def enter_forward(runtime: ForwardRuntime) -> contextvars.Token:
    """Binds ``runtime`` to this thread's native attention calls until ``leave_forward``."""
    return _IN_FLIGHT.set(runtime)


def leave_forward(token: contextvars.Token) -> None:
    _IN_FLIGHT.reset(token)


def forward_in_flight() -> ForwardRuntime | None:
    """The runtime bound by ``enter_forward`` on this thread, or None."""
    return _IN_FLIGHT.get()


def _runtime() -> ForwardRuntime:
    runtime = _IN_FLIGHT.get()
    if runtime is None:
        raise RuntimeError(
            "native attention ran outside an accelerated forward (no runtime bound); this is a bug: report "
            "it with the traceback"
        )
    return runtime


def _sequence(split: bool) -> SequenceParallel | None:
    """The sequence layout of the forward in flight, where the call attends over the split sequence."""
    layout = _runtime().layout if split else None
    return None if layout is None or layout.sequence is None else layout.sequence.joint


def _attend(
    selector: AttentionSelector,
    role: str,
    category: str,
    scale: float,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    need_lse: bool = False,
    attn_mask: torch.Tensor | None = None,
):
    return selector.attend(
        role, category, query, key, value, attn_mask=attn_mask, scale=scale, return_lse=need_lse
    )


def _attend_in_layout(
    split: bool,
    role: str,
    category: str,
    scale: float,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    overlap: Overlap = NOTHING,
) -> tuple[torch.Tensor, object]:
    """The kernel call, wrapped in the sequence-parallel communication when the layout splits the sequence,
    and ``overlap``'s work's result (run while that communication travels: see ``attention_beside``)."""

    selector = _runtime().selector

    def attend(q, k, v, need_lse=False):
        return _attend(selector, role, category, scale, q, k, v, need_lse, attn_mask)

    sp = _sequence(split)
    if sp is not None and sp.degree > 1:
        if attn_mask is not None:  # a key mask: it travels with its keys (qkv_attention places nothing then)

            def attend_masked(q, k, v, mask, scale, need_lse):
                return _attend(selector, role, category, scale, q, k, v, need_lse, mask)

            attended = with_mask_column(sp, attend_masked, query, key, value, attn_mask, scale)
            return overlap.finish(attended, overlap.run_beside())
        return sp.attention_beside(query, key, value, attend, overlap)
    # A key-padding mask (native blocks pass one tensor per forward): the padded keys dropped, an unmasked
    # kernel; the dense mask while compiling or capturing, where the host cannot read it.
    kept = kept_keys(attn_mask, query.shape[0], key.shape[1], first_sight=True)
    if kept is not None:
        attended = attend_kept(query, key, value, kept, lambda q, k, v: _attend(
            selector, role, category, scale, q, k, v
        ))  # fmt: skip
        return overlap.finish(attended, overlap.run_beside())
    return overlap.finish(attend(query, key, value), overlap.run_beside())


@torch.library.custom_op("omni_accel::routed_attention", mutates_args=())
def _routed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    split: bool,
    role: str,
    category: str,
    scale: float,
    attn_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Provider resolution, the parallel layout's communication and the kernel call as one opaque op:
    inside a compiled graph the choice still follows the pipeline's config and any active
    ``attention_scope`` at run time, and the graph around it (norms, RoPE, projections) fuses without a
    break."""
    out, _ = _attend_in_layout(split, role, category, scale, query, key, value, attn_mask)
    # Contiguous, as the fake promises: the graph may view the output (the eager path copies it there anyway).
    return out.contiguous()


@_routed_attention.register_fake
def _(query, key, value, split, role, category, scale, attn_mask):
    return query.new_empty(*query.shape[:-1], value.shape[-1])


@dataclass(frozen=True)
class AttentionSite:
    """One attention call site of a native block: ``role`` names it (users target it in
    ``AttentionConfig.per_role``), ``category`` ("self" or "cross") is the fallback key. ``ring_merges``:
    under a ring layout its calls attend over the K/V blocks of the split sequence one after the other and
    merge them through the log-sum-exp, so its provider must return the LSE (checked at accelerate); False
    for a site over K/V every rank holds whole (cross attention, a refiner ahead of the split), or one whose
    calls may run one kernel over the gathered sequence (work beside it, on a ring of peer writes): its
    provider is checked at the call."""

    role: str
    category: str
    scale: float | None = None  # None: 1 / sqrt(head size)
    ring_merges: bool = True


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    site: AttentionSite,
    split: bool = False,
    attn_mask: torch.Tensor | None = None,
    placement: Placement | None = None,
) -> torch.Tensor:
    """Attention over BSHD tensors through the provider the forward's selector resolves for ``site``;
    ``split``: over the sequence the forward's layout splits (its communication wraps the kernel), else
    over what this rank holds. ``placement``: the q, k and v given are where ``input_placement`` asked
    them to be written."""
    scale = site.scale if site.scale is not None else 1 / math.sqrt(query.shape[-1])
    if torch.compiler.is_dynamo_compiling():
        return _routed_attention(query, key, value, split, site.role, site.category, scale, attn_mask)
    args = (split, site.role, site.category, scale, query, key, value, attn_mask)
    return _attend_in_layout(*args, overlap=NOTHING if placement is None else Overlap(placement=placement))[0]


def places_inputs() -> bool:
    """Whether attention under the forward's layout takes q, k and v written where its exchange wants them
    (``input_placement`` gives a placement: between the GPUs of one machine, a ring or Ulysses alone).
    There it also hides work run beside it (``attention_beside``) behind its exchanges: a ring's K/V then
    meet one kernel, Ulysses' peers' heads travel by the copy engine. Decided eagerly (it may map the peer
    buffers), so compiled code gets it as a constant."""
    sp = _sequence(True)
    return sp is not None and sp.places_inputs()


def input_placement(
    batch: int, heads: int, head_dim: int, dtype: torch.dtype, beside: bool = False
) -> Placement | None:
    """Where q, k and v (``[batch, this rank's tokens, heads, head_dim]``) should be written for attention
    under the forward's layout to take them without a copy (``qkv_norm_rope(placement=...)``), or None: anywhere.
    ``beside``: they go to ``attention_beside`` with work to hide the exchanges behind."""
    sp = None if torch.compiler.is_dynamo_compiling() else _sequence(True)
    if sp is None or sp.degree == 1:
        return None
    return sp.input_placement(batch, heads, head_dim, head_dim, dtype, beside)


def attention_beside(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    site: AttentionSite,
    work: Callable[[], T],
    placement: Placement | None = None,
    then: Callable[[T], U] | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, T | U]:
    """``(attention(..., split=True), work())`` for ``work`` that does not depend on the attention: under a
    layout that splits the sequence it runs once the exchanges are posted, while they travel (a ring's K/V blocks then
    meet one kernel over the whole sequence instead of two and a merge). ``then(work())``, when given, is
    work on its result that does not depend on the attention either: it runs after the kernel, while the
    outputs travel back (Ulysses by peer writes), and its result is returned instead. ``out``: where the
    output goes (``[B, tokens, heads, Dv]``, maybe columns of the next projection's input), written there by
    the exchange itself where it can. Compiled, the parts are traced apart and the compiler orders them."""
    overlap = Overlap(work, then, out, placement)
    if torch.compiler.is_dynamo_compiling():
        return overlap.finish(attention(query, key, value, site, split=True), overlap.run_beside())
    scale = site.scale if site.scale is not None else 1 / math.sqrt(query.shape[-1])
    args = (True, site.role, site.category, scale, query, key, value)
    return _attend_in_layout(*args, overlap=overlap)


def qkv_attention(
    segments: Sequence[Segment],
    weights: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]],
    head_dim: int,
    eps: float | None,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    site: AttentionSite,
    across_heads: bool = False,
    placed: bool = False,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``attention(*qkv_norm_rope(segments, weights, ...), site, split=True, attn_mask=attn_mask)``.
    ``placed`` (``places_inputs()``): q, k and v are written where the layout's exchange wants them;
    compiled, the two are then one opaque op, since a compiled graph cannot hand the q/k kernel a peer's
    buffer."""
    scale = site.scale if site.scale is not None else 1 / math.sqrt(head_dim)
    placed = placed and attn_mask is None  # the exchanges that take placed inputs take no mask
    if placed and rope is not None and torch.compiler.is_dynamo_compiling():
        qs, ks, vs = (list(t) for t in zip(*segments, strict=True))
        q_weights, k_weights = (list(w) for w in zip(*weights, strict=True))
        args = (qs, ks, vs, q_weights, k_weights, head_dim, eps, *rope, across_heads)
        return _placed_attention(*args, site.role, site.category, scale)
    placement = None
    if placed:
        first = segments[0][0]
        heads = first.shape[-1] // head_dim
        placement = input_placement(first.shape[0], heads, head_dim, first.dtype)
    q, k, v = qkv_norm_rope(segments, weights, head_dim, eps, rope, across_heads, placement)
    return attention(q, k, v, site, True, attn_mask, placement)


@torch.library.custom_op("omni_accel::placed_attention", mutates_args=())
def _placed_attention(
    qs: list[torch.Tensor],
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    q_weights: list[torch.Tensor | None],
    k_weights: list[torch.Tensor | None],
    head_dim: int,
    eps: float | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    across_heads: bool,
    role: str,
    category: str,
    scale: float,
) -> torch.Tensor:
    """``qkv_attention`` with its inputs placed, as one op in compiled graphs."""
    segments = list(zip(qs, ks, vs, strict=True))
    weights = list(zip(q_weights, k_weights, strict=True))
    site = AttentionSite(role, category, scale)
    out = qkv_attention(segments, weights, head_dim, eps, (cos, sin), site, across_heads, True)
    return out.contiguous()  # as the fake promises


@_placed_attention.register_fake
def _(qs, ks, vs, q_weights, k_weights, head_dim, *rest):
    first = qs[0]
    heads = first.shape[-1] // head_dim
    return first.new_empty(first.shape[0], sum(q.shape[1] for q in qs), heads, vs[0].shape[-1] // heads)
