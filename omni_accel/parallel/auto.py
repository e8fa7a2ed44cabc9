"""``parallel="auto"``: a layout chosen for the model, the number of ranks and how the pipeline calls it.

The rules are the measured ones (docs/PARALLELISM.md, docs/archive/performance-history.md), applied in this order:

1. CFG first. When the call runs both guidance branches (Wan's default ``guidance_scale=5``, FLUX's true CFG),
   ``cfg=2`` splits them over two ranks: one tensor exchanged per step, the fastest layout on two GPUs
   for such calls (docs/PERFORMANCE.md).
2. The remaining ranks split the sequence: Ulysses up to the largest degree that divides the heads, ring
   for the rest; on two ranks whose K/V can travel by peer writes, ring for a model whose plan says
   ``ring_first`` (FLUX: its single blocks' MLP GEMM runs beside the K/V transfer). On two GPUs these are
   the fastest measured for FLUX and Wan (docs/PERFORMANCE.md, docs/PARALLELISM.md); beyond two ranks
   the rule is not measured yet.
3. A model without a sequence plan takes tensor parallelism, when its heads split.

A model without native blocks (or with ``native=False``) is spread by what it declares to Diffusers
(``choose_generic_layout``): rules 1 and 2 where its ``_cp_plan`` splits its sequence; without one, its
guidance branches alone (cfg=2 on two ranks). Whether a call runs both branches is its pipelines' rule
(``ModelSpec.cfg_pairing``: two calls a step; ``ModelSpec.batched_guidance``: one call holding both).

``accelerate`` makes the native swap at once and decides the layout at the pipeline's first call, from that
call's arguments (FLUX with ``true_cfg_scale`` and a negative prompt runs both branches; Wan does by
default); later calls keep it, and run correctly on it whatever their arguments. Transformer calls made
directly before the first pipeline call run whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ParallelConfig


@dataclass(frozen=True)
class AutoLayout:
    config: ParallelConfig | None  # None: one rank, nothing to spread
    reason: str


def choose_layout(
    world_size: int, heads: int, cfg_by_default: bool, sequence_plan: bool, ring_first: bool = False
) -> AutoLayout:
    """The layout for ``world_size`` ranks of a model with ``heads`` attention heads (see module doc);
    ``ring_first``: the model's plan says so and the ranks can write each other's memory."""
    if world_size == 1:
        return AutoLayout(None, "one rank: nothing to spread")
    cfg = 2 if cfg_by_default and world_size % 2 == 0 else 1
    rest = world_size // cfg
    why = [f"cfg={cfg}: the call runs both guidance branches"] if cfg == 2 else []
    if rest == 1:
        return AutoLayout(ParallelConfig(cfg=cfg), "; ".join(why))
    if not sequence_plan:
        if heads % rest:
            raise ValueError(
                f"parallel='auto' cannot spread this model over {world_size} ranks: it has no sequence plan "
                f"and its {heads} heads do not split {rest} ways. Launch a number of ranks that divides {heads}."
            )
        why.append(f"tp={rest}: no sequence plan, so the heads are split")
        return AutoLayout(ParallelConfig(tp=rest, cfg=cfg), "; ".join(why))
    if ring_first and rest == 2:
        why.append(
            "ring=2: for this model a ring whose K/V travel by peer writes is measured faster than Ulysses "
            "on two ranks"
        )
        return AutoLayout(ParallelConfig(ring=2, cfg=cfg), "; ".join(why))
    ulysses = max(d for d in range(1, rest + 1) if rest % d == 0 and heads % d == 0)
    ring = rest // ulysses
    measured = "the fastest measured on two ranks" if rest == 2 else "not yet measured beyond two ranks"
    why.append(
        f"ulysses={ulysses}, ring={ring}: Ulysses up to the largest degree dividing the {heads} heads, "
        f"ring for the rest ({measured})"
    )
    return AutoLayout(ParallelConfig(ulysses=ulysses, ring=ring, cfg=cfg), "; ".join(why))


def choose_generic_layout(
    world_size: int, heads: int, name: str, guidance: bool, sequence_plan: bool
) -> AutoLayout:
    """The layout for ``name``, a model without native blocks, over ``world_size`` (> 1) ranks: rules 1 and 2
    where its ``_cp_plan`` splits its sequence (``sequence_plan``); without one, one guidance branch per
    rank, which takes two ranks and a call that runs both (``guidance``). Never tp: every Diffusers
    ``_tp_plan`` comes with a ``_cp_plan``, and the generic tier's tp is not measured."""
    if sequence_plan:
        return choose_layout(world_size, heads, cfg_by_default=guidance, sequence_plan=True)
    alone = (
        f"parallel='auto' spreads {name} by its guidance branches alone, one per rank (cfg=2: it has no native "
        "blocks and no Diffusers _cp_plan to split its sequence)"
    )
    if world_size != 2:
        raise ValueError(
            f"{alone}, which takes 2 ranks, and {world_size} were started; launch 2 "
            "(torchrun --nproc-per-node 2), or run it on one rank."
        )
    if not guidance:
        raise ValueError(
            f"{alone}, and this first pipeline call runs no classifier-free guidance; make the first call a "
            "guided one (the layout is chosen there and kept), or run the pipeline on one rank."
        )
    return AutoLayout(
        ParallelConfig(cfg=2),
        "cfg=2: the call runs both guidance branches (no _cp_plan: its sequence cannot be split)",
    )
