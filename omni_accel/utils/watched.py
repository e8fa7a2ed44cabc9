"""Parameters whose ``.data`` use counts as a write, for the stores that keep results derived from weights
(the exact projection cache, the FP8 weight copies) and check them by version counter.

``p.data`` is a tensor with a version counter of its own, so an in-place edit through it (the EMA pattern
``p.data.mul_(d).add_(...)``, peft's merge) leaves ``p._version`` unchanged and no cheap check could see it.
Setting ``.data`` to the parameter itself (``module.to`` a device it is on, as model CPU offload's hook
does before each call) is no write. A watcher turns the parameters it depends on into ``WatchedParameter``
and back when it lets them go; a parameter two watchers share turns back only when the last one lets it go.
The stores compare
``weight_version``: the version counter plus the ``.data`` uses, counted apart so that autograd, which checks
the version counter of what it saved, does not see a read of ``.data`` (a weight norm logged between a
training forward and its backward) as a write.

Fused optimizers (``fused=True``) and others with kernels of their own write the parameters without moving
the version counter: while any parameter is watched, a process-wide optimizer step hook counts each step as
a write to the watched parameters it updates (before the step and after it, so a step that fails midway and a
store filled during the step count too); other parameters and the step itself are left alone. And so that
an optimizer picks its implementation (the multi-tensor one on a GPU) for a watched parameter as for a plain
one, ``WatchedParameter`` joins the types torch's optimizers take for it, as torch's own ``DTensor`` does.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import nn
from torch.optim.optimizer import (
    _foreach_supported_types,
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

_USES = "_omni_data_uses"  # on a watched parameter: how many times its ``.data`` was read or set


class WatchedParameter(nn.Parameter):
    """A parameter whose ``.data`` counts as a write: reading or setting it moves ``weight_version``."""

    @property
    def data(self) -> torch.Tensor:
        _count_use(self)
        return nn.Parameter.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        nn.Parameter.data.__set__(self, value)
        # ``module.to`` a device and dtype the parameter has sets it to itself: no write. Another tensor of the
        # same memory still counts: an alias read before may have been written since.
        if value is not self:
            _count_use(self)

    # A copy belongs to no watcher (the stores of a copied model start empty): a plain parameter.
    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        copied = nn.Parameter(nn.Parameter.data.__get__(self).clone(), self.requires_grad)
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol: int):
        state = {name: value for name, value in self.__dict__.items() if name not in (_COUNT, _USES)}
        return _plain_parameter, (nn.Parameter.data.__get__(self), self.requires_grad, state)


def _plain_parameter(data: torch.Tensor, requires_grad: bool, state: dict) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad)
    param.__dict__.update(state)
    return param


def _count_use(param: torch.Tensor) -> None:
    state = param.__dict__
    state[_USES] = state.get(_USES, 0) + 1


def weight_version(tensor: torch.Tensor) -> int:
    """``tensor._version`` plus, for a parameter ever watched, its ``.data`` uses: moves at every write,
    through ``.data`` too (both only grow)."""
    return tensor._version + tensor.__dict__.get(_USES, 0)


def _count_optimizer_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            if type(param) is WatchedParameter:
                _count_use(param)


_LOCK = threading.Lock()
_COUNT = "_omni_watchers"  # on a watched parameter: how many watchers hold it
_STEP_HOOKS: list = []  # the optimizer step hooks, registered at the first watch in the process


def _join_optimizer_steps() -> None:
    """Registers ``_count_optimizer_step`` around every optimizer step and makes ``WatchedParameter`` a
    type the optimizers' multi-tensor path takes, once (under ``_LOCK``)."""
    if not _STEP_HOOKS:
        _STEP_HOOKS.append(register_optimizer_step_pre_hook(_count_optimizer_step))
        _STEP_HOOKS.append(register_optimizer_step_post_hook(_count_optimizer_step))
        if WatchedParameter not in _foreach_supported_types:
            _foreach_supported_types.append(WatchedParameter)


class Watcher:
    """The parameters one store watches (by identity: a tensor's ``==`` is elementwise)."""

    def __init__(self) -> None:
        self._params: dict[int, weakref.ref] = {}

    def watch(self, param: torch.Tensor) -> None:
        """Makes ``param`` count ``.data`` use (a plain ``nn.Parameter``; other tensors are left alone)."""
        with _LOCK:
            ref = self._params.get(id(param))
            if ref is not None and ref() is param:
                return
            if type(param) is nn.Parameter:
                _join_optimizer_steps()
                param.__class__ = WatchedParameter
            elif type(param) is not WatchedParameter:
                return
            self._params[id(param)] = weakref.ref(param)
            setattr(param, _COUNT, getattr(param, _COUNT, 0) + 1)

    def release(self) -> None:
        """Lets every watched parameter go; one no other watcher holds becomes a plain parameter again."""
        with _LOCK:
            for ref in self._params.values():
                param = ref()
                if param is None:
                    continue
                count = getattr(param, _COUNT, 1) - 1
                if count > 0:
                    setattr(param, _COUNT, count)
                    continue
                if hasattr(param, _COUNT):
                    delattr(param, _COUNT)
                if type(param) is WatchedParameter:
                    param.__class__ = nn.Parameter
            self._params = {}
