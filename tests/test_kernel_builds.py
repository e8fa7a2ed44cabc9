"""Kernels compiled on first use (FlashInfer's) are built in the background while the next provider serves,
and ``auto`` switches to them once built; where FlashInfer goes first. CPU: the requests name a CUDA device
and FlashInfer's build is replaced by one the test controls (tests/test_gpu_providers.py builds the real
one on a GPU)."""

import threading
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
    state_before = cuda_graphs._global_state()
    flashinfer.set()
    kernel_builds.wait(10)
    assert kernel_builds.generation() > before
    assert cuda_graphs._global_state() != state_before  # replays are captured anew with the built kernel
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
