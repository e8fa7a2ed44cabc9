"""Kernels compiled on first use (FlashInfer's) are built in the background while the next provider serves,
and ``auto`` switches to them once built; where FlashInfer goes first. CPU: the requests name a CUDA device
and FlashInfer's build is replaced by one the test controls (tests/test_gpu_providers.py builds the real
one on a GPU)."""

import contextlib
import threading
import types
import uuid

import pytest
import torch

from omni_accel import background, cuda_graphs, kernel_builds
from omni_accel.attention.base import AttentionRequest
from omni_accel.attention.providers.flashinfer import FlashInferProvider
from omni_accel.attention.registry import platform_preference
from omni_accel.attention.selection import AttentionConfig, AttentionSelector, resolve


def _request(head_dim: int, kv_len: int, has_mask: bool = False) -> AttentionRequest:
    return AttentionRequest(torch.bfloat16, "cuda", head_dim, has_mask, False, (9, 0), kv_len)


@pytest.fixture
def flashinfer(monkeypatch):
    """FlashInfer "installed", its kernel built by a build the test releases (``release.set()``)."""
    release, key = threading.Event(), uuid.uuid4().hex

    def kernel_ready(self, request):
        return kernel_builds.ready((key, request.head_dim), lambda: release.wait(30), "a test kernel")

    monkeypatch.setattr(FlashInferProvider, "unavailable_reason", lambda self: None)
    monkeypatch.setattr(FlashInferProvider, "kernel_ready", kernel_ready)
    return release


def test_flashinfer_goes_first_only_where_it_beats_cudnn(flashinfer):
    flashinfer.set()  # builds finish at once
    for request in (_request(64, 4429), _request(128, 35375)):
        platform_preference(request)  # starts the build
        kernel_builds.wait(10)
        assert platform_preference(request)[0][0] == "flashinfer", request
    for request in (_request(128, 4608), _request(64, 1024), _request(64, 4429, has_mask=True)):
        assert platform_preference(request)[0][0] != "flashinfer", request
    assert platform_preference(_request(64, 4429, has_mask=True))[0][0] == "sdpa"


def test_the_next_provider_serves_until_the_background_build_is_done(flashinfer):
    request = _request(64, 4429)
    selector = AttentionSelector()
    before = kernel_builds.generation()
    first = selector.resolve("self", "self", request)
    assert first.name == "sdpa_cudnn" and "flashinfer waits for its kernel" in first.reason
    assert selector.resolve("self", "self", request) is first  # cached while the build runs
    settled = kernel_builds.settled()
    flashinfer.set()
    kernel_builds.wait(10)
    assert kernel_builds.generation() > before
    assert kernel_builds.settled() > settled  # replays are captured anew with the built kernel
    assert selector.resolve("self", "self", request).name == "flashinfer"
    assert resolve(AttentionConfig(), "self", "self", request).name == "flashinfer"


def test_a_failed_build_is_said_once_and_never_picked(monkeypatch):
    key = uuid.uuid4().hex

    def broken() -> None:
        raise RuntimeError("nvcc not found")

    assert not kernel_builds.ready(key, broken, "a broken kernel")
    kernel_builds.wait(10)
    assert kernel_builds.state(key) == "failed: RuntimeError: nvcc not found"
    assert not kernel_builds.ready(key, broken, "a broken kernel")


def test_under_a_parallel_layout_the_caller_builds_and_waits(monkeypatch):
    monkeypatch.setattr(kernel_builds, "parallel", lambda: True)
    built = []
    key = uuid.uuid4().hex
    with background.LOCK:  # as a CUDA graph capture holds it: the caller's build must not wait for it
        assert kernel_builds.ready(key, lambda: built.append(threading.current_thread()), "a rank's kernel")
    assert built == [threading.current_thread()] and kernel_builds.state(key) == "ready"


def test_a_jit_compile_holds_nothing_and_only_the_plan_after_it_holds_the_lock():
    """FlashInfer's nvcc run (about 90 s on a fresh machine) must not hold captures and compiles off."""
    key, seen, jit_may_end = uuid.uuid4().hex, {}, threading.Event()

    def jit() -> None:
        seen["jit"] = background.LOCK.locked()
        with background.nothing_beside() as free:  # a capture may run meanwhile
            seen["capture beside the jit"] = free
        jit_may_end.wait(30)

    def build() -> None:
        seen["build"] = background.LOCK.locked()

    assert not kernel_builds.ready(key, build, "a JIT-compiled kernel", jit=jit)
    assert kernel_builds.state(key) == "building" and "a JIT-compiled kernel" in kernel_builds.building()
    jit_may_end.set()
    kernel_builds.wait(10)
    assert seen == {"jit": False, "capture beside the jit": True, "build": True}
    assert kernel_builds.state(key) == "ready"

    broken, planned = uuid.uuid4().hex, []  # a failed JIT is a failed build: its plan never runs
    assert not kernel_builds.ready(
        broken, lambda: planned.append(1), "a kernel nvcc refuses", jit=lambda: 1 / 0
    )
    kernel_builds.wait(10)
    assert kernel_builds.state(broken) == "failed: ZeroDivisionError: division by zero" and not planned


def test_flashinfers_ahead_compile_steps_aside_where_its_internals_moved(monkeypatch, caplog):
    """``_jit_kernel`` calls FlashInfer internals; where they are not what 0.6.1 has (here: no flashinfer
    at all, as a moved module would look), it says so and leaves the compile to the plan, which always can."""
    import sys

    from omni_accel.attention.providers import flashinfer

    monkeypatch.setitem(sys.modules, "flashinfer.prefill", None)  # importing it raises ImportError
    with caplog.at_level("WARNING", logger="omni_accel"):
        flashinfer._jit_kernel(64, torch.bfloat16, torch.device("cuda", 0))
    assert "the plan compiles it" in caplog.text and "ModuleNotFoundError" in caplog.text


@torch.no_grad()
def test_a_step_is_captured_while_builds_run_and_once_more_when_they_are_all_done(monkeypatch):
    """A graph captured while kernels build keeps what served meanwhile until the last build is done (not one
    capture per build), and after that until a capture may run: the graphs' host side on the CPU, the
    capture and replay replaced by stand-ins."""
    kernel_builds.wait(30)
    assert not kernel_builds.in_flight()
    monkeypatch.setattr(cuda_graphs, "_eager_reason", lambda module, leaves: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    captured = []

    def capture(self, key, forward, leaves, spec, settled):
        captured.append(kernel_builds.building())
        graph = self.graphs[key] = types.SimpleNamespace(key=key, may_replay_early=False, settled=settled)
        return graph

    monkeypatch.setattr(cuda_graphs.StepGraphs, "_capture", capture)
    monkeypatch.setattr(cuda_graphs.StepGraphs, "_replay", lambda self, graph, leaves: "replayed")
    module = torch.nn.Linear(4, 4)
    cuda_graphs.StepGraphs(module).install()
    x = torch.randn(2, 4)
    releases = {uuid.uuid4().hex: threading.Event() for _ in range(2)}
    for index, (key, release) in enumerate(releases.items()):
        kernel_builds.compiled(key, lambda release=release: release.wait(30), f"kernel {index}")
    assert isinstance(module(x), torch.Tensor)  # a new key runs eagerly once
    assert module(x) == "replayed"  # then is captured, the builds still running
    assert captured == [["kernel 0", "kernel 1"]]
    first, second = releases
    releases[first].set()
    kernel_builds.join(first)
    assert module(x) == "replayed" and len(captured) == 1  # one build done, the other still running
    releases[second].set()
    kernel_builds.wait(10)
    with background.LOCK:  # a compile runs: no capture may, and the graph serves on
        assert module(x) == "replayed" and module(x) == "replayed" and len(captured) == 1
    assert isinstance(module(x), torch.Tensor)  # then the step runs once more with the built kernels
    assert module(x) == "replayed" and captured[1:] == [[]]  # and is captured anew
    assert module(x) == "replayed" and len(captured) == 2
