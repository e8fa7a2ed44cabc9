"""Version-guarded, scoped, reversible patches of third-party code (installed as ``omni_accel.patches``).

Each patch is one module naming its target, the versions it was checked against (``PACKAGE``,
``CHECKED_VERSIONS``) and why it exists, with ``apply`` / ``revert``. Patches of a module or a class
(``apply(target)``, ``"package.module"``, ``"package.module:Class"`` or the class itself)
go through ``apply``/``revert`` here, reference-counted per target, so two accelerated pipelines share a
patch and the last ``restore`` removes it; a patch of one pipeline instance (``pair_cfg_calls``) is applied
and reverted by ``accelerate``/``restore`` directly, after ``check_applicable``.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import Any

from packaging.version import Version

_APPLIED: Counter[tuple[str, str | type]] = Counter()
_OURS = "_omni_accel_patch"


def ours(wrapper: Callable, original: Callable) -> Callable:
    """Marks ``wrapper`` as a patch's stand-in for ``original`` (its ``__wrapped__``): ``revert`` then tells
    it from a user's patch made over it, which stays, and the code watch looks through it."""
    wrapper.__wrapped__ = original
    setattr(wrapper, _OURS, True)
    return wrapper


def is_ours(function: Any) -> bool:
    """``function`` was installed by one of our patches (see ``ours``)."""
    return getattr(function, _OURS, False) is True


def unwrapped(function: Any) -> Any:
    """``function`` with our patches' wrappers around it looked through."""
    while is_ours(function):
        function = function.__wrapped__
    return function


def _patch_module(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name}")


def check_version(package: str, patch: ModuleType) -> None:
    from importlib.metadata import version

    installed = Version(version(package))
    low, high = (Version(v) for v in patch.CHECKED_VERSIONS)
    if not low <= installed < high:
        raise RuntimeError(
            f"Patch {patch.__name__} was checked against {package} {low} to < {high}; {installed} is installed. "
            f"Install a checked version or disable the feature that needs it."
        )


def check_applicable(name: str) -> None:
    """Raises if the installed third-party version is outside the range the patch was checked against."""
    patch = _patch_module(name)
    check_version(patch.PACKAGE, patch)


def applicable(name: str) -> bool:
    """``check_applicable`` as a question, for a patch whose feature is optional."""
    try:
        check_applicable(name)
    except RuntimeError:
        return False
    return True


def _target(target: str | type):
    """A module (``"package.module"``), an attribute of one (``"package.module:Class"``) or a class itself
    (one that its module's namespace may not hold: a class made in a function)."""
    if isinstance(target, type):
        return target
    module_name, _, attribute = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attribute) if attribute else module


def apply(name: str, target: str | type) -> None:
    patch = _patch_module(name)
    if _APPLIED[(name, target)] == 0:
        check_version(patch.PACKAGE, patch)
        patch.apply(_target(target))
    _APPLIED[(name, target)] += 1


def revert(name: str, target: str | type) -> None:
    if _APPLIED[(name, target)] == 0:
        raise RuntimeError(f"Patch {name} on {target} is not applied.")
    _APPLIED[(name, target)] -= 1
    if _APPLIED[(name, target)] == 0:
        del _APPLIED[(name, target)]
        _patch_module(name).revert(_target(target))


def applied() -> dict[tuple[str, str | type], int]:
    return dict(_APPLIED)
