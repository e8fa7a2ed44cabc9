"""Variants of a layout for A/B runs in one launch: ``ulysses2+three_stages`` is ``ulysses2`` with one of
the library's choices changed while that layout is built and timed (suffixes combine). Benchmarks only.

    three_stages      Ulysses attention in three head stages (a quarter, a half, a quarter) instead of two
    four_stages       Ulysses attention in four equal head stages
    one_stage         Ulysses attention in one stage (every head's transfers, then the kernel)
    nccl_exchange     Ulysses' exchanges by NCCL's all-to-all, not by peer writes (tensor parallelism then
                      keeps every token on every rank, as it does without peer writes)
    replicated_tokens tensor parallelism with every token on every rank (all-reduces after the row-split
                      projections, the norms and gates on every token), as before the token split
    unstacked         a CFG pipeline's two calls per step run one after the other, not stacked in one batch
                      (``ParallelConfig.batch_guidance=False``)
    nothing_beside    FLUX's single blocks keep QKV and the MLP input in one GEMM, with no work beside the
                      exchanges (a ring by peer writes then attends the local block first everywhere)
    one_kernel        a ring by peer writes always waits for every block and runs one kernel, also where
                      no work runs beside the transfer (FLUX's double blocks, Wan)
    copied_gathers    tensor parallelism's gathers copy the norm-modulate's output into every rank's
                      buffer, as before that kernel wrote its rows there itself
    packed_inputs     Ulysses by peer writes packs and sends q, k and v in two head stages and FLUX's
                      single blocks keep one GEMM, as before the q/k kernel wrote each head group into
                      its rank's buffer itself (for a Ulysses layout only: it changes the ring's blocks too)
    one_placed_stage  Ulysses with placed inputs in one kernel over all a rank's heads at every length, as
                      before long sequences (Wan 14B) ran two head stages, the second's heads sent by the
                      copy engine beside the first's kernel
    streams_apart     tensor parallelism's exchanges in FLUX's double blocks one stream at a time (a barrier
                      each, no transfer beside the other stream's GEMMs), as before image and text ended
                      theirs together
    returned_apart    Ulysses by peer writes returns the outputs by the SM copy into a tensor of their own,
                      copied into the output projection's input after, and FLUX's single blocks run their
                      GELU after that, as before the GELU ran beside the outputs' copy-engine return
    modulation_per_block  each block computes its own AdaLN modulation, as before every block's was
                      computed at once, split over the ranks: whole on every rank under Ulysses and the
                      ring, its tensor-parallel slice all-gathered block by block under tp
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import omni_accel.layers.fused as fused
import omni_accel.models.flux as flux
import omni_accel.parallel.peer_exchange as peer_exchange
import omni_accel.parallel.sequence as sequence
from omni_accel import ParallelConfig
from omni_accel.layers.projection import apply_one, read_linear
from omni_accel.layers.split_modulation import SplitModulation
from omni_accel.parallel.sequence_hooks import SequenceState
from omni_accel.parallel.tensor import shard_of

# The module, not the function ``omni_accel.parallel`` exports under the same name.
parallelize = importlib.import_module("omni_accel.parallel.parallelize")


@contextlib.contextmanager
def _patched(module, name: str, value) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def _both(*contexts: contextlib.AbstractContextManager) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def _stages_of(counts_for):
    """A ``head_stages`` that splits the heads by ``counts_for(heads, degree)``, or as the library does
    where that returns None."""
    original = sequence.head_stages

    def stages(heads: int, degree: int) -> list[tuple[int, int]]:
        counts = counts_for(heads, degree)
        if counts is None:
            return original(heads, degree)
        return [(sum(counts[:i]), count) for i, count in enumerate(counts)]

    return stages


def _three(heads: int, degree: int) -> list[int] | None:
    quarter = heads // 4 // degree * degree
    return None if degree == 1 or quarter < degree else [quarter, heads - 2 * quarter, quarter]


def _four(heads: int, degree: int) -> list[int] | None:
    return None if heads < 4 * degree else sequence.split_sizes(heads, 4)


def _one_kernel(original):
    def ring(peers, q, k, v, kv_sizes, attend, beside=None):
        return original(peers, q, k, v, kv_sizes, attend, beside or (lambda: None))

    return ring


def _one_at_a_time(together):
    def apart(items, *args):
        return [out for item in items for out in together([item], *args)]

    return apart


def _streams_apart() -> contextlib.AbstractContextManager:
    names = ("norm_modulate_gathered_together", "apply_together", "feed_forwards_together")
    return _both(*(_patched(flux, name, _one_at_a_time(getattr(flux, name))) for name in names))


def _returned_apart(original):
    def placed(peers, placement, sizes, stages, attend, beside, then=None, out=None):
        return sequence.finish(*original(peers, placement, sizes, stages, attend, beside), then, out)

    return placed


def _modulation_per_block(self, key, conditioning):
    site = next(site for site in self.sites if site.key == key)
    if shard_of(site.module()) is not None:
        return self.project_sites([site], conditioning)[key]
    return apply_one(site.input(conditioning), read_linear(site.module(), key))


VARIANTS = {
    "three_stages": lambda: _patched(sequence, "head_stages", _stages_of(_three)),
    "four_stages": lambda: _patched(sequence, "head_stages", _stages_of(_four)),
    "one_stage": lambda: _patched(sequence, "head_stages", lambda heads, degree: [(0, heads)]),
    "nccl_exchange": lambda: _patched(peer_exchange, "ENABLED", False),
    "replicated_tokens": lambda: _patched(
        parallelize, "SequenceState", lambda ulysses, ring, tp: SequenceState(ulysses, ring)
    ),
    "unstacked": lambda: _patched(ParallelConfig, "stacks_guidance", property(lambda self: False)),
    "nothing_beside": lambda: _patched(flux, "overlaps_work", lambda layout: False),
    "copied_gathers": lambda: _patched(fused, "gather_targets", lambda x, rows: None),
    "packed_inputs": lambda: _both(
        _patched(sequence, "ulysses_placement", lambda *args: None),
        _patched(flux, "overlaps_work", lambda layout: False),
    ),
    "one_placed_stage": lambda: _patched(sequence, "PLACED_STAGES_FROM", float("inf")),
    "streams_apart": _streams_apart,
    "returned_apart": lambda: _patched(
        sequence, "ulysses_in_place", _returned_apart(sequence.ulysses_in_place)
    ),
    "modulation_per_block": lambda: _patched(SplitModulation, "project", _modulation_per_block),
    "one_kernel": lambda: _patched(
        sequence, "ring_by_peer_writes", _one_kernel(sequence.ring_by_peer_writes)
    ),
}


def split(name: str) -> tuple[str, contextlib.AbstractContextManager]:
    """``"ulysses2+three_stages"`` -> ``("ulysses2", the variant's context)``; several suffixes combine
    (``"ulysses2+unstacked+packed_inputs"``); no suffix, no change."""
    base, *variants = name.split("+")
    return base, _both(*(VARIANTS[variant]() for variant in variants))
