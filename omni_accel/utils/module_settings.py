"""A module's settings: its own attributes of plain values (eps, approximate, a norm's shape), what a
computation that does not call its forward still assumes of it."""

from __future__ import annotations

from typing import Any

from torch import nn

_NAMES: dict[type, tuple[str, ...]] = {}  # per class: the attributes its instances are read for
# ``fused_projections``: Diffusers' fuse_qkv_projections() flag, which its code reads at every call where
# it matters (``models.base`` checks it apart); a module unfused again holds False where it had none
_SKIPPED = frozenset({"training", "fused_projections"})


def setting_names(module: nn.Module) -> tuple[str, ...]:
    """The names of ``module``'s plain attributes, found once per class (on its first instance seen)."""
    names = _NAMES.get(type(module))
    if names is None:
        names = _NAMES[type(module)] = tuple(
            sorted(
                name
                for name, value in module.__dict__.items()
                if not name.startswith("_") and name not in _SKIPPED and _plain(value)
            )
        )
    return names


def settings(module: nn.Module) -> tuple:
    """The values of ``setting_names(module)`` now (None for one this instance lacks)."""
    state = module.__dict__
    return tuple(state.get(name) for name in setting_names(module))


def _plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_plain(item) for item in value)
    return value is None or type(value) in (bool, int, float, str)
