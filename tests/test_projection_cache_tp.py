"""Under tensor parallelism a hit is taken only when every rank hits, so collectives never deadlock."""

import pytest
import torch
import torch.distributed as dist
from multirank import run_multirank

from omni_accel.cache import ExactProjectionCache


def _body(rank: int, world: int) -> None:
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    consulted = []

    class Precomputed(ExactProjectionCache):
        def _lookup_precomputed(self, name, module, conditioning):
            consulted.append(name)  # an offline artifact is not coordinated across ranks: never under TP
            return None

    cache = Precomputed(tp_group=dist.group.WORLD)
    computed = []

    def compute(cond):
        computed.append(1)
        out = lin(cond)
        dist.all_reduce(out)  # a collective inside compute: a one-sided hit would hang the other rank
        return out

    def step(value):
        cond = torch.full((2, 8), value)
        cache.prepare(cond)
        return cache.project("p", lin, cond, lambda: compute(cond))

    def expected(value):
        out = lin(torch.full((2, 8), value))
        dist.all_reduce(out)
        return out

    for value in (1.0, 2.0):  # first request: misses everywhere
        step(value)
    assert cache.hits == 0 and len(computed) == 2
    for value in (1.0, 2.0):  # second request: hits everywhere
        assert torch.equal(step(value), expected(value))
    assert cache.hits == 2 and len(computed) == 2

    if rank == 1:  # one rank forgets everything
        cache.clear()
    assert torch.equal(step(1.0), expected(1.0))
    assert len(computed) == 3, "every rank must recompute when one rank missed"
    assert torch.equal(step(1.0), expected(1.0)) and len(computed) == 3  # back in sync: hit everywhere

    if rank == 0:  # one rank edits a weight in place (a test-only divergence; outputs now differ by rank)
        lin.weight.add_(0.0)  # same values, new version: still must recompute
    assert torch.equal(step(1.0), expected(1.0))
    assert len(computed) == 4, "a weight change on one rank must make every rank recompute"

    # the weight change also invalidated the other conditioning's entry on rank 0: recomputed everywhere
    assert torch.equal(step(2.0), expected(2.0))
    assert len(computed) == 5
    before = cache.hits
    for value in (1.0, 2.0):
        assert torch.equal(step(value), expected(value))
    assert cache.hits == before + 2 and len(computed) == 5
    assert not consulted


@pytest.mark.multirank
def test_tp_hits_are_unanimous():
    run_multirank(_body, 2)
