"""``parallel="auto"``: a layout chosen for the model, the number of ranks and how the pipeline calls it.

The rules are the measured ones (docs/PARALLELISM.md, docs/PERFORMANCE.md), applied in this order:

1. CFG first. When the call runs both guidance branches (Wan's default ``guidance_scale=5``, FLUX's true CFG),
   ``cfg=2`` splits them over two ranks: one tensor exchanged per step (two H200s: 1.93x on FLUX true CFG,
   1.99x on Wan 14B).
2. Two remaining ranks take tensor parallelism for image models (FLUX 1024x1024 on two H200s, steps replayed
   from CUDA graphs: tp 82.2 ms, ulysses 90.2, ring 92.6 against 132.4 on one GPU), and Ulysses for models
   whose sequences are long (``ParallelPlan.sequence_first``: Wan's 32k-token videos, 1.72x against tp's
   1.59x; ring's 1.76x is within 2 % and its merge rounds differently, while Ulysses was bitwise one GPU).
3. More remaining ranks take Ulysses up to the largest degree that divides the heads, and ring for the
   rest (not yet measured beyond two ranks: issue 12).

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
    world_size: int, heads: int, cfg_by_default: bool, sequence_plan: bool, sequence_first: bool = False
) -> AutoLayout:
    """The layout for ``world_size`` ranks of a model with ``heads`` attention heads (see module doc)."""
    if world_size == 1:
        return AutoLayout(None, "one rank: nothing to spread")
    cfg = 2 if cfg_by_default and world_size % 2 == 0 else 1
    rest = world_size // cfg
    why = [f"cfg={cfg}: the call runs both guidance branches"] if cfg == 2 else []
    if rest == 1:
        return AutoLayout(ParallelConfig(cfg=cfg), "; ".join(why))
    if ((rest == 2 and not sequence_first) or not sequence_plan) and heads % rest == 0:
        why.append(f"tp={rest}: the fastest layout measured on two ranks" if rest == 2 else f"tp={rest}")
        return AutoLayout(ParallelConfig(tp=rest, cfg=cfg), "; ".join(why))
    if not sequence_plan:
        raise ValueError(
            f"parallel='auto' cannot spread this model over {world_size} ranks: it has no sequence plan and "
            f"its {heads} heads do not split {rest} ways. Launch a number of ranks that divides {heads}."
        )
    ulysses = max(d for d in range(1, rest + 1) if rest % d == 0 and heads % d == 0)
    ring = rest // ulysses
    if rest == 2:
        why.append(f"ulysses={ulysses}, ring={ring}: long sequences split faster than tensor parallelism")
    else:
        why.append(
            f"ulysses={ulysses}, ring={ring}: Ulysses up to the largest degree dividing the {heads} heads, "
            "ring for the rest (not yet measured beyond two ranks)"
        )
    return AutoLayout(ParallelConfig(ulysses=ulysses, ring=ring, cfg=cfg), "; ".join(why))
