"""Run a test body on several ranks (gloo on CPU, or NCCL with one GPU each) and surface any rank's failure
with its traceback.

The ranks are forked from a forkserver that imported torch, Diffusers, transformers, omni_accel and the
tests' helpers once per session: a spawned rank spent ~6-13 s importing them, at each of the suite's ~35
launches. The forkserver forks before any of that code has run a thread, and each rank takes the launching
process's environment as it is at the launch (as a spawned one would). With a GPU the ranks are spawned:
importing the helpers initialises CUDA, which a forked process cannot use."""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "diffusers",
    "diffusers.models",
    "diffusers.pipelines",
    "transformers",
    "omni_accel",
    "omni_accel.api",
    "conftest",
    "native_contract",
    "tiny_builders",
    "tiny_transformers",
]


def _kernels_compile_in_the_call() -> None:
    """As conftest's fixture does for the GPU tests in the parent: a rank's first kernel launches compile in
    the call rather than being served by the references (a one-rank group is no parallel layout)."""
    from omni_accel.utils import triton_builds

    triton_builds._knobs = lambda: None


def _entry(rank: int, world: int, port: int, init: bool, backend: str, fn, args, errors, env) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            _kernels_compile_in_the_call()
        if init:
            dist.init_process_group(
                backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
            )
        fn(rank, world, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():
            # As omni_accel.parallel.mesh does at exit: a gloo worker that has just finished a collective
            # frees its tensors under the GIL; exiting before it got the GIL aborts the process (SIGABRT,
            # "terminate called without an active exception").
            time.sleep(0.05)
            dist.destroy_process_group()


def run_multirank(
    fn, world: int, *args, timeout: float = 240, init: bool = True, backend: str = "gloo"
) -> None:
    """Runs ``fn(rank, world, *args)`` in ``world`` processes; raises with the first traceback.

    With ``init=False`` the processes only get torchrun's environment and must join the group themselves."""
    if torch.cuda.is_available():
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts: the session's first launch
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, init, backend, fn, args, errors, dict(os.environ)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    if not errors.empty():
        raise AssertionError(errors.get())
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout}s (a collective hung)")
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited with codes {bad}")


def run_checks(rank: int, world: int, checks) -> None:
    """A rank's body that runs every check of ``checks`` (functions of no arguments) and raises once with
    the traceback of each that failed: one launch serves many checks, and one failure hides none."""
    failures = []
    for check in checks:
        try:
            check()
        except Exception:
            failures.append(f"{check.__name__}:\n{traceback.format_exc()}")
    assert not failures, "\n".join(failures)
