"""``ParallelConfig``: how the transformer is spread over the ranks torchrun started."""

from __future__ import annotations

from dataclasses import dataclass

_DEGREES = ("tp", "ulysses", "ring", "cfg")


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of tensor (``tp``), sequence (``ulysses`` all-to-all, ``ring`` K/V rotation) and CFG-branch
    (``cfg``) parallelism. Their product must equal the world size. ``timeout_s`` bounds every collective,
    so a dead rank ends in an error instead of a hang. ``batch_guidance``: with ``cfg=1`` under tp, ulysses
    or ring, a pipeline that calls the transformer once per guidance branch gets each step's two calls run
    as one call of both branches stacked along the batch (faster per step; twice the activation memory of
    one call; see ``omni_accel.parallel.cfg``)."""

    tp: int = 1
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1
    timeout_s: float = 600.0
    batch_guidance: bool = True

    def __post_init__(self) -> None:
        for name in _DEGREES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive int, got {value!r}.")
        if self.cfg > 2:
            raise ValueError(f"cfg={self.cfg}: classifier-free guidance has two branches, so cfg is 1 or 2.")
        if not self.timeout_s > 0:
            raise ValueError(f"ParallelConfig.timeout_s must be > 0, got {self.timeout_s!r}.")
        if not isinstance(self.batch_guidance, bool):
            raise ValueError(
                f"ParallelConfig.batch_guidance must be True or False, got {self.batch_guidance!r}."
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
        return f"ParallelConfig({degrees}{'' if self.batch_guidance else ', batch_guidance=False'})"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
