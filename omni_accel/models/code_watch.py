"""The Diffusers and torch code a native block stands in for, watched for patches.

A native block computes what its Diffusers forward computes without calling it, nor the forwards of its
submodules, its attention processor or the functions those call. A user who patches one (an attention-map
recorder on ``FluxAttnProcessor.__call__`` or on ``dispatch_attention_fn``, a token-merging ``forward``)
expects the patch to run, and in plain Diffusers it does. So the blocks watch:

* each such method on its class: one that is not the function its class's module defines (replaced, or
  wrapped with ``functools.wraps``), before ``accelerate`` or after it;
* the module-level functions those methods' own code calls by name (``apply_rotary_emb``,
  ``dispatch_attention_fn``): one that is not a function of Diffusers' or torch's own (replaced in the
  module, before ``accelerate`` or after it). A patched method's globals are its patch's, not watched.

A patched one sends the blocks to Diffusers' forward, which calls it, and keeps the steps out of CUDA
graphs, whose replays would skip its Python. The watch is read once per forward: a patch made and undone
in the middle of one (a hook on one block that patches for that block alone) is not seen. Not watched:
functions reached through an attribute (``F.linear``, ``torch.nn.functional.scaled_dot_product_attention``),
which the native math does not call either way where they are torch's own, and functions called only by
the module-level ones.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable, Iterable

from torch import nn

from omni_accel.patches import unwrapped

from ..utils.versions import forward_serial

Holder = type | types.ModuleType  # where a watched function is looked up by name


class CodeWatch:
    """The watched functions of some blocks: ``methods`` ((class, name) pairs) and the module functions they
    call by name where they are unpatched (``watched``, followed as the methods change); ``reason()`` says
    why the blocks must run Diffusers' code."""

    def __init__(self, methods: Iterable[tuple[type, str]]) -> None:
        self.methods = tuple(dict.fromkeys(methods))
        self._seen: dict[tuple[Holder, str], tuple[Callable | None, str | None]] = {}
        self._method_functions: tuple[Callable | None, ...] = ()
        self.watched: tuple[tuple[Holder, str], ...] = ()
        self._follow_methods()
        self._checked = threading.local()  # ``last``: (forward serial, its reason) of this thread

    @classmethod
    def of_blocks(
        cls, blocks: Iterable[nn.Module], diffusers_class: Callable[[nn.Module], type]
    ) -> CodeWatch:
        """The functions ``blocks`` stand in for: each block's Diffusers ``forward`` (``diffusers_class``
        gives its class), its submodules' ``forward``, the ``__call__`` of the attention processors the native
        math computes (``_processor_stood_in_for``), and the module-level functions those call by name."""
        methods = []
        for block in blocks:
            for module in block.modules():
                owner = diffusers_class(block) if module is block else type(module)
                if owner.forward is not nn.Module.forward:  # a container has no forward of its own
                    methods.append((owner, "forward"))
                processor = _processor_stood_in_for(module)
                if processor is not None:
                    methods.append((processor, "__call__"))
        return cls(methods)

    def __reduce__(self):  # classes pickle by name, modules do not: the functions are found again
        return CodeWatch, (self.methods,)

    def __deepcopy__(self, memo: dict) -> CodeWatch:
        return CodeWatch(self.methods)

    def reason(self) -> str | None:
        """Why this forward's blocks must run Diffusers' code: a watched function patched, or None. Checked
        once per forward (``utils.versions.forward_serial``); a function seen before costs an identity test."""
        serial = forward_serial()
        last = getattr(self._checked, "last", None)
        if last is not None and last[0] == serial:
            return last[1]
        if any(
            getattr(*key, None) is not seen
            for key, seen in zip(self.methods, self._method_functions, strict=True)
        ):
            self._follow_methods()
        found = None
        for key in self.watched:
            found = found or self._check(key)
        self._checked.last = (serial, found)
        return found

    def _follow_methods(self) -> None:
        """Watch the methods and the module functions that their unpatched code calls by name. A patched
        method's globals are the patch's (a user's ``_orig_call``, a notebook's helper), not Diffusers': they
        are dropped, and the unpatched method's are watched again once it is back."""
        self._method_functions = tuple(getattr(*key, None) for key in self.methods)
        pristine = [key for key in self.methods if self._check(key) is None]
        self.watched = tuple(dict.fromkeys((*self.methods, *_called_by_name(pristine))))

    def _check(self, key: tuple[Holder, str]) -> str | None:
        function = getattr(*key, None)
        seen = self._seen.get(key)
        if seen is None or seen[0] is not function:
            seen = self._seen[key] = (function, _patched(*key, function))
        return seen[1]


def _processor_stood_in_for(module: nn.Module) -> type | None:
    """The attention processor class whose ``__call__`` the native math computes for ``module``: its
    class's default (what the blocks run natively with, whatever processor is set at ``accelerate``), else
    the Diffusers processor set on it; None for a module without one, or with a user's processor alone."""
    default = getattr(type(module), "_default_processor_cls", None)
    if default is not None:
        return default
    processor = getattr(module, "processor", None)
    if processor is None or _top_package(type(processor).__module__) != "diffusers":
        return None
    return type(processor)


def _called_by_name(methods: Iterable[tuple[type, str]]) -> list[tuple[types.ModuleType, str]]:
    """(module, name) of each plain function that ``methods`` call by a global name of their module."""
    found = []
    for holder, name in methods:
        function = unwrapped(getattr(holder, name))
        code = getattr(function, "__code__", None)
        module = sys.modules.get(getattr(function, "__module__", None) or "")
        if code is None or module is None:
            continue
        for global_name in code.co_names:
            value = module.__dict__.get(global_name)
            if callable(value) and not isinstance(value, type | types.ModuleType):
                found.append((module, global_name))  # a function, or what stands in one's place
    return found


def _patched(holder: Holder, name: str, function: Callable | None) -> str | None:
    """Why ``function`` (``holder.name`` now) is not the code Diffusers or torch defines there, or None.
    Our own patches (``patches/``, which wrap what they patch) are looked through."""
    function = unwrapped(function)
    if isinstance(holder, types.ModuleType):
        package = _top_package(holder.__name__)
        if _defined_by(function, package, getattr(function, "__name__", "")) or _builtin_of(
            function, package
        ):
            return None
        return f"{holder.__name__}.{name} is patched (not Diffusers' or torch's function): Diffusers' forward runs it"
    owner = next((c for c in holder.__mro__ if name in c.__dict__), holder)
    if _defined_by(function, owner.__module__, f"{owner.__qualname__}.{name}"):
        return None
    return (
        f"{owner.__module__}.{owner.__qualname__}.{name} is patched (not the function its module defines): "
        "Diffusers' forward runs it"
    )


def _defined_by(function: Callable | None, module_name: str, qualname: str) -> bool:
    """``function`` is the plain, unwrapped function ``qualname`` that the file of its module defines, that
    module being ``module_name`` (or a module of the package ``module_name`` names), or torch's."""
    code = getattr(function, "__code__", None)
    module = getattr(function, "__module__", None) or ""
    return (
        code is not None
        and (module == module_name or _top_package(module) in (module_name, "torch"))
        and getattr(function, "__qualname__", None) == qualname
        and not hasattr(function, "__wrapped__")
        and code.co_filename == getattr(sys.modules.get(module), "__file__", None)
    )


def _builtin_of(function: Callable | None, package: str) -> bool:
    """``function`` is a function of torch's or ``package``'s written in C (``torch.rsqrt`` imported by
    name)."""
    return isinstance(function, types.BuiltinFunctionType) and _top_package(
        getattr(function, "__module__", None) or ""
    ) in (package, "torch")


def _top_package(module_name: str) -> str:
    return module_name.partition(".")[0]
