"""Our Triton kernels' first launches, compiled in the background while PyTorch's ops serve.

Triton compiles a kernel the first time a process launches it with a new specialization (dtypes,
constexprs, alignments): 0.1-0.5 s each with a cold disk cache, so a fresh machine's first FLUX.2 call took
1.8 s against 0.12 warm (docs/PERFORMANCE.md, "First call"). An op that has a PyTorch reference launches
its kernels inside ``first_launches()``: a launch there that misses Triton's in-process cache is not
compiled in the call. Triton's JIT cache hook (set while our ops run, chained to any hook already set)
starts the compile in the background (``kernel_builds.compiled``: Triton's own ``preload`` of the
specialization it was about to compile), skips the launch and marks it; the op then returns its reference.
The build thread also compiles the kernel's C launcher, before the kernel enters Triton's in-process cache
(``_LauncherFirst``). Once both are done the launches hit Triton's cache and run the kernel.

- A compile found in Triton's disk cache takes milliseconds: the first miss in a process waits up to
  ``_DISK_WAIT`` for its compile, and the later misses wait as well while those waits keep succeeding.
- Under a parallel layout, a compile that failed in the background, or a Triton without the hook
  (before 3.4), the launch compiles as it always did.
- Other threads' launches, and launches outside ``first_launches()``, reach the hook that was there
  before unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from .. import kernel_builds
from ..utils.logging import get_logger

logger = get_logger(__name__)

_DISK_WAIT = 0.05  # seconds: a compile served from the disk cache is done well within it


class FirstLaunches:
    """What ``first_launches()`` yields: ``deferred`` says whether a launch inside it was skipped. It is
    True from the start while Triton's driver is still being set up in the background: the op launches
    nothing then (``if not launches.deferred``), since a launch would set the driver up a second time."""

    __slots__ = ("deferred",)

    def __init__(self, deferred: bool = False) -> None:
        self.deferred = deferred


@contextlib.contextmanager
def first_launches() -> Iterator[FirstLaunches]:
    """Launches inside it whose kernel is not yet built in this process are skipped, their compile started
    in the background; the caller computes the reference where the yielded ``deferred`` is True."""
    knobs = _knobs()
    if knobs is None:
        yield FirstLaunches()
        return
    if driver_setting_up():
        if not kernel_builds.parallel():
            yield FirstLaunches(deferred=True)
            return
        wait_for_driver()  # ranks launch alike: a rank serving a reference would differ from its replicas
    launches = FirstLaunches()
    outer = getattr(_LOCAL, "launches", None)
    _LOCAL.launches = launches
    _hold(knobs)
    try:
        yield launches
    finally:
        _release(knobs)
        _LOCAL.launches = outer


_LOCAL = threading.local()
_HOOK_LOCK = threading.Lock()
_HOLDERS = [0]  # ops inside ``first_launches`` now, in every thread
_PREVIOUS: list[Any] = [None]  # the hook ours chains to
_WARM_DISK = [True]  # every compile waited for so far finished within ``_DISK_WAIT``
_DRIVER_KEY = ("triton", "driver")


def set_up_in_background() -> None:
    """Starts Triton's driver set-up as a background build: with a cold disk cache it compiles its C helpers
    (about a second), which the first launch would otherwise wait for. ``accelerate`` calls it, so that it
    runs while the first call encodes its prompt; ops whose launches come meanwhile serve their references,
    and a CUDA graph captured meanwhile is captured anew once it is done (``kernel_builds.settled``)."""
    if torch.cuda.is_available() and _knobs() is not None:
        kernel_builds.compiled(_DRIVER_KEY, _set_up_driver, "Triton's driver set-up")


def driver_setting_up() -> bool:
    """Whether ``set_up_in_background``'s build is still at work."""
    return kernel_builds.state(_DRIVER_KEY) == "building"


def wait_for_driver() -> None:
    """Waits for what is left of the background set-up: for launches that have no reference to serve
    instead (they would set the driver up a second time beside it)."""
    kernel_builds.join(_DRIVER_KEY)


def _set_up_driver() -> None:
    """Triton's driver helpers, and its backend's hash: that runs ``ptxas --version`` twice (Triton caches
    both), two process forks of a few hundred ms together from a process holding a model's memory (a fork
    holds the GIL), which the first compile would otherwise make during the first call."""
    try:
        from triton.runtime.driver import driver

        driver.active.utils  # noqa: B018 (built on first access)
        from triton.compiler.compiler import make_backend

        make_backend(driver.active.get_current_target()).hash()
    except Exception as error:  # the first launch sets it up (and raises what it raises) instead
        logger.debug("Triton's driver was not set up in the background: %s", error)


def _build_launcher(kernel: Any) -> None:
    """Compiles the C launcher of a kernel ``preload`` built into Triton's disk cache (its first launch would
    otherwise compile it, a few hundred ms); the launch still loads both itself, in its own thread."""
    try:
        from triton.runtime.driver import driver

        make = getattr(driver.active, "launcher_cls", None)
        if kernel is not None and make is not None:
            make(kernel.src, kernel.metadata)
    except Exception as error:  # the launch builds it instead
        logger.debug("Triton launcher not built in the background: %s", error)


class _LauncherFirst:
    """Triton's async-compile mode as its JIT calls it (``submit``), in the build thread only: the kernel's
    launcher is built before the kernel enters the JIT's in-process cache. ``preload`` otherwise puts it
    there first, so a launch meanwhile found it and compiled the launcher again on the calling thread (a
    few hundred ms of gcc)."""

    def submit(self, key: Any, compile_fn: Any, finalize_fn: Any) -> Any:
        kernel = compile_fn()
        _build_launcher(kernel)
        finalize_fn(kernel)  # into the JIT's cache: launches from now on find a built launcher
        return kernel


@contextlib.contextmanager
def _launcher_before_cache() -> Iterator[bool]:
    """Runs the ``preload`` inside it through ``_LauncherFirst``; yields False where this Triton has no
    async-compile mode (the caller builds the launcher after ``preload`` then)."""
    try:
        from triton.runtime import _async_compile
    except ImportError:
        yield False
        return
    token = _async_compile.active_mode.set(_LauncherFirst())
    try:
        yield True
    finally:
        _async_compile.active_mode.reset(token)


def _knobs() -> Any:
    """Triton's runtime knobs where they have the JIT cache hook and ``JITFunction.preload``, else None."""
    try:
        import triton
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if knobs is None or not hasattr(knobs, "jit_cache_hook") or not hasattr(JITFunction, "preload"):
        return None
    return knobs


def _hold(knobs: Any) -> None:
    with _HOOK_LOCK:
        _HOLDERS[0] += 1
        if knobs.jit_cache_hook is not _hook:
            _PREVIOUS[0] = knobs.jit_cache_hook
            knobs.jit_cache_hook = _hook


def _release(knobs: Any) -> None:
    with _HOOK_LOCK:
        _HOLDERS[0] -= 1
        if _HOLDERS[0] == 0 and knobs.jit_cache_hook is _hook:  # a hook set since stays
            knobs.jit_cache_hook = _PREVIOUS[0]
            _PREVIOUS[0] = None


def _hook(**call: Any) -> bool | None:
    """Triton's ``jit_cache_hook``: called before it compiles; True skips the compile and the launch."""
    launches = getattr(_LOCAL, "launches", None)
    previous = _PREVIOUS[0]
    if previous is not None and previous(**call):  # it skips the launch: our op serves the reference
        if launches is not None:
            launches.deferred = True
        return True
    if launches is None or call.get("is_manual_warmup", True):
        return False
    try:
        deferred = _defer(call["fn"], call["compile"])
    except Exception as error:  # anything unexpected: compile in the call, as without us
        logger.debug("Triton kernel compiled in the call: %s", error)
        return False
    launches.deferred = launches.deferred or deferred
    return deferred


def _defer(fn: Any, compile: dict[str, Any]) -> bool:
    """Whether this launch is skipped: its compile started in the background and not done in time."""
    if kernel_builds.parallel():
        return False
    key = ("triton", fn.module, fn.name, compile["key"], compile["device"])
    if kernel_builds.state(key) not in ("not started", "building"):
        return False  # built (and still missed: another cache) or failed: compiled here, as without us
    jit, device, data = fn.jit_function, compile["device"], compile["specialization_data"]

    def build() -> None:
        with torch.cuda.device(device) if torch.cuda.is_available() else contextlib.nullcontext():
            with _launcher_before_cache() as ordered:  # on the launch's GPU: a thread starts on the first
                kernel = jit.preload(data)
            if not ordered:
                _build_launcher(kernel)

    wait = _DISK_WAIT if _WARM_DISK[0] else 0.0
    if kernel_builds.compiled(key, build, f"Triton kernel {fn.name}", wait):
        return False  # found on disk: Triton loads it again in this call, at once
    if wait:
        _WARM_DISK[0] = False  # compiling for real: the later misses do not wait either
    return True
