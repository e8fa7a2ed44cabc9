"""Diffusers' LoRA shape checks see the full shapes of tensor-parallel linears.

Target: the LoRA loader mixins of ``diffusers.loaders.lora_pipeline`` that check LoRA shapes against the
transformer's weights before loading (``_maybe_expand_transformer_param_shape_or_error_``,
``_maybe_expand_lora_state_dict``: FLUX's Control-LoRA expansion). Why: under tensor parallelism a linear
holds this rank's slice, so those checks would take every split linear for one that needs expanding (or
refuse the LoRA). While they run, each split weight is shown as a meta tensor of its full shape (the checks
read shapes only; nothing is gathered); the real slices are back before the LoRA is loaded. Outside a
tensor-parallel transformer nothing changes.
"""

from __future__ import annotations

import functools
from types import ModuleType

from omni_accel.parallel.tensor import full_shapes

from . import ours

PACKAGE = "diffusers"
CHECKED_VERSIONS = ("0.42.0", "0.43.0")
_METHODS = ("_maybe_expand_transformer_param_shape_or_error_", "_maybe_expand_lora_state_dict")
_ORIGINALS = "_omni_accel_original_shape_checks"


def _wrapped(function):
    @functools.wraps(function)
    def method(cls, transformer, *args, **kwargs):
        with full_shapes(transformer):
            return function(cls, transformer, *args, **kwargs)

    return classmethod(ours(method, function))


def _owners(module: ModuleType) -> list[type]:
    return [
        cls
        for cls in vars(module).values()
        if isinstance(cls, type) and any(name in vars(cls) for name in _METHODS)
    ]


def apply(module: ModuleType) -> None:
    for cls in _owners(module):
        originals = {name: vars(cls)[name] for name in _METHODS if name in vars(cls)}
        setattr(cls, _ORIGINALS, originals)
        for name, original in originals.items():
            setattr(cls, name, _wrapped(original.__func__))


def revert(module: ModuleType) -> None:
    for cls in [c for c in vars(module).values() if isinstance(c, type) and _ORIGINALS in vars(c)]:
        for name, original in vars(cls)[_ORIGINALS].items():
            setattr(cls, name, original)
        delattr(cls, _ORIGINALS)
