"""Sequence-parallel attention against single-process full attention.

Spawning a rank costs seconds of imports, so each world size is spawned once and runs every check for that
size; a check that fails reports its traceback and the rest still run.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import queue
import time
import traceback
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from omni_accel.attention.merge import merge_partials
from omni_accel.attention.providers.sdpa import SdpaMathProvider
from omni_accel.parallel import peer_memory
from omni_accel.parallel.config import LayoutTuning, ParallelConfig
from omni_accel.parallel.mesh import init_parallel
from omni_accel.parallel.overlap import Overlap
from omni_accel.parallel.peer_memory import PeerBuffers
from omni_accel.parallel.sequence import (
    SequenceParallel,
    gather,
    shard,
    split_sizes,
)
from omni_accel.parallel.token_rows import (
    Rows,
    gather_rows,
    gather_targets,
    gathered_together,
    start_sum,
    sum_rows,
    sum_together,
)

PROVIDER = SdpaMathProvider()
TOLERANCE = 1e-5
DEFAULT_GROUP_TIMEOUT_S = 60  # what the workers start their default group with


def attend(q, k, v, need_lse):
    return PROVIDER.forward(q, k, v, return_lse=need_lse)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def make_inputs(seed: int, q_len: int, kv_len: int, heads: int, v_dim: int, batch: int = 2, dim: int = 8):
    """The same full tensors on every rank: each then takes its own shard."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_len, heads, dim, generator=g)
    k = torch.randn(batch, kv_len, heads, dim, generator=g) * 2  # sharper softmax: merge errors show
    v = torch.randn(batch, kv_len, heads, v_dim, generator=g)
    return q, k, v


def check_attention(
    groups: dict,
    *,
    q_len: int,
    heads: int,
    kv_len: int | None = None,
    v_dim: int = 8,
    batch: int = 2,
    beside: bool = False,
    placed: bool = False,
    tuning: LayoutTuning | None = None,
) -> None:
    """Against one process; ``beside``: through ``attention_beside`` with work that must run exactly once
    and come back, work on its result after the kernel and the output written into given columns (the ring
    by peer writes then attends with one kernel instead of two and a merge);
    ``placed``: q, k and v written where the layout's ``input_placement`` asks, as a block's kernel does
    (with work beside, Ulysses' peers' heads staged for the copy engine)."""
    q, k, v = make_inputs(q_len * 100 + heads, q_len, kv_len or q_len, heads, v_dim, batch)
    want = PROVIDER.forward(q, k, v)
    sp = SequenceParallel.plan(q_len, kv_length=kv_len, **groups, tuning=tuning)
    local = (sp.shard(q), sp.shard(k, kv=True), sp.shard(v, kv=True))
    placement = sp.input_placement(batch, heads, q.shape[-1], v_dim, q.dtype, beside) if placed else None
    if placed:
        assert placement is not None, "no placement where peer writes serve"
        local = placement.place(*local)
    local_q = sp.shard(q)
    if beside:  # and work on its result beside the outputs' return, which go into a wider tensor's columns
        runs, width = [], heads * v_dim
        wide = torch.zeros(*local_q.shape[:2], width + 3)
        into = wide[..., :width].unflatten(-1, (heads, v_dim))
        work = Overlap(lambda: runs.append(1) or "done", lambda d: f"{d}, then", into, placement)
        out, done = sp.attention_beside(*local, attend, work)
        assert (runs, done) == ([1], "done, then")
        assert out.data_ptr() == wide.data_ptr() and not wide[..., width:].any()
    else:
        out = sp.attention_beside(*local, attend, Overlap(placement=placement))[0]
    assert out.shape == (*local_q.shape[:3], v_dim)
    err = rel_err(sp.gather(out), want)
    assert err <= TOLERANCE, f"relative error {err:.2e}"


@contextlib.contextmanager
def peer_writes_over_files(directory: str):
    """Exchanges by peer writes, each rank's buffers shared files every rank maps: on CPU, the same writes
    into peers' memory and barriers the GPUs' symmetric memory carries. Every group's transport is decided
    anew inside (and again after)."""
    made, original = {}, peer_memory._try_peer_buffers

    def file_backed(group):
        if group.group_name not in made:
            made[group.group_name] = _file_backed_peers(group, directory)
        return made[group.group_name]

    peer_memory.forget_groups()
    peer_memory._try_peer_buffers = file_backed
    try:
        yield made
    finally:
        peer_memory._try_peer_buffers = original
        peer_memory.forget_groups()


def _file_backed_peers(group, directory: str) -> PeerBuffers:
    rank, world, slots = dist.get_rank(group), dist.get_world_size(group), itertools.count()

    def allocate(numel: int, dtype: torch.dtype):
        slot = next(slots)
        paths = [os.path.join(directory, f"{group.group_name}-{slot}-{r}") for r in range(world)]
        with open(paths[rank], "wb") as file:
            file.truncate(numel * dtype.itemsize)
        dist.barrier(group=group)
        buffers = [torch.from_file(path, shared=True, size=numel, dtype=dtype) for path in paths]
        return buffers, lambda channel: dist.barrier(group=group)

    return PeerBuffers(rank, world, allocate)


def check_peer_writes(groups: dict, directory: str, placed: bool = True, **case) -> None:
    """Ulysses and ring by peer writes on ``case``, then on a longer sequence (the buffers grow), with and
    without work beside the exchanges, with inputs sent by the layout and (``placed``, where one group
    splits the sequence) written in place by their producer, Ulysses' in one kernel and in head stages."""
    staged = LayoutTuning(placed_stages_from=1)  # placed in head stages, as at Wan 14B's length
    ways = [(False, LayoutTuning())] + ([(True, LayoutTuning()), (True, staged)] if placed else [])
    with peer_writes_over_files(directory) as made:
        for beside, (in_place, tuning) in itertools.product((False, True), ways):
            check_attention(groups, beside=beside, placed=in_place, tuning=tuning, **case)
            longer = {**case, "q_len": case["q_len"] + 3}
            check_attention(groups, beside=beside, placed=in_place, tuning=tuning, **longer)
    assert made, "the peer-write path was not taken"


def check_shard_gather(group, length: int) -> None:
    x = torch.arange(2 * length * 3, dtype=torch.float32).view(2, length, 3)
    sizes = split_sizes(length, dist.get_world_size(group))
    local = shard(x, 1, group)
    assert local.shape[1] == sizes[dist.get_rank(group)]
    assert torch.equal(gather(local, 1, group, sizes), x)


def check_token_rows(group, lengths: tuple[int, ...], batch: int, directory: str | None = None) -> None:
    """Tensor parallelism's token exchanges for a tensor of segments of ``lengths`` tokens (each split over
    ``group``): the gather gives the full tensor, the sum each rank's tokens of every rank's partial sums
    added in rank order (bitwise); by peer writes over files when ``directory`` is given."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    rows = Rows(f"case{len(lengths)}", group.group_name, tuple(tuple(split_sizes(n, world)) for n in lengths))
    full = torch.randn(batch, sum(lengths), 3, 4, generator=torch.Generator().manual_seed(0))
    segments = full.split(list(lengths), dim=1)

    def local(t: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [
                shard(part, 1, group, sizes)
                for part, sizes in zip(t.split(list(lengths), 1), rows.sizes, strict=True)
            ],
            dim=1,
        )

    partials = [torch.randn(full.shape, generator=torch.Generator().manual_seed(1 + r)) for r in range(world)]
    expected = partials[0] + partials[1]
    for partial_sum in partials[2:]:
        expected += partial_sum
    other = Rows("other", rows.group, rows.sizes)  # a second stream's exchanges, ended with the first's
    with peer_writes_over_files(directory) if directory else contextlib.nullcontext() as made:
        for _ in range(2):  # a second round reuses the buffers
            assert torch.equal(gather_rows(local(full), rows), torch.cat(segments, dim=1))
            assert torch.equal(sum_rows(partials[me], rows), local(expected))
            # the first stream's sends by the copy engine, one barrier for both (by peer writes)
            started = [start_sum(partials[me], rows, beside=True), start_sum(2 * partials[me], other)]
            first, second = sum_together(started)
            assert torch.equal(first, local(expected)) and torch.equal(second, local(2 * expected))
            targets = [gather_targets(local(t), r) for t, r in ((full, rows), (2 * full, other))]
            if directory:
                for target, t in zip(targets, (full, 2 * full), strict=True):
                    target.write(local(t))
                first, second = gathered_together(targets)
                assert torch.equal(first, torch.cat(segments, dim=1)) and torch.equal(second, 2 * first)
            else:
                assert targets == [None, None]
    assert directory is None or made, "the peer-write path was not taken"


TOKEN_ROW_CASES = [
    dict(lengths=(6,), batch=1),
    dict(lengths=(7,), batch=2),
    dict(lengths=(3, 9), batch=1),
    dict(lengths=(1, 5), batch=2),
]


# Cases run under every scheme; together they cover uneven and empty shards, heads that do not divide the
# Ulysses degree (down to ranks with no head), cross attention (sharded K/V, another value width), Ulysses in one and in two pipeline stages (heads >= 2 x degree), and batches of 2 and of 1 (whose
# all-to-alls skip the copies).
TWO_RANK_CASES = [
    dict(q_len=7, heads=5, batch=1),
    dict(q_len=7, kv_len=4, heads=4, v_dim=5, batch=1),
    dict(q_len=8, heads=4),
    dict(q_len=7, heads=3),
    dict(q_len=1, heads=2),
    dict(q_len=5, heads=1),
    dict(q_len=7, kv_len=4, heads=3, v_dim=5),
    dict(q_len=6, kv_len=1, heads=2),
]
FOUR_RANK_CASES = [
    dict(q_len=37, heads=9, batch=1),
    dict(q_len=10, kv_len=7, heads=8),
    dict(q_len=8, heads=4),
    dict(q_len=37, heads=3),
    dict(q_len=5, heads=3),
    dict(q_len=3, heads=6),
    dict(q_len=37, kv_len=11, heads=3, v_dim=5),
    dict(q_len=9, kv_len=2, heads=2),
]


def two_rank_checks(directory: str) -> list:
    world = dist.group.WORLD
    checks = [(f"shard/gather length {n}", partial(check_shard_gather, world, n)) for n in (5, 1)]
    schemes = (("ulysses", dict(ulysses_group=world)), ("ring", dict(ring_group=world)))
    for scheme, groups in schemes:
        checks += [
            (f"{scheme} {case} beside={beside}", partial(check_attention, groups, beside=beside, **case))
            for case in TWO_RANK_CASES
            for beside in (False, True)
        ]
        checks += [
            (f"{scheme} by peer writes {case}", partial(check_peer_writes, groups, directory, **case))
            for case in TWO_RANK_CASES
        ]
    for where in (None, directory):
        checks += [
            (f"token rows {case} {where}", partial(check_token_rows, world, directory=where, **case))
            for case in TOKEN_ROW_CASES
        ]
    return checks


def check_group_timeouts(groups: dict, timeout_s: float) -> None:
    """The layout's own groups wait as long as the config says (torch starts a new gloo group with 30
    minutes); a dimension over all ranks is the default group, with the timeout it was started with."""
    for group in groups.values():
        if group is not None:
            own = group is not dist.group.WORLD
            want = datetime.timedelta(seconds=timeout_s if own else DEFAULT_GROUP_TIMEOUT_S)
            assert group._get_backend(torch.device("cpu")).options._timeout == want


def four_rank_checks(directory: str) -> list:
    schemes = {}
    for name, degrees in (("ulysses2 x ring2", (2, 2)), ("ulysses4", (4, 1)), ("ring4", (1, 4))):
        state = init_parallel(ParallelConfig(ulysses=degrees[0], ring=degrees[1], timeout_s=123))
        schemes[name] = dict(ulysses_group=state.group("ulysses"), ring_group=state.group("ring"))
    peer_writes = [
        (
            f"{name} by peer writes {case}",
            partial(check_peer_writes, schemes[name], directory, "x" not in name, **case),
        )
        for name in ("ulysses2 x ring2", "ulysses4", "ring4")
        for case in FOUR_RANK_CASES
    ]
    tp = init_parallel(ParallelConfig(tp=2, ulysses=2)).group("tp")
    token_rows_checks = [
        (
            f"tp2 x ulysses2: token rows {case} {where}",
            partial(check_token_rows, group, directory=where, **case),
        )
        for group in (tp, dist.group.WORLD)
        for where in (None, directory)
        for case in TOKEN_ROW_CASES
    ]
    return (
        peer_writes
        + token_rows_checks
        + [
            (f"{name} timeouts", partial(check_group_timeouts, groups, 123))
            for name, groups in schemes.items()
        ]
        + [
            (f"{name} {case}", partial(check_attention, groups, **case))
            for name, groups in schemes.items()
            for case in FOUR_RANK_CASES
        ]
    )


CHECKS = {2: two_rank_checks, 4: four_rank_checks}


def worker(rank: int, world: int, init_file: str, results) -> None:
    failures, ran = [], 0
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=DEFAULT_GROUP_TIMEOUT_S),
        )
        for name, check in CHECKS[world](os.path.dirname(init_file)):
            ran += 1
            try:
                check()
            except Exception:
                failures.append(f"[rank {rank}] {name}\n{traceback.format_exc()}")
    except BaseException:
        failures.append(f"[rank {rank}] setup\n{traceback.format_exc()}")
    finally:
        results.put((rank, ran, failures))
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, tmp_path, deadline_s: float = 150) -> None:
    """Runs ``worker`` on ``world`` spawned ranks; fails with every rank's tracebacks, never hangs."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(rank, world, str(tmp_path / "store"), results))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    reports = {}
    deadline = time.monotonic() + deadline_s
    try:
        while len(reports) < world and time.monotonic() < deadline:
            try:
                rank, ran, failures = results.get(timeout=1)
                reports[rank] = (ran, failures)
            except queue.Empty:
                if not any(proc.is_alive() for proc in procs) and results.empty():
                    break
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join()
    missing = sorted(set(range(world)) - set(reports))
    assert not missing, f"ranks {missing} did not report (exit codes {[p.exitcode for p in procs]})"
    failures = [failure for _, rank_failures in reports.values() for failure in rank_failures]
    assert not failures, "\n".join(failures)
    assert all(ran for ran, _ in reports.values())


@pytest.mark.multirank
def test_two_ranks(tmp_path):
    """Ulysses 2 and ring 2 on every case, plus the uneven shard/gather helpers."""
    run_ranks(2, tmp_path)


@pytest.mark.multirank
def test_four_ranks(tmp_path):
    """Ulysses 2 x ring 2, Ulysses 4 and ring 4 on every case."""
    run_ranks(4, tmp_path)


def test_split_sizes():
    assert split_sizes(37, 4) == [10, 9, 9, 9]
    assert split_sizes(8, 4) == [2, 2, 2, 2]
    assert split_sizes(2, 4) == [1, 1, 0, 0]
    with pytest.raises(ValueError):
        split_sizes(3, 0)


def test_merge_partials_is_exact_where_averaging_is_not():
    """Ring attention is only as right as this merge: blocks of unequal length and sharpness must be weighted
    by their softmax mass, which averaging the block outputs gets wrong."""
    q, k, v = make_inputs(0, q_len=6, kv_len=11, heads=3, v_dim=5)
    want = PROVIDER.forward(q, k, v)
    out = lse = None
    block_outs = []
    for k_blk, v_blk in zip(k.split([3, 8], dim=1), v.split([3, 8], dim=1), strict=True):
        block_out, block_lse = attend(q, k_blk, v_blk, True)
        block_outs.append(block_out)
        out, lse = merge_partials(out, lse, block_out, block_lse)
    assert rel_err(out, want) <= TOLERANCE
    assert rel_err(sum(block_outs) / len(block_outs), want) > 0.05
    assert rel_err(lse, PROVIDER.forward(q, k, v, return_lse=True)[1]) <= TOLERANCE


def test_single_rank_plan_is_plain_attention():
    q, k, v = make_inputs(1, q_len=5, kv_len=7, heads=3, v_dim=8)
    sp = SequenceParallel.plan(5, kv_length=7)
    assert sp.degree == 1 and sp.index == 0
    assert rel_err(sp.attention(q, k, v, attend), PROVIDER.forward(q, k, v)) <= TOLERANCE


def test_plan_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match="nonzero total"):
        SequenceParallel.plan(0)
    with pytest.raises(ValueError, match="each of the 1 ranks"):
        SequenceParallel((3, 4))
    q, k, v = make_inputs(2, q_len=5, kv_len=5, heads=2, v_dim=8)
    with pytest.raises(ValueError, match="plan says 4"):
        SequenceParallel.plan(4).attention(q, k, v, attend)
    with pytest.raises(ValueError, match="heads"):
        SequenceParallel.plan(5).attention(q, k[:, :, :1], v[:, :, :1], attend)


def test_peer_writes_follow_their_tuning_and_environment_switch(monkeypatch):
    """``LayoutTuning(peer_writes=False)``, or ``OMNI_ACCEL_PEER_WRITES=0`` for its default, sends a group
    that has peer buffers back to the all-to-all."""
    from types import SimpleNamespace

    from omni_accel.parallel.config import PEER_WRITES_SWITCH

    group, made = SimpleNamespace(group_name="two GPUs"), object()
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(peer_memory, "_try_peer_buffers", lambda group: made)
    monkeypatch.setattr(peer_memory, "_BY_GROUP", {})
    assert SequenceParallel((1, 1), ulysses_group=group)._peers(group) is made
    off = SequenceParallel((1, 1), ulysses_group=group, tuning=LayoutTuning(peer_writes=False))
    assert off._peers(group) is None and not off.places_inputs()
    monkeypatch.setenv(PEER_WRITES_SWITCH, "0")
    assert LayoutTuning() == LayoutTuning(peer_writes=False)
    assert SequenceParallel((1, 1), ulysses_group=group)._peers(group) is None


def test_layout_tuning_refuses_what_it_cannot_take():
    for bad in (dict(head_stages=0), dict(placed_stages_from=True), dict(peer_writes=1)):
        with pytest.raises(ValueError, match="LayoutTuning"):
            LayoutTuning(**bad)
    with pytest.raises(ValueError, match="must be a LayoutTuning"):
        ParallelConfig(tp=2, tuning={"peer_writes": False})
    assert "tuning=LayoutTuning(" in str(ParallelConfig(tp=2, tuning=LayoutTuning(head_stages=1)))
    assert str(ParallelConfig(tp=2)) == "ParallelConfig(tp=2, ulysses=1, ring=1, cfg=1)"
