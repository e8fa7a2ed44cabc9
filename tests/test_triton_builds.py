"""Our Triton kernels' first launches are compiled in the background while the op's reference serves
(``omni_accel/utils/triton_builds.py``). CPU: a stand-in for Triton's runtime that follows Triton 3.6's
protocol (``knobs.runtime.jit_cache_hook`` called before a compile with these keywords, a True answer
skipping the compile and the launch, ``JITFunction.preload`` compiling a specialization from its data);
tests/test_gpu_triton_builds.py runs the real one on a GPU."""

import contextvars
import sys
import threading
import types

import pytest

from omni_accel import kernel_builds
from omni_accel.utils import triton_builds


class _JITFunction:
    """A kernel: ``kernel[grid](key)`` launches the specialization ``key``, compiled on a miss."""

    def __init__(self, name: str, compile_seconds: threading.Event | None = None) -> None:
        self.name, self.cache, self.launched, self.compiled_in_call = name, set(), [], []
        _KERNELS[name] = self
        self.release = compile_seconds or threading.Event()
        self.preload_error: Exception | None = None

    def __getitem__(self, grid):
        def run(key: str):
            if key not in self.cache:
                hook = _KNOBS.jit_cache_hook
                info = types.SimpleNamespace(module="tests.fake", name=self.name, jit_function=self)
                compile = {"key": key, "device": 0, "specialization_data": key}
                if hook is not None and hook(
                    key=key,
                    repr=self.name,
                    fn=info,
                    compile=compile,
                    is_manual_warmup=False,
                    already_compiled=False,
                ):
                    return None
                self.compiled_in_call.append(key)
                self.cache.add(key)
            self.launched.append(key)
            return self

        return run

    def preload(self, data: str) -> None:
        """Compiles ``data`` into the cache; under an async-compile mode (``_ASYNC``) through its
        ``submit(key, compile, finalize)``, the cache entry made by ``finalize``, as Triton 3.6 does."""

        def compile_fn():
            assert self.release.wait(10)
            if self.preload_error is not None:
                raise self.preload_error
            return types.SimpleNamespace(src=data, metadata=self.name)  # Triton's CompiledKernel has both

        mode = _ASYNC.active_mode.get()
        if mode is not None:
            return mode.submit(data, compile_fn, lambda kernel: self.cache.add(data))
        kernel = compile_fn()
        self.cache.add(data)
        return kernel


_KNOBS = types.SimpleNamespace(jit_cache_hook=None)
_ASYNC = types.ModuleType("triton.runtime._async_compile")
_ASYNC.active_mode = contextvars.ContextVar("async_compile_active_mode", default=None)
_KERNELS: dict[str, "_JITFunction"] = {}  # by name: whether a launcher was built before its kernel was cached


class _Driver:
    """``triton.runtime.driver.driver``: ``active.utils`` compiles C helpers on first access,
    ``active.launcher_cls(src, metadata)`` a kernel's launcher; ``make_backend(target).hash()`` (Triton's
    compiler module) runs ``ptxas --version`` on first use."""

    def __init__(self) -> None:
        self.launchers, self.utils_threads, self.release = [], [], threading.Event()
        self.hash_threads: list[str] = []
        self.release.set()

    def get_current_target(self):
        return "cuda:90"

    def make_backend(self, target):
        assert target == "cuda:90"
        return types.SimpleNamespace(hash=lambda: self.hash_threads.append(threading.current_thread().name))

    @property
    def active(self):
        return self

    @property
    def utils(self):
        assert self.release.wait(10)
        self.utils_threads.append(threading.current_thread().name)
        return self

    def launcher_cls(self, src, metadata):
        cached = src in _KERNELS[metadata].cache  # a launch meanwhile would build the launcher itself
        self.launchers.append((src, metadata, threading.current_thread().name, cached))


@pytest.fixture(autouse=True)
def fake_triton(monkeypatch):
    triton = types.ModuleType("triton")
    triton.knobs = types.SimpleNamespace(runtime=_KNOBS)
    runtime = types.ModuleType("triton.runtime")
    jit = types.ModuleType("triton.runtime.jit")
    jit.JITFunction = _JITFunction
    driver = types.ModuleType("triton.runtime.driver")
    driver.driver = _Driver()
    compiler = types.ModuleType("triton.compiler.compiler")
    compiler.make_backend = driver.driver.make_backend
    modules = {"triton": triton, "triton.runtime": runtime, "triton.runtime.jit": jit}
    modules.update({"triton.runtime.driver": driver, "triton.compiler.compiler": compiler})
    modules["triton.runtime._async_compile"] = _ASYNC
    runtime._async_compile = _ASYNC
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(triton_builds, "_DRIVER_KEY", ("triton", "driver", object()))  # not set up yet
    monkeypatch.setattr(_KNOBS, "jit_cache_hook", None)
    monkeypatch.setattr(triton_builds, "_WARM_DISK", [False])  # a cold disk cache: no wait
    yield
    kernel_builds.wait(10)


def _op(kernel: _JITFunction, key: str) -> str:
    """An op as ours are written: the kernel, or its reference where the launch was deferred."""
    with triton_builds.first_launches() as launches:
        if not launches.deferred:
            kernel[(1,)](key)
    return "reference" if launches.deferred else "kernel"


def test_a_first_launch_is_served_by_the_reference_while_it_compiles_in_the_background():
    kernel = _JITFunction("norm_modulate")
    assert _op(kernel, "bf16,3072") == "reference"
    assert kernel.launched == [] and kernel.compiled_in_call == []
    assert _op(kernel, "bf16,3072") == "reference"  # still compiling: one compile, not two
    assert kernel_builds.in_flight()
    kernel.release.set()
    kernel_builds.wait(10)
    assert not kernel_builds.in_flight()
    assert _op(kernel, "bf16,3072") == "kernel"
    assert kernel.launched == ["bf16,3072"] and kernel.compiled_in_call == []
    assert _KNOBS.jit_cache_hook is None  # set only while our ops run
    # its launcher (C, compiled on a first launch) was built beside it, into the disk cache, before the
    # kernel entered the JIT's cache (a launch finding it there first would have built the launcher itself)
    assert sys.modules["triton.runtime.driver"].driver.launchers == [
        ("bf16,3072", "norm_modulate", "omni-build: Triton kernel norm_modulate", False)
    ]


def test_the_driver_is_set_up_in_the_background_and_the_references_serve_meanwhile(monkeypatch):
    monkeypatch.setattr(triton_builds.torch.cuda, "is_available", lambda: True)
    driver = sys.modules["triton.runtime.driver"].driver
    driver.release.clear()
    generation = kernel_builds.generation()
    triton_builds.set_up_in_background()
    triton_builds.set_up_in_background()  # once per process
    kernel = _JITFunction("first")
    kernel.cache.add("a")  # built already: only the driver holds it back
    assert _op(kernel, "a") == "reference"
    assert kernel.launched == [] and driver.utils_threads == []  # nothing touched the driver meanwhile
    settled = kernel_builds.settled()  # a CUDA graph captured meanwhile is captured anew after it
    assert kernel_builds.building() == ["Triton's driver set-up"]  # what describe says waits
    driver.release.set()
    triton_builds.wait_for_driver()
    assert kernel_builds.generation() > generation  # cached choices resolve anew
    assert kernel_builds.settled() > settled  # and graph keys
    assert _op(kernel, "a") == "kernel"
    assert driver.utils_threads == ["omni-build: Triton's driver set-up"]  # off the calling thread
    assert driver.hash_threads == ["omni-build: Triton's driver set-up"]  # its ptxas probes too


def test_under_a_parallel_layout_a_launch_waits_for_the_driver(monkeypatch):
    monkeypatch.setattr(triton_builds.torch.cuda, "is_available", lambda: True)
    driver = sys.modules["triton.runtime.driver"].driver
    driver.release.clear()
    triton_builds.set_up_in_background()
    monkeypatch.setattr(kernel_builds, "parallel", lambda: True)  # ranks launch alike
    threading.Timer(0.2, driver.release.set).start()
    kernel = _JITFunction("rank_after_driver")
    kernel.cache.add("a")
    assert _op(kernel, "a") == "kernel"
    assert driver.utils_threads == ["omni-build: Triton's driver set-up"]  # done before the launch


def test_a_compile_found_on_disk_is_waited_for(monkeypatch):
    monkeypatch.setattr(triton_builds, "_WARM_DISK", [True])
    kernel = _JITFunction("gated_residual")
    kernel.release.set()  # compiles at once, as a disk cache hit
    assert _op(kernel, "bf16") == "kernel"
    slow = _JITFunction("concat_gelu")
    assert _op(slow, "bf16") == "reference"  # not done within the wait: compiling for real
    assert triton_builds._WARM_DISK == [False]
    slow.release.set()


def test_launches_outside_our_ops_and_other_hooks_behave_as_without_us():
    seen = []

    def users_hook(**call):
        seen.append(call["key"])
        return False

    _KNOBS.jit_cache_hook = users_hook
    kernel = _JITFunction("theirs")
    kernel[(1,)]("a")  # outside ``first_launches``: compiled in the call
    assert kernel.compiled_in_call == ["a"] and seen == ["a"]
    ours = _JITFunction("ours")
    assert _op(ours, "b") == "reference"
    assert seen == ["a", "b"]  # their hook still sees every compile
    assert _KNOBS.jit_cache_hook is users_hook
    ours.release.set()


def test_a_hook_that_skips_a_compile_is_obeyed_and_the_reference_serves():
    _KNOBS.jit_cache_hook = lambda **call: True
    kernel = _JITFunction("skipped")
    assert _op(kernel, "a") == "reference"
    assert kernel.launched == [] and kernel.compiled_in_call == []
    assert kernel_builds.state(("triton", "tests.fake", "skipped", "a", 0)) == "not started"


def test_under_a_parallel_layout_the_launch_compiles_in_the_call(monkeypatch):
    monkeypatch.setattr(kernel_builds, "parallel", lambda: True)
    kernel = _JITFunction("rank")
    assert _op(kernel, "a") == "kernel"
    assert kernel.compiled_in_call == ["a"]


def test_a_failed_background_compile_compiles_in_the_call_next_time():
    kernel = _JITFunction("broken")
    kernel.preload_error = RuntimeError("ptxas died")
    kernel.release.set()
    assert _op(kernel, "a") == "reference"
    kernel_builds.wait(10)
    assert kernel_builds.state(("triton", "tests.fake", "broken", "a", 0)).startswith("failed")
    assert _op(kernel, "a") == "kernel"
    assert kernel.compiled_in_call == ["a"]


def test_nested_ops_each_see_their_own_launches():
    outer, inner = _JITFunction("outer"), _JITFunction("inner")
    outer.cache.add("a")
    with triton_builds.first_launches() as launches:
        assert _op(inner, "a") == "reference"
        outer[(1,)]("a")
    assert not launches.deferred and outer.launched == ["a"]
    inner.release.set()


def test_without_the_hook_in_triton_launches_compile_as_they_come(monkeypatch):
    monkeypatch.delattr(_KNOBS, "jit_cache_hook")
    with triton_builds.first_launches() as launches:
        pass
    assert not launches.deferred
