"""Registering our layout hooks through Diffusers' ``HookRegistry``: named, composable with the user's own
hooks (step caches, offload, layerwise casting) and removable."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from diffusers.hooks import HookRegistry, ModelHook
from torch import nn


class LayoutHook(ModelHook):
    """A hook of a parallel layout. It decides from the arguments' shapes alone, so a CUDA graph captured
    with it stays right for every call with the same key; ``replay_key`` adds what else it decided for the
    call in flight (see ``omni_accel.cuda_graphs``)."""

    def replay_key(self) -> tuple:
        return ()


def _keep_outermost(registry: HookRegistry, name: str) -> None:
    """Moves the hooks registered after ``name`` under it. They come off from the outermost in: Diffusers'
    ``remove_hook`` of an inner hook would drop the forward of an outer one that has its own."""
    order = registry._hook_order
    if order[-1] == name:
        return
    stack = order[order.index(name) :]  # ours, then the hooks registered after it
    hooks = {key: registry.hooks[key] for key in stack}
    for key in reversed(stack):
        registry.remove_hook(key, recurse=False)
    for key in [*stack[1:], name]:
        registry.register_hook(hooks[key], key)
    _forward_that_copies(registry._module_ref, hooks[name])


def register(module: nn.Module, hook: ModelHook, name: str) -> Callable[[], None]:
    """Registers ``hook`` on ``module`` as ``name``; returns the undo."""
    registry = HookRegistry.check_if_exists_or_initialize(module)
    registry.register_hook(hook, name)
    _forward_that_copies(module, hook)
    # A partial, not a closure: the undo a deep copy of the model holds removes the copy's hook.
    return functools.partial(registry.remove_hook, name, recurse=False)


def _forward_that_copies(module: nn.Module, hook: ModelHook) -> None:
    """Replaces the forward Diffusers just wrapped around ``hook`` (the outermost) with the same wrapper
    made of a module-level function: Diffusers' is a closure over the hook's function reference, so a deep
    copy of the model would run the original's hooks, and through them the original model. Where Diffusers'
    wrapper is not as 0.42 makes it (``fn_ref``, ``__wrapped__``), it is left as it is."""
    if not hasattr(hook, "fn_ref") or not hasattr(module.forward, "__wrapped__"):
        return
    module.forward = functools.update_wrapper(
        functools.partial(_hooked_forward, hook.fn_ref, module), module.forward.__wrapped__
    )


def _hooked_forward(fn_ref: Any, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Diffusers' hooked forward (``HookRegistry.register_hook``): the hook's pre-forward, the forward it
    wraps (or its own ``new_forward``), its post-forward."""
    args, kwargs = fn_ref.pre_forward(module, *args, **kwargs)
    return fn_ref.post_forward(module, fn_ref.forward(*args, **kwargs))


def run_all(steps: list[Callable[[], None]]) -> None:
    """Runs ``steps`` in order: an undo made of several, as a partial (a deep copy runs its own)."""
    for step in steps:
        step()


class SubmoduleHooks:
    """Layout hooks on submodules of ``root`` by path, kept on whichever module holds the path: peft swaps
    a linear for its LoRA wrapper (``load_lora_weights``) and back (``unload_lora_weights``), which would
    leave a hook on a module no longer called, or inside the wrapper, under the adapter's own output."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self._placed: list[list] = []  # [path, hook, name, outermost, module, undo]

    def add(self, path: str, hook: ModelHook, name: str, outermost: bool = False) -> None:
        """``outermost``: kept outside any hook registered after it on that module (a hook that splits a
        module's inputs: a step cache's hook on Wan's first block must see the tokens this rank holds, as
        the block returns them). Others stay where they were registered (a user's hook on the output
        projection sees the gathered output, as on one GPU)."""
        module = self.root.get_submodule(path)
        self._placed.append([path, hook, name, outermost, module, register(module, hook, name)])

    def follow(self) -> None:
        """Moves each hook to the module now at its path, and the ``outermost`` ones outside hooks
        registered after them; called before every forward of ``root``."""
        for placed in self._placed:
            path, hook, name, outermost, module, undo = placed
            now = self.root.get_submodule(path)
            if now is not module:
                undo()
                placed[4:] = [now, register(now, hook, name)]
            elif outermost:
                _keep_outermost(now._diffusers_hook, name)

    def remove(self) -> None:
        for *_, undo in self._placed:
            undo()
        self._placed.clear()


@functools.cache
def _forward_signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)


def bound_arguments(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The forward call's arguments by name (pipelines pass most by keyword, some positionally)."""
    signature = _forward_signature(type(module))
    arguments = signature.bind(module, *args, **kwargs).arguments
    arguments.pop(next(iter(signature.parameters)))  # self
    return dict(arguments)
