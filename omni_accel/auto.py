"""Zero-code acceleration: every Diffusers pipeline built after ``enable()`` is accelerated as it is built.

However a script builds its pipelines (``from_pretrained``, ``from_pipe``, a constructor,
``AutoPipelineFor*``), each ends in the ``__init__`` of a ``DiffusionPipeline`` subclass; ``enable`` wraps
those (the classes loaded now, and through ``__init_subclass__`` the ones Diffusers imports later) so that
when the outermost ``__init__`` returns, ``accelerate(pipe, config, **options)`` runs. A modular pipeline
(``diffusers.modular_pipelines``) gets its components after it is built (``load_components``,
``update_components``): both end in ``ModularPipeline.register_components``, after which its transformer is
accelerated (again, with the same options, when it was replaced). ``disable`` unwraps them; pipelines
already accelerated stay so (``omni_accel.restore(pipe)`` undoes one). In IPython: ``%load_ext omni_accel``
enables it with the options from the environment (see ``options_from_env``).

Zero-code never makes a script fail where plain Diffusers works: when ``accelerate`` refuses a pipeline, a
warning says why and the pipeline stays plain Diffusers.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections.abc import Mapping
from typing import Any

from diffusers import DiffusionPipeline, ModularPipeline
from torch import nn

from . import api
from .api.entry import in_sync
from .api.state import STATE_ATTR
from .config import AccelConfig
from .parallel.config import ParallelConfig
from .parallel.mesh import is_main_process
from .utils.logging import NOTICE, get_logger

logger = get_logger(__name__)

_LOCK = threading.Lock()
_LOCAL = threading.local()  # the depth of nested pipeline __init__ calls on this thread
_config: AccelConfig | None = None  # what enable() was given, keyword options over its ``config``
_wrapped: dict[type, Any] = {}  # class -> its original __init__
_modular_register: Any = None  # ModularPipeline.register_components before we wrapped it
_hooked_subclasses = False  # DiffusionPipeline.__init_subclass__ is ours (it defines none of its own)


def enable(config: AccelConfig | None = None, **options: Any) -> None:
    """Accelerates every pipeline built from now on with ``accelerate(pipe, config, **options)``: an option
    given here overrides ``config``'s."""
    if config is not None and not isinstance(config, AccelConfig):
        raise TypeError(f"config must be an omni_accel.AccelConfig, got {type(config).__name__}.")
    resolved = (config or AccelConfig()).with_overrides(**options)  # a bad option fails here, not later
    global _config, _hooked_subclasses
    with _LOCK:
        _config = resolved
        if not _hooked_subclasses:
            if "__init_subclass__" in vars(DiffusionPipeline):
                raise RuntimeError(
                    "DiffusionPipeline defines __init_subclass__ in this Diffusers version; zero-code "
                    "acceleration was checked against versions that do not"
                )
            DiffusionPipeline.__init_subclass__ = classmethod(_init_subclass)
            _hooked_subclasses = True
        for cls in _subclasses(DiffusionPipeline):
            _wrap(cls)
        _wrap_modular()
    logger.info("zero-code acceleration on for pipelines built from now on (%s)", resolved)


def disable() -> None:
    """Stops accelerating new pipelines (the ones already accelerated stay so)."""
    global _config, _hooked_subclasses, _modular_register
    with _LOCK:
        _config = None
        for cls, original in _wrapped.items():
            cls.__init__ = original
        _wrapped.clear()
        if _modular_register is not None:
            ModularPipeline.register_components = _modular_register
            _modular_register = None
        if _hooked_subclasses:
            del DiffusionPipeline.__init_subclass__
            _hooked_subclasses = False


def enabled() -> bool:
    return _config is not None


_YES, _NO = ("1", "true", "yes"), ("0", "false", "no")


def options_from_env(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """``accelerate`` options from ``OMNI_ACCEL_ATTENTION``, ``OMNI_ACCEL_COMPILE`` and
    ``OMNI_ACCEL_CUDA_GRAPHS`` (1: on, 0: off; unset: auto), ``OMNI_ACCEL_PARALLEL`` ("tp=2,ulysses=1,..."),
    ``OMNI_ACCEL_PROJECTION_CACHE_BYTES``, ``OMNI_ACCEL_QUANTIZE`` ("fp8": lossy, opt-in)."""
    env = os.environ if environ is None else environ
    options: dict[str, Any] = {}
    if env.get("OMNI_ACCEL_ATTENTION"):
        options["attention"] = env["OMNI_ACCEL_ATTENTION"]
    compiled = _switch(env, "OMNI_ACCEL_COMPILE")  # 0: never (the automatic choice compiles the generic tier)
    if compiled is not None:
        options["compile"] = compiled
    graphs = _switch(env, "OMNI_ACCEL_CUDA_GRAPHS")
    if graphs is not None:
        options["cuda_graphs"] = graphs
    if env.get("OMNI_ACCEL_PARALLEL"):
        options["parallel"] = parse_parallel(env["OMNI_ACCEL_PARALLEL"])
    budget = env.get("OMNI_ACCEL_PROJECTION_CACHE_BYTES", "")
    if budget:
        if not budget.strip().isdigit():
            raise ValueError(
                f"OMNI_ACCEL_PROJECTION_CACHE_BYTES={budget!r}: expected a number of bytes, like 0 or 268435456"
            )
        options["projection_cache_bytes"] = int(budget)
    if env.get("OMNI_ACCEL_QUANTIZE"):
        options["quantize"] = env["OMNI_ACCEL_QUANTIZE"]
    return options


def _switch(env: Mapping[str, str], name: str) -> bool | None:
    """An on/off variable: True, False, or None where unset or empty; any other value is refused (a typo
    such as ``on`` would otherwise leave the option silently at its default)."""
    value = env.get(name, "").strip().lower()
    if not value:
        return None
    if value not in _YES + _NO:
        raise ValueError(f"{name}={env[name]!r}: expected one of {', '.join(_YES + _NO)}")
    return value in _YES


def parse_parallel(text: str) -> ParallelConfig | str:
    """ "tp=2,ulysses=2" -> ParallelConfig(tp=2, ulysses=2); "auto" stays "auto"."""
    if text.strip() == "auto":
        return "auto"
    degrees = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in ("tp", "ulysses", "ring", "cfg") or not value.isdigit():
            raise ValueError(
                f"parallel layout {text!r}: expected 'auto' or items like tp=2, ulysses=2, cfg=2"
            )
        degrees[name] = int(value)
    return ParallelConfig(**degrees)


def _subclasses(cls: type) -> list[type]:
    found, stack = [], list(cls.__subclasses__())
    while stack:
        sub = stack.pop()
        found.append(sub)
        stack.extend(sub.__subclasses__())
    return found


def _init_subclass(cls, **kwargs: Any) -> None:
    super(DiffusionPipeline, cls).__init_subclass__(**kwargs)
    with _LOCK:
        if _config is not None:
            _wrap(cls)


def _wrap(cls: type) -> None:
    original = cls.__dict__.get("__init__")
    if original is None or cls in _wrapped:
        return  # inherits a wrapped __init__, or already wrapped

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        depth = getattr(_LOCAL, "depth", 0)
        _LOCAL.depth = depth + 1
        try:
            original(self, *args, **kwargs)
        finally:
            _LOCAL.depth = depth
        config = _config
        if depth == 0 and config is not None:
            _accelerate_or_warn(self, config)

    _wrapped[cls] = original
    cls.__init__ = __init__


def _wrap_modular() -> None:
    """Wraps ``ModularPipeline.register_components``, where every way of giving a modular pipeline its
    components ends (``__init__``, ``load_components``, ``update_components``)."""
    global _modular_register
    if _modular_register is not None:
        return
    original = ModularPipeline.register_components

    @functools.wraps(original)
    def register_components(self, **kwargs: Any) -> None:
        original(self, **kwargs)
        config = _config
        if config is not None:
            _follow_components(self, config)

    _modular_register = original
    ModularPipeline.register_components = register_components


def _follow_components(pipe: ModularPipeline, config: AccelConfig) -> None:
    """After a modular pipeline's components changed: accelerate its transformer once one is loaded, and
    again (with the options it was accelerated with) when the one accelerated was replaced or removed."""
    state = getattr(pipe, STATE_ATTR, None)
    if state is not None:
        if in_sync(pipe):
            return
        config = state.config
        api.restore(pipe)
    if any(isinstance(getattr(pipe, name, None), nn.Module) for name in config.components):
        _accelerate_or_warn(pipe, config)


def _sharing(pipe: Any, config: AccelConfig) -> AccelConfig:
    """``config`` for a pipeline holding a transformer another pipeline accelerated with other options (a
    ``from_pipe`` sibling of one accelerated by hand, or by zero-code under an earlier ``enable()`` with other
    options): one module runs one setup, so the pipeline shares that one, as ``accelerate(sibling)`` without
    options does, and a warning names the options that do not apply. Zero-code asked them of every pipeline,
    not of this module."""
    for name in config.components:
        module = getattr(pipe, name, None)
        owner, differ = api.differing_options(module, config) if isinstance(module, nn.Module) else (None, [])
        if owner is not None and differ:
            logger.warning(
                "zero-code: %s.%s is shared with another pipeline (from_pipe) accelerated with %s; %s shares "
                "that setup, and the options %s it was to be accelerated with do not apply to it "
                "(omni_accel.restore() that pipeline, then accelerate this one with them)",
                type(pipe).__name__,
                name,
                ", ".join(f"{o}={getattr(owner, o)!r}" for o in differ),
                type(pipe).__name__,
                ", ".join(f"{o}={getattr(config, o)!r}" for o in differ),
            )
            return dataclasses.replace(config, **{o: getattr(owner, o) for o in differ})
    return config


def _accelerate_or_warn(pipe: Any, config: AccelConfig) -> None:
    """``accelerate`` and one NOTICE line saying so (the user's script does not name it), or (where it
    refuses) a warning, with the pipeline left plain Diffusers."""
    config = _sharing(pipe, config)
    try:
        getattr(api.accelerate(pipe, config), STATE_ATTR).zero_code = True
    except Exception as exc:
        logger.warning(
            "zero-code acceleration left %s as plain Diffusers, because accelerate() refused it: %s: %s "
            "(omni_accel.accelerate(pipe) raises the same; docs/troubleshooting.md has the fix)",
            type(pipe).__name__,
            type(exc).__name__,
            exc,
        )
        return
    if not is_main_process():  # one line per pipeline, not one per rank
        return
    report = api.describe(pipe)
    modes = ", ".join(f"{c.name} {c.mode}" for c in report.components) or "no denoiser found"
    logger.log(
        NOTICE,
        "zero-code: %s accelerated (%s); omni_accel.describe(pipe) for details, OMNI_ACCEL_VERBOSITY=warning "
        "silences this",
        type(pipe).__name__,
        modes,
    )


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext omni_accel``: pipelines created in the notebook from now on are accelerated."""
    enable(**options_from_env())


def unload_ipython_extension(ipython: Any) -> None:
    disable()
