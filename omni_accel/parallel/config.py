"""``ParallelConfig``: how the transformer is spread over the ranks torchrun started."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

_DEGREES = ("tp", "ulysses", "ring", "cfg")
PEER_WRITES_SWITCH = "OMNI_ACCEL_PEER_WRITES"
"""``0`` in the environment: ``LayoutTuning.peer_writes`` defaults to False (a debugging aid: rules the peer
writes out without a code change)."""


def _peer_writes_by_default() -> bool:
    return os.environ.get(PEER_WRITES_SWITCH, "1") != "0"


@dataclass(frozen=True)
class LayoutTuning:
    """How a layout moves its tensors between the ranks. The defaults are what measurement chose on one
    machine's H200s (docs/PARALLELISM.md); every choice is exact either way, so an A/B is two
    ``ParallelConfig``s differing only here, in one launch.

    ``peer_writes``: between the GPUs of one machine, exchanges are peer writes into symmetric memory
    (False: the NCCL collectives everywhere; the default follows ``OMNI_ACCEL_PEER_WRITES``).
    ``place_inputs``: native blocks' q/k kernel writes q, k and v where the exchange sends them from (the
    peers' buffers), so attention needs no packing copy (False: the exchange packs them).
    ``split_tokens``: under tp, each rank norms and modulates its share of the tokens between the
    projections where the token exchanges pay (peer writes, or gloo), instead of every rank every token.
    ``head_stages``: Ulysses' exchanges pipelined over this many head stages, one stage's transfers beside
    another's kernel (fewer where the heads do not give every rank one per stage; 1: no pipelining).
    ``placed_stages_from``: with inputs placed by the q/k kernel, sequences at least this long run
    ``head_stages`` kernels, shorter ones one kernel over all a rank's heads (a kernel over fewer heads
    loses efficiency on short sequences)."""

    peer_writes: bool = field(default_factory=_peer_writes_by_default)
    place_inputs: bool = True
    split_tokens: bool = True
    head_stages: int = 2
    placed_stages_from: int = 16384

    def __post_init__(self) -> None:
        for name in ("peer_writes", "place_inputs", "split_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LayoutTuning.{name} must be True or False, got {getattr(self, name)!r}.")
        for name in ("head_stages", "placed_stages_from"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LayoutTuning.{name} must be a positive int, got {value!r}.")


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of tensor (``tp``), sequence (``ulysses`` all-to-all, ``ring`` K/V rotation) and CFG-branch
    (``cfg``) parallelism. Their product must equal the world size. ``timeout_s`` bounds every collective,
    so a dead rank ends in an error instead of a hang. ``batch_guidance``: with ``cfg=1`` under tp, ulysses
    or ring, a pipeline that calls the transformer once per guidance branch gets each step's two calls run
    as one call of both branches stacked along the batch (faster per step; twice the activation memory of
    one call; see ``omni_accel.parallel.cfg``). ``tuning``: how the exchanges run (``LayoutTuning``)."""

    tp: int = 1
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1
    timeout_s: float = 600.0
    batch_guidance: bool = True
    tuning: LayoutTuning = field(default_factory=LayoutTuning)

    def __post_init__(self) -> None:
        for name in _DEGREES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive int, got {value!r}.")
        if self.cfg > 2:
            raise ValueError(f"cfg={self.cfg}: classifier-free guidance has two branches, so cfg is 1 or 2.")
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
            raise ValueError(
                f"ParallelConfig.timeout_s must be a finite number of seconds > 0, got {self.timeout_s!r}."
            )
        if not isinstance(self.batch_guidance, bool):
            raise ValueError(
                f"ParallelConfig.batch_guidance must be True or False, got {self.batch_guidance!r}."
            )
        if not isinstance(self.tuning, LayoutTuning):
            raise ValueError(f"ParallelConfig.tuning must be a LayoutTuning, got {self.tuning!r}.")
        if not self.batch_guidance and (self.cfg > 1 or self.tp * self.sequence_parallel == 1):
            raise ValueError(
                f"{self}: batch_guidance=False turns off the stacking of a step's two guidance calls that only a "
                "layout with cfg=1 and tp, ulysses or ring above 1 does, so here it would change nothing; leave "
                "batch_guidance out (with cfg=2 the two branches run on two ranks)."
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.ulysses * self.ring * self.cfg

    @property
    def sequence_parallel(self) -> int:
        return self.ulysses * self.ring

    @property
    def stacks_guidance(self) -> bool:
        """Whether pairable guidance calls run as one stacked call (see ``batch_guidance``)."""
        return self.batch_guidance and self.cfg == 1 and self.tp * self.sequence_parallel > 1

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            fits = [
                f"tp={t}, ulysses={u}, ring={r}, cfg={c}"
                for c in (1, 2)
                for t in _divisors(world_size // c if world_size % c == 0 else 0)
                for u in _divisors(world_size // (c * t))
                for r in [world_size // (c * t * u)]
                if c * t * u * r == world_size
            ][:6]
            raise ValueError(
                f"{self} spans {self.world_size} ranks, but {world_size} were started. "
                f"Configurations that fit {world_size} ranks include: {'; '.join(fits)}."
            )

    def __str__(self) -> str:
        degrees = f"tp={self.tp}, ulysses={self.ulysses}, ring={self.ring}, cfg={self.cfg}"
        stacking = "" if self.batch_guidance else ", batch_guidance=False"
        tuning = "" if self.tuning == LayoutTuning() else f", tuning={self.tuning}"
        return f"ParallelConfig({degrees}{stacking}{tuning})"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
